"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, streamed in chunks.

Each rank forwards chunk k while chunk k+1 is still arriving, so a large array costs about one
transfer time however many ranks there are. The last rank acknowledges to the root, so the root
also fails (rather than returning) when the ranks disagree on the call (another root, length, dtype).
"""

from __future__ import annotations

import numpy as np

from .call import Call, chunk_count, sub_bounds

_EMPTY = np.empty(0, dtype=np.uint8)


def chain_broadcast(c: Call, root: int, data: np.ndarray) -> None:
    n = c.size
    if n == 1:
        return
    order = [(root + i) % n for i in range(n)]
    pos = order.index(c.rank)
    succ = order[pos + 1] if pos + 1 < n else None
    pieces = sub_bounds(0, len(data), chunk_count(len(data), data.itemsize, c.chunk_bytes))
    for a, b in pieces:
        if pos > 0:
            c.t.recv_into(order[pos - 1], c.tag, data[a:b], c.code, c.deadline, c.meta)
        if succ is not None:
            c.t.send(succ, c.tag, data[a:b], c.code, c.meta, c.deadline)
    if pos == n - 1:
        c.t.send(root, c.tag, _EMPTY, c.code, c.meta, c.deadline)
    elif pos == 0:
        c.t.recv_into(order[-1], c.tag, _EMPTY, c.code, c.deadline, c.meta)
