"""The measuring half of `shmcoll-bench`: warmup, iteration cap, the timed loop, the check, the row.

No printing and no argument parsing here (cli.py and options.py do both), so every rank runs
exactly the same sequence of collectives: any decision that changes how many calls a rank makes
(the time cap on iterations) is taken from values every rank has gathered, never from a rank's
own clock alone.

One loop for every library: `group` is a shmcoll ProcessGroup or a peer's adapter (adapters.py),
and the collective's descriptor (collectives.py) builds that library's calls, so OpenMPI and gloo
are timed and checked by this very code and a ratio compares libraries, not benchmark loops. The
loop itself asks the group only for rank, world_size, barrier() and all_gather(array).

Time: each rank's mean over the timed iterations, reported as the slowest rank's. Iteration cap:
when the fastest warmup call (slowest rank's) says --iters calls would take more than --max-time,
fewer are timed (about --max-time worth, never fewer than MIN_CAPPED_ITERS). algbw = bytes / time;
busbw = algbw * the descriptor's bus factor. --check: after timing, one call of the same kind on
known inputs (on the last rotated buffer when cold), compared with the exact reference.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shmcoll.types import ReduceKind

from .adapters import SHMCOLL
from .buffers import cycle_calls, llc, plan, rotating
from .collectives import COLLECTIVES
from .descriptor import Call, Collective, Payload, Sizing
from .inputs import OPS
from .results import Row

MIN_CAPPED_ITERS = 3  # the time cap never cuts the timed loop below this many calls


class Group(Protocol):
    """What the loop needs of a group besides the collective's own calls."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def barrier(self) -> None: ...

    def all_gather(self, buf: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Spec:
    """One sweep, as every rank sees it."""

    collective: Collective
    dtype_name: str
    op_name: str
    iters: int
    warmup: int
    check: bool
    max_time: float  # seconds per size that the timed loop aims to stay under; 0: no cap
    cold: bool = False  # rotate through buffers that together exceed the last-level cache

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Spec:
        """The sweep that options.parse_args describes."""
        return cls(COLLECTIVES[args.collective], args.dtype, args.op, args.iters, args.warmup, args.check,
                   args.max_time, args.cold)

    @property
    def op(self) -> ReduceKind:
        return OPS[self.op_name]

    @property
    def redop(self) -> str:
        """The redop column: the op of a reducing collective, else 'none'."""
        return self.op_name if self.collective.reduces else "none"

    def json_context(self, world: int, transport: str) -> dict[str, Any]:
        """What --json adds to every row: the job's and the sweep's context."""
        coll = self.collective
        dtype = self.dtype_name if coll.payload is Payload.ARRAY else None
        return dict(world_size=world, collective=coll.name, transport=transport, dtype=dtype, warmup=self.warmup,
                    in_place=coll.in_place, cold=self.cold)


def choose_iters(iters: int, per_call_s: float | None, max_time: float) -> int:
    """The requested count, cut so the timed loop takes about max_time (never below 3 or above iters)."""
    if not max_time or per_call_s is None or per_call_s <= 0 or per_call_s * iters <= max_time:
        return iters
    return min(iters, max(MIN_CAPPED_ITERS, int(max_time / per_call_s)))


def measure(group: Group, spec: Spec, dtype: np.dtype, size: int, library: str = SHMCOLL) -> Row:
    """Warm up, agree on an iteration count, barrier, time the loop, optionally check; one Row."""
    coll, n = spec.collective, group.world_size
    if coll.payload is Payload.BYTES:
        dtype = np.dtype(np.uint8)  # a payload of `size` bytes, built from a byte buffer
    elems, count, nbytes = coll.layout(size, n, dtype.itemsize, group.rank)
    bufs = [] if coll.sizing is Sizing.NOTHING else \
        rotating(dtype, elems, plan(elems * dtype.itemsize, spec.cold, llc()[0]))
    call = cycle_calls(coll.calls(library, group, bufs, spec.op))  # on buffers of ones: stable under every op
    iters = warm_up(group, spec, call)
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    mean = (time.perf_counter() - t0) / iters
    wrong = 0
    if spec.check:
        wrong = check_once(group, spec, bufs[-1] if spec.cold and bufs else np.empty(elems, dtype), count, library)
    stats = group.all_gather(np.array([mean, wrong], np.float64)).reshape(n, 2)
    return make_row(spec, n, count, nbytes, float(stats[:, 0].max()),
                    int(stats[:, 1].sum()) if spec.check else None, iters, max(1, len(bufs)))


def warm_up(group: Group, spec: Spec, call: Call) -> int:
    """spec.warmup untimed calls, then the iteration count every rank agrees on: the fastest warmup
    call (later calls no longer pay compile or first-touch costs) of the slowest rank decides."""
    fastest = None
    for _ in range(spec.warmup):
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        fastest = took if fastest is None else min(fastest, took)
    if not spec.max_time or fastest is None:
        return spec.iters
    slowest = float(group.all_gather(np.array([fastest], np.float64)).max())
    return choose_iters(spec.iters, slowest, spec.max_time)


def check_once(group: Group, spec: Spec, buf: np.ndarray, count: int, library: str = SHMCOLL) -> int:
    """One more call on known inputs written into `buf` (this rank's input, layout()'s element count);
    this rank's wrong elements. `count` is layout()'s reported count."""
    coll, op, rank, n = spec.collective, spec.op, group.rank, group.world_size
    coll.fill_check_input(buf, rank, n, op)
    result = coll.calls(library, group, [buf], op)[0]()
    return coll.wrong_elements(result, buf, rank, n, op, count)


def make_row(spec: Spec, n: int, count: int, nbytes: int, seconds: float, wrong: int | None, iters: int,
             buffers: int = 1) -> Row:
    """The table row of one size from the slowest rank's time per call: nccl-tests' algbw and busbw."""
    factor = spec.collective.bus_factor(n)
    algbw = busbw = None
    if factor is not None:
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        busbw = algbw * factor
    return Row(size=nbytes, count=count, type=spec.collective.payload.type_column(spec.dtype_name),
               redop=spec.redop, time_us=seconds * 1e6, algbw=algbw, busbw=busbw, wrong=wrong, iters=iters,
               buffers=buffers)
