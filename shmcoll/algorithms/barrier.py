"""Dissemination barrier: ceil(log2 n) rounds; in round k rank r signals r + 2^k and hears from r - 2^k.

After the last round every rank has (transitively) heard from every other, so nobody leaves before
everybody arrived.
"""

from __future__ import annotations

import numpy as np

from .call import Call

_EMPTY = np.empty(0, dtype=np.uint8)


def dissemination_barrier(c: Call) -> None:
    n, r, distance = c.size, c.rank, 1
    while distance < n:
        c.t.send((r + distance) % n, c.tag, _EMPTY, c.code, c.meta, c.deadline)
        c.t.recv_into((r - distance) % n, c.tag, _EMPTY, c.code, c.deadline, c.meta)
        distance *= 2
