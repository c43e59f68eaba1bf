"""Ring all-reduce (reduce-scatter then all-gather) and ring all-gather, streamed in chunks.

Every rank moves about 2(n-1)/n of the array regardless of n. Each segment is reduced once, along
the ring, by a fixed sequence of ranks, then copied around: every rank ends bitwise identical.
Sends never block on a peer that is itself sending, because transports always drain their inputs.

Every function also runs on a sub-ring: `members` lists the ranks taking part, in ring order (the
hierarchical algorithms run one inside each host and one across hosts), and `owned[p]` is the
(start, stop) piece that position p ends up owning; pieces may differ in length, even be empty.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from .. import kernels
from ..transport.base import HostRange, RangeStep
from ..types import ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds

Bounds = tuple[int, int]


def _members(c: Call, members: Sequence[int] | None) -> Sequence[int]:
    return range(c.size) if members is None else members


def _ring_ranges(c: Call, data: np.ndarray, ring: Sequence[int], owned: Sequence[Bounds],
                 phases: tuple[int, ...]) -> tuple[RangeStep, ...]:
    """The steps of a reduce-scatter (phase 1: each folds what it receives) and of an all-gather
    (phase 0: each copies it), in the order given, at this rank's position of `ring`: in step k of a
    phase it sends segment p-k-phase to its right neighbour and receives segment p-k-phase-1 from
    its left, every segment cut into the same number of frames, so both ends of a step agree."""
    pieces = chunk_count(max(b - a for a, b in owned), data.itemsize, c.chunk_bytes)
    return _ring_schedule(tuple(ring), c.rank, tuple(owned), pieces, phases)


@functools.lru_cache(maxsize=256)
def _ring_schedule(ring: tuple[int, ...], rank: int, owned: tuple[Bounds, ...], pieces: int,
                   phases: tuple[int, ...]) -> tuple[RangeStep, ...]:
    """_ring_ranges' steps: the same for every call of a kind, so kept."""
    n, p = len(ring), ring.index(rank)
    to, src = ring[(p + 1) % n], ring[(p - 1) % n]
    steps: list[RangeStep] = []
    for first in phases:
        for step in range(n - 1):
            sent, received = owned[(p - step - first) % n], owned[(p - step - first - 1) % n]
            steps += [(to, src, *s, *r, first == 1) for s, r in zip(sub_bounds(*sent, pieces),
                                                                   sub_bounds(*received, pieces))]
    return tuple(steps)


def _run_ring(c: Call, data: np.ndarray, steps: tuple[RangeStep, ...], op: ReduceKind | None,
              host_range: HostRange | None = None) -> None:
    """A ring's steps in a row (Transport.send_recv_ranges): every one to the same right
    neighbour, from the same left one."""
    c.t.send_recv_ranges(steps, c.tag, data, c.code, c.meta, c.deadline, op, host_range)


def ring_reduce_scatter(c: Call, data: np.ndarray, op: ReduceKind, ring: Sequence[int],
                        owned: Sequence[Bounds]) -> None:
    """Position p of `ring` ends with op over every member's data[owned[p]] (other pieces: partial)."""
    if len(ring) > 1:  # a ring of one has no steps (a rank alone on its host, in two_level.py)
        _run_ring(c, data, _ring_ranges(c, data, ring, owned, (1,)), op)


def ring_all_gather_owned(c: Call, data: np.ndarray, ring: Sequence[int], owned: Sequence[Bounds]) -> None:
    """Every member ends with every position's data[owned[p]], copied around the ring."""
    if len(ring) > 1:
        _run_ring(c, data, _ring_ranges(c, data, ring, owned, (0,)), None)


def summed(op: ReduceKind) -> ReduceKind:
    """The op to fold with: AVG is summed, and divided once where a piece is finished (scale_if_avg)."""
    return ReduceKind.SUM if op is ReduceKind.AVG else op


def scale_if_avg(c: Call, piece: np.ndarray, op: ReduceKind, count: int) -> None:
    """Finish an AVG: divide the sum of `count` inputs (nothing to do for other ops)."""
    if op is ReduceKind.AVG:
        kernels.scale_into(piece, c.code, count)


