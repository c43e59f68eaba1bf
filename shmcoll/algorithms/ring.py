"""Ring all-reduce (reduce-scatter then all-gather) and ring all-gather, streamed in chunks.

Every rank moves about 2(n-1)/n of the array regardless of n. Each segment is reduced once, along
the ring, by a fixed sequence of ranks, then copied around: every rank ends bitwise identical.
Sends never block on a peer that is itself sending, because transports always drain their inputs.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..types import ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds


def _ring_step(c: Call, data: np.ndarray, send_seg, recv_seg, pieces: int, op: ReduceKind | None) -> None:
    """Send one segment to the right neighbour while receiving (reducing or copying) one from the left."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    for (s0, s1), (r0, r1) in zip(sub_bounds(*send_seg, pieces), sub_bounds(*recv_seg, pieces)):
        c.t.send(right, c.tag, data[s0:s1], c.code, c.meta, c.deadline)
        c.t.recv_into(left, c.tag, data[r0:r1], c.code, c.deadline, c.meta, op)


def ring_all_reduce(c: Call, data: np.ndarray, op: ReduceKind) -> None:
    """In place over a 1-D storage array; AVG is a SUM scaled by the segment's owner."""
    n, r = c.size, c.rank
    segs = segment_bounds(len(data), n)
    pieces = chunk_count(max(b - a for a, b in segs), data.itemsize, c.chunk_bytes)
    for step in range(n - 1):
        _ring_step(c, data, segs[(r - step) % n], segs[(r - step - 1) % n], pieces, op)
    owned = segs[(r + 1) % n]
    if op is ReduceKind.AVG:
        kernels.scale_into(data[owned[0]:owned[1]], c.code, n)
    for step in range(n - 1):
        _ring_step(c, data, segs[(r + 1 - step) % n], segs[(r - step) % n], pieces, None)


def one_shot_all_reduce(c: Call, data: np.ndarray, op: ReduceKind) -> None:
    """Small arrays: everyone sends everything to everyone, then every rank folds all inputs in rank
    order (x0 op x1 op ...), reducing straight from the received messages: bitwise identical."""
    n, r = c.size, c.rank
    for step in range(1, n):
        c.t.send((r + step) % n, c.tag, data, c.code, c.meta, c.deadline)
    own = data.copy() if r else data
    if r:
        c.t.recv_into(0, c.tag, data, c.code, c.deadline, c.meta)
    for src in range(1, n):
        if src == r:
            kernels.reduce_into(data, own, c.code, op)
        else:
            c.t.recv_into(src, c.tag, data, c.code, c.deadline, c.meta, op)
    if op is ReduceKind.AVG:
        kernels.scale_into(data, c.code, n)


def ring_all_gather(c: Call, local: np.ndarray, out: np.ndarray) -> None:
    """out (1-D, n * len(local)) receives every rank's block in rank order."""
    n, r, block = c.size, c.rank, len(local)
    out[r * block:(r + 1) * block] = local
    segs = [(i * block, (i + 1) * block) for i in range(n)]
    pieces = chunk_count(block, out.itemsize, c.chunk_bytes)
    for step in range(n - 1):
        _ring_step(c, out, segs[(r - step) % n], segs[(r - step - 1) % n], pieces, None)
