"""Large collectives on one host with every byte crossing between processes once.

Through shared memory every byte crosses twice: the writer copies it into a slot, the reader
reduces or copies it out. Here each rank instead reads its peers' arrays straight out of their
memory, or writes into them (Linux cross-memory attach, `process_vm_readv` and `process_vm_writev`:
the kernel copies once), as OpenMPI's shared-memory transport does for large messages. Every call:

1. publishes on the board where its array is (pid and address) with the call's header, so
   mismatched calls are caught as on any board call, and reads every rank's (once the ranks have
   agreed, below, in one compiled step: Board.gather_open);
2. moves what it needs between its peers' arrays and its own:
   - all_reduce: each rank owns an equal range; it folds that range of every rank's array in rank
     order (kernels.reduce_from_peers, through a scratch area that stays in cache) into its own
     array, piece by piece, divides each piece for AVG and writes it into every peer's array
     while it is still in cache. The peers' lines of that piece were just read for the fold, so
     the result goes out without a trip through memory: a 64 MiB all-reduce of 2 ranks takes
     about 30% less time than when each rank copies the other ranges out after a wait for their
     owners. Inside a group across hosts each owned range is all-reduced across hosts between
     its fold and its write into every host peer's array (two_level.py: the in-host phases of a
     large all-reduce); a large one is folded and written back by the row that carries it across,
     a piece at a time, while that piece is in cache (HostRange), and a kind of call the host has
     agreed on runs its gather, that row and the final wait as native calls back to back
     (all_reduce_in_one_row);
   - reduce_scatter: the same fold of its own block, in the call's private copy of the input;
   - all_gather: every peer's block into its place; broadcast: the root's array (inside a group
     across hosts, the root's host's ranks, and on every other host the slices the host's ranks
     carried across: two_level_broadcast.py's large broadcast);
3. waits on the board's done words: nobody returns (and lets the caller change its array) while a
   peer may still read it or write into it.

Only the owner of a range reads or writes that range of any rank's array while it folds, and
nobody reads an owner's finished range while the owner writes it, so results are bitwise the same
on every rank. At most three waits per call, whatever the number of ranks: when ranks outnumber
cores, no rank waits on a chain of others being scheduled, as around a ring.

Whether ranks may read each other depends on the host (ptrace rules such as Yama's
ptrace_scope, seccomp in containers, pid namespaces); the kernel checks writes the same way. So
the first such call of a group asks:
each rank reads a random token from every peer and votes on its step word; all ranks see all
votes, so all agree. If any rank says no, that call and every later one on that board runs the
fallback the plan gives (select.without_single_copy, or two_level*.py's rings and chain) instead.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import numpy as np

from .. import kernels
from ..errors import CollectiveError, PeerLost
from ..kept import keep
from ..transport.base import BoardGuard, RangeStep
from ..transport.shm_board import Board, entry_header
from ..types import ReduceKind
from .call import Call, segment_bounds
from .overlap import Crossing, in_pieces
from .ring import scale_if_avg

#: Bytes of each peer's range read at a time: with the running fold, twice this stays in a core's cache.
PIECE_BYTES = 128 << 10
#: A range crossing hosts in pieces of at least this many bytes is folded and written back by the
#: crossing's row (HostRange); a smaller piece stays in cache from one phase to the next anyway.
#: (A call in one row, all_reduce_in_one_row, always is: there the Python it saves counts more.)
ROW_FOLDS_FROM_BYTES = 2 << 20
#: The descriptor a rank publishes in its board entry, as u64 words (the entry must hold its bytes):
#: the kernels that read and write peers' arrays take every rank's, as gathered, for their peers.
PID, ADDRESS, TOKEN_ADDRESS, TOKEN, STEP, STEP_SLEEPERS = range(6)
DESCRIPTOR_BYTES = kernels.PEER_BYTES
#: The step word's values for call seq: (seq + 1) << 2 | one of these (the vote on reading arrays).
OFFER, DECLINE = 1, 2

_token = np.zeros(1, dtype=np.int64)  # what peers read from this process to prove they read the right one
_TOKEN_ADDRESS = kernels.address_of(_token)
_own = np.zeros(DESCRIPTOR_BYTES // 8, dtype=np.int64)  # this process's descriptor, but for ADDRESS
_own_pid = 0  # this process's pid, as _own holds it
_scratch = threading.local()
#: Arrays peers read that are at least this large move onto huge pages when they come back; the
#: last ARRAYS_REMEMBERED (address, bytes) seen, and whether each has moved.
HUGE_PAGES_FROM_BYTES = 4 << 20
ARRAYS_REMEMBERED = 64
#: Kinds of call whose descriptors' room a board keeps (_room); training repeats a handful.
ROOMS_KEPT = 64
_seen_arrays: dict[tuple[int, int], bool] = {}
#: What runs a call where ranks may not read each other: the algorithm select would pick otherwise.
Fallback = Callable[[Call], None]


def _new_token() -> None:
    """A token of this process's own (a forked child draws another), and its descriptor's words."""
    global _own_pid
    _token[0] = int.from_bytes(os.urandom(8), "little", signed=True)
    _own_pid = os.getpid()
    _own[:STEP] = _own_pid, 0, _TOKEN_ADDRESS, _token[0]


_new_token()
os.register_at_fork(after_in_child=_new_token)


class Readers(NamedTuple):
    """The ranks of one call that read each other's arrays and the board they meet on: every rank
    of a group on one host (of_group), or one host's ranks of a group across hosts (of_host: the
    in-host phases of two_level.py's large all-reduce and of two_level_broadcast.py's large
    broadcast). Peers are named by group rank, listed and folded in `ranks` order. (A named tuple:
    one is built for every call.)"""

    board: Board
    ranks: tuple[int, ...]
    guard: Callable[[], BoardGuard]

    @classmethod
    def of_group(cls, c: Call) -> Readers:
        return cls(c.board, tuple(range(c.size)), c.board_guard)

    @classmethod
    def of_host(cls, c: Call, board: Board, host: tuple[int, ...]) -> Readers:
        return cls(board, host, lambda: c.t.host_board_guard(c.tag, c.meta))


def single_copy_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, fallback: Fallback) -> None:
    """data (1-D storage array, contiguous) reduced in place; by fallback(c) where ranks may not
    read each other. Each rank folds its own range and writes each finished piece straight into
    every peer's array, so the call has no step between reducing and copying to wait on."""
    among = Readers.of_group(c)
    peers = _publish_and_agree(c, among, data, fallback)
    if peers is None:
        return
    _reduce_range(c, among, data, op, peers, _byte_ranges(data, c.size)[c.rank], deliver=True)
    _finish(c, among)


