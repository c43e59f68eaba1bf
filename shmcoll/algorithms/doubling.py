"""Recursive doubling all-reduce: ceil(log2 n) exchange steps, for small arrays among many ranks.

The one-shot all-reduce (ring.py) finishes in one step, but each rank sends and receives n-1
whole arrays; across many hosts that is many messages per call. Here, in step k, position p
exchanges its partial result with position p XOR 2^k, so after log2 n steps every rank holds the
whole reduction, having sent log2 n arrays. When n is not a power of two, the positions past the
largest power of two first give their array to a partner below it, which folds it in, and take the
result back from it at the end (two more steps for both).

Every step of a rank is one row of Transport.exchanges() (doubling_steps), which TCP runs in one
native call: the hand-offs too, so a column of 3 hosts crosses without Python between its steps.

Bitwise identical everywhere: both ends of an exchange fold the lower position's value first
(`lower op higher`), so they compute the same bits even where an op is not commutative bit for
bit (a SUM of two NaNs keeps the first one's payload), and partners hold equal values at every
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..transport.base import PeerStep, Way
from ..types import ReduceKind
from .call import Call
from .ring import scale_if_avg, summed


def recursive_doubling_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int]) -> None:
    """In place over a 1-D storage array, among `members` (this rank one of them)."""
    c.t.exchanges(doubling_steps(members, c.rank), c.tag, data, c.code, c.meta, c.deadline, summed(op))
    scale_if_avg(c, data, op, len(members))


def doubling_steps(members: Sequence[int], rank: int) -> tuple[PeerStep, ...]:
    """rank's steps of recursive doubling among members, in order: a position past the largest
    power of two gives its array to its partner (position - core) and takes the result back; its
    partner folds it in first and gives the result back last."""
    ranks = list(members)
    n, p = len(ranks), ranks.index(rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:
        partner = ranks[p - core]
        return (partner, Way.GIVE), (partner, Way.TAKE)
    steps = partner_steps(ranks, p, core)
    if p + core >= n:
        return steps
    extra = ranks[p + core]
    return ((extra, Way.FOLD_IN),) + steps + ((extra, Way.GIVE),)


def partner_steps(ranks: Sequence[int], p: int, core: int) -> tuple[PeerStep, ...]:
    """The exchanges of position p among the first `core` positions (a power of two) of ranks, in
    order: the partner, and whether p is the lower position, whose value is folded first."""
    distances = (1 << k for k in range(core.bit_length() - 1))
    return tuple((ranks[p ^ d], Way.THEIRS_FIRST if p & d else Way.OWN_FIRST) for d in distances)
