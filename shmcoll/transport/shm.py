"""ShmTransport: ranks on one host talk through rings of slots in POSIX shared memory.

A send copies the array into the slots of the channel to the peer, a slot at a time, so the reader
works on the first slots while later ones are still being written. `recv_into` reduces (or copies)
straight out of each slot into the destination: no intermediate buffer. A message the caller is not
asking for yet (another tag) is moved out of the ring into the mailbox, so a receive on one tag is
never blocked by unread messages on another, and a writer whose ring is full keeps draining its own
incoming rings, so two ranks sending each other large messages cannot deadlock.

Failure: a rank that detects a problem writes the abort flag and reason into the host header, which
every local rank sees within one wait slice; a dead peer is noticed from its pid.
"""

from __future__ import annotations

import time

import numpy as np

from .. import kernels
from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerLost
from . import frame
from .base import BoardGuard, LinkTransport, place
from .frame import HEADER_SIZE, Meta
from .liveness import ProcessWatch
from .mailbox import AbortReason, Mailbox, Message
from .shm_board import Board
from .shm_channel import WAIT_SLICE, Channel
from .shm_layout import (
    ABORT_TEXT_BYTES,
    ABORT_TEXT_OFFSET,
    CHUNK,
    SLOT_HEADER_BYTES,
    STATE_DEPARTED,
    W_ABORT,
    W_ABORT_LEN,
    W_PIDS,
    W_STATES,
)
from .shm_segment import Segment, pid_alive

#: Default seconds a waiter spins (yielding) before blocking in the kernel (SHMCOLL_SPIN_US).
DEFAULT_SPIN_S = 200e-6


class _Assembly:
    """A message being moved out of a ring into the mailbox, slot by slot."""

    def __init__(self, header: frame.Header):
        self.header = header
        self.payload = np.empty(header.nbytes, dtype=np.uint8)
        self.got = 0


