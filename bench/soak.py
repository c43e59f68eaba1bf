"""Soak: thousands of random collectives, every result checked against a float64 reference.

    shmcoll-run -n 3 python bench/soak.py --minutes 10 [--transport shm|tcp|hier] [--hosts H] [--seed 1]

Every rank draws the same sequence of calls from a shared seed (op, dtype, size from 0 to
--max-bytes, root, spawned or blocking; up to three spawned all-reduces stay in flight while later
blocking calls queue behind them), builds its input from (seed, call, rank), so each rank can
compute the exact expected result locally. Inputs are small integers, so sums and products are
exact in every dtype and any reduction order. Rank 0 prints counts, errors and each rank's resident
memory after the first 500 calls and at the end (it must not grow), and its peak. Exit status 1 on
any wrong result.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable

import numpy as np

import shmcoll
from shmcoll import ReduceKind
from shmcoll.config import load_config
from shmcoll.types import BFLOAT16

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64] + ([BFLOAT16] if BFLOAT16 is not None else [])
INT_OPS = [ReduceKind.SUM, ReduceKind.PROD, ReduceKind.MIN, ReduceKind.MAX]
#: Calls after which each rank samples its resident memory: doubling steps tell growth from a plateau.
SAMPLE_AT = [500 * 2 ** k for k in range(8)]
KINDS = ["all_reduce", "spawn_all_reduce", "broadcast", "all_gather", "barrier"]


def inputs(seed: int, call: int, rank: int, count: int, dtype, op) -> np.ndarray:
    high = 2 if op is ReduceKind.PROD else 8
    rng = np.random.default_rng((seed, call, rank))
    return rng.integers(-high, high + 1, size=count).astype(np.float64).astype(dtype)


def expected_reduce(seed, call, n, count, dtype, op) -> np.ndarray:
    xs = [inputs(seed, call, r, count, dtype, op).astype(np.float64) for r in range(n)]
    folds: dict[ReduceKind, Callable[..., np.ndarray]] = {
        ReduceKind.SUM: np.sum, ReduceKind.AVG: np.sum, ReduceKind.PROD: np.prod, ReduceKind.MIN: np.min,
        ReduceKind.MAX: np.max}
    fold = folds[op](np.stack(xs), axis=0) if count else np.zeros(0)
    if op is ReduceKind.AVG:
        fold = fold / n
    return fold.astype(dtype)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def draw(rng, max_bytes: int, n: int):
    kind = KINDS[rng.integers(len(KINDS))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    is_float = np.dtype(dtype).kind == "f" or dtype is BFLOAT16
    ops = list(ReduceKind) if is_float else INT_OPS
    op = ops[rng.integers(len(ops))]
    size = int(rng.choice([0, 1, 7, int(rng.integers(1, 4096)), int(rng.integers(1, max_bytes + 1))]))
    return kind, dtype, op, max(0, size // np.dtype(dtype).itemsize), int(rng.integers(n))


def wrong_elements(got: np.ndarray, want: np.ndarray) -> int:
    """Elements that differ bit for bit (so -0.0 and NaN payloads count too)."""
    return int(np.count_nonzero(got.view(np.uint8).reshape(-1) != want.view(np.uint8).reshape(-1)))


class Spawned:
    """spawn_all_reduce calls still in flight: joined a few calls later, after blocking ones."""

    def __init__(self):
        self.pending = []  # (handle, data, expected)

    def start(self, pg, seed, call, dtype, op, count) -> None:
        data = inputs(seed, call, pg.rank, count, dtype, op)
        want = expected_reduce(seed, call, pg.world_size, count, dtype, op)
        self.pending.append((pg.spawn_all_reduce(data, op), data, want))

    def join(self, keep: int = 0) -> int:
        """Join all but the newest `keep`; the number of wrong elements among them."""
        wrong = 0
        while len(self.pending) > keep:
            handle, data, want = self.pending.pop(0)
            handle.join(timeout=600)
            wrong += wrong_elements(data, want)
        return wrong


def one_call(pg, seed, call, kind, dtype, op, count, root) -> int:
    """Run one collective; the number of wrong elements on this rank."""
    n, r = pg.world_size, pg.rank
    if kind == "barrier":
        pg.barrier()
        return 0
    if kind == "all_reduce":
        data = inputs(seed, call, r, count, dtype, op)
        pg.all_reduce(data, op)
        return wrong_elements(data, expected_reduce(seed, call, n, count, dtype, op))
    if kind == "broadcast":
        data = inputs(seed, call, root, count, dtype, op) if r == root else np.zeros(count, dtype)
        pg.broadcast(root, data)
        return int(np.count_nonzero(data != inputs(seed, call, root, count, dtype, op)))
    out = pg.all_gather(inputs(seed, call, r, count, dtype, op))
    want = np.concatenate([inputs(seed, call, s, count, dtype, op) for s in range(n)])
    return int(np.count_nonzero(out != want))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--max-bytes", type=int, default=4 << 20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--transport", default=None)
    p.add_argument("--hosts", type=int, default=None,
                   help="simulate this many hosts (ranks split in equal runs, each its own SHMCOLL_HOST_ID)")
    args = p.parse_args(argv)
    if args.hosts:
        cfg = load_config()
        os.environ["SHMCOLL_HOST_ID"] = f"simulated-host-{cfg.rank * args.hosts // cfg.world_size}"
    with shmcoll.init(transport=args.transport) as pg:
        rng = np.random.default_rng(args.seed)
        rss_warm = 0
        trend = np.zeros(len(SAMPLE_AT), np.int64)
        counts, wrong, call = {k: 0 for k in KINDS}, 0, 0
        end = time.monotonic() + 60 * args.minutes
        go = np.ones(1, np.int32)
        spawned = Spawned()
        while go[0]:
            kind, dtype, op, count, root = draw(rng, args.max_bytes, pg.world_size)
            if kind == "spawn_all_reduce":
                spawned.start(pg, args.seed, call, dtype, op, count)
            else:
                wrong += one_call(pg, args.seed, call, kind, dtype, op, count, root)
            wrong += spawned.join(keep=int(rng.integers(4)))  # up to 3 stay in flight across later calls
            counts[kind] += 1
            call += 1
            if call == 500:
                rss_warm = resident_bytes()
            if call in SAMPLE_AT:
                trend[SAMPLE_AT.index(call)] = resident_bytes()
            if call % 50 == 0:  # everyone stops at the same call: rank 0's clock decides
                go[0] = int(time.monotonic() < end) if pg.rank == 0 else 0
                pg.broadcast(0, go)
        wrong += spawned.join()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
        final = resident_bytes()
        report = np.array([wrong, rss_warm or final, final, peak, *trend], np.int64)  # (under 500 calls: no baseline)
        every = pg.all_gather(report).reshape(pg.world_size, -1)
        if pg.rank == 0:
            print(f"soak: {pg.transport.name} transport, {pg.world_size} ranks, {args.minutes:g} min, "
                  f"seed {args.seed}: {call} collectives {counts}")
            for rank, (bad, warm, final, top, *samples) in enumerate(every):
                print(f"  rank {rank}: wrong elements {bad}; resident {warm / 2**20:.0f} MiB after 500 calls, "
                      f"{final / 2**20:.0f} MiB at the end; peak {top / 2**20:.0f} MiB; resident MiB after N calls: "
                      + ", ".join(f"{at}: {mib / 2**20:.0f}" for at, mib in zip(SAMPLE_AT, samples) if mib))
        return 1 if every[:, 0].sum() else 0


if __name__ == "__main__":
    sys.exit(main())