def all_reduce_among(c: Call, among: Readers, data: np.ndarray, op: ReduceKind, fallback: Fallback,
                     crossing: Crossing) -> None:
    """data reduced in place among `among`'s ranks, one host's ranks of a group across hosts: each
    rank folds crossing's pieces (byte ranges, its own, disjoint from its peers') of every rank's
    array, and each piece crosses hosts (two_level.py: its all-reduce across hosts) between its
    fold and its write into every peer's array. In turn, the crossing's row does both as it goes
    (HostRange); overlapped, the fold of the next piece runs here while one crosses on a helper
    thread (overlap.in_pieces). Nobody reads a peer's range after folding it, so no step word is
    needed between, and _finish's wait covers every write into this rank's array. By fallback(c)
    where the ranks may not read each other."""
    peers = _publish_and_agree(c, among, data, fallback)
    if peers is None:
        return
    me = among.ranks.index(c.rank)
    overlapped = crossing.overlap and len(crossing.pieces) > 1
    if overlapped or max((hi - lo for lo, hi in crossing.pieces), default=0) < ROW_FOLDS_FROM_BYTES:
        in_pieces(crossing.pieces, lambda piece: _reduce_range(c, among, data, op, peers, piece),
                  lambda piece: crossing.far(piece, None),
                  lambda piece: _deliver(among, data, peers, me, piece, c.code, crossing.divisor), c.deadline,
                  crossing.overlap)
    else:
        for piece in crossing.pieces:
            _across_as_host_range(c, among, data, op, peers, piece, crossing)
    _finish(c, among)


