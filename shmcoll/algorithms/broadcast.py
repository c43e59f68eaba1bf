"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, streamed in chunks.

Each rank forwards chunk k while chunk k+1 is still arriving, so a large array costs about one
transfer time however many ranks there are. Two kinds of empty frames make disagreement fail on
every rank instead of leaving some waiting or returning: every non-root tells the rank it believes
is root that it arrived (so ranks naming different roots always receive a frame they can compare),
and the tail tells everyone the data reached the end (so no rank returns before all have checked).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .call import Call, chunk_count, sub_bounds

_EMPTY = np.empty(0, dtype=np.uint8)


def chain_broadcast(c: Call, root: int, data: np.ndarray, order: Sequence[int] | None = None) -> None:
    """order: the chain, root first (default: every rank, from root upwards); others skip the call."""
    if order is None:
        order = [(root + i) % c.size for i in range(c.size)]
    n = len(order)
    if n == 1 or c.rank not in order:
        return
    pos, tail = order.index(c.rank), order[-1]
    if pos > 0:
        _signal(c, root)  # "arrived": the root checks it at the end
    _stream(c, data, order, pos)
    if pos == n - 1:
        for peer in order[:-1]:
            _signal(c, peer)  # "done": nobody leaves before the tail has the data
        return
    if pos == 0:
        for peer in order[1:]:
            _expect(c, peer)
    _expect(c, tail)


def _stream(c: Call, data: np.ndarray, order: Sequence[int], pos: int) -> None:
    succ = order[pos + 1] if pos + 1 < len(order) else None
    for a, b in sub_bounds(0, len(data), chunk_count(len(data), data.itemsize, c.chunk_bytes)):
        if pos > 0:
            c.t.recv_into(order[pos - 1], c.tag, data[a:b], c.code, c.deadline, c.meta)
        if succ is not None:
            c.t.send(succ, c.tag, data[a:b], c.code, c.meta, c.deadline)


def _signal(c: Call, peer: int) -> None:
    c.t.send(peer, c.tag, _EMPTY, c.code, c.meta, c.deadline)


def _expect(c: Call, peer: int) -> None:
    c.t.recv_into(peer, c.tag, _EMPTY, c.code, c.deadline, c.meta)