class ShmTransport(LinkTransport):
    name = "shm"
    board: Board

    def __init__(self, segment: Segment, local_of: dict[int, int], rank: int, world_size: int, *,
                 timeout: float = 300.0, spin_s: float = DEFAULT_SPIN_S, mailbox: Mailbox | None = None):
        """mailbox: shared with a NetTransport under a HierarchicalTransport, so aborts and lost
        remote peers reported by TCP end shared-memory waits too."""
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._seg, self._mem, self._layout = segment, segment.mem, segment.layout
        self._bytes = segment.mem.data  # the same memory, for struct's pack_into and unpack_from
        self._local_of, self._me = dict(local_of), local_of[rank]
        self._spin_ns = int(spin_s * 1e9)
        self._mailbox = mailbox or Mailbox(rank, world_size)
        self.bytes_to = [0] * world_size  # payload bytes sent to each rank (what the hierarchy moves where)
        peers = [r for r in local_of if r != rank]
        self._out = {p: self._channel(self._me, local_of[p]) for p in peers}
        self._in = {p: self._channel(local_of[p], self._me) for p in peers}
        blocks = [self._layout.block_index(self._me, k) for k in range(self._layout.blocks)]
        self._successor_block, self._spare_blocks, self._spares = blocks[:1], blocks[1:], set(blocks[1:])
        self._assembling: dict[int, _Assembly] = {}
        self._alive_at = {p: time.monotonic() for p in peers}
        self._watch = ProcessWatch()
        self._closed = self._closing = False
        self.board = Board(self._mem, self._layout, rank, self._local_of, spin_s)
        segment.register(self._me)

    def _channel(self, src: int, dst: int) -> Channel:
        return Channel(self._mem, self._layout, src, dst)

    def _give_block(self, to: int, ch: Channel) -> None:
        """Move the pair to rank `to` onto one of this rank's channel blocks: its successor in local
        order (the peer rings and chains stream to) gets block 0 for good, any other peer a spare
        one, taken back from a pair that has nothing left unread if none is free. Without either,
        the message goes through the lane."""
        if self._local_of[to] == (self._me + 1) % self._layout.n_local:
            if self._successor_block:
                ch.move_to(self._successor_block.pop())
            return
        if not self._spare_blocks:
            self._reclaim_spare()
        if self._spare_blocks:
            ch.move_to(self._spare_blocks.pop(0))

    def _reclaim_spare(self) -> None:
        """Move a pair that holds a spare block and is drained back to its lane, freeing the block
        (skipping pairs another thread is sending on: their lock is busy)."""
        for other in self._out.values():
            if other.block not in self._spares or not other.lock.acquire(False):
                continue
            try:
                if other.block in self._spares and other.drained():
                    self._spare_blocks.append(other.block)
                    other.move_to(None)
                    return
            finally:
                other.lock.release()

    # ---- sending ----
    def _send_to(self, to: int, header: bytes, buf: np.ndarray, deadline: float) -> None:
        raw = buf.reshape(-1).view(np.uint8)
        head = np.frombuffer(header, dtype=np.uint8)
        ch = self._out[to]
        with ch.lock:
            if not ch.in_block and buf.nbytes > ch.slot_bytes:
                self._give_block(to, ch)
            offset = 0
            while True:
                n = min(ch.slot_bytes, buf.nbytes - offset)
                ch.wait_space(deadline, self._spin_ns, lambda: self._check_send(to), f"rank {to} did not free a slot")
                at = ch.offset()
                self._mem[at:at + HEADER_SIZE] = head
                CHUNK.pack_into(self._bytes, at + HEADER_SIZE, offset, n)
                self._mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + n] = raw[offset:offset + n]
                ch.advance_writer()
                offset += n
                if offset >= buf.nbytes:
                    return

    def _check_send(self, to: int) -> None:
        """Between waits for a free slot: fail on abort or death, and drain our own incoming rings."""
        self._check(to, strict=False)
        self.drain_incoming()

    # ---- receiving ----
    def recv(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        if src == self.rank:
            return self._mailbox.take(src, tag, deadline, strict)
        while True:
            msg = self._mailbox.pop(src, tag)
            if msg is not None:
                return msg
            self._pump(src, tag, deadline, strict, target=None)

    def recv_into(self, src: int, tag: int, out: np.ndarray, code: int, deadline: float,
                  want: Meta | None = None, op=None, strict: bool = True) -> None:
        if src == self.rank:
            return super().recv_into(src, tag, out, code, deadline, want, op, strict)
        while True:
            msg = self._mailbox.pop(src, tag)
            if msg is not None:
                return place(msg, out, code, want, op)
            if self._pump(src, tag, deadline, strict, target=(out, code, want, op)):
                return

    def _pump(self, src: int, tag: int, deadline: float, strict: bool, target) -> bool:
        """Move one message out of src's ring: straight into target when it is the one wanted
        (returns True), else into the mailbox (returns False, as when another thread holds the ring)."""
        ch = self._in[src]
        if not ch.lock.acquire(timeout=WAIT_SLICE):
            self._check(src, strict)
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"no message from rank {src} (tag {tag}) before the deadline")
            return False
        try:
            if self._mailbox.has(src, tag):
                return False  # another thread moved it out of the ring while we waited for the lock
            if src not in self._assembling:
                header, chunk_at, n = self._next_slot(src, deadline, strict, target[2] if target else None)
                if target is not None and frame.queue_tag(header) == tag:
                    self._consume_into(src, header, chunk_at, n, target, deadline, strict)
                    return True
                self._absorb(src, header, chunk_at, n)
            while src in self._assembling:
                self._absorb(src, self._assembling[src].header, *self._next_chunk(src, deadline, strict))
            return False
        finally:
            ch.lock.release()

    def _next_slot(self, src: int, deadline: float, strict: bool,
                   want: Meta | None = None) -> tuple[frame.Header, int, int]:
        """Wait for the first slot of src's next message; its frame header, chunk offset and length."""
        at = self._wait_slot(src, deadline, strict, want)
        header = frame.unpack(self._mem[at:at + HEADER_SIZE].tobytes(), src)
        chunk_at, n = CHUNK.unpack_from(self._bytes, at + HEADER_SIZE)
        return header, chunk_at, n

    def _next_chunk(self, src: int, deadline: float, strict: bool) -> tuple[int, int]:
        """Wait for a later slot of the message being read: the writer holds its ring for the whole
        message, so only the chunk's offset and length need reading."""
        return CHUNK.unpack_from(self._bytes, self._wait_slot(src, deadline, strict) + HEADER_SIZE)

    def _wait_slot(self, src: int, deadline: float, strict: bool, want: Meta | None = None) -> int:
        ch = self._in[src]
        ch.wait_data(deadline, self._spin_ns, lambda: self._check(src, strict, want), f"no message from rank {src}")
        return ch.offset()

    def _slot_payload(self, src: int, n: int) -> np.ndarray:
        at = self._in[src].offset() + SLOT_HEADER_BYTES
        return self._mem[at:at + n]

    def _consume_into(self, src, header, chunk_at, n, target, deadline, strict) -> None:
        """Reduce or copy every slot of this message straight into the caller's array."""
        out, code, want, op = target
        if out.nbytes != header.nbytes or header.dtype != code or (want is not None and header.meta != want):
            place(Message(header, self._mem[:0]), out, code, want, op)  # raises the mismatch
        flat = out.reshape(-1)
        while True:
            chunk = self._slot_payload(src, n).view(out.dtype)
            dst = flat[chunk_at // out.itemsize:][:len(chunk)]
            if op is None:
                dst[...] = chunk
            else:
                kernels.reduce_into(dst, chunk, code, op)
            self._in[src].advance_reader()
            if chunk_at + n >= header.nbytes:
                return
            chunk_at, n = self._next_chunk(src, deadline, strict)

    def _absorb(self, src: int, header: frame.Header, chunk_at: int, n: int) -> None:
        """Copy one slot into the message being moved to the mailbox; post it once complete."""
        job = self._assembling.get(src)
        if job is None:
            job = self._assembling[src] = _Assembly(header)
        job.payload[chunk_at:chunk_at + n] = self._slot_payload(src, n)
        job.got = chunk_at + n
        self._in[src].advance_reader()
        if job.got >= job.header.nbytes:
            del self._assembling[src]
            self._mailbox.put(Message(job.header, job.payload))

    def drain_incoming(self) -> None:
        """Move every filled slot of our incoming rings into the mailbox, without waiting."""
        for src, ch in self._in.items():
            if not ch.has_data() or not ch.lock.acquire(False):
                continue
            try:
                while ch.has_data():
                    deadline = time.monotonic() + self.timeout  # a filled slot is there: no wait happens
                    job = self._assembling.get(src)
                    if job is None:
                        self._absorb(src, *self._next_slot(src, deadline, False))
                    else:
                        self._absorb(src, job.header, *self._next_chunk(src, deadline, False))
            finally:
                ch.lock.release()

    def recv_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        srcs = set(srcs)
        while True:
            for src in sorted(srcs):
                msg = self._mailbox.pop(src, tag)
                if msg is not None:
                    return msg
                if not self.usable(src):
                    srcs.discard(src)
            self._raise_if_aborted()
            left = deadline - time.monotonic()
            if not srcs or left <= 0:
                return None
            self.drain_incoming()
            self._wait_a_little(srcs, left)

    def _wait_a_little(self, srcs: set[int], left: float) -> None:
        """Block briefly until one of srcs may have written."""
        self._in[min(srcs)].wait_briefly(min(left, WAIT_SLICE / 4))

    def usable(self, peer: int) -> bool:
        return peer == self.rank or (not self._exited([peer]) and not self._departed(peer))

    # ---- liveness and aborts ----
    def board_guard(self, tag: int, want: Meta) -> BoardGuard:
        """What a board wait runs between looks: fail on abort or death, and on a peer that called
        another collective at this sequence number (its ring frames for our tag, or its board entry).
        It takes no frame: one that describes this very call is a later step's, from a peer already
        past this board step (a two-level call's barrier, then its sends on the same tag), and stays
        queued for the receive that wants it. A failure the guard reports may also be dropped, when
        the step turns out done after all (Board._finish_step), so it must not cost a frame."""
        def guard(src: int | None = None) -> None:
            self._check(src, True, want)
            self.drain_incoming()
            for peer in self._in:
                msg = self._mailbox.peek(peer, tag)
                problem = frame.describe_mismatch(msg.header.meta, want, peer) if msg is not None else None
                if problem:
                    raise CollectiveMismatch(problem)
        return guard

    def _check(self, src: int | None, strict: bool, want: Meta | None = None) -> None:
        """Called between wait slices: raise if waiting for src can no longer succeed."""
        self._raise_if_aborted()
        if strict:
            self._raise_if_remote_lost()
        if want is not None:
            problem = self.board.probe(want)
            if problem:
                raise CollectiveMismatch(problem)
        peers = self._in if strict or src is None else [src]
        for peer in self._exited(peers):  # a rank that closed its group on purpose may exit: that is no loss
            if not self._departed(peer):  # this order: a rank marks itself departed before it exits,
                # so "exited" read first, then "departed", is exact
                self._raise_if_aborted()  # it may have aborted since our first look, then left
                raise PeerLost(f"rank {peer} was lost: its process is gone (killed?)", peer)
        if src is not None and src != self.rank and self._departed(src) and not self._in[src].has_data():
            self._raise_if_aborted()  # a rank that failed sets the abort flag before it leaves: its reason wins
            raise PeerLost(f"rank {src} closed its group while this rank still expected a message from it", src)

    def _exited(self, peers) -> list[int]:
        """Those of peers whose process has exited, in rank order (one system call for them all)."""
        pid_of = {peer: int(self._seg.words[W_PIDS + self._local_of[peer]]) for peer in peers if peer != self.rank}
        gone = self._watch.exited(pid_of.values())
        return [peer for peer in sorted(pid_of) if pid_of[peer] in gone]

    def check_health(self, strict: bool = True) -> None:
        """As Transport.check_health; a HierarchicalTransport also calls it while waiting on TCP,
        since TCP alone cannot see local deaths or this host's abort flag."""
        if strict:
            self._check(None, True)
        else:
            self._raise_if_aborted()

    def _raise_if_remote_lost(self) -> None:
        """Peers lost on a shared mailbox (TCP peers of a hierarchy); empty for plain shared memory."""
        lost = self._mailbox.lost_peers()
        if lost:
            peer, reason = next(iter(lost.items()))
            raise PeerLost(f"rank {peer} was lost: {reason}", peer)

    def _peer_alive(self, peer: int) -> bool:
        pid = int(self._seg.words[W_PIDS + self._local_of[peer]])
        alive = pid_alive(pid) if pid else True
        if alive and not _stopped(pid):
            self._alive_at[peer] = time.monotonic()
        return alive

    def _departed(self, peer: int) -> bool:
        return int(self._seg.words[W_STATES + self._local_of[peer]]) == STATE_DEPARTED

    def _raise_if_aborted(self) -> None:
        local = self._mailbox.aborted
        if local is not None:
            raise local.error()
        if self._closing:
            raise CollectiveError(f"rank {self.rank} closed this group while a call was still waiting")
        who = int(self._seg.words[W_ABORT])
        if who:
            length = int(self._seg.words[W_ABORT_LEN])
            text = self._mem[ABORT_TEXT_OFFSET:ABORT_TEXT_OFFSET + length].tobytes()
            raise AbortReason.decode(text, who - 1).error()

    def abort(self, reason: AbortReason) -> None:
        """Record the abort here and in the host's abort flag, unless a local rank already set it.
        The flag is written even when this mailbox already holds an abort: in a hierarchy that may
        have come over TCP from another host, and this host's other ranks may not have read their
        copy yet; they must see the abort before they see this rank leave (else: PeerLost)."""
        if self._mailbox.aborted is None:
            self._mailbox.set_abort(reason)
        if int(self._seg.words[W_ABORT]):
            return  # another rank aborted first; everyone already sees its reason
        text = reason.encode()[:ABORT_TEXT_BYTES]
        self._mem[ABORT_TEXT_OFFSET:ABORT_TEXT_OFFSET + len(text)] = np.frombuffer(text, dtype=np.uint8)
        self._seg.words[W_ABORT_LEN] = len(text)
        self._seg.words[W_ABORT] = self.rank + 1

    def retire_below(self, seq: int) -> None:
        self._mailbox.retire_below(seq)

    def last_heard(self) -> list[float]:
        heard = [0.0] * self.world_size
        for peer in self._in:
            self._peer_alive(peer)
            heard[peer] = self._alive_at[peer]
        return heard

    def begin_close(self) -> None:
        """From now on every wait here fails at its next look (within a wait slice), so threads still
        using this transport let go of the segment before close() unmaps it."""
        if not self._closing:
            self._closing = True
            self._seg.words[W_STATES + self._me] = STATE_DEPARTED

    def close(self) -> None:
        if self._closed:
            return
        self.begin_close()
        self.join_background(2 * WAIT_SLICE + 1.0)
        self._closed = True
        self._watch.close()
        self._seg.close()


def _stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, a debugger): alive but silent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False