def _across_as_host_range(c: Call, among: Readers, own: np.ndarray, op: ReduceKind, peers: np.ndarray,
                          piece: tuple[int, int], crossing: Crossing) -> None:
    """One piece folded, across hosts and written back, all by the crossing's row where it can
    (HostRange); the rest after it (_host_range_done)."""
    host_range = HostRange(c, among, own, op, peers, piece, crossing.divisor == 1)
    crossing.far(piece, host_range)
    _host_range_done(c, among, own, peers, piece, host_range, crossing.divisor)


class OneRow(NamedTuple):
    """A large all-reduce's usual call at one rank, prepared on its first call (two_level.py's
    _in_one_row): its host's ranks have agreed to read each other's arrays, and its range crosses
    hosts whole in one native row (Transport.prepare_range_row). all_reduce_in_one_row runs it."""

    board: Board  # its host's
    host: tuple[int, ...]  # the ranks that read each other's arrays: the board's
    piece: tuple[int, int]  # this rank's range, in bytes
    elements: tuple[int, int]  # ... in elements
    ring: tuple[RangeStep, ...]  # its steps across hosts (ring.ring_all_reduce's)
    row: Any  # those steps as the transport's native row
    room: _Room  # where the host's descriptors are gathered
    words: np.ndarray  # its HostRange's


def all_reduce_in_one_row(c: Call, one: OneRow, data: np.ndarray, op: ReduceKind, divisor: int) -> None:
    """all_reduce_among's usual call: the host's gather of descriptors runs as the first step of
    the row across hosts (Transport.run_range_row's `before`), the row folds the range out of the
    host peers' arrays, carries it and writes it back (HostRange), then the host's wait (_finish):
    native calls one after another, with little Python between. Where ranks share cores, each step
    of Python a rank takes is time its host peers wait for, and after each wait it runs from a
    cache the other ranks' copies have emptied: 2 + 2 ranks on 2 cores, 1 MiB, the general path
    spent 160-190 us of Python per call and rank. Where the gather does not finish in its first go,
    it finishes here and the steps go as send_recv_ranges runs them."""
    board, room, seq, (a, b) = one.board, one.room, c.meta.seq, one.elements
    address = kernels.address_of(data)
    _prefer_huge_pages(data, address)
    _describe(room, address)
    among = Readers.of_host(c, board, one.host)
    host_range = HostRange(c, among, data, op, room.descriptors, one.piece, divisor == 1, one.words)
    first = [kernels.BOARD_DONE]

    def gather() -> bool:
        first[0] = board.gather_open_first(seq, room.descriptors, room.header, c.code)
        return first[0] == kernels.BOARD_DONE

    if not c.t.run_range_row(one.row, c.tag, data[a:b], c.code, c.meta, c.deadline, op, host_range, gather):
        board.gather_open_rest(first[0], seq, room.descriptors, room.header, c.code, c.deadline, among.guard(),
                               c.meta)
        c.t.send_recv_ranges(one.ring, c.tag, data[a:b], c.code, c.meta, c.deadline, op, host_range)
    _written_back(c, among, data, room.descriptors, one.piece, host_range, divisor)
    _finish(c, among)


def _host_range_done(c: Call, among: Readers, own: np.ndarray, peers: np.ndarray, piece: tuple[int, int],
                     host_range: HostRange, divisor: int) -> None:
    """After the row of a host range: what it did not fold folded (where the row stopped early and
    any other way took the range across without folding it first), and _written_back."""
    host_range.fold_rest()
    _written_back(c, among, own, peers, piece, host_range, divisor)


def _written_back(c: Call, among: Readers, own: np.ndarray, peers: np.ndarray, piece: tuple[int, int],
                  host_range: HostRange, divisor: int) -> None:
    """After the row of a host range that folded all of it (send_recv_ranges folds what its row
    did not before it goes on): what the row did not write back (a step not final, or the piece is
    an AVG's, divided on its way back) written."""
    lo, hi = piece
    delivered = host_range.delivered == hi - lo
    for src in among.ranks:
        if src != c.rank:
            among.board.bytes_read_from[src] += hi - lo
            among.board.bytes_written_to[src] += hi - lo if delivered else 0
    if not delivered:
        _deliver(among, own, peers, host_range.me, piece, c.code, divisor)


