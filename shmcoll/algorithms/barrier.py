"""Dissemination barrier: ceil(log2 n) rounds; in round k rank r signals r + 2^k and hears from r - 2^k.
Among a power of two of ranks the rounds pair up instead: r and r ^ 2^k meet, which a transport
may do in one call for all rounds (Transport.exchanges).

After the last round every rank has (transitively) heard from every other, so nobody leaves before
everybody arrived. Across hosts, where a transport runs a rank's meetings in one native call,
doubling_barrier meets as recursive doubling does, ranks past a power of two included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..types import ReduceKind
from .call import Call
from .doubling import doubling_steps

_EMPTY = np.empty(0, dtype=np.uint8)


def dissemination_barrier(c: Call, members: Sequence[int] | None = None) -> None:
    """members: the ranks taking part (default every rank); the hierarchy runs it per host and across hosts."""
    ranks = range(c.size) if members is None else members
    n, p, distance = len(ranks), ranks.index(c.rank), 1
    if n & (n - 1) == 0:  # a power of two: pairs meet (r and r ^ 2^k), all in one call where they can
        doubling_barrier(c, ranks)
        return
    while distance < n:
        c.t.send(ranks[(p + distance) % n], c.tag, _EMPTY, c.code, c.meta, c.deadline)
        c.t.recv_into(ranks[(p - distance) % n], c.tag, _EMPTY, c.code, c.deadline, c.meta)
        distance *= 2


def doubling_barrier(c: Call, members: Sequence[int]) -> None:
    """Recursive doubling's meetings with empty frames (doubling.doubling_steps): a rank past the
    largest power of two says it arrived to its partner and hears back once the core met. Two more
    steps than dissemination's rounds there, but all of a rank's steps in one row, which TCP runs in
    one native call: the barrier across hosts, in each column."""
    c.t.exchanges(doubling_steps(members, c.rank), c.tag, _EMPTY, c.code, c.meta, c.deadline, ReduceKind.SUM)
