"""NetTransport: one TCP connection per peer pair, one reader thread per connection.

The reader thread drains its socket into the mailbox whenever data waits there, so sends never
deadlock on a peer that is itself sending. Headers are validated (frame.unpack) before a payload
buffer is allocated; a malformed frame closes that connection and the peer counts as lost.
Payloads go out with sendmsg straight from the caller's array (no copy) and come in with recv_into.

A caller waiting for a peer's message reads that peer's socket itself, while its `_Inbox` lock
keeps the reader thread out and asleep: it polls the socket for up to `spin_s`
(config.tcp_spin_seconds), then sleeps in poll on it for up to CALLER_SLEEP_SECONDS, and only
then leaves the wait to the reader thread. A reader thread woken for every frame adds a second
wake-up and a hand-off of the GIL to each message (tens of microseconds each, hundreds where
ranks outnumber cores), on both sides of every exchange: most of a small message's round trip.
Python threads cannot spin for one another (they would pass the GIL back and forth), so the
waiting thread reads alone. Only frames already whole in the socket are read this way; the rest
(large ones, a peer stopped mid-send, the connection's end) are the reader thread's.

A pairwise exchange (Transport.exchange: the small all-reduce's step across hosts, a two-rank
barrier; exchanges: recursive doubling's steps in a row, with the hand-offs of ranks past a power
of two) goes further where it can have the connections at once: one native call runs the steps,
each sending its frame, waiting as a caller does, reading the peer's frame of the same call and
folding it in or copying it, as the step's way says (kernels.swap_row). So does a ring's or
halving-doubling's step (Transport.send_recv), where it can have both connections: native calls
send its frame while they read the peer's straight into place, or through a small scratch folded
as it comes (kernels.duplex), with a look at the group's health between calls; and a whole
schedule of such steps over one array, each with its own peers (Transport.send_recv_ranges: a
ring's or halving-doubling's, worked out once per kind of call), runs in one native call where it
can have every connection the steps use (kernels.duplex_row). Anything else on the socket first is
left there for the paths above.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from .. import kernels
from ..errors import CollectiveError, CollectiveTimeout, PeerLost
from ..kept import keep
from ..net.congestion import paced
from ..types import ReduceKind
from . import frame
from .base import EMPTY, NOT_STARTED, SENT, HostRange, LinkTransport, PeerStep, RangeStep, Step, Transport
from .frame import ABORT, DATA, GOODBYE, HEADER_SIZE, HEARTBEAT, Meta, queue_tag
from .mailbox import AbortReason, Mailbox, Message

_POLL = 0.25  # socket timeout: how often blocked readers and writers look at the deadline and state
#: Seconds a waiting caller sleeps in poll on its peer's socket, after spinning, before the reader
#: thread takes over: a round of small collectives answers well within it, and a longer wait only
#: notices a fault elsewhere (another peer lost, an abort from this host) this much later.
CALLER_SLEEP_SECONDS = 20e-3
#: Seconds after a caller found its message on the socket during which the reader thread leaves the
#: socket to callers (asleep, not woken by what arrives): in a run of collectives the next frame
#: comes within that, and a caller will be there to read it. A frame nobody asks for (one that
#: recv_any waits for, a peer's abort while this rank waits on another) waits this long, as long
#: as a caller's own sleep. Where ranks outnumber cores a peer's frame often comes before this
#: rank's next step begins: a reader thread awake would take it, and the step would lose its native
#: call to the reader's copy and hand-off (4 hosts of one rank on 2 cores, 1 MiB all-reduce: one
#: step in five with 2 ms here, 2.65 against 2.2 ms per call).
QUIET_SECONDS = CALLER_SLEEP_SECONDS
_GOODBYE_SECONDS = 2.0
#: Bytes a caller peeks at to find a whole frame: a small frame's header and payload in one look.
PEEK_BYTES = 4096
#: Largest array a pairwise exchange sends and receives in one native call (NetTransport.swap_row):
#: the small all-reduce's, whose time is mostly the calls around the kernel's.
SWAP_MAX_BYTES = 256 << 10
_ROWS_KEPT = 256  # prepared rows a transport keeps (a group's calls ask for a few kinds)
#: Sizes a row keeps room for a peer's frame of (SwapRow.inbound): at most this many times
#: SWAP_MAX_BYTES per row, and a training step repeats a handful of sizes.
INBOUNDS_KEPT = 8
#: Seconds one native duplex call (NetTransport._duplexes) runs before it returns for a look at the
#: group's health and the deadline, and is called again where it stopped.
DUPLEX_SLICE_SECONDS = CALLER_SLEEP_SECONDS
#: Payload a duplex sends ahead of what it has read of the peer's frame (native/duplex.h), on a
#: connection no timer paces: between two namespace hosts under cubic, against 128 KiB, a 1 MiB
#: all-reduce of 2 hosts x 1 took 267-280 us instead of 299-301, 16 MiB 3.96-3.98 ms instead of
#: 4.49-4.54, 64 MiB on 2 x 2 48.9-49.4 ms instead of 51.4-54.6; 4 x 1 at 16 MiB alike.
DUPLEX_LEAD_BYTES = 512 << 10
#: ... and on one BBR paces (SHMCOLL_TCP_CONGESTION=system on such a kernel), where the larger lead
#: held every connection in BBR's slow mode: 1 MiB on 2 x 1 took 452-545 us in 3 runs of 3 with
#: it, 308-312 in 2 of 3 with this one (744 in the third).
DUPLEX_LEAD_BYTES_PACED = 128 << 10
#: Bytes of the scratch (one per thread) through which a folding duplex reads the peer's payload.
DUPLEX_SCRATCH_BYTES = 256 << 10
_SENT, _IN_STATE, _BEATS = 0, 3, 4  # kernels.duplex's progress words this side reads
#: Seconds between heartbeats to each peer. A rank silent for several of them is reported as such
#: by a timeout (a SIGSTOPped or hung process), unlike a live rank that is itself waiting.
HEARTBEAT_SECONDS = 0.5


def duplex_lead(sock: socket.socket) -> int:
    """The lead a duplex on this connection sends with: DUPLEX_LEAD_BYTES, or
    DUPLEX_LEAD_BYTES_PACED where BBR paces it."""
    return DUPLEX_LEAD_BYTES_PACED if paced(sock) else DUPLEX_LEAD_BYTES


class NetTransport(LinkTransport):
    name = "tcp"

    def __init__(self, rank: int, world_size: int, socks: dict[int, socket.socket], *,
                 timeout: float = 300.0, max_payload: int = frame.MAX_PAYLOAD, mailbox: Mailbox | None = None,
                 local: Transport | None = None, spin_s: float = 0.0, native_spin_s: float | None = None):
        """socks: one connected socket per peer this transport reaches (every other rank, or only
        the remote ones under a HierarchicalTransport, which passes the mailbox it shares and this
        host's shared-memory transport as `local`: its abort flag ends a blocked send here too).
        spin_s: how long a caller's wait polls its socket first (config.tcp_spin_seconds);
        native_spin_s: the same for the native exchanges, swap_row's and duplex's
        (config.native_spin_seconds; default spin_s)."""
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._max_payload, self._spin_s = max_payload, spin_s
        self._native_spin_ns = int((spin_s if native_spin_s is None else native_spin_s) * 1e9)
        self._mailbox = mailbox or Mailbox(rank, world_size)
        self._local = local
        self.bytes_to = [0] * world_size  # payload bytes sent to each rank (what the hierarchy moves where)
        self._socks = socks
        self._send_locks = {peer: threading.Lock() for peer in socks}
        self._closing = False
        self._relayed = False  # this rank has sent its ABORT frames
        self._close_lock = threading.Lock()
        self._readers = []
        self._inboxes = {peer: _Inbox(sock) for peer, sock in socks.items()}
        self._leads = {peer: duplex_lead(sock) for peer, sock in socks.items()}
        self._beats = {peer: frame.pack(HEARTBEAT, peer, 0, Meta(), 0, (), 0) for peer in socks}  # as they come
        self._scratch = threading.local()  # each thread's DUPLEX_SCRATCH_BYTES
        self._rows: dict[tuple[PeerStep, ...], SwapRow | None] = {}  # prepare_row's, by steps
        self._range_rows: dict[tuple, RangeRow | None] = {}  # _range_row's, by steps and element size
        for peer, sock in socks.items():
            sock.settimeout(_POLL)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = threading.Thread(target=self._read_loop, args=(peer, self._inboxes[peer]),
                                      name=f"shmcoll-tcp-reader-{peer}", daemon=True)
            reader.start()
            self._readers.append(reader)
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="shmcoll-tcp-heartbeat", daemon=True)
        if socks:
            self._heartbeat.start()

    # ---- sending ----
    def _send_to(self, to: int, header: bytes, buf: np.ndarray, deadline: float) -> None:
        self._send_frame(to, header, buf.data.cast("B") if buf.nbytes else b"", deadline)

    def _send_frame(self, to: int, header: bytes, payload, deadline: float | None, control: bool = False) -> None:
        lock = self._send_locks[to]
        while not lock.acquire(timeout=_POLL):  # another thread of this rank sends to `to`
            self._check_can_send(to, deadline, control)
        try:
            self._send_locked(to, [memoryview(header), memoryview(payload)], deadline, control)
        finally:
            lock.release()

    def _send_locked(self, to: int, parts: list[memoryview], deadline: float | None, control: bool = False) -> None:
        """control: an ABORT or GOODBYE, which must go out even from an aborted transport."""
        sock = self._socks[to]
        while parts:
            self._check_can_send(to, deadline, control)
            try:
                sent = sock.sendmsg(parts)
            except TimeoutError:
                continue
            except OSError as exc:
                raise PeerLost(f"sending to rank {to} failed: {exc}", to) from exc
            parts = _advance(parts, sent)

    def _check_can_send(self, to: int, deadline: float | None, control: bool = False) -> None:
        if not control:
            self.check_health(strict=False)
        lost = self._mailbox.lost_peers()
        if to in lost:
            raise PeerLost(f"rank {to} was lost: {lost[to]}", to)
        if deadline is not None and time.monotonic() > deadline:
            raise CollectiveTimeout(f"rank {to} did not accept data before the deadline (stopped or overloaded?)")

    # ---- both ways at once ----
    def prepare_row(self, steps: Sequence[PeerStep]) -> SwapRow | None:
        """The first steps whose peers this transport reaches, with their connections looked up:
        worked out once per kind of row (the connections are all made at start), since a general
        path's all-reduce or broadcast asks for its row at every call."""
        key = tuple(steps)
        if key not in self._rows:
            return keep(self._rows, key, self._row_of(key), _ROWS_KEPT)
        return self._rows[key]

    def _row_of(self, steps: Sequence[PeerStep]) -> SwapRow | None:
        reached: list[PeerStep] = []
        for step in steps:
            if step[0] not in self._inboxes:
                break
            reached.append(step)
        if not reached:
            return None
        peers = [peer for peer, _ in reached]
        first = [peers.index(peer) for peer in peers]
        sends_data = tuple(way.sends_data for _, way in reached)
        return SwapRow(peers, bytes(way for _, way in reached), tuple(i for i, f in enumerate(first) if f == i), first,
                       sends_data, [self._inboxes[peer] for peer in peers], [self._send_locks[peer] for peer in peers],
                       tuple(peer for peer, sends in zip(peers, sends_data) if sends), {})

    def swap_row(self, row: SwapRow, header: bytes | np.ndarray, tag: int, seq: int, data: np.ndarray, code: int,
                 op: ReduceKind, deadline: float, into: np.ndarray | None = None) -> tuple[int, int]:
        """Exchanges in a row, in one native call (kernels.swap_row: each step sends, waits,
        reads and folds, as its way says, with no Python between), as far as this thread can have
        the steps' connections at once (_claim_row): all are claimed first, so no reader thread
        takes a later step's frame meanwhile. Each wait is a caller's (spin, then up to
        CALLER_SLEEP_SECONDS asleep); a peer's frame that is not there by then, or anything else on
        the socket first, stops the row, and that step's receive is left to recv. The group's health
        is looked at closely only where the mailbox shows trouble: a fault elsewhere (this host's
        abort) shows in the receive of the first step that does not finish. The small calls of a
        training step come here call after call, and where ranks share cores each line of Python
        here is time a peer waits for: what a row needs is looked up once (prepare_row)."""
        nbytes = data.nbytes
        if nbytes > SWAP_MAX_BYTES:
            return 0, NOT_STARTED
        claimed = self._claim_row(row, tag)
        if not claimed:
            return 0, NOT_STARTED
        whole = claimed == len(row.peers)
        status, swapped, sent = kernels.SWAP_SENT, 0, 0
        try:
            left_s = deadline - time.monotonic()
            if self._mailbox.troubled or left_s < 0:  # where a send's checks fail
                for peer in row.peers[:claimed]:
                    self._check_can_send(peer, deadline)
            for i in row.claims:
                if i < claimed:
                    row.inboxes[i].quiet_reader()
            left_s = max(0.0, left_s)
            status, swapped, sent = kernels.swap_row(
                [inbox.sock.fileno() for inbox in row.inboxes[:claimed]], row.peers if whole else row.peers[:claimed],
                row.ways if whole else row.ways[:claimed], header, tag, seq, data, data if into is None else into,
                row.inbound(nbytes), code, int(op), self._native_spin_ns, int(min(CALLER_SLEEP_SECONDS, left_s) * 1e9),
                int(left_s * 1e9))
        finally:
            self._release_row(row, claimed, swapped, keep_send_lock=status == kernels.SWAP_PARTIAL)
        if whole and swapped == claimed:
            for peer in row.data_peers:
                self.bytes_to[peer] += nbytes
            return swapped, NOT_STARTED
        self._count_sent(row, swapped, nbytes)
        if swapped == claimed:
            return swapped, NOT_STARTED
        peer = row.peers[swapped]
        sends_data = row.sends_data[swapped]
        if status == kernels.SWAP_PARTIAL:  # the reader thread drains the peer's frame meanwhile
            out = frame.for_call(header, tag, seq)
            try:
                self._send_rest(peer, out if sends_data else frame.without_payload(out), data if sends_data else EMPTY,
                                sent, deadline)
            finally:
                row.send_locks[swapped].release()
        elif status < 0:
            raise PeerLost(f"sending to rank {peer} failed: {os.strerror(-status)}", peer)
        self.bytes_to[peer] += nbytes if sends_data else 0
        return swapped, SENT

    def _count_sent(self, row: SwapRow, swapped: int, nbytes: int) -> None:
        """bytes_to after a row's first `swapped` steps: data's bytes to each step's peer that sends."""
        for peer, sends in zip(row.peers[:swapped], row.sends_data):
            if sends:
                self.bytes_to[peer] += nbytes

    def _claim_row(self, row: SwapRow, tag: int) -> int:
        """How many of row's first steps this thread now holds both connections of (_take, once per
        peer), in order until one it cannot have."""
        for i in row.claims:
            if not self._take(row.inboxes[i], row.send_locks[i], row.peers[i], tag):
                return i
        return len(row.inboxes)

    def _release_row(self, row: SwapRow, claimed: int, swapped: int, keep_send_lock: bool) -> None:
        """Give back what _claim_row took: the socket stays the caller's for a while (the reader
        thread napping) where its peer's frame was found; keep_send_lock: that of the step that
        stopped (`swapped`), whose frame is still to be sent."""
        kept = row.first[swapped] if keep_send_lock else -1
        for i in row.claims:
            if i >= claimed:
                break
            inbox = row.inboxes[i]
            inbox.lock.release()
            inbox.leave(i < swapped)
            if i != kept:
                row.send_locks[i].release()

    def _claim(self, to: int, src: int, tag: int) -> _Inbox | None:
        """src's inbox with its lock and the send lock to `to`, both taken, where this thread can
        have them at once: src's reader thread idle, nothing of this call from src queued already,
        no send to `to` under way. None, holding nothing, where it cannot."""
        inbox = self._inboxes.get(src)
        if inbox is None or to not in self._send_locks:
            return None
        return inbox if self._take(inbox, self._send_locks[to], src, tag) else None

    def _take(self, inbox: _Inbox, send_lock: threading.Lock, src: int, tag: int) -> bool:
        """The inbox's lock (src's) and a send lock, both taken, where this thread can have them at
        once (see _claim); False, holding nothing, where it cannot."""
        if not inbox.lock.acquire(False):
            return False
        if self._mailbox.has(src, tag) or not send_lock.acquire(False):
            inbox.lock.release()
            return False
        return True

    def _send_rest(self, to: int, header: bytes, data: np.ndarray, sent: int, deadline: float) -> None:
        """What a native call left of the frame (header, then data) after `sent` bytes, sent here
        (holding the send lock) while the reader thread drains the peer's socket."""
        if sent < len(header) + data.nbytes:
            self._send_locked(to, _advance([memoryview(header), data.data.cast("B")], sent), deadline)

    def _duplexes(self, to: int, src: int, tag: int, steps: Sequence[Step], code: int, meta: Meta,
                  deadline: float) -> tuple[int, int]:
        """send_recv_row()'s steps in native calls (kernels.duplex), one after another while this
        thread holds both connections (_claim: taken once for the whole row). Anything but src's
        frame first on its socket stops the row: that step's receive is left to recv, and the
        socket to its reader thread at once, which drains it while the rest of the step's frame
        goes out: a peer sending to this rank meanwhile never waits on a socket nobody reads. So
        does a peer's frame that has not begun to come within a slice once this step's frame is
        out (_only_waiting): the connections are free for this rank's other threads. A
        frame cut off mid-way (a failure elsewhere ended the wait) leaves src's stream
        unreadable: it counts as ended."""
        inbox = self._claim(to, src, tag)
        if inbox is None:
            return 0, NOT_STARTED
        swapped, progress = 0, np.zeros(5, np.int64)
        try:
            inbox.quiet_reader()
            try:
                for out, into, op in steps:
                    progress[:] = 0
                    header = frame.pack(DATA, self.rank, tag, meta, code, out.shape, out.nbytes)
                    self._run_duplex(to, src, inbox, header, out, into, code, meta, tag, deadline, op, progress)
                    if progress[_IN_STATE] != kernels.IN_DONE:
                        break
                    self.bytes_to[to] += out.nbytes
                    swapped += 1
            finally:
                inbox.lock.release()
                if progress[_IN_STATE] == kernels.IN_BODY and not inbox.finished:
                    self._connection_ended(src, inbox, "its frame was cut off when this rank gave up", graceful=False)
                inbox.leave(progress[_IN_STATE] == kernels.IN_DONE)
            if swapped < len(steps):  # another frame came first: the rest of this step's goes out here
                self._send_rest(to, header, out, int(progress[_SENT]), deadline)
                self.bytes_to[to] += out.nbytes
        finally:
            self._send_locks[to].release()
        return swapped, SENT

    def _duplex_ranges(self, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                       deadline: float, op: ReduceKind | None, host_range: HostRange | None) -> tuple[int, int]:
        """send_recv_ranges()'s steps in one native call (kernels.duplex_row), a slice at a time,
        where this thread can hold every connection they use at once (their peers' inboxes and send
        locks, all taken first, as _duplexes takes one pair's): no Python between the steps. Where
        the row stops (another frame first on a step's socket, or only the wait for a peer's frame
        left after a slice: _duplexes's reasons), the rest of that step's frame goes out here, the
        host range folded first, and its receive is left to recv (SENT)."""
        row = self._range_row(tuple(steps), data.itemsize)
        if row is None or not self._claim_all(row, tag):
            return 0, NOT_STARTED
        return self._run_claimed(row, steps, tag, data, code, meta, deadline, op, host_range)

    def prepare_range_row(self, steps: tuple[RangeStep, ...], itemsize: int) -> RangeRow | None:
        return self._range_row(steps, itemsize)

    def run_range_row(self, row: RangeRow, tag: int, data: np.ndarray, code: int, meta: Meta, deadline: float,
                      op: ReduceKind | None, host_range: HostRange, before: Callable[[], bool]) -> bool:
        if not self._claim_all(row, tag):
            finished, done = 0, NOT_STARTED
            if not before():
                return False
        elif not self._first_holding(row, before):
            return False
        else:
            finished, done = self._run_claimed(row, row.ranges, tag, data, code, meta, deadline, op, host_range)
        self._ranges_after(row.ranges, finished, done, tag, data, code, meta, deadline, op, host_range)
        return True

    def _run_claimed(self, row: RangeRow, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int,
                     meta: Meta, deadline: float, op: ReduceKind | None,
                     host_range: HostRange | None) -> tuple[int, int]:
        """_duplex_ranges' row, once _claim_all holds it."""
        progress, at = row.progress, row.at
        row.words.fill(0)
        header = row.header(self.rank, meta, code)
        status = kernels.DUPLEX_PENDING
        try:
            try:
                status = self._row_slices(row, at, header, tag, meta.seq, data, code, op, deadline, progress,
                                          host_range)
            finally:
                i = int(at[0])  # the step the row stopped at
                self._release_inboxes(row, i, progress)
            for to, _, nbytes in row.steps[:i]:
                self.bytes_to[to] += nbytes
            if status == kernels.DUPLEX_DONE:
                return len(steps), SENT
            to, _, a, b = steps[i][:4]
            if host_range is not None:
                host_range.fold_rest()
            self._send_rest(to, frame.pack(DATA, self.rank, tag, meta, code, (b - a,), (b - a) * data.itemsize),
                            data[a:b], int(progress[_SENT]), deadline)
            self.bytes_to[to] += (b - a) * data.itemsize
            return i, SENT
        finally:
            for lock in row.send_locks:
                lock.release()

    def _row_slices(self, row: RangeRow, at: np.ndarray, header: bytes, tag: int, seq: int, data: np.ndarray,
                    code: int, op: ReduceKind | None, deadline: float, progress: np.ndarray,
                    host_range: HostRange | None) -> int:
        """kernels.duplex_row a slice at a time, with _run_duplex's looks between slices: its status
        once the row is whole, another frame comes first, or only a wait is left."""
        scratch = self._thread_scratch()
        if self._mailbox.troubled or time.monotonic() > deadline:
            to, src, nbytes = row.steps[0]
            self._check_between_slices(to, src, HEADER_SIZE + nbytes, progress, deadline)
        while True:
            wait_s = min(DUPLEX_SLICE_SECONDS, max(0.0, deadline - time.monotonic()))
            status = kernels.duplex_row(row.table, at, header, row.beats, tag, seq, data, scratch, code,
                                        -1 if op is None else int(op), self._native_spin_ns, int(wait_s * 1e9),
                                        progress, None if host_range is None else host_range.native)
            if progress[_BEATS]:
                for src in row.srcs:
                    self._mailbox.touch(src)
                progress[_BEATS] = 0
            if status in (kernels.DUPLEX_DONE, kernels.DUPLEX_ELSEWHERE):
                return status
            if status == kernels.DUPLEX_HOST_FAILED and host_range is not None:
                host_range.raise_failure()
            to, src, nbytes = row.steps[int(at[0])]
            frame_bytes = HEADER_SIZE + nbytes
            self._raise_if_failed(status, to, src)
            if _only_waiting(progress, frame_bytes):
                return status
            self._check_between_slices(to, src, frame_bytes, progress, deadline)

    def _range_row(self, steps: tuple[RangeStep, ...], itemsize: int) -> RangeRow | None:
        """The native row of send_recv_ranges()'s steps over an array of itemsize-byte elements,
        worked out once per kind (its connections, byte ranges and peers' heartbeats); None where
        some peer is not this transport's (under a HierarchicalTransport, a rank of this host)."""
        key = (steps, itemsize)
        if key not in self._range_rows:
            return keep(self._range_rows, key, self._range_row_of(steps, itemsize), _ROWS_KEPT)
        return self._range_rows[key]

    def _range_row_of(self, steps: tuple[RangeStep, ...], itemsize: int) -> RangeRow | None:
        if not steps or any(to not in self._socks or src not in self._inboxes for to, src, *_ in steps):
            return None
        table = np.array([(self._socks[to].fileno(), self._inboxes[src].sock.fileno(), src, a * itemsize,
                           (b - a) * itemsize, b - a, lo * itemsize, (hi - lo) * itemsize, hi - lo, folds,
                           self._leads[to], final)
                          for (to, src, a, b, lo, hi, folds), final in zip(steps, _final_receives(steps))], np.int64)
        tos = tuple(dict.fromkeys(to for to, *_ in steps))
        srcs = tuple(dict.fromkeys(src for _, src, *_ in steps))
        peers = tuple((to, src, (b - a) * itemsize) for to, src, a, b, *_ in steps)
        firsts = tuple(next(i for i, step in enumerate(steps) if step[1] == src) for src in srcs)
        words = np.zeros(6, np.int64)
        return RangeRow(table, peers, b"".join(self._beats[src] for _, src, *_ in steps), tos, srcs, firsts,
                        [self._inboxes[src] for src in srcs], [self._send_locks[to] for to in tos], words,
                        words[:5], words[5:], {}, steps)

    def _claim_all(self, row: RangeRow, tag: int) -> bool:
        """Every inbox and send lock of a row taken, where this thread can have them all at once
        (no reader thread reading, nothing of this call queued from any of its peers, no send
        under way to any); False, holding nothing, where it cannot."""
        taken: list[threading.Lock] = []
        for src, inbox in zip(row.srcs, row.inboxes):
            if not inbox.lock.acquire(False):
                break
            taken.append(inbox.lock)
            if self._mailbox.has(src, tag):
                break
        else:
            for lock in row.send_locks:
                if not lock.acquire(False):
                    break
                taken.append(lock)
            else:
                for inbox in row.inboxes:
                    inbox.quiet_reader()
                return True
        for lock in taken:
            lock.release()
        return False

    def _first_holding(self, row: RangeRow, before: Callable[[], bool]) -> bool:
        """before() while holding a claimed row: True where it finished (the row is still held),
        else False with the row given back, as it is where before() raises."""
        try:
            if before():
                return True
        except BaseException:
            self._give_back(row)
            raise
        self._give_back(row)
        return False

    def _give_back(self, row: RangeRow) -> None:
        """A claimed row's connections given back unused."""
        for inbox in row.inboxes:
            inbox.lock.release()
            inbox.leave(False)
        for lock in row.send_locks:
            lock.release()

    def _release_inboxes(self, row: RangeRow, stopped: int, progress: np.ndarray) -> None:
        """Give back a row's inboxes: a frame the row was reading when it gave up (a failure
        elsewhere ended the wait) leaves its stream unreadable, which counts as ended; the reader
        thread naps on a socket whose frames the row found."""
        cut_off = stopped < len(row.steps) and progress[_IN_STATE] == kernels.IN_BODY
        src_at = row.steps[stopped][1] if stopped < len(row.steps) else -1
        for src, first, inbox in zip(row.srcs, row.firsts, row.inboxes):
            inbox.lock.release()
            if cut_off and src == src_at and not inbox.finished:
                self._connection_ended(src, inbox, "its frame was cut off when this rank gave up", graceful=False)
            inbox.leave(first < stopped)

    def _run_duplex(self, to: int, src: int, inbox: _Inbox, header: bytes, out: np.ndarray, into: np.ndarray,
                    code: int, meta: Meta, tag: int, deadline: float, op: ReduceKind | None,
                    progress: np.ndarray) -> None:
        """kernels.duplex a slice at a time, until both frames are whole, another frame comes
        first, or only the wait for the peer's is left (_only_waiting): the group's health and
        the deadline are checked between slices (before the first only where the mailbox shows
        trouble or the deadline passed, as in swap_row), heartbeats it read are noted as the
        reader thread would."""
        expect = frame.pack(DATA, src, tag, meta, code, into.shape, into.nbytes)
        scratch = self._thread_scratch() if op is not None else _NO_SCRATCH
        if self._mailbox.troubled or time.monotonic() > deadline:
            self._check_between_slices(to, src, len(header) + out.nbytes, progress, deadline)
        while True:
            wait_s = min(DUPLEX_SLICE_SECONDS, max(0.0, deadline - time.monotonic()))
            status = kernels.duplex(self._socks[to].fileno(), header, out, inbox.sock.fileno(), expect,
                                    self._beats[src], into, scratch, code, -1 if op is None else int(op),
                                    self._native_spin_ns, int(wait_s * 1e9), progress, self._leads[to])
            if progress[_BEATS]:
                self._mailbox.touch(src)
                progress[_BEATS] = 0
            if status in (kernels.DUPLEX_DONE, kernels.DUPLEX_ELSEWHERE):
                return
            self._raise_if_failed(status, to, src)
            if _only_waiting(progress, len(header) + out.nbytes):
                return
            self._check_between_slices(to, src, len(header) + out.nbytes, progress, deadline)

    def _raise_if_failed(self, status: int, to: int, src: int) -> None:
        """PeerLost for a duplex's status that ended its step: src's connection ended (noted, as
        the reader thread would), or the send to `to` failed."""
        if status == kernels.DUPLEX_ENDED:
            self._connection_ended(src, self._inboxes[src], "its connection closed (process died?)", graceful=False)
            raise PeerLost(f"rank {src}'s connection ended (process died?)", src)
        if status < 0:
            raise PeerLost(f"sending to rank {to} failed: {os.strerror(-status)}", to)

    def _check_between_slices(self, to: int, src: int, frame_bytes: int, progress: np.ndarray,
                              deadline: float) -> None:
        """What a duplex looks at before it goes on after a slice: the deadline, then the group's health."""
        if time.monotonic() > deadline:
            late = (f"rank {to} did not take this rank's data" if progress[_SENT] < frame_bytes
                    else f"rank {src}'s data did not come")
            raise CollectiveTimeout(f"{late} before the deadline (stopped or overloaded?)")
        self._check_can_send(to, deadline)

    def _thread_scratch(self) -> np.ndarray:
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None:
            scratch = self._scratch.buffer = np.empty(DUPLEX_SCRATCH_BYTES, np.uint8)
        return scratch

    # ---- receiving ----
    def recv(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        if src in self._inboxes:
            now = time.monotonic()
            msg = self._read_while_waiting(src, tag, min(deadline, now + self._spin_s),
                                           min(deadline, now + CALLER_SLEEP_SECONDS))
            if msg is not None:
                return msg
        return self._mailbox.take(src, tag, deadline, strict)

    def recv_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        return self._mailbox.take_any(set(srcs), tag, deadline)

    def _read_while_waiting(self, src: int, tag: int, spin_until: float, sleep_until: float) -> Message | None:
        """Read src's frames on this thread until its message with tag came: polling the socket
        until `spin_until`, then asleep in poll until `sleep_until`. Only frames that are whole in
        the socket already: one still arriving (a large one, or a peer stopped mid-send), a
        malformed one and the connection's end are left to the reader thread, which blocks on
        them, while this caller waits on the mailbox with its deadline. None when the message did
        not come here (it comes through the mailbox, or the mailbox says why it cannot)."""
        inbox = self._inboxes[src]
        if not inbox.lock.acquire(False):
            return None  # the reader thread is reading that socket
        msg = self._mailbox.pop(src, tag)  # the reader thread may have queued it before
        if msg is not None:
            inbox.lock.release()
            return msg
        inbox.mute_reader(True)
        try:
            while msg is None and not inbox.finished and self._mailbox.aborted is None:
                now = time.monotonic()
                if now >= sleep_until:
                    break
                if not inbox.readable(0.0 if now < spin_until else sleep_until - now):
                    continue
                header = inbox.whole_frame_waiting(src, self._max_payload)
                if header is None:
                    break
                if header.kind == DATA and queue_tag(header) == tag:
                    msg = self._take_awaited(src, inbox, header)
                else:
                    self._take_whole_frame(src, inbox, header)
            return msg
        finally:
            inbox.lock.release()
            inbox.leave(msg is not None)

    def _read_loop(self, peer: int, inbox: _Inbox) -> None:
        """Whenever data waits on the socket and no caller is reading it or has just found its
        message there (_Inbox), read one frame."""
        while not inbox.finished:
            if not inbox.wait_for_frames():
                if self._closing:
                    return
                continue
            if inbox.left_to_callers():  # one found its message since: what came is its next
                continue
            if not inbox.lock.acquire(False):
                inbox.nap_while_held()
                continue
            try:
                if not inbox.finished and inbox.readable():  # else a caller took what was there
                    self._take_frame(peer, inbox)
            finally:
                inbox.lock.release()

    def _take_frame(self, peer: int, inbox: _Inbox) -> None:
        """Read one frame, however long it takes to come, and deliver it; the connection's end (a
        goodbye, a protocol error, EOF) is reported to the mailbox once and ends the reading."""
        try:
            header = frame.unpack(self._read(inbox.sock, HEADER_SIZE), peer, self._max_payload)
            payload = _allocate(header.nbytes)
            if header.nbytes:
                self._read_into(inbox.sock, payload.data)
        except (frame.FrameError, ValueError) as exc:
            self._connection_ended(peer, inbox, f"protocol error, connection dropped: {exc}", graceful=False)
            return
        except (EOFError, OSError) as exc:
            reason = "its connection closed" if isinstance(exc, EOFError) else f"connection error: {exc}"
            self._connection_ended(peer, inbox, reason + " (process died?)", graceful=False)
            return
        self._deliver(peer, inbox, header, payload)

    def _take_whole_frame(self, peer: int, inbox: _Inbox, header: frame.Header) -> None:
        """Deliver the frame whole_frame_waiting found (header already validated)."""
        payload = self._read_whole(peer, inbox, header)
        if payload is not None:
            self._deliver(peer, inbox, header, payload)

    def _take_awaited(self, peer: int, inbox: _Inbox, header: frame.Header) -> Message | None:
        """The frame whole_frame_waiting found, when it is the message its caller waits for: read and
        handed straight back (nothing of this tag from peer is queued: only the caller, holding
        the socket, reads it now). None when the mailbox drops it as stale, or the read fails."""
        payload = self._read_whole(peer, inbox, header)
        if payload is None or not self._mailbox.accepts(header):
            return None
        return Message(header, payload)

    def _read_whole(self, peer: int, inbox: _Inbox, header: frame.Header) -> np.ndarray | None:
        """The payload of a frame whose bytes all wait in the socket: one read takes them, header
        and payload together. None when the connection ended under us (reported)."""
        raw = bytearray(HEADER_SIZE + header.nbytes)
        try:
            self._read_into(inbox.sock, memoryview(raw))
        except (EOFError, OSError) as exc:  # cannot happen to bytes already there, but a socket may be shut under us
            self._connection_ended(peer, inbox, f"connection error: {exc} (process died?)", graceful=False)
            return None
        return np.frombuffer(raw, np.uint8, offset=HEADER_SIZE)

    def _deliver(self, peer: int, inbox: _Inbox, header: frame.Header, payload: np.ndarray) -> None:
        if header.kind == DATA:
            self._mailbox.put(Message(header, payload))
        elif header.kind == HEARTBEAT:
            self._mailbox.touch(peer)
        elif header.kind == ABORT:
            self._mailbox.set_abort(AbortReason.decode(payload.tobytes(), peer))
        else:  # GOODBYE
            self._connection_ended(peer, inbox, "goodbye", graceful=True)

    def _connection_ended(self, peer: int, inbox: _Inbox, reason: str, graceful: bool) -> None:
        inbox.finished = True
        if not self._closing:
            self._mailbox.peer_gone(peer, reason, graceful)

    def _read(self, sock: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        self._read_into(sock, memoryview(buf))
        return buf

    def _read_into(self, sock: socket.socket, view: memoryview) -> None:
        got = 0
        while got < len(view):
            if self._closing:
                raise EOFError("transport closing")
            try:
                k = sock.recv_into(view[got:])
            except TimeoutError:
                continue
            if k == 0:
                raise EOFError("connection closed by peer")
            got += k

    def _heartbeat_loop(self) -> None:
        header = frame.pack(HEARTBEAT, self.rank, 0, Meta(), 0, (), 0)
        while not self._stop_heartbeat.wait(HEARTBEAT_SECONDS):
            for peer, lock in self._send_locks.items():
                if lock.acquire(False):  # a send in progress says "alive" already
                    try:
                        self._beat(peer, header)
                    finally:
                        lock.release()

    def _beat(self, peer: int, header: bytes) -> None:
        try:
            sent = self._socks[peer].send(header, socket.MSG_DONTWAIT)
        except OSError:
            return  # buffer full (peer stopped) or connection gone: the reader reports the latter
        if sent < len(header):  # never leave half a frame in the stream
            try:
                self._send_locked(peer, [memoryview(header)[sent:]], time.monotonic() + self.timeout, control=True)
            except CollectiveError:
                pass

    # ---- state ----
    def check_health(self, strict: bool = True) -> None:
        reason = self._mailbox.aborted
        if reason is not None:
            raise reason.error()
        if self._local is not None:
            self._local.check_health(strict=False)
        lost = self._mailbox.lost_peers() if strict else None
        if lost:
            peer, why = next(iter(lost.items()))
            raise PeerLost(f"rank {peer} was lost: {why}", peer)

    def abort(self, reason: AbortReason) -> None:
        """Record the abort (the first one wins) and tell every peer, once. A rank aborted by a
        peer relays it too: frames on one connection arrive in order, so each peer reads this
        rank's ABORT before it sees the connection close, whatever became of the first ABORT."""
        if self._mailbox.aborted is None:
            self._mailbox.set_abort(reason)
        with self._close_lock:
            if self._relayed:
                return
            self._relayed = True
        self.broadcast_control(ABORT, reason.encode())

    def broadcast_control(self, kind: int, payload: bytes) -> None:
        header = frame.pack(kind, self.rank, 0, Meta(), 0, (), len(payload))
        for peer in self._socks:
            try:
                self._send_frame(peer, header, payload, time.monotonic() + _GOODBYE_SECONDS, control=True)
            except Exception:  # best effort: that peer may be the one that died
                pass

    def retire_below(self, seq: int) -> None:
        self._mailbox.retire_below(seq)

    def last_heard(self) -> list[float]:
        return list(self._mailbox.last_heard)

    def close(self) -> None:
        with self._close_lock:
            if self._closing:
                return
            if self._mailbox.aborted is None:
                self.broadcast_control(GOODBYE, b"")
            elif not self._relayed:  # aborted by a peer while idle: relay it before the close is seen
                self._relayed = True
                self.broadcast_control(ABORT, self._mailbox.aborted.encode())
            self._closing = True
        self._stop_heartbeat.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=HEARTBEAT_SECONDS + 1.0)
        for sock in self._socks.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for reader in self._readers:
            reader.join(timeout=2 * _POLL + 1.0)
        self.join_background(2 * _POLL + 1.0)  # their sends fail on the shut sockets
        for sock in self._socks.values():
            sock.close()
        for inbox in self._inboxes.values():
            inbox.close()


class SwapRow(NamedTuple):
    """The connections of a row of exchanges (NetTransport.prepare_row), looked up once for a
    caller that runs the same steps call after call (lean.py's column across hosts)."""

    peers: list[int]
    ways: bytes  # kernels.swap_row's: byte i, what step i does (Way)
    claims: tuple[int, ...]  # the steps that take their peer's connections: each peer's first
    first: list[int]  # for each step, the step that took its peer's connections
    sends_data: tuple[bool, ...]  # whether step i sends the array (not nothing, or an empty frame)
    inboxes: list[_Inbox]
    send_locks: list[threading.Lock]
    data_peers: tuple[int, ...]  # the peers of the steps that send the array, in step order
    #: the native call's room for a peer's frame, by payload bytes; one caller at a time uses a
    #: row's, since it holds the first step's connection throughout
    inbounds: dict[int, np.ndarray]

    def inbound(self, nbytes: int) -> np.ndarray:
        """Room for a frame of nbytes of payload (kernels.swap_row's `inbound`)."""
        room = self.inbounds.get(nbytes)
        if room is None:
            room = keep(self.inbounds, nbytes, np.empty(HEADER_SIZE + nbytes, np.uint8), INBOUNDS_KEPT)
        return room


def _final_receives(steps: Sequence[RangeStep]) -> list[bool]:
    """Whether each step's received range stays as that step leaves it: no later step receives
    into any of it (a ring's last fold of a segment and its all-gather, halving-doubling's last
    halving and its doubling), so a host range may deliver those bytes as they come."""
    later: list[tuple[int, int]] = []
    finals = []
    for *_, lo, hi, _ in reversed(steps):
        finals.append(all(hi <= a or b <= lo for a, b in later))
        later.append((lo, hi))
    return finals[::-1]


class RangeRow(NamedTuple):
    """send_recv_ranges()'s steps as one native row (NetTransport._range_row): kernels.duplex_row's
    table, and the connections its steps use, looked up once per kind of call."""

    table: np.ndarray  # int64 (steps, kernels.DUPLEX_STEP_WORDS)
    steps: tuple[tuple[int, int, int], ...]  # each step's (to, src, bytes sent)
    beats: bytes  # each step's peer's heartbeat header, one after another
    tos: tuple[int, ...]  # the ranks the steps send to, each once
    srcs: tuple[int, ...]  # ... and receive from
    firsts: tuple[int, ...]  # the first step that receives from each of srcs
    inboxes: list[_Inbox]  # srcs'
    send_locks: list[threading.Lock]  # tos'
    #: What a run of the row keeps between its native calls, one run at a time (it holds every
    #: connection of the row): kernels.duplex_row's progress and the step it is at, in `words`; the
    #: frame header of each kind of call (the native call writes in the tag and sequence number).
    words: np.ndarray
    progress: np.ndarray
    at: np.ndarray
    headers: dict[tuple, bytes]
    ranges: tuple[RangeStep, ...]  # the steps it runs, as send_recv_ranges() takes them

    def header(self, rank: int, meta: Meta, code: int) -> bytes:
        """The frame header of a call like `meta` over data of wire type `code`, sent by rank."""
        key = (meta[1:], code)  # all but the sequence number (Meta's first field)
        header = self.headers.get(key)
        if header is None:
            header = keep(self.headers, key, frame.pack(DATA, rank, 0, meta._replace(seq=0), code, (0,), 0),
                          _ROWS_KEPT)
        return header


class _Inbox:
    """The reading side of one connection: whoever holds `lock` reads whole frames from `sock`;
    `finished` once the connection ended (nothing more will be read from it).

    The reader thread sleeps on the socket (`wait_for_frames`) unless callers are reading it: while
    one polls or holds the lock, and for QUIET_SECONDS after one found its message there, the
    socket is muted for it and it sleeps in short naps instead, checking whether callers are still
    at it. It unmutes the socket itself before any long sleep, so nothing ever waits on a muted
    socket for long."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()
        self.finished = False
        self._quiet_until = 0.0  # callers read here recently: the reader thread naps until then
        self._napping = False  # the reader thread sleeps no longer than QUIET_SECONDS
        self._reader_wakes = select.epoll()  # what the reader thread sleeps on
        self._reader_wakes.register(sock, select.EPOLLIN)
        self._holder_looks = select.poll()  # what the lock's holder polls
        self._holder_looks.register(sock, select.POLLIN)

    def wait_for_frames(self) -> bool:
        """The reader thread's sleep, not holding the lock: True when data (or the connection's
        end) may wait on the socket, False after a nap or _POLL seconds of nothing."""
        quiet = self._quiet_until - time.monotonic()
        if quiet > 0:
            self._napping = True
            self.mute_reader(True)
            self._wait(quiet)
            return False
        self._napping = False  # first: a caller leaving from now on unmutes the socket itself
        self.mute_reader(False)
        return self._wait(_POLL)

    def left_to_callers(self) -> bool:
        """Whether a caller found its message here within QUIET_SECONDS (leave): what comes now is
        likely its next one."""
        return self._quiet_until > time.monotonic()

    def nap_while_held(self) -> None:
        """The reader thread's sleep while a caller holds the lock, as after a find: muted, at most
        QUIET_SECONDS, woken by a caller that leaves without its message (leave). Waiting on the
        lock instead, it would take it the moment a caller's long row gives it back, and with it
        the next call's first frame, which that caller's next row was about to read in place: 4
        hosts of one rank on 2 cores, 16 MiB all-reduce, 4 calls in 10 lost their row that way."""
        self._napping = True
        self.mute_reader(True)
        if self.lock.locked():
            self._wait(QUIET_SECONDS)

    def _wait(self, seconds: float) -> bool:
        try:
            return bool(self._reader_wakes.poll(seconds))
        except (OSError, ValueError):  # closed under us: reading says how
            return True

    def leave(self, found: bool) -> None:
        """A caller is done polling (holding the lock no more): after finding its message the
        reader thread keeps napping, else the socket is the reader thread's again at once."""
        if found:
            self._quiet_until = time.monotonic() + QUIET_SECONDS
            if self._napping:
                return  # it wakes within QUIET_SECONDS and sees the callers' time go on
        else:
            self._quiet_until = 0.0
        self.mute_reader(False)

    def readable(self, wait_s: float = 0.0) -> bool:
        """Data (or the connection's end) waits on the socket, now or within wait_s seconds
        (whoever holds the lock: asleep in the kernel meanwhile, the GIL released)."""
        try:
            return bool(self._holder_looks.poll(wait_s * 1e3))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Release the epoll descriptor (once the reader thread is done with it)."""
        self._reader_wakes.close()

    def quiet_reader(self) -> None:
        """mute_reader(True) for a caller about to read, unless the reader thread naps, muted already."""
        if not self._napping:
            self.mute_reader(True)

    def mute_reader(self, muted: bool) -> None:
        """Keep the reader thread asleep while a caller reads (or wake it for what waits): a thread
        woken for every frame would take the GIL from the caller it only races."""
        try:
            self._reader_wakes.modify(self.sock, 0 if muted else select.EPOLLIN)
        except (OSError, ValueError):
            pass  # closed: the reader thread ends on its own

    def whole_frame_waiting(self, peer: int, max_payload: int) -> frame.Header | None:
        """The header of a whole, valid frame that waits in the socket's buffer (peeked, not
        taken), or None. One peek of up to PEEK_BYTES shows a small frame whole; a larger one is
        whole when the buffer holds as many bytes as it announces (FIONREAD). Only once readable():
        the peek would wait out the socket's timeout for a first byte."""
        try:
            seen = self.sock.recv(PEEK_BYTES, socket.MSG_PEEK)
            if len(seen) < HEADER_SIZE:
                return None
            header = frame.unpack(seen[:HEADER_SIZE], peer, max_payload)
            whole = HEADER_SIZE + header.nbytes
            if len(seen) < whole and (whole <= PEEK_BYTES or self._bytes_waiting() < whole):
                return None
        except (OSError, ValueError, frame.FrameError):
            return None
        return header

    def _bytes_waiting(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


_NO_SCRATCH = np.empty(0, np.uint8)  # a duplex that copies reads straight into place


def _only_waiting(progress: np.ndarray, frame_bytes: int) -> bool:
    """Whether a duplex that did not finish has sent its whole frame and read nothing of the
    peer's: from there on it would only wait, holding both connections. Another thread of this
    rank (a spawned call, another group's) may have to send to that peer first, so the wait is
    left to recv, which holds neither."""
    return progress[_IN_STATE] == kernels.IN_WAITING and progress[_SENT] == frame_bytes


def _allocate(nbytes: int) -> np.ndarray:
    """A payload buffer; a size this process cannot hold is the peer's fault (a protocol error)."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        raise frame.FrameError(f"a frame announced {nbytes} bytes, more than this process can allocate") from exc


def _advance(parts: list[memoryview], sent: int) -> list[memoryview]:
    """Drop the first `sent` bytes from a list of buffers (sendmsg may send part of them)."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts = parts[1:]
    if parts and sent:
        parts = [parts[0][sent:], *parts[1:]]
    return parts
