"""Federated averaging with a deadline: rank 0 averages whatever arrived in time, then shares it.

Rank 0 never waits past the deadline for a slow or dead rank, and returns at once when every rank
has arrived. Vectors travel on the round's own tag (its sequence number) and rank 0 retires the
round when it ends, so a straggler's late vector is dropped on arrival, never averaged into a later
round. Results go to stragglers too, from a background thread, so a stopped rank whose socket is
full cannot stall rank 0.
"""

from __future__ import annotations

import time

import numpy as np

from .. import kernels
from ..errors import CollectiveError
from ..transport.base import check_meta
from ..types import BF16, F16
from .call import Call


def to_f64(storage: np.ndarray, code: int) -> np.ndarray:
    if code == F16.code:
        return kernels.f16_bits_to_f64(storage)
    if code == BF16.code:
        return kernels.bf16_bits_to_f64(storage)
    return storage.astype(np.float64)


def from_f64(values: np.ndarray, code: int, out: np.ndarray) -> None:
    """Round float64 values once to the element type of `out` (a storage array)."""
    if code == F16.code:
        out[...] = kernels.f64_to_f16_bits(values)
    elif code == BF16.code:
        out[...] = kernels.f64_to_bf16_bits(values)
    else:
        out[...] = values


def federated_average(c: Call, data: np.ndarray, window: float) -> int:
    if c.rank != 0:
        c.t.send(0, c.tag, data, c.code, c.meta, c.deadline)
        c.t.recv_into(0, c.tag, data, c.code, c.deadline, c.meta, strict=False)  # only rank 0 matters
        return 0
    arrivals = _collect(c, data, time.monotonic() + window)
    total = np.zeros(len(data), dtype=np.float64)
    for src in sorted(arrivals):
        total += to_f64(arrivals[src], c.code)
    from_f64(total / len(arrivals), c.code, data)
    c.t.retire_below(c.meta.seq + 1)
    _share(c, data, set(arrivals))
    return len(arrivals)


def _collect(c: Call, data: np.ndarray, until: float) -> dict[int, np.ndarray]:
    arrivals = {0: data.copy()}
    waiting = set(range(1, c.size))
    while waiting:
        msg = c.t.recv_any(waiting, c.tag, until)
        if msg is None:
            break
        check_meta(msg, c.meta)
        arrivals[msg.header.src] = msg.payload.view(data.dtype)
        waiting.discard(msg.header.src)
    return arrivals


def _share(c: Call, data: np.ndarray, arrived: set[int]) -> None:
    """Send the average to every rank: those that arrived now, stragglers in the background."""
    for peer in sorted(arrived - {0}):
        _send_quietly(c, peer, data)
    late = [peer for peer in range(1, c.size) if peer not in arrived]
    if late:
        result = data.copy()
        def deliver_late() -> None:
            for peer in late:
                _send_quietly(c, peer, result)

        c.t.start_background(deliver_late, "shmcoll-federated-late")


def _send_quietly(c: Call, peer: int, data: np.ndarray) -> None:
    try:
        c.t.send(peer, c.tag, data, c.code, c.meta, c.deadline)
    except CollectiveError:
        pass  # a dead or stuck client must not fail the round; it will fail on its own side