class HostRange:
    """A piece of this rank's range as the row across hosts folds it out of the host peers'
    arrays and writes it back into theirs as it goes (transport.base.HostRange,
    native/host_range.h): each 128 KiB of it is read from memory once for the fold, the crossing
    and the write-back, where a fold of the whole piece before the row and a write-back after it
    each take it through memory again: 2 + 2 simulated hosts on 2 cores, alternating, median of 6
    runs, 16 MiB 17.6 ms against 19.9, 4 MiB 4.86 against 5.38 (2 MiB even, 1 MiB 3% slower: hence
    ROW_FOLDS_FROM_BYTES)."""

    __slots__ = ("native", "me", "_among", "_code", "_op")

    def __init__(self, c: Call, among: Readers, own: np.ndarray, op: ReduceKind, peers: np.ndarray,
                 piece: tuple[int, int], delivers: bool, words: np.ndarray | None = None) -> None:
        """words: host_range_words(piece), kept by a caller that makes such calls again (zeroed here)."""
        lo, hi = piece
        if words is None:
            words = host_range_words(piece)
        else:
            words.fill(0)
        self.me = among.ranks.index(c.rank)
        self.native = (own, peers, _scratch_area(), words, self.me, lo, hi, PIECE_BYTES, int(delivers))
        self._among, self._code, self._op = among, c.code, int(op)

    @property
    def delivered(self) -> int:
        """Bytes the row wrote into every peer's array."""
        return int(self.native[3][kernels.HOST_DELIVERED])

    def fold_rest(self) -> None:
        if kernels.host_range_fold(self.native, self._code, self._op):
            self.raise_failure()

    def raise_failure(self) -> NoReturn:
        words = self.native[3]
        _read_failed(self._among, self._among.ranks[int(words[kernels.HOST_FAILED])], int(words[kernels.HOST_ERROR]))


