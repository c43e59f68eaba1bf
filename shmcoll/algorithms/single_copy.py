"""Large all-reduce on one host with every byte crossing between processes once.

Through shared memory every byte crosses twice: the writer copies it into a slot, the reader
reduces or copies it out. Here each rank instead reads its peers' arrays straight out of their
memory (Linux cross-memory attach, `process_vm_readv`, the kernel copies once), as OpenMPI's
shared-memory transport does for large messages:

1. every rank publishes on the board where its array is (pid and address) and the call's header,
   so mismatched calls are caught as on any board call;
2. each rank owns an equal range of the array; it folds that range of every rank's array in rank
   order (kernels.reduce_from_peers, through a scratch area that stays in cache) into its own
   array, divides it for AVG, then says so on a step word of its entry;
3. once every owner has said so, each rank copies every other range out of its owner's array;
4. the board's done words: nobody returns (and lets the caller change its array) while a peer may
   still read it.

Only the owner of a range writes it, and no rank reads a range while its owner writes it, so the
result is bitwise the same on every rank. Three waits per call, whatever the number of ranks:
when ranks outnumber cores, no rank waits on a chain of others being scheduled, as around a ring.

Whether ranks may read each other depends on the host (ptrace rules such as Yama's
ptrace_scope, seccomp in containers, pid namespaces). So the first such call of a group asks:
each rank reads a random token from every peer and votes on its step word; all ranks see all
votes, so all agree. If any rank says no, that call and every later one runs the fallback the plan
gives (select.without_single_copy) instead.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable

import numpy as np

from .. import kernels
from ..errors import CollectiveError, PeerLost
from ..transport.base import BoardGuard
from ..transport.shm_board import Board
from ..types import ReduceKind
from .call import Call, segment_bounds
from .ring import scale_if_avg

#: Bytes of each peer's range read at a time: with the running fold, twice this stays in a core's cache.
PIECE_BYTES = 128 << 10
#: The descriptor a rank publishes in its board entry, as u64 words (the entry must hold its bytes).
PID, ADDRESS, TOKEN_ADDRESS, TOKEN, STEP, STEP_SLEEPERS = range(6)
DESCRIPTOR_BYTES = 64
#: The step word's values for call seq: (seq + 1) << 2 | one of these.
OFFER, DECLINE, REDUCED = 1, 2, 3

_token = np.zeros(1, dtype=np.int64)  # what peers read from this process to prove they read the right one
_TOKEN_ADDRESS = _token.__array_interface__["data"][0]
_scratch = threading.local()


def _new_token() -> None:
    _token[0] = int.from_bytes(os.urandom(8), "little", signed=True)


_new_token()
os.register_at_fork(after_in_child=_new_token)


def single_copy_all_reduce(c: Call, data: np.ndarray, op: ReduceKind,
                           fallback: Callable[[Call, np.ndarray], None]) -> None:
    """data (1-D storage array, contiguous) reduced in place; by fallback(c, data) where ranks may
    not read each other."""
    board = c.board
    if board.single_copy_agreed is False:
        fallback(c, data)
        return
    guard, seq = c.board_guard(), c.meta.seq
    board.publish(c.meta, c.code, data, c.deadline, guard, payload=_descriptor(data))
    descriptors = [board.read(src, seq, c.meta, c.deadline, guard).view(np.int64).copy() for src in range(c.size)]
    if board.single_copy_agreed is None:
        board.single_copy_agreed = _agree(c, board, guard, descriptors)
        if not board.single_copy_agreed:
            board.finish(seq)
            board.wait_all_finished(seq, c.deadline, guard)
            fallback(c, data)
            return
    peers = np.array([d[[PID, ADDRESS]] for d in descriptors], dtype=np.int64)
    _reduce_own_range(c, board, guard, data, op, peers)
    _copy_other_ranges(c, board, guard, data, peers)
    board.finish(seq)
    board.wait_all_finished(seq, c.deadline, guard)


def _descriptor(data: np.ndarray) -> np.ndarray:
    """PID, ADDRESS, TOKEN_ADDRESS, TOKEN, then the step word and its sleepers, zero."""
    address = data.__array_interface__["data"][0]
    words = np.zeros(DESCRIPTOR_BYTES // 8, dtype=np.int64)
    words[:STEP] = os.getpid(), address, _TOKEN_ADDRESS, _token[0]
    return words


def _step_value(seq: int, step: int) -> int:
    return (seq + 1) << 2 | step


def _signal(board: Board, seq: int, rank: int, step: int) -> None:
    word = board.payload_word(rank, seq, STEP)
    kernels.store_and_wake(board.mem, word, _step_value(seq, step), 2 * board.payload_word(rank, seq, STEP_SLEEPERS))


def _wait_for_all(c: Call, board: Board, guard: BoardGuard, step: int, what: str) -> None:
    """Until every peer's step word for this call reaches `step` (OFFER: it has voted)."""
    seq = c.meta.seq
    for src in range(c.size):
        if src != c.rank:
            board.wait_at_least(board.payload_word(src, seq, STEP), _step_value(seq, step),
                                2 * board.payload_word(src, seq, STEP_SLEEPERS), c.deadline,
                                functools.partial(guard, src), f"rank {src} to {what}")


