"""Where a small all_reduce's time goes: the whole call, the compiled board step alone, and each
Python piece of the lean path (shmcoll/lean.py) timed alone.

    shmcoll-run -n 2 python bench/call_breakdown.py [--count 2] [--calls 20000]

Both ranks time loops of whole `pg.all_reduce` calls, then loops of `kernels.board_all_reduce`
alone with the same arguments the lean path passes (best of 3 each); then rank 0 times each piece
of the lean path on its own with timeit while rank 1 waits. It reaches into the group's internals
on purpose: it measures them. Needs every rank on this host (the board).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
import timeit
from collections.abc import Callable

import numpy as np

import shmcoll
from shmcoll import ReduceKind, kernels
from shmcoll.recorder import FlightRecorder
from shmcoll.transport.shm_board import DONE_SLEEPERS, WAIT_SLICE_NS


def best_loop(pg, call: Callable[[], object], calls: int) -> float:
    """Microseconds per call, best of 3 loops started together on every rank."""
    best = float("inf")
    for _ in range(3):
        pg.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def alone(call: Callable[[], object], number: int = 200_000) -> float:
    return min(timeit.repeat(call, number=number, repeat=3)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2, help="float32 elements (default 2: 8 bytes)")
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args(argv)
    pg = shmcoll.init()
    data, op = np.ones(args.count, np.float32), ReduceKind.SUM
    for _ in range(500):
        pg.all_reduce(data, op)
    lean = pg._lean
    if lean is None or lean._alone:
        print("call_breakdown: needs at least 2 ranks, all on this host", file=sys.stderr)
        return 2
    p = lean._prepared[data.dtype, data.size, op]
    assert p is not None
    runner, seq = pg._runner, pg._runner._seq
    whole = best_loop(pg, lambda: pg.all_reduce(data, op), args.calls)
    step = best_loop(pg, lambda: kernels.board_all_reduce(lean._mem, data, p.header, lean._where, pg.rank, next(seq),
                                                          p.code, p.op, 0, lean._spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS),
                     args.calls)
    if pg.rank == 0:
        count, worker, recorder = itertools.count(), runner._worker, FlightRecorder()
        rows = [
            ("pg.all_reduce, whole call", whole),
            ("kernels.board_all_reduce alone, on every rank", step),
            ("type checks and data.flags", alone(lambda: type(data) is np.ndarray and type(op) is ReduceKind
                                                 and data.flags.c_contiguous and data.flags.writeable)),
            ("key tuple and dict lookup", alone(lambda: lean._prepared.get((data.dtype, data.size, op)))),
            ("lean_seq's checks and next(count)", alone(lambda: (runner._broken is not None or runner._closed
                                                                 or runner.tuning.debug or not worker.idle(),
                                                                 next(count)))),
            ("time.monotonic() twice", alone(lambda: (time.monotonic(), time.monotonic()))),
            ("flight recorder append", alone(lambda: recorder.completed(p.meta, 1e-6, 5))),
            ("a 2-argument call into shmcoll._native", alone(lambda: kernels.load_word(lean._mem, 0))),
        ]
        print(f"call_breakdown: {pg.world_size} ranks, all_reduce of {data.nbytes} bytes, us per call")
        for name, us in rows:
            print(f"  {name:50s} {us:7.2f}")
    pg.barrier()
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
