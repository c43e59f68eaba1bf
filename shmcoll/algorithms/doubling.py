"""Recursive doubling all-reduce: ceil(log2 n) exchange steps, for small arrays among many ranks.

The one-shot all-reduce (ring.py) finishes in one step, but each rank sends and receives n-1
whole arrays; across many hosts that is many messages per call. Here, in step k, position p
exchanges its partial result with position p XOR 2^k, so after log2 n steps every rank holds the
whole reduction, having sent log2 n arrays. When n is not a power of two, the positions past the
largest power of two first hand their array to a partner below it, and get the result back at the
end (two more steps for them).

Bitwise identical everywhere: both ends of an exchange fold the lower position's value first
(`lower op higher`), so they compute the same bits even where an op is not commutative bit for
bit (a SUM of two NaNs keeps the first one's payload), and partners hold equal values at every
step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..types import ReduceKind
from .call import Call
from .ring import scale_if_avg, summed


def recursive_doubling_all_reduce(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int]) -> None:
    """In place over a 1-D storage array, among `members` (this rank one of them)."""
    def among_core(ranks: list[int], p: int, core: int) -> None:
        c.t.exchanges(partner_steps(ranks, p, core), c.tag, data, c.code, c.meta, c.deadline, summed(op))
        scale_if_avg(c, data, op, len(ranks))

    on_power_of_two(c, data, op, members, among_core)


def partner_steps(ranks: Sequence[int], p: int, core: int) -> tuple[tuple[int, bool], ...]:
    """The exchanges of position p among the first `core` positions (a power of two) of ranks, in
    order: (partner, whether p is the lower position, whose value is folded first)."""
    distances = (1 << k for k in range(core.bit_length() - 1))
    return tuple((ranks[p ^ d], not p & d) for d in distances)


def on_power_of_two(c: Call, data: np.ndarray, op: ReduceKind, members: Sequence[int],
                    among_core: Callable[[list[int], int, int], None]) -> None:
    """Run among_core(ranks, position, core) on the first `core` positions of members, the largest
    power of two of them; each position past it hands its array to position - core first (which
    folds it in, lower op higher) and gets the finished result back from it at the end."""
    ranks = list(members)
    n, p = len(ranks), ranks.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:
        partner = ranks[p - core]
        c.t.send(partner, c.tag, data, c.code, c.meta, c.deadline)
        c.t.recv_into(partner, c.tag, data, c.code, c.deadline, c.meta)
        return
    extra = ranks[p + core] if p + core < n else None
    if extra is not None:
        c.t.recv_into(extra, c.tag, data, c.code, c.deadline, c.meta, summed(op))
    among_core(ranks, p, core)
    if extra is not None:
        c.t.send(extra, c.tag, data, c.code, c.meta, c.deadline)