def ring_reduce_scatter_op(c: Call, data: np.ndarray, op: ReduceKind, ring: Sequence[int],
                           owned: Sequence[Bounds]) -> None:
    """ring_reduce_scatter for any op, AVG included: each position's piece ends finished."""
    ring_reduce_scatter(c, data, summed(op), ring, owned)
    a, b = owned[ring.index(c.rank)]
    scale_if_avg(c, data[a:b], op, len(ring))


def ring_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int] | None = None,
                    host_range: HostRange | None = None) -> None:
    """In place over a 1-D storage array; AVG is a SUM scaled by each segment's owner between the
    two phases, which otherwise run as one row of steps, with host_range where data is one."""
    ring = _members(c, members)
    if op is ReduceKind.AVG:
        if host_range is not None:
            host_range.fold_rest()
        owned = _segments(len(data), len(ring))
        ring_reduce_scatter_op(c, data, op, ring, owned)
        ring_all_gather_owned(c, data, ring, owned)
        return
    ring = ring if type(ring) is tuple else tuple(ring)
    _run_ring(c, data, ring_all_reduce_steps(ring, c.rank, len(data), data.itemsize, c.chunk_bytes), op, host_range)


@functools.lru_cache(maxsize=256)
def ring_all_reduce_steps(ring: tuple[int, ...], rank: int, count: int, itemsize: int,
                          chunk_bytes: int) -> tuple[RangeStep, ...]:
    """ring_all_reduce's steps at `rank` over count elements (both phases, equal segments), looked
    up in one step per call: where ranks share cores, each step of the lookup is time a peer waits for."""
    owned = _segments(count, len(ring))
    pieces = chunk_count(max(b - a for a, b in owned), itemsize, chunk_bytes)
    return _ring_schedule(ring, rank, owned, pieces, (1, 0))


@functools.lru_cache(maxsize=256)
def _segments(count: int, parts: int) -> tuple[Bounds, ...]:
    return tuple(segment_bounds(count, parts))


def one_shot_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int] | None = None) -> None:
    """Small arrays: everyone sends everything to everyone, then every rank folds all inputs in
    member order (x0 op x1 op ...), reducing straight from the received messages: bitwise identical."""
    ranks = _members(c, members)
    n, p = len(ranks), ranks.index(c.rank)
    if n == 2:
        c.t.exchange(ranks[1 - p], c.tag, data, c.code, c.meta, c.deadline, op, own_first=p == 0)
        scale_if_avg(c, data, op, n)
        return
    for step in range(1, n):  # each rank starts with a different peer: no one is sent to by all at once
        c.t.send(ranks[(p + step) % n], c.tag, data, c.code, c.meta, c.deadline)
    first = ranks[0]
    own = data.copy() if c.rank != first else data
    if c.rank != first:
        c.t.recv_into(first, c.tag, data, c.code, c.deadline, c.meta)
    for src in ranks[1:]:
        if src == c.rank:
            kernels.reduce_into(data, own, c.code, op)
        else:
            c.t.recv_into(src, c.tag, data, c.code, c.deadline, c.meta, op)
    scale_if_avg(c, data, op, len(ranks))


def ring_all_gather(c: Call, local: np.ndarray, out: np.ndarray) -> None:
    """out (1-D, n * len(local)) receives every rank's block in rank order."""
    ring_all_gather_v(c, local, out, [len(local)] * c.size)


def ring_all_gather_v(c: Call, local: np.ndarray, out: np.ndarray, sizes: Sequence[int]) -> None:
    """out (1-D) receives every rank's `local` in rank order; rank r contributes sizes[r] elements
    (pieces of different, even zero, length are fine)."""
    starts = np.cumsum([0, *sizes]).tolist()
    owned = [(starts[i], starts[i + 1]) for i in range(c.size)]
    a, b = owned[c.rank]
    out[a:b] = local
    ring_all_gather_owned(c, out, range(c.size), owned)


def ring_reduce_scatter_blocks(c: Call, work: np.ndarray, out: np.ndarray, op: ReduceKind) -> None:
    """out = op over every rank's block c.rank of `work` (a 1-D scratch copy of the input, n equal
    blocks; it ends holding partial results). Each block is folded once, along the ring, in a fixed
    order, so the result does not depend on timing."""
    block = len(work) // c.size
    ring_reduce_scatter_op(c, work, op, range(c.size), [(i * block, (i + 1) * block) for i in range(c.size)])
    out[:] = work[c.rank * block:(c.rank + 1) * block]
