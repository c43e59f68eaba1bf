"""Binomial-tree reduce: n ranks' arrays folded into one rank's in ceil(log2 n) steps.

Sending every array straight to the target makes the target take in n - 1 arrays, one after
another, through its one link. In a binomial tree, position q (counted from the target, which is
position 0) first folds in the arrays of q + 1, q + 2, q + 4, ... (each a subtree's partial result)
for as long as those bits of q are clear, then sends its own to q - d at the first set bit d, and
is done. The target takes in ceil(log2 n) arrays; every rank sends at most one; the same n - 1
arrays cross in all. Folding order depends only on n and the target's position, so a call's result
is the same on every run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..types import ReduceKind
from .call import Call
from .direct import recv_stream, send_stream


def binomial_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int], target: int) -> None:
    """members' arrays folded into `target`'s data (a member; 1-D storage array, in place). Every
    other member's data ends holding a partial result. op is applied as given (a SUM for AVG: the
    caller scales)."""
    n = len(members)
    origin = members.index(target)
    q = (members.index(c.rank) - origin) % n
    distance = 1
    while distance < n:
        if q & distance:
            send_stream(c, members[(q - distance + origin) % n], data)
            return
        if q + distance < n:
            recv_stream(c, members[(q + distance + origin) % n], data, op)
        distance <<= 1