def _agree(c: Call, board: Board, guard: BoardGuard, descriptors: list[np.ndarray]) -> bool:
    """Whether every rank can read every peer's token: each votes, all read all votes."""
    seq = c.meta.seq
    yes = all(can_read(d) for src, d in enumerate(descriptors) if src != c.rank)
    _signal(board, seq, c.rank, OFFER if yes else DECLINE)
    _wait_for_all(c, board, guard, OFFER, "vote on reading arrays directly")
    votes = [kernels.load_word(board.mem, board.payload_word(src, seq, STEP)) for src in range(c.size)]
    return yes and _step_value(seq, DECLINE) not in votes


def can_read(descriptor: np.ndarray) -> bool:
    """Whether this process reads the token the descriptor's publisher holds, where it says: so
    reads are allowed, and its pid names the same process here (no other pid namespace)."""
    probe = np.zeros(1, dtype=np.int64)
    found = kernels.read_peer(probe, int(descriptor[PID]), int(descriptor[TOKEN_ADDRESS]))
    return found == 0 and probe[0] == descriptor[TOKEN]


def _byte_ranges(c: Call, data: np.ndarray) -> list[tuple[int, int]]:
    return [(a * data.itemsize, b * data.itemsize) for a, b in segment_bounds(data.size, c.size)]


def _reduce_own_range(c: Call, board: Board, guard: BoardGuard, data: np.ndarray, op: ReduceKind,
                      peers: np.ndarray) -> None:
    lo, hi = _byte_ranges(c, data)[c.rank]
    failed = kernels.reduce_from_peers(data.view(np.uint8), peers, c.rank, lo, hi, c.code, int(op), _scratch_area())
    if failed is not None:
        _read_failed(guard, *failed)
    scale_if_avg(c, data[lo // data.itemsize:hi // data.itemsize], op, c.size)
    _signal(board, c.meta.seq, c.rank, REDUCED)
    _wait_for_all(c, board, guard, REDUCED, "reduce its range")


def _copy_other_ranges(c: Call, board: Board, guard: BoardGuard, data: np.ndarray, peers: np.ndarray) -> None:
    """Every other owner's range out of its array, starting after our own rank (so ranks spread
    their reads over the owners instead of all reading rank 0 first)."""
    out, ranges = data.view(np.uint8), _byte_ranges(c, data)
    for k in range(1, c.size):
        src = (c.rank + k) % c.size
        lo, hi = ranges[src]
        error = kernels.read_peer(out[lo:hi], int(peers[src, 0]), int(peers[src, 1]) + lo)
        if error:
            _read_failed(guard, src, error)


def _scratch_area() -> np.ndarray:
    """This thread's two pieces of scratch (a group's calls on one thread run one at a time)."""
    area = getattr(_scratch, "area", None)
    if area is None:
        area = _scratch.area = np.empty(2 * PIECE_BYTES, dtype=np.uint8)
    return area


def _read_failed(guard: BoardGuard, src: int, error: int) -> None:
    """A read of rank src's array failed after every rank had agreed reads work: src is gone (the
    guard raises PeerLost), or its memory changed under the call."""
    guard(src)
    message = f"reading rank {src}'s array directly failed: {os.strerror(error)}"
    raise PeerLost(message, src) if error == errno.ESRCH else CollectiveError(message)
