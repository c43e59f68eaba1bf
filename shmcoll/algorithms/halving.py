"""Rabenseifner's all-reduce: reduce-scatter by recursive halving, all-gather by recursive doubling.

A ring moves the fewest bytes, 2(n-1)/n of the array per rank, but in 2(n-1) steps one after
another; across many hosts each step pays the network's latency. Here the same bytes move in
2 log2 n steps. In halving step k, position p and its partner p XOR d (d = n/2, n/4, ..., 1) each
keep one half of the segments they still share and send the other half, which the partner folds
into its own; after log2 n steps position p holds segment p, finished. The all-gather runs the
steps backwards, copying. When n is not a power of two, the positions past the largest power of
two give their array to a partner below it first and take the result back at the end.

Each segment is finished at one position and copied from there: bitwise identical everywhere.

Rabenseifner's reduce (halving_reduce) runs the halving steps alone, then every position sends its
finished segment straight to the target: the target takes in 2(n-1)/n of the array, against
ceil(log2 n) arrays down a binomial tree (binomial.py), for a quarter more bytes in all at 4 ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..transport.base import PeerStep, Way
from ..types import ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .direct import recv_stream, send_stream
from .ring import scale_if_avg, summed

Span = tuple[int, int]  # [first, last) segment


def halving_doubling_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int]) -> None:
    """In place over a 1-D storage array, among `members` (this rank one of them)."""
    ranks = list(members)
    n, p = len(ranks), ranks.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:  # past the largest power of two
        partner = ranks[p - core]
        _hand_off(c, data, op, (partner, Way.GIVE), (partner, Way.TAKE))
        return
    extra = ranks[p + core] if p + core < n else None
    if extra is not None:
        _hand_off(c, data, op, (extra, Way.FOLD_IN))
    segments = segment_bounds(len(data), core)
    span = _reduce_scatter(c, data, summed(op), ranks, p, core, segments)
    a, b = _elements(segments, span)
    scale_if_avg(c, data[a:b], op, n)
    _all_gather(c, data, ranks, p, core, segments, span)
    if extra is not None:
        _hand_off(c, data, op, (extra, Way.GIVE))


def halving_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int], target: int) -> None:
    """members' arrays folded into `target`'s data (a member; 1-D storage array, in place); every
    other member's data is scratch. op is applied as given (a SUM for AVG: the caller scales). A
    position past the largest power of two gives its array to its partner first; where it is the
    target, it then takes every segment as any target does."""
    ranks = list(members)
    n, p = len(ranks), ranks.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    segments = segment_bounds(len(data), core)
    if p >= core:
        _hand_off(c, data, op, (ranks[p - core], Way.GIVE))
    else:
        if p + core < n:
            _hand_off(c, data, op, (ranks[p + core], Way.FOLD_IN))
        a, b = _elements(segments, _reduce_scatter(c, data, op, ranks, p, core, segments))
        if c.rank != target:
            send_stream(c, target, data[a:b])
    if c.rank == target:
        for owner in range(core):
            if ranks[owner] != c.rank:
                recv_stream(c, ranks[owner], data[slice(*segments[owner])])


def _hand_off(c: Call, data: np.ndarray, op: ReduceKind, *steps: PeerStep) -> None:
    c.t.exchanges(steps, c.tag, data, c.code, c.meta, c.deadline, summed(op))


def _reduce_scatter(c: Call, data: np.ndarray, op: ReduceKind, ranks: list[int], p: int, core: int,
                    segments: list[tuple[int, int]]) -> Span:
    """Halve the shared segments with each partner in turn; returns the span this position owns: (p, p+1)."""
    first, last = 0, core
    distance = core >> 1
    while distance:
        middle = (first + last) // 2
        upper = bool(p & distance)
        keep, give = ((middle, last), (first, middle)) if upper else ((first, middle), (middle, last))
        _swap(c, data, ranks[p ^ distance], _elements(segments, give), _elements(segments, keep), op)
        first, last = keep
        distance >>= 1
    return first, last


def _all_gather(c: Call, data: np.ndarray, ranks: list[int], p: int, core: int, segments: list[tuple[int, int]],
                span: Span) -> None:
    """The halving steps backwards: send the span this position holds, copy in the partner's."""
    first, last = span
    distance = 1
    while distance < core:
        width = last - first
        theirs = (first + width, last + width) if not p & distance else (first - width, last - width)
        _swap(c, data, ranks[p ^ distance], _elements(segments, (first, last)), _elements(segments, theirs), None)
        first, last = min(first, theirs[0]), max(last, theirs[1])
        distance <<= 1


def _elements(segments: list[tuple[int, int]], span: Span) -> tuple[int, int]:
    """The elements of segments [first, last)."""
    first, last = span
    return segments[first][0], segments[last - 1][1]


def _swap(c: Call, data: np.ndarray, partner: int, out: tuple[int, int], into: tuple[int, int],
          op: ReduceKind | None) -> None:
    """Send data[out] to the partner while receiving its data into data[into] (folded with op, or
    copied), streamed in chunks: both ends cut their two ranges into the same number of pieces."""
    pieces = chunk_count(max(out[1] - out[0], into[1] - into[0]), data.itemsize, c.chunk_bytes)
    steps = [(data[s0:s1], data[r0:r1], op) for (s0, s1), (r0, r1) in zip(sub_bounds(*out, pieces),
                                                                           sub_bounds(*into, pieces))]
    c.t.send_recv_row(partner, partner, c.tag, steps, c.code, c.meta, c.deadline)