def host_range_words(piece: tuple[int, int]) -> np.ndarray:
    """The words (kernels.duplex_row's host range) of a HostRange of `piece`."""
    return np.zeros(kernels.HOST_FOLDED + -(-(piece[1] - piece[0]) // PIECE_BYTES), np.int64)


def single_copy_reduce_scatter(c: Call, work: np.ndarray, out: np.ndarray, op: ReduceKind,
                               fallback: Fallback) -> None:
    """out = block c.rank of the reduction of every rank's `work` (a private 1-D copy of the
    input, n equal blocks, that peers read during the call)."""
    lo, hi = _byte_ranges(work, c.size)[c.rank]

    def keep_block(c: Call) -> None:
        out[:] = work[lo // work.itemsize:hi // work.itemsize]
    reduce_scatter_among(c, Readers.of_group(c), work, op, (lo, hi), fallback, keep_block)


def reduce_scatter_among(c: Call, among: Readers, work: np.ndarray, op: ReduceKind, byte_range: tuple[int, int],
                         fallback: Fallback, then: Fallback) -> None:
    """work[byte_range] (this rank's own, disjoint from its peers') = op over every rank of
    `among` (the group, or one host's ranks of a group across hosts: two_level_reduce.py's
    reduce-scatter) of the same range, folded in among.ranks order; then then(c) (taking the block
    out, or the step across hosts) while peers may still read the rest of work (then changes only
    this rank's range, which no peer reads). By fallback(c) where the ranks may not read each other."""
    peers = _publish_and_agree(c, among, work, fallback)
    if peers is None:
        return
    _reduce_range(c, among, work, op, peers, byte_range)
    then(c)
    _finish(c, among)


def single_copy_all_gather(c: Call, local: np.ndarray, out: np.ndarray, fallback: Fallback) -> None:
    """out (1-D, n * len(local)) receives every rank's block in rank order."""
    among = Readers.of_group(c)
    peers = _publish_and_agree(c, among, local, fallback)
    if peers is None:
        return
    block, gathered = local.nbytes, out.view(np.uint8)
    gathered[c.rank * block:(c.rank + 1) * block] = local.view(np.uint8)
    for src in _others(among, c.rank):
        _read(among, gathered[src * block:(src + 1) * block], peers, src, 0)
    _finish(c, among)


def single_copy_broadcast(c: Call, root: int, data: np.ndarray, fallback: Fallback) -> None:
    """data (1-D) becomes the root's on every rank."""
    broadcast_among(c, Readers.of_group(c), root, data, fallback)


def broadcast_among(c: Call, among: Readers, root: int, data: np.ndarray, fallback: Fallback) -> None:
    """data (1-D) becomes the root's on every rank of `among` (the group, or the root's host's
    ranks of a group across hosts: two_level_broadcast.py's large broadcast)."""
    peers = _publish_and_agree(c, among, data, fallback)
    if peers is None:
        return
    if c.rank != root:
        _read(among, data.view(np.uint8), peers, among.ranks.index(root), 0)
    _finish(c, among)


def gather_owned_among(c: Call, among: Readers, data: np.ndarray, owned: Sequence[tuple[int, int]],
                       fallback: Fallback) -> None:
    """Every rank of `among` (one host's ranks) ends with data[owned[p]] of every position p, read
    from that position's rank (element ranges, disjoint, maybe empty): the slices of
    two_level_broadcast.py's large broadcast, gathered from the ranks that carried them across
    hosts."""
    gather_blocks_among(c, among, data, [(bounds,) for bounds in owned], fallback)


def gather_blocks_among(c: Call, among: Readers, data: np.ndarray, owned: Sequence[Sequence[tuple[int, int]]],
                        fallback: Fallback) -> None:
    """gather_owned_among with any number of element ranges per position: the blocks each column
    of two_level.py's large all-gather brought across hosts."""
    peers = _publish_and_agree(c, among, data, fallback)
    if peers is None:
        return
    out, size = data.view(np.uint8), data.itemsize
    for p in _others(among, among.ranks.index(c.rank)):
        for a, b in owned[p]:
            if b > a:
                _read(among, out[a * size:b * size], peers, p, a * size)
    _finish(c, among)


def _publish_and_agree(c: Call, among: Readers, source: np.ndarray, fallback: Fallback) -> np.ndarray | None:
    """Publish where `source` is (an array of the call's shape and type, which peers will read)
    and read every rank's descriptor: int64 rows (pid and address first), in among.ranks order.
    None once fallback(c) has run instead, where the ranks may not read each other (asked on the
    first call)."""
    board = among.board
    if board.single_copy_agreed is False:
        fallback(c)
        return None
    address = kernels.address_of(source)
    _prefer_huge_pages(source, address)
    if board.single_copy_agreed and among.ranks == board.host_ranks:
        return _gather_descriptors(c, among, source, address)
    guard, seq = among.guard(), c.meta.seq
    board.publish(c.meta, c.code, source, c.deadline, guard, payload=_descriptor(address))
    descriptors = [board.read(src, seq, c.meta, c.deadline, guard).view(np.int64) for src in among.ranks]
    if board.single_copy_agreed is None:
        board.single_copy_agreed = _agree(c, among, [d.copy() for d in descriptors])
        if not board.single_copy_agreed:
            _finish(c, among)
            fallback(c)
            return None
    return np.array([d[:DESCRIPTOR_BYTES // 8] for d in descriptors])  # a copy: the entries change after the call


def _gather_descriptors(c: Call, among: Readers, source: np.ndarray, address: int) -> np.ndarray:
    """_publish_and_agree's publish and reads in one compiled step (Board.gather_open: the same
    entries), once the ranks agreed: every board rank's descriptor, this rank's reading left open
    until _finish, in the room the board keeps for calls of this kind (_room), which the kernels
    take as their peers as it is."""
    room = _room(c, among, source)
    _describe(room, address)
    among.board.gather_open(c.meta.seq, room.descriptors, room.header, c.code, c.deadline, among.guard, c.meta)
    return room.descriptors


def _describe(room: _Room, address: int) -> None:
    """This process's descriptor in room, of the array at `address`."""
    if room.pid[0] != _own_pid:  # new, or in a forked child: this process's pid and token
        room.mine[:] = _own
        room.pid[0] = _own_pid
    room.mine[ADDRESS] = address


class _Room(NamedTuple):
    """Where _gather_descriptors gathers a kind of call's descriptors, kept on the board: a large
    call comes back call after call, and where ranks share cores every array it need not build
    is time its peers do not wait for."""

    descriptors: np.ndarray  # every board rank's, as int64 rows in board order
    mine: np.ndarray  # this rank's row of descriptors
    header: np.ndarray  # the call's entry header (the compiled step writes in the sequence number)
    pid: list[int]  # the process whose descriptor `mine` holds


def one_row(c: Call, among: Readers, data: np.ndarray, piece: tuple[int, int], elements: tuple[int, int],
            ring: tuple[RangeStep, ...], row: Any) -> OneRow:
    """A OneRow of calls like c over data (ring: its steps across hosts, row: the transport's, or
    None where it runs none)."""
    return OneRow(among.board, among.ranks, piece, elements, ring, row, _room(c, among, data), host_range_words(piece))


def _room(c: Call, among: Readers, source: np.ndarray) -> _Room:
    key = (_Room, c.meta[1:], c.code, source.shape)  # the call but for its sequence number (Meta's first field)
    room = among.board.kept.get(key)
    if room is None:
        descriptors = np.empty((len(among.ranks), DESCRIPTOR_BYTES // 8), np.int64)
        room = keep(among.board.kept, key, _Room(descriptors, descriptors[among.ranks.index(c.rank)],
                                                 entry_header(c.rank, c.meta._replace(seq=0), c.code, source), [0]),
                    ROOMS_KEPT)
    assert isinstance(room, _Room)
    return room


def _finish(c: Call, among: Readers) -> None:
    """Until no peer may still read our array: everyone has finished the call."""
    board, seq = among.board, c.meta.seq
    board.finish(seq)
    board.wait_all_finished(seq, c.deadline, lambda: among.guard()())  # the guard built only if needed


def _prefer_huge_pages(array: np.ndarray, address: int) -> None:
    """Move a large array that comes back (a training loop's gradient buckets, a benchmark's
    buffer) onto huge pages, once. A peer's read pins every page it covers: torch allocates on
    4 KiB pages (numpy asks for huge ones), and reading 16 MiB of them takes about a third longer.
    The move costs 10-70 ms at 16 MiB, so an array seen only once is left alone; a failure (an
    older kernel) only leaves it slower."""
    if array.nbytes < HUGE_PAGES_FROM_BYTES:
        return
    key = (address, array.nbytes)
    moved = _seen_arrays.get(key)
    if moved is None:
        _seen_arrays[key] = False
        if len(_seen_arrays) > ARRAYS_REMEMBERED:
            del _seen_arrays[next(iter(_seen_arrays))]
    elif not moved:
        _seen_arrays[key] = True
        kernels.collapse_to_huge_pages(array)


def _descriptor(address: int) -> np.ndarray:
    """PID, ADDRESS (of the array peers read), TOKEN_ADDRESS, TOKEN, then the step word and its
    sleepers, zero."""
    words = _own.copy()
    words[ADDRESS] = address
    return words


def _step_value(seq: int, step: int) -> int:
    return (seq + 1) << 2 | step


def _signal(c: Call, among: Readers, step: int) -> None:
    """Set our step word for this call to `step` and wake its waiters."""
    board, seq = among.board, c.meta.seq
    word, sleepers = board.payload_word(c.rank, seq, STEP), 2 * board.payload_word(c.rank, seq, STEP_SLEEPERS)
    kernels.store_and_wake(board.mem, word, _step_value(seq, step), sleepers)


def _wait_for_all(c: Call, among: Readers, step: int, what: str) -> None:
    """Until every peer's step word for this call reaches `step` (OFFER: it has voted)."""
    board, guard, seq = among.board, among.guard(), c.meta.seq
    for src in among.ranks:
        if src != c.rank:
            board.wait_at_least(board.payload_word(src, seq, STEP), _step_value(seq, step),
                                2 * board.payload_word(src, seq, STEP_SLEEPERS), c.deadline,
                                functools.partial(guard, src), f"rank {src} to {what}")


def _agree(c: Call, among: Readers, descriptors: list[np.ndarray]) -> bool:
    """Whether every rank can read every peer's token: each votes, all read all votes."""
    board, seq = among.board, c.meta.seq
    yes = all(can_read(d) for src, d in zip(among.ranks, descriptors) if src != c.rank)
    _signal(c, among, OFFER if yes else DECLINE)
    _wait_for_all(c, among, OFFER, "vote on reading arrays directly")
    votes = [kernels.load_word(board.mem, board.payload_word(src, seq, STEP)) for src in among.ranks]
    return yes and _step_value(seq, DECLINE) not in votes


def can_read(descriptor: np.ndarray) -> bool:
    """Whether this process reads the token the descriptor's publisher holds, where it says: so
    reads are allowed, and its pid names the same process here (no other pid namespace)."""
    probe = np.zeros(1, dtype=np.int64)
    found = kernels.read_peer(probe, int(descriptor[PID]), int(descriptor[TOKEN_ADDRESS]))
    return found == 0 and probe[0] == descriptor[TOKEN]


def _byte_ranges(data: np.ndarray, parts: int) -> list[tuple[int, int]]:
    return [(a * data.itemsize, b * data.itemsize) for a, b in segment_bounds(data.size, parts)]


def _others(among: Readers, me: int) -> list[int]:
    """The position of every other rank, starting after our own `me` (so ranks spread their reads
    over their peers instead of all reading the first first)."""
    n = len(among.ranks)
    return [(me + k) % n for k in range(1, n)]


def _reduce_range(c: Call, among: Readers, data: np.ndarray, op: ReduceKind, peers: np.ndarray,
                  byte_range: tuple[int, int], deliver: bool = False) -> None:
    """data[byte_range] = every rank's same range folded in order (divided, for AVG); where
    `deliver`, written into every peer's array too."""
    lo, hi = byte_range
    rank, n = c.t.rank, len(among.ranks)
    divisor = n if op is ReduceKind.AVG else 1
    failed = kernels.reduce_from_peers(data, peers, among.ranks.index(rank), lo, hi, c.code, int(op),
                                       _scratch_area(), divisor if deliver else 0)
    if failed is not None:
        _read_failed(among, among.ranks[failed[0]], failed[1])
    board = among.board
    for src in among.ranks:
        if src != rank:
            board.bytes_read_from[src] += hi - lo
            if deliver:
                board.bytes_written_to[src] += hi - lo
    if not deliver and op is ReduceKind.AVG:
        scale_if_avg(c, data[lo // data.itemsize:hi // data.itemsize], op, n)


def _deliver(among: Readers, own: np.ndarray, peers: np.ndarray, me: int, byte_range: tuple[int, int], code: int,
             divisor: int = 1) -> None:
    """own[byte_range] (this rank's array taken as bytes, at position me, of wire type `code`) written
    into every peer's array, divided by divisor first where it is above 1 (AVG), a piece at a
    time while in cache (kernels.scale_to_peers)."""
    lo, hi = byte_range
    if divisor > 1:
        failed = kernels.scale_to_peers(own, peers, me, lo, hi, code, divisor)
    else:
        failed = kernels.write_to_peers(own, peers, me, lo, hi)
    if failed is not None:
        _read_failed(among, among.ranks[failed[0]], failed[1])
    for src in among.ranks:
        if src != among.ranks[me]:
            among.board.bytes_written_to[src] += hi - lo


def _read(among: Readers, out: np.ndarray, peers: np.ndarray, p: int, offset: int) -> None:
    """len(out) bytes of the array of the rank at position p from byte `offset` into out (uint8)."""
    error = kernels.read_peer(out, int(peers[p, 0]), int(peers[p, 1]) + offset)
    if error:
        _read_failed(among, among.ranks[p], error)
    among.board.bytes_read_from[among.ranks[p]] += out.nbytes


def _scratch_area() -> np.ndarray:
    """This thread's two pieces of scratch (a group's calls on one thread run one at a time)."""
    area = getattr(_scratch, "area", None)
    if area is None:
        area = _scratch.area = np.empty(2 * PIECE_BYTES, dtype=np.uint8)
    return area


def _read_failed(among: Readers, src: int, error: int) -> NoReturn:
    """A read of rank src's array (or a write into it) failed after every rank had agreed reads
    work: src is gone (the guard raises PeerLost), or its memory changed under the call."""
    among.guard()(src)
    message = f"reading or writing rank {src}'s array directly failed: {os.strerror(error)}"
    raise PeerLost(message, src) if error == errno.ESRCH else CollectiveError(message)
