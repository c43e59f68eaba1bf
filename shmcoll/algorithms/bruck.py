"""Bruck all-gather: n ranks gather everyone's block in ceil(log2 n) steps, for small blocks.

A ring takes n - 1 steps of one block each; across many hosts each step is a network latency. Here,
in step k, position p sends every block it holds so far (its own and the next 2^k - 1 positions',
at most n - 2^k of them) to position p - 2^k and receives as many from position p + 2^k, so after
ceil(log2 n) steps it holds all n. The blocks live in one array in position order, so what travels
is one contiguous range, or two where it wraps past the last position, received straight into place.
Every rank sends a step's frames only after its earlier steps came in: by induction a rank that
finished step k has seen positions p .. p + 2^(k+1) - 1 make the same call, and one that finished
them all has seen every position (so disagreement fails everywhere).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from .call import Call


def bruck_all_gather_blocks(c: Call, local: np.ndarray, out: np.ndarray) -> None:
    """out receives every rank's equal-sized block (local on this rank) in rank order."""
    block = len(local)
    out[c.rank * block:(c.rank + 1) * block] = local
    bruck_all_gather(c, out, [(r * block, (r + 1) * block) for r in range(c.size)], range(c.size))


def bruck_all_gather(c: Call, buf: np.ndarray, spans: Sequence[tuple[int, int]], members: Sequence[int]) -> None:
    """buf[spans[i][0]:spans[i][1]] is members[i]'s block, spans in order and back to back; this
    rank's own is in place, the others arrive. Each step's frame out and frame in go at once
    (Transport.send_recv: over TCP one native duplex), a wrapped range packed into one frame."""
    n, p = len(members), members.index(c.rank)
    for _, count, to, src in bruck_schedule(n, p):
        out = _packed(buf, wrapped_ranges(spans, p, count))
        into_ranges = wrapped_ranges(spans, src, count)
        into = _packed(buf, into_ranges) if len(into_ranges) > 1 else buf[slice(*into_ranges[0])]
        c.t.send_recv(members[to], members[src], c.tag, out, into, c.code, c.meta, c.deadline)
        if len(into_ranges) > 1:
            _unpack(into, buf, into_ranges)


def bruck_schedule(n: int, p: int) -> Iterator[tuple[int, int, int, int]]:
    """Position p's steps among n, in order: (distance, count, to, src): the count blocks from p on
    go out to position `to` (distance before), as many come in from `src` (distance after), whose
    blocks they are, from src on."""
    distance = 1
    while distance < n:
        yield distance, min(distance, n - distance), (p - distance) % n, (p + distance) % n
        distance <<= 1


def _packed(buf: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """buf's ranges as one array: a view of a single range, a copy of two."""
    return buf[slice(*ranges[0])] if len(ranges) == 1 else np.concatenate([buf[a:b] for a, b in ranges])


def _unpack(packed: np.ndarray, buf: np.ndarray, ranges: list[tuple[int, int]]) -> None:
    """packed's elements back into buf's ranges, in order (_packed's inverse)."""
    at = 0
    for a, b in ranges:
        buf[a:b] = packed[at:at + b - a]
        at += b - a


def wrapped_ranges(spans: Sequence[tuple[int, int]], first: int, count: int) -> list[tuple[int, int]]:
    """The blocks of positions first .. first + count - 1 (modulo len(spans)) as element ranges of
    the array: one range, or two where the positions wrap past the last."""
    n = len(spans)
    last = first + count - 1
    if last < n:
        return [(spans[first][0], spans[last][1])]
    return [(spans[first][0], spans[n - 1][1]), (spans[0][0], spans[last - n][1])]
