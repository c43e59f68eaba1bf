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

from collections.abc import Sequence

import numpy as np

from .call import Call
from .direct import recv_stream, send_stream


def bruck_all_gather_blocks(c: Call, local: np.ndarray, out: np.ndarray) -> None:
    """out receives every rank's equal-sized block (local on this rank) in rank order."""
    block = len(local)
    out[c.rank * block:(c.rank + 1) * block] = local
    bruck_all_gather(c, out, [(r * block, (r + 1) * block) for r in range(c.size)], range(c.size))


def bruck_all_gather(c: Call, buf: np.ndarray, spans: Sequence[tuple[int, int]], members: Sequence[int]) -> None:
    """buf[spans[i][0]:spans[i][1]] is members[i]'s block, spans in order and back to back; this
    rank's own is in place, the others arrive."""
    n, p = len(members), members.index(c.rank)
    distance = 1
    while distance < n:
        count = min(distance, n - distance)
        for a, b in wrapped_ranges(spans, p, count):
            send_stream(c, members[(p - distance) % n], buf[a:b])
        for a, b in wrapped_ranges(spans, (p + distance) % n, count):
            recv_stream(c, members[(p + distance) % n], buf[a:b])
        distance <<= 1


def wrapped_ranges(spans: Sequence[tuple[int, int]], first: int, count: int) -> list[tuple[int, int]]:
    """The blocks of positions first .. first + count - 1 (modulo len(spans)) as element ranges of
    the array: one range, or two where the positions wrap past the last."""
    n = len(spans)
    last = first + count - 1
    if last < n:
        return [(spans[first][0], spans[last][1])]
    return [(spans[first][0], spans[n - 1][1]), (spans[0][0], spans[last - n][1])]
