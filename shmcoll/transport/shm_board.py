"""The board: small collectives on shared memory in one step, whatever the number of ranks.

Each local rank owns two board entries, used alternately by sequence number. For a small
collective every rank writes its whole input into its entry once (payload, frame header, then the
"published" word), and every rank reads every entry straight out of shared memory, in rank order,
so reductions are bitwise identical everywhere. A rank reuses an entry only when every peer has
finished the call that last read it (each rank's "done" word says which).

Ordering, on any CPU (the words are loaded and stored by kernels.py's atomics):
  * a writer stores its payload and header, then the published word with a release (sequentially
    consistent) store; a reader loads the published word with acquire before it reads the entry,
    so seeing the word implies seeing the entry whole;
  * a reader reads every entry, then stores its done word the same way; a writer loads every
    peer's done word with acquire before it overwrites its entry, so no peer still reads the old one.
Waits spin briefly, then sleep on a futex of the word that the writer wakes (kernels.wait_word),
in slices of at most WAIT_SLICE_NS, between which aborts, dead peers and the deadline are checked.
The all-reduce and the broadcast run as one compiled step each (kernels.board_all_reduce and
board_broadcast); the other calls publish and read through the methods below. A large all-reduce
publishes only where its array is, for peers to read directly (algorithms/single_copy.py), and
signals its steps on words of its entry.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import kernels
from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from . import frame
from .frame import HEADER_SIZE, Meta
from .shm_layout import (
    BOARD_HEADER_OFFSET,
    BOARD_SLEEPERS_OFFSET,
    SLOT_HEADER_BYTES,
    W_DONE,
    W_DONE_SLEEPERS,
    Layout,
)

#: Longest compiled wait before the waiter looks at aborts, dead peers and its deadline.
WAIT_SLICE_NS = 10_000_000
_SRC_START, _SRC_END = frame.SRC_FIELD  # the one header field that differs between ranks' entries
#: The u32 counter of ranks asleep on some done word (W_DONE_SLEEPERS's low half).
DONE_SLEEPERS = 2 * W_DONE_SLEEPERS
assert (kernels.BOARD_HEADER_AT, kernels.BOARD_HEADER_BYTES, kernels.BOARD_SLEEPERS_AT, kernels.BOARD_PAYLOAD_AT) \
    == (BOARD_HEADER_OFFSET, HEADER_SIZE, BOARD_SLEEPERS_OFFSET, SLOT_HEADER_BYTES)
assert frame.SRC_FIELD == kernels.SRC_FIELD


def entry_header(rank: int, meta: Meta, code: int, data: np.ndarray) -> np.ndarray:
    """The frame header rank's board entry carries for the call `meta` over data (1-D, wire type
    `code`), as writable uint8: every path of a board call builds it here, so ranks compare alike."""
    return np.frombuffer(bytearray(frame.pack(frame.DATA, rank, 0, meta, code, data.shape, data.nbytes)), np.uint8)


class Board:
    def __init__(self, mem: np.ndarray, layout: Layout, rank: int, local_of: dict[int, int], spin_s: float):
        self.mem, self._layout, self._rank, self._local_of = mem, layout, rank, local_of
        self._me = local_of[rank]
        #: whether every local rank can read its peers' memory (None until the first call that asks;
        #: algorithms/single_copy.py)
        self.single_copy_agreed: bool | None = None
        #: what the algorithms keep per kind of call on this board (single_copy.py's descriptors):
        #: one call at a time uses a board
        self.kept: dict[tuple, object] = {}
        #: bytes this rank read straight from each local rank's memory so far (single_copy.py), by group rank
        self.bytes_read_from = [0] * (max(local_of) + 1)
        #: ... and wrote straight into each local rank's memory (a large all-reduce on one host)
        self.bytes_written_to = [0] * (max(local_of) + 1)
        self.spin_ns = int(spin_s * 1e9)  # how long a wait spins before it sleeps
        self._nbytes = 0
        self._header = b""
        #: per local group rank: its entry offsets for even and odd sequence numbers and its done
        #: word (the compiled all-reduce's map; it runs only when every rank is local)
        self.where = np.zeros((max(local_of) + 1, 3), dtype=np.int64)
        for r, local in local_of.items():
            self.where[r] = layout.board_offset(local, 0), layout.board_offset(local, 1), W_DONE + local
        #: the ranks on this board, in local order, which is rank order (bootstrap numbers a host's
        #: ranks so, and a compiled all-gather places their blocks so), and their rows of `where`:
        #: the map of a compiled all-reduce among this host's ranks only (the in-host step of a
        #: group across hosts; the same map as `where` when every rank is local)
        self.host_ranks = tuple(sorted(local_of, key=local_of.__getitem__))
        self.host_where = np.ascontiguousarray(self.where[list(self.host_ranks)])

    @property
    def capacity(self) -> int:
        return self._layout.board_bytes

    # ---- the compiled all-reduce ----
    def all_reduce_step(self, seq: int, data: np.ndarray, header: np.ndarray, code: int, op: int) -> int:
        """The whole all-reduce among this board's ranks (host_ranks) in one compiled call when no
        wait outlasts a slice (the usual case): kernels.BOARD_DONE, else the status all_reduce_rest
        goes on from. data: 1-D storage array, reduced in place; header: our frame header as uint8
        (the step fills in the sequence number)."""
        return kernels.board_all_reduce(self.mem, data, header, self.host_where, self._me, seq, code, op, 0,
                                        self.spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)

    def all_reduce(self, seq: int, data: np.ndarray, header: np.ndarray, code: int, op: int, deadline: float,
                   guard: Callable[[], Callable[[int], None]], want: Meta) -> None:
        """all_reduce_step, then, only if a wait outlasted its first slice, all_reduce_rest with the
        check guard() builds (not built at all on the usual path)."""
        status = self.all_reduce_step(seq, data, header, code, op)
        if status != kernels.BOARD_DONE:
            self.all_reduce_rest(status, seq, data, header, code, op, deadline, guard(), want)

    def all_reduce_rest(self, status: int, seq: int, data: np.ndarray, header: np.ndarray, code: int, op: int,
                        deadline: float, check: Callable[[int], None], want: Meta) -> None:
        """Finish an all-reduce whose first step returned `status` (_finish_step)."""
        self._finish_step(status, lambda position, spin, wait: kernels.board_all_reduce(
            self.mem, data, header, self.host_where, self._me, seq, code, op, position, spin, wait, DONE_SLEEPERS),
            seq, data, deadline, check, want)

    def broadcast(self, seq: int, data: np.ndarray, header: np.ndarray, code: int, source: int | None,
                  deadline: float, guard: Callable[[], Callable[[int], None]], want: Meta) -> None:
        """Group rank source's data (1-D storage array, wire type `code`) into every other board
        rank's data in one compiled call, as all_reduce does an all-reduce (kernels.board_broadcast);
        with source None nobody's, and the board's ranks only meet. Every rank has seen every
        board rank's call when it returns."""
        on_board = self.board_source(source)
        status = kernels.board_broadcast(self.mem, data, header, self.host_where, self._me, seq, code, on_board, 0,
                                         self.spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)
        if status != kernels.BOARD_DONE:
            self.broadcast_rest(status, seq, data, header, code, on_board, deadline, guard(), want)

    def board_source(self, source: int | None) -> int:
        """The source kernels.board_broadcast takes for group rank source: its place among
        host_ranks, or (None) one past the last, whose payload nobody copies."""
        return len(self.host_ranks) if source is None else self._local_of[source]

    def broadcast_rest(self, status: int, seq: int, data: np.ndarray, header: np.ndarray, code: int, on_board: int,
                       deadline: float, check: Callable[[int], None], want: Meta) -> None:
        """Finish a broadcast (on_board: board_source's) whose first step returned `status` (_finish_step)."""
        self._finish_step(status, lambda position, spin, wait: kernels.board_broadcast(
            self.mem, data, header, self.host_where, self._me, seq, code, on_board, position, spin, wait,
            DONE_SLEEPERS), seq, data, deadline, check, want)

    def all_gather(self, seq: int, out: np.ndarray, header: np.ndarray, code: int, deadline: float,
                   guard: Callable[[], Callable[[int], None]], want: Meta) -> None:
        """Every board rank's block of out (a 1-D storage array of one equal block per rank of
        host_ranks, in that order; header describes one block) into every board rank's out, this
        rank's own in place, in one compiled call (kernels.board_all_gather), as all_reduce does an
        all-reduce."""
        status = kernels.board_all_gather(self.mem, out, header, self.host_where, self._me, seq, code, 0,
                                          self.spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)
        if status != kernels.BOARD_DONE:
            self.all_gather_rest(status, seq, out, header, code, deadline, guard(), want)

    def all_gather_rest(self, status: int, seq: int, out: np.ndarray, header: np.ndarray, code: int,
                        deadline: float, check: Callable[[int], None], want: Meta) -> None:
        """Finish an all-gather whose first step returned `status` (_finish_step)."""
        self._finish_step(status, lambda position, spin, wait: kernels.board_all_gather(
            self.mem, out, header, self.host_where, self._me, seq, code, position, spin, wait, DONE_SLEEPERS),
            seq, out, deadline, check, want)

    def gather_open(self, seq: int, out: np.ndarray, header: np.ndarray, code: int, deadline: float,
                    guard: Callable[[], Callable[[int], None]], want: Meta) -> None:
        """publish() of this rank's block of out (one equal block per rank of host_ranks, in that
        order) with the call's header (of its array), and every board rank's block read into
        place, in one compiled call (kernels.board_gather_open): the entries publish() and read()
        would write and check, but this rank's reading stays open: finish() ends it, once its
        peers may change what the blocks describe (a large call's arrays, single_copy.py)."""
        status = self.gather_open_first(seq, out, header, code)
        if status != kernels.BOARD_DONE:
            self.gather_open_rest(status, seq, out, header, code, deadline, guard(), want)

    def gather_open_first(self, seq: int, out: np.ndarray, header: np.ndarray, code: int) -> int:
        """gather_open()'s compiled call, its first wait slice only: its status, kernels.BOARD_DONE
        once every block is in (else gather_open_rest goes on)."""
        return kernels.board_gather_open(self.mem, out, header, self.host_where, self._me, seq, code, 0,
                                         self.spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)

    def gather_open_rest(self, status: int, seq: int, out: np.ndarray, header: np.ndarray, code: int,
                         deadline: float, check: Callable[[int], None], want: Meta) -> None:
        """Finish a gather_open whose first call returned `status` (_finish_step)."""
        self._finish_step(status, lambda position, spin, wait: kernels.board_gather_open(
            self.mem, out, header, self.host_where, self._me, seq, code, position, spin, wait, DONE_SLEEPERS),
            seq, out, deadline, check, want)

    def _finish_step(self, status: int, step: Callable[[int, int, int], int], seq: int, data: np.ndarray,
                     deadline: float, check: Callable[[int], None], want: Meta) -> None:
        """Go on with a compiled board step (step(position, spin_ns, slice_ns) -> status) that returned
        `status`: check (check(src) raises on failure) between wait slices, until done or the deadline."""
        position, failure = 0, None
        while status != kernels.BOARD_DONE:
            if status < 0:
                self._step_mismatch(self.host_ranks[-2 - status], seq, data, want)
            if failure is not None and status == position:
                raise failure  # a failure seen after the awaited entry came (a peer that published, then left) is none
            position, failure = status, None
            src = self._rank if position == 0 else self.host_ranks[position - 1]
            try:
                check(src)
            except CollectiveError as exc:
                failure = exc
            if failure is None and time.monotonic() > deadline:
                raise CollectiveTimeout(f"waited for rank {src}'s board entry until the deadline")
            spin, wait = (0, 0) if failure is not None else (0, WAIT_SLICE_NS)
            status = step(position, spin, wait)

    def _step_mismatch(self, src: int, seq: int, data: np.ndarray, want: Meta) -> None:
        self._mismatch(self._read_header(self._entry(src, seq)), src, want, data.nbytes)

    # ---- publishing and reading, for the other board calls ----
    def publish(self, meta: Meta, code: int, data: np.ndarray, deadline: float, check: Callable[[], None],
                payload: np.ndarray | None = None) -> None:
        """Write our entry for meta.seq (data: a 1-D array of wire type `code`) once no peer can
        still be reading the entry it replaces. `payload`, where given, is what the entry carries
        instead of data (every rank of the call publishes one of the same size); the header still
        describes data."""
        seq = meta.seq
        header = self._header = entry_header(self._rank, meta, code, data).tobytes()
        payload = (data if payload is None else payload).view(np.uint8)
        self._nbytes = payload.nbytes
        at = self._entry(self._rank, seq)
        previous = int(kernels.load_word(self.mem, at // 8))
        if previous:
            self._wait_all_done(previous, deadline, check, "peers to finish reading our board entry")
        self.mem[at + BOARD_HEADER_OFFSET:at + BOARD_HEADER_OFFSET + HEADER_SIZE] = np.frombuffer(header, np.uint8)
        self.mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + len(payload)] = payload
        kernels.store_and_wake(self.mem, at // 8, seq + 1, (at + BOARD_SLEEPERS_OFFSET) // 4)

    def read(self, src: int, seq: int, want: Meta, deadline: float, check: Callable[[int], None]) -> np.ndarray:
        """Rank src's payload (uint8 view into shared memory) for seq; CollectiveMismatch if its call differs."""
        at, raw = self._published(src, seq, deadline, check)
        if raw[_SRC_END:] != self._header[_SRC_END:] or raw[:_SRC_START] != self._header[:_SRC_START]:
            self._mismatch(raw, src, want, self._nbytes)  # the same call makes the same header, but for the source rank
        return self.mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + self._nbytes]

    def read_any_size(self, src: int, seq: int, want: Meta, deadline: float,
                      check: Callable[[int], None]) -> np.ndarray:
        """As read, for calls whose ranks publish different amounts (all_gather_v, scatter): only the
        call's description must match; the payload is as long as src's entry says."""
        at, raw = self._published(src, seq, deadline, check)
        header = frame.unpack(raw, src)
        problem = frame.describe_mismatch(header.meta, want, src)
        if problem:
            raise CollectiveMismatch(problem)
        return self.mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + min(header.nbytes, self.capacity)]

    def _published(self, src: int, seq: int, deadline: float, check: Callable[[int], None]) -> tuple[int, bytes]:
        """Wait for src's entry of seq; its offset and raw frame header."""
        at = self._entry(src, seq)
        if src != self._rank:
            self._wait(at // 8, seq + 1, False, (at + BOARD_SLEEPERS_OFFSET) // 4, deadline, lambda: check(src),
                       f"rank {src}'s board entry")
        return at, self._read_header(at)

    def _read_header(self, at: int) -> bytes:
        return self.mem[at + BOARD_HEADER_OFFSET:at + BOARD_HEADER_OFFSET + HEADER_SIZE].tobytes()

    def _entry(self, rank: int, seq: int) -> int:
        return int(self.where[rank, seq % 2])

    @staticmethod
    def _mismatch(raw: bytes, src: int, want: Meta, nbytes: int) -> None:
        """Raise CollectiveMismatch: rank src's entry header (raw) differs from this rank's call (nbytes of data)."""
        header = frame.unpack(raw, src)
        problem = frame.describe_mismatch(header.meta, want, src)
        raise CollectiveMismatch(problem or f"rank {src} published {header.nbytes} bytes of dtype code "
                                            f"{header.dtype}, this rank {nbytes}")

    def published(self, src: int, seq: int) -> bool:
        """Whether rank src has published its entry for seq (it is inside that call)."""
        return kernels.load_word(self.mem, self._entry(src, seq) // 8) == seq + 1

    def payload_word(self, src: int, seq: int, k: int) -> int:
        """The index of u64 word k of rank src's entry payload for seq (in mem as u64 words)."""
        return (self._entry(src, seq) + SLOT_HEADER_BYTES) // 8 + k

    def finish(self, seq: int) -> None:
        """We have read every entry of seq: peers may overwrite theirs."""
        kernels.store_and_wake(self.mem, W_DONE + self._me, seq + 1, DONE_SLEEPERS)

    def wait_all_finished(self, seq: int, deadline: float, check: Callable[[], None]) -> None:
        """Until every peer has finished seq. A call that goes on over the rings after a board step
        waits here first, so no peer still waiting on the board takes its ring frames for a
        mismatch. check must not consume frames (peers past this point may already send them)."""
        self._wait_all_done(seq + 1, deadline, check, "peers to finish the board step")

    def probe(self, want: Meta) -> str | None:
        """A peer that published an entry for want.seq describing another call: how it differs."""
        for src in self._local_of:
            at = self._entry(src, want.seq)
            if src == self._rank or kernels.load_word(self.mem, at // 8) != want.seq + 1:
                continue
            problem = frame.describe_mismatch(frame.unpack(self._read_header(at), src).meta, want, src)
            if problem:
                return problem
        return None

    # ---- waiting ----
    def _wait_all_done(self, mark: int, deadline: float, check: Callable[[], None], what: str) -> None:
        for peer, local in self._local_of.items():
            if peer != self._rank:
                self._wait(W_DONE + local, mark, True, DONE_SLEEPERS, deadline, check, what)

    def wait_at_least(self, word: int, target: int, sleepers: int, deadline: float, check: Callable[[], None],
                      what: str) -> None:
        """Until u64 word `word` of mem reaches target (sleepers: the u32 counter of its waiters)."""
        self._wait(word, target, True, sleepers, deadline, check, what)

    def _wait(self, word: int, target: int, at_least: bool, sleepers: int, deadline: float,
              check: Callable[[], None], what: str) -> None:
        """Until the word reaches target: compiled wait slices (spinning in the first only), check()
        between them (it raises on failure)."""
        spin = self.spin_ns
        while not kernels.wait_word(self.mem, word, target, at_least, sleepers, spin, WAIT_SLICE_NS):
            spin = 0
            self._between_slices(lambda: kernels.wait_word(self.mem, word, target, at_least, sleepers, 0, 0),
                                 deadline, check, what)

    @staticmethod
    def _between_slices(ready: Callable[[], bool], deadline: float, check: Callable[[], None], what: str) -> None:
        """After a wait slice ran out: raise on failure or past the deadline. A failure seen after
        the awaited word arrived (a peer that published, then left) is no failure."""
        try:
            check()
        except CollectiveError:
            if ready():
                return
            raise
        if time.monotonic() > deadline:
            raise CollectiveTimeout(f"waited for {what} until the deadline")
