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

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..transport.base import PeerStep, RangeStep, Way
from ..types import ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .direct import recv_stream, send_stream
from .ring import scale_if_avg, summed

Span = tuple[int, int]  # [first, last) segment


def halving_doubling_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int]) -> None:
    """In place over a 1-D storage array, among `members` (this rank one of them)."""
    ranks = tuple(members)
    n, p = len(ranks), ranks.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:  # past the largest power of two
        partner = ranks[p - core]
        _hand_off(c, data, op, (partner, Way.GIVE), (partner, Way.TAKE))
        return
    extra = ranks[p + core] if p + core < n else None
    if extra is not None:
        _hand_off(c, data, op, (extra, Way.FOLD_IN))
    h = _halving(ranks, p, len(data), data.itemsize, c.chunk_bytes)
    if op is ReduceKind.AVG:
        _run(c, data, h.folding, summed(op))
        scale_if_avg(c, data[h.owned[0]:h.owned[1]], op, n)
        _run(c, data, h.copying, None)
    else:
        _run(c, data, h.folding + h.copying, op)
    if extra is not None:
        _hand_off(c, data, op, (extra, Way.GIVE))


def halving_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int], target: int) -> None:
    """members' arrays folded into `target`'s data (a member; 1-D storage array, in place); every
    other member's data is scratch. op is applied as given (a SUM for AVG: the caller scales). A
    position past the largest power of two gives its array to its partner first; where it is the
    target, it then takes every segment as any target does."""
    ranks = tuple(members)
    n, p = len(ranks), ranks.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    segments = segment_bounds(len(data), core)
    if p >= core:
        _hand_off(c, data, op, (ranks[p - core], Way.GIVE))
    else:
        if p + core < n:
            _hand_off(c, data, op, (ranks[p + core], Way.FOLD_IN))
        h = _halving(ranks, p, len(data), data.itemsize, c.chunk_bytes)
        _run(c, data, h.folding, op)
        if c.rank != target:
            send_stream(c, target, data[h.owned[0]:h.owned[1]])
    if c.rank == target:
        for owner in range(core):
            if ranks[owner] != c.rank:
                recv_stream(c, ranks[owner], data[slice(*segments[owner])])


class _Halving(NamedTuple):
    """A position's steps (below the largest power of two), the same for every call of a kind."""

    folding: tuple[RangeStep, ...]  # the reduce-scatter's, by halving
    copying: tuple[RangeStep, ...]  # the all-gather's, the halving steps backwards
    owned: tuple[int, int]  # the elements this position holds finished between the two


@functools.lru_cache(maxsize=256)
def _halving(ranks: tuple[int, ...], p: int, count: int, itemsize: int, chunk_bytes: int) -> _Halving:
    core = 1 << (len(ranks).bit_length() - 1)
    segments = segment_bounds(count, core)
    halving, span = _halving_exchanges(p, core)
    doubling = doubling_exchanges(p, core, span)
    return _Halving(_in_frames(ranks, p, halving, segments, itemsize, chunk_bytes, True),
                    _in_frames(ranks, p, doubling, segments, itemsize, chunk_bytes, False), _elements(segments, span))


def _run(c: Call, data: np.ndarray, steps: tuple[RangeStep, ...], op: ReduceKind | None) -> None:
    c.t.send_recv_ranges(steps, c.tag, data, c.code, c.meta, c.deadline, op)


Exchange = tuple[int, Span, Span]  # a step's distance to its partner, the segments it sends, those it receives


def _halving_exchanges(p: int, core: int) -> tuple[list[Exchange], Span]:
    """Halve the shared segments with each partner in turn (distance core/2, ..., 1): keep one
    half, send the other; and the span this position ends with: (p, p+1)."""
    first, last = 0, core
    distance, steps = core >> 1, []
    while distance:
        middle = (first + last) // 2
        keep, give = ((middle, last), (first, middle)) if p & distance else ((first, middle), (middle, last))
        steps.append((distance, give, keep))
        first, last = keep
        distance >>= 1
    return steps, (first, last)


def doubling_exchanges(p: int, core: int, span: Span) -> list[Exchange]:
    """The halving steps backwards: send the span this position holds, copy in the partner's."""
    first, last = span
    distance, steps = 1, []
    while distance < core:
        width = last - first
        theirs = (first + width, last + width) if not p & distance else (first - width, last - width)
        steps.append((distance, (first, last), theirs))
        first, last = min(first, theirs[0]), max(last, theirs[1])
        distance <<= 1
    return steps


def _in_frames(ranks: tuple[int, ...], p: int, exchanges: list[Exchange], segments: list[tuple[int, int]],
               itemsize: int, chunk_bytes: int, folds: bool) -> tuple[RangeStep, ...]:
    """Each exchange with its partner streamed in chunks: both ends cut their two ranges into the
    same number of frames."""
    steps: list[RangeStep] = []
    for distance, sent, received in exchanges:
        partner = ranks[p ^ distance]
        out, into = _elements(segments, sent), _elements(segments, received)
        pieces = chunk_count(max(out[1] - out[0], into[1] - into[0]), itemsize, chunk_bytes)
        steps += [(partner, partner, *o, *i, folds)
                  for o, i in zip(sub_bounds(*out, pieces), sub_bounds(*into, pieces))]
    return tuple(steps)


def _hand_off(c: Call, data: np.ndarray, op: ReduceKind, *steps: PeerStep) -> None:
    c.t.exchanges(steps, c.tag, data, c.code, c.meta, c.deadline, summed(op))


def _elements(segments: list[tuple[int, int]], span: Span) -> tuple[int, int]:
    """The elements of segments [first, last)."""
    first, last = span
    return segments[first][0], segments[last - 1][1]
