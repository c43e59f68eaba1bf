"""The Transport contract: everything an algorithm or a ProcessGroup may ask of a transport.

A transport moves arrays to and from one peer at a time and knows nothing of collectives. Algorithms
call `send` and `recv_into`; `recv_into` either copies a message into the destination or reduces it
into it (op given), so a transport that can read in place (shared memory) needs no extra copy.
`exchange` and `send_recv` are a step's send and receive together, which TCP runs in native calls
(`exchanges` and `send_recv_row` several such steps in a row).
Every wait takes an absolute deadline (time.monotonic() seconds). A transport that has a
shared-memory board (one-step small collectives, algorithms/board.py) also offers the guard its
waits run.

Implementations: ShmTransport (shm.py, ranks on one host), NetTransport (tcp.py, TCP), the
HierarchicalTransport over both (hierarchical.py) and SubTransport (sub.py, a split group's view of
its parent's transport).
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol

import numpy as np

from .. import kernels
from ..errors import CollectiveMismatch
from ..types import TAG_RESERVED_BASE, ReduceKind
from . import frame
from .frame import DATA, Meta, describe_mismatch
from .mailbox import AbortReason, Mailbox, Message
from .topology import Topology

if TYPE_CHECKING:
    from .shm_board import Board
    from .tcp import SwapRow


#: What an empty frame carries: nothing (its header alone describes the call).
EMPTY = np.empty(0, dtype=np.uint8)
#: What a step of Transport._swaps or _duplexes did: nothing, or sent the array only.
NOT_STARTED, SENT = range(2)
#: One step of send_recv_row: the array sent, the array received into, and how (op: folded; None: copied).
Step = tuple[np.ndarray, np.ndarray, ReduceKind | None]


class Way(enum.IntEnum):
    """What a step of exchanges() does with its peer (kernels.swap_row's ways). An exchange sends
    the array and folds the peer's in, in the order both ends use; among a number of ranks that is
    not a power of two, a rank past the largest power of two gives its array to a partner, which
    folds it in, and takes the result back from it. A broadcast's steps move the array one way and
    an empty frame, which only describes the call, the other (or empty frames both ways where the
    array has not come yet): doubling_broadcast.py's."""

    THEIRS_FIRST = kernels.WAY_THEIRS_FIRST  # exchange: data = theirs op data
    OWN_FIRST = kernels.WAY_OWN_FIRST  # exchange: data = data op theirs
    GIVE = kernels.WAY_GIVE  # send only
    TAKE = kernels.WAY_TAKE  # receive only: the peer's array replaces data
    FOLD_IN = kernels.WAY_FOLD_IN  # receive only: data = data op theirs
    SWAP = kernels.WAY_SWAP  # exchange: the peer's array replaces data (or fills swap_row's `into`)
    CAST_OUT = kernels.WAY_SWAP | kernels.WAY_THEIRS_EMPTY  # send; an empty frame back
    CAST_IN = kernels.WAY_SWAP | kernels.WAY_OURS_EMPTY  # an empty frame out; the peer's array replaces data
    MEET = kernels.WAY_SWAP | kernels.WAY_OURS_EMPTY | kernels.WAY_THEIRS_EMPTY  # empty frames both ways
    GIVE_EMPTY = kernels.WAY_GIVE | kernels.WAY_OURS_EMPTY  # send only, an empty frame
    TAKE_EMPTY = kernels.WAY_TAKE | kernels.WAY_THEIRS_EMPTY  # receive only, an empty frame

    @property
    def sends(self) -> bool:
        return self not in (Way.TAKE, Way.FOLD_IN, Way.TAKE_EMPTY)

    @property
    def receives(self) -> bool:
        return self not in (Way.GIVE, Way.GIVE_EMPTY)

    @property
    def sends_data(self) -> bool:
        """Whether what this step sends is the array (else nothing, or an empty frame)."""
        return self.sends and not self & kernels.WAY_OURS_EMPTY

    @property
    def takes_data(self) -> bool:
        """Whether what this step receives is the peer's array (else nothing, or an empty frame)."""
        return self.receives and not self & kernels.WAY_THEIRS_EMPTY


#: One step of exchanges(): the peer, and what this rank does with it.
PeerStep = tuple[int, Way]
#: One step of send_recv_ranges(): elements [out_lo, out_hi) of the array to rank `to` while rank
#: src's frame of the call comes into [in_lo, in_hi), folded with the call's op (folds) or copied:
#: (to, src, out_lo, out_hi, in_lo, in_hi, folds).
RangeStep = tuple[int, int, int, int, int, int, bool]


class HostRange(Protocol):
    """The range of the array a row of send_recv_ranges() carries across hosts that this rank's
    host folds and takes back by reading its ranks' arrays (algorithms/single_copy.py), handed to
    the row so each piece is folded out of the host peers' arrays just before the row sends it or
    folds into it, and written into theirs as soon as it is final (native/host_range.h): a piece is
    read from memory once for all of it. A transport that runs the row natively hands `native` to
    kernels.duplex_row; any other way of moving the array must fold_rest() before it touches it."""

    native: tuple[Any, ...]

    def fold_rest(self) -> None:
        """Fold every piece the row has not folded yet."""

    def raise_failure(self) -> NoReturn:
        """Raise what a failed read or write of a host peer's array means (the row stopped at it)."""


class BoardGuard(Protocol):
    """What a board wait runs between looks at the board: raises when waiting can no longer succeed."""

    def __call__(self, src: int | None = None) -> None:
        """src: the rank waited for, or None (waiting for peers to finish reading)."""


class Transport(ABC):
    """Point-to-point messages between the ranks of one group, each wait bounded by a deadline."""

    name: ClassVar[str]  # "shm", "tcp", "hier", "sub": how benchmarks and messages name it
    rank: int
    world_size: int
    timeout: float  # seconds a group built on this transport gives each call
    board: Board | None = None  # the shared-memory board, where every rank of the group shares one host
    host_board: Board | None = None  # this host's board, where the group spans hosts (the in-host step)
    topology: Topology | None = None  # which ranks share a host, where the group spans hosts
    overlap: bool = False  # config.overlaps_across_hosts, where the group spans hosts
    overlap_in_group: bool = False  # whether any rank of the group overlaps: then ranges cross hosts in pieces

    def tag_of(self, seq: int) -> int:
        """The tag of the group's collective number seq: the root group's range is
        [TAG_RESERVED_BASE, 2 * TAG_RESERVED_BASE); a sub-group's transport has its own range."""
        return TAG_RESERVED_BASE + seq % TAG_RESERVED_BASE

    @abstractmethod
    def send(self, to: int, tag: int, buf: np.ndarray, code: int, meta: Meta, deadline: float) -> None:
        """Send a C-contiguous array (its raw bytes, its shape, wire dtype `code`) to rank `to`."""

    @abstractmethod
    def recv(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        """Next message from src with tag (see Mailbox.take for `strict`)."""

    def recv_into(self, src: int, tag: int, out: np.ndarray, code: int, deadline: float,
                  want: Meta | None = None, op: ReduceKind | None = None, strict: bool = True) -> None:
        """Receive into `out` (a 1-D storage array): copy, or reduce with op. Checks the sender's call."""
        msg = self.recv(src, tag, deadline, strict)
        place(msg, out, code, want, op)

    def exchange(self, peer: int, tag: int, data: np.ndarray, code: int, meta: Meta, deadline: float,
                 op: ReduceKind, own_first: bool) -> None:
        """One pairwise step of an all-reduce: send data (a 1-D storage array) to peer and fold in
        the array peer sends in the same call, data = own op theirs where own_first, else theirs
        op own (both ends then hold bitwise the same result); with an empty array the two only
        meet (a barrier's step)."""
        way = Way.OWN_FIRST if own_first else Way.THEIRS_FIRST
        self.exchanges(((peer, way),), tag, data, code, meta, deadline, op)

    def exchanges(self, steps: Sequence[PeerStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                  deadline: float, op: ReduceKind) -> None:
        """Each (peer, way) of steps in turn: recursive doubling's exchange() steps, and a rank's
        array given to a partner and the result taken back. A transport may run them in a row at
        once (`_swaps`); a step it cannot is a send, then a receive, as its way says."""
        while steps:
            swapped, done = self._swaps(steps, tag, data, code, meta, deadline, op)
            steps = self.exchanges_after(steps, swapped, done, tag, data, code, meta, deadline, op)

    def exchanges_after(self, steps: Sequence[PeerStep], swapped: int, done: int, tag: int,
                        data: np.ndarray, code: int, meta: Meta, deadline: float,
                        op: ReduceKind) -> Sequence[PeerStep]:
        """Where a row of exchanges (_swaps, swap_row) stopped after `swapped` whole steps and
        `done` of the next: that step finished here, its send and its receive as far as its way
        has them. The steps after it."""
        if swapped == len(steps):
            return ()
        peer, way = steps[swapped]
        if done == NOT_STARTED and way.sends:
            self.send(peer, tag, data if way.sends_data else EMPTY, code, meta, deadline)
        if way.receives:
            self._fold_theirs(peer, tag, data if way.takes_data else EMPTY, code, meta, deadline, op, way)
        return steps[swapped + 1:]

    def _fold_theirs(self, peer: int, tag: int, data: np.ndarray, code: int, meta: Meta, deadline: float,
                     op: ReduceKind, way: Way) -> None:
        """A step's receive: peer's array folded into data in the order both ends use, or copied
        (TAKE, CAST_IN, SWAP), or an empty frame met."""
        if way in (Way.TAKE, Way.CAST_IN, Way.SWAP) or not data.nbytes:  # an empty frame only meets
            self.recv_into(peer, tag, data, code, deadline, meta)
            return
        if way is not Way.THEIRS_FIRST:
            self.recv_into(peer, tag, data, code, deadline, meta, op)
            return
        theirs = np.empty_like(data)
        self.recv_into(peer, tag, theirs, code, deadline, meta)
        kernels.reduce_into(theirs, data, code, op)
        data[:] = theirs

    def _swaps(self, steps: Sequence[PeerStep], tag: int, data: np.ndarray, code: int, meta: Meta,
               deadline: float, op: ReduceKind) -> tuple[int, int]:
        """The first steps of exchanges() where this transport can run them at once (a row,
        prepare_row and swap_row, with the call's frame header): how many it ran whole, and what
        it did of the next one: SENT (data went out, the peer's array is still to be received) or
        NOT_STARTED (nothing: where the transport runs no rows, for every step)."""
        row = self.prepare_row(steps)
        if row is None:
            return 0, NOT_STARTED
        header = frame.pack(DATA, self.rank, tag, meta, code, data.shape, data.nbytes)
        return self.swap_row(row, header, tag, meta.seq, data, code, op, deadline)

    def prepare_row(self, steps: Sequence[PeerStep]) -> SwapRow | None:
        """The first steps of exchanges() that swap_row can run in one native call, worked out once
        for a caller that runs them call after call (lean.py); None where this transport runs none."""
        return None

    def row_transport(self) -> Transport:
        """The transport whose swap_row runs the rows prepare_row prepares: this one, or the part of
        it that reaches the rows' peers (a caller that runs rows call after call calls it there)."""
        return self

    def swap_row(self, row: SwapRow, header: bytes | np.ndarray, tag: int, seq: int, data: np.ndarray, code: int,
                 op: ReduceKind, deadline: float, into: np.ndarray | None = None) -> tuple[int, int]:
        """A prepared row's exchanges at once, as _swaps, from a frame header packed once for calls
        like this one (the native call writes in their tag and sequence number); into: where a row
        that only copies places its peers' arrays (default data; the same length)."""
        raise NotImplementedError(f"the {self.name} transport runs no rows of exchanges")

    def send_recv(self, to: int, src: int, tag: int, out: np.ndarray, into: np.ndarray, code: int, meta: Meta,
                  deadline: float, op: ReduceKind | None = None) -> None:
        """One step of a ring or of halving-doubling: send `out` to rank `to` while receiving src's
        array of the same call into `into` (both 1-D storage arrays): folded, into = into op
        theirs, or copied (op None)."""
        self.send_recv_row(to, src, tag, ((out, into, op),), code, meta, deadline)

    def send_recv_row(self, to: int, src: int, tag: int, steps: Sequence[Step], code: int, meta: Meta,
                      deadline: float) -> None:
        """send_recv() with each (out, into, op) of steps in turn, all to `to` and from `src`: a
        ring's steps. A step starts once the one before is whole, so a step may send what an earlier
        one received. A transport may run them at once (`_duplexes`); a step it cannot is a send,
        then a receive (sends never block on a peer that is itself sending)."""
        while steps:
            swapped, done = self._duplexes(to, src, tag, steps, code, meta, deadline)
            if swapped == len(steps):
                return
            out, into, op = steps[swapped]
            if done == NOT_STARTED:
                self.send(to, tag, out, code, meta, deadline)
            self.recv_into(src, tag, into, code, deadline, meta, op)
            steps = steps[swapped + 1:]

    def _duplexes(self, to: int, src: int, tag: int, steps: Sequence[Step], code: int, meta: Meta,
                  deadline: float) -> tuple[int, int]:
        """The first steps of send_recv_row() where this transport can run them at once: how many
        it ran whole, and what it did of the next one: SENT (out went, src's array is still to be
        received) or NOT_STARTED (nothing: the default)."""
        return 0, NOT_STARTED

    def send_recv_ranges(self, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                         deadline: float, op: ReduceKind | None, host_range: HostRange | None = None) -> None:
        """A whole schedule of send_recv() steps over ranges of one array (a 1-D storage array),
        each step with its own peers, worked out once per kind of call (ring.py's, halving.py's):
        a transport may run them all in one native call (`_duplex_ranges`), with `host_range` where the
        array is a host range; the rest go as send_recv_row() runs each peer's run of steps."""
        finished, done = self._duplex_ranges(steps, tag, data, code, meta, deadline, op, host_range)
        self._ranges_after(steps, finished, done, tag, data, code, meta, deadline, op, host_range)

    def _ranges_after(self, steps: Sequence[RangeStep], finished: int, done: int, tag: int, data: np.ndarray,
                      code: int, meta: Meta, deadline: float, op: ReduceKind | None,
                      host_range: HostRange | None) -> None:
        """send_recv_ranges()'s steps from the first one its row did not finish (what it did of
        that one: `done`), each peer's run of them as send_recv_row() runs it."""
        if finished < len(steps) and host_range is not None:
            host_range.fold_rest()
        if finished < len(steps) and done == SENT:
            _, src, _, _, lo, hi, folds = steps[finished]
            self.recv_into(src, tag, data[lo:hi], code, deadline, meta, op if folds else None)
            finished += 1
        at = finished
        while at < len(steps):
            to, src = steps[at][:2]
            run = []
            while at < len(steps) and steps[at][:2] == (to, src):
                _, _, a, b, lo, hi, folds = steps[at]
                run.append((data[a:b], data[lo:hi], op if folds else None))
                at += 1
            self.send_recv_row(to, src, tag, run, code, meta, deadline)

    def prepare_range_row(self, steps: tuple[RangeStep, ...], itemsize: int) -> Any:
        """send_recv_ranges()'s steps over an array of itemsize-byte elements as one native row that
        run_range_row runs, worked out once for a caller that runs it call after call (single_copy.py's
        large all-reduce in one row); None where this transport runs none."""
        return None

    def run_range_row(self, row: Any, tag: int, data: np.ndarray, code: int, meta: Meta, deadline: float,
                      op: ReduceKind | None, host_range: HostRange, before: Callable[[], bool]) -> bool:
        """send_recv_ranges() of a prepared row's steps, with before() first: a native step of the
        caller's that must come first (single_copy.py's gather of its host peers' descriptors), run
        once this thread holds the row's connections, so nothing of Python's comes between the two.
        Where before() returns False (it did not finish in its first go), nothing else is done and
        this returns False: the caller finishes its step and runs send_recv_ranges. True once every
        step is done."""
        raise NotImplementedError(f"the {self.name} transport runs no rows of ranges")

    def _duplex_ranges(self, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                       deadline: float, op: ReduceKind | None, host_range: HostRange | None) -> tuple[int, int]:
        """The first steps of send_recv_ranges() where this transport runs them at once: how many
        it ran whole, and what it did of the next one (as _duplexes; the default: nothing). Where
        it stops early with `host_range`, it has folded the host range before anything left its row."""
        return 0, NOT_STARTED

    @abstractmethod
    def recv_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        """First message with tag from any of srcs, skipping lost peers; None once the deadline passes."""

    @abstractmethod
    def check_health(self, strict: bool = True) -> None:
        """Raise if the group is aborted or (strict) a peer was lost; not strict is for waits that
        outlive lost peers (a federated round)."""

    def board_guard(self, tag: int, want: Meta) -> BoardGuard:
        """The guard a board wait of the call `want` (on `tag`) runs; only transports with a board."""
        raise NotImplementedError(f"the {self.name} transport has no shared-memory board")

    def host_board_guard(self, tag: int, want: Meta) -> BoardGuard:
        """As board_guard, for waits on host_board; only transports with one."""
        raise NotImplementedError(f"the {self.name} transport has no board for its host")

    @abstractmethod
    def abort(self, reason: AbortReason) -> None:
        """Fail every current and future wait here and tell every peer to do the same."""

    @abstractmethod
    def retire_below(self, seq: int) -> None:
        """Discard collective frames older than seq, now and when they arrive later."""

    @abstractmethod
    def last_heard(self) -> list[float]:
        """time.monotonic() of the last frame from each rank (0.0: never)."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye to peers and release every resource; idempotent."""

    def start_background(self, target: Callable[[], None], name: str) -> None:
        """Run target on a thread that may still use this transport after the collective that
        started it returned (a federated round's deliveries to late ranks): close() ends its waits
        and joins it before releasing anything it could touch."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        self.__dict__.setdefault("_background", []).append(thread)
        thread.start()

    def join_background(self, timeout: float) -> None:
        """Wait (bounded) for the threads of start_background; their waits must be failing by now."""
        end = time.monotonic() + timeout
        for thread in self.__dict__.get("_background", []):
            thread.join(max(0.0, end - time.monotonic()))


class LinkTransport(Transport):
    """A transport that carries frames to its peers itself (shared memory, TCP): one send path for
    both, with the self-send and the per-peer byte count (`bytes_to`) in one place."""

    bytes_to: list[int]
    _mailbox: Mailbox

    def send(self, to: int, tag: int, buf: np.ndarray, code: int, meta: Meta, deadline: float) -> None:
        header = frame.pack(DATA, self.rank, tag, meta, code, buf.shape, buf.nbytes)
        if to == self.rank:
            self._mailbox.post_to_self(header, buf)
            return
        self.bytes_to[to] += buf.nbytes
        self._send_to(to, header, buf, deadline)

    @abstractmethod
    def _send_to(self, to: int, header: bytes, buf: np.ndarray, deadline: float) -> None:
        """Carry one frame (header, then buf's bytes) to peer `to`."""


def check_meta(msg: Message, want: Meta | None) -> None:
    """Raise CollectiveMismatch when the sender's collective call differs from ours."""
    if want is not None:
        problem = describe_mismatch(msg.header.meta, want, msg.header.src)
        if problem:
            raise CollectiveMismatch(problem)


def place(msg: Message, out: np.ndarray, code: int, want: Meta | None, op: ReduceKind | None) -> None:
    check_meta(msg, want)
    h = msg.header
    if h.dtype != code or h.nbytes != out.nbytes:
        raise CollectiveMismatch(
            f"rank {h.src} sent {h.nbytes} bytes of dtype code {h.dtype} where {out.nbytes} bytes "
            f"of dtype code {code} were expected")
    src = msg.payload.view(out.dtype)
    if op is None:
        out[...] = src
    else:
        kernels.reduce_into(out, src, code, op)
