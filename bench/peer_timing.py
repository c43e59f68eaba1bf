"""The timed loop of the peer scripts (mpi_allreduce.py, gloo_allreduce.py): shmcoll-bench's policy.

The policy is bench_core.measure's, step for step, so a ratio compares libraries and not loops:
a buffer of float32 ones (count = size / 4, at least 1) reduced in place with SUM; `warmup`
untimed calls; the fastest warmup call, slowest rank, decides the timed count through
bench_core.choose_iters (at most `iters`, about `max_time` seconds, at least 3); a barrier; the
timed loop; time per call = this rank's mean, reported as the maximum over ranks.

Each peer supplies three callables: make_call(elems) -> a zero-argument in-place all-reduce on a
fresh buffer, max_over_ranks(float) -> float, and barrier().
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shmcoll.launch.bench_core import UsageError, bus_factor, choose_iters, layout, parse_size

ITEMSIZE = 4  # float32


def size_list(text: str) -> list[int]:
    """'8,1K,64K' -> [8, 1024, 65536] (argparse type)."""
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """--sizes, --iters, --warmup, --max-time and --json, with shmcoll-bench's meanings."""
    p.add_argument("--sizes", type=size_list, required=True, metavar="LIST",
                   help="comma-separated sizes in bytes, suffixes K/M/G allowed (e.g. 8,1K,64K)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size at most (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per size first (default 5)")
    p.add_argument("--max-time", dest="max_time", type=float, default=2.0,
                   help="aim for at most this many seconds of timed calls per size; 0: no cap (default 2)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="rank 0 writes {library, rows} here")


def measure(make_call, max_over_ranks, barrier, world: int, size: int, iters: int, warmup: int,
            max_time: float) -> dict:
    """One size, timed as bench_core.measure times it; a row with shmcoll-bench's JSON keys."""
    elems, count, nbytes = layout("all_reduce", size, world, ITEMSIZE)
    call = make_call(elems)
    fastest = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        fastest = took if fastest is None else min(fastest, took)
    n_iters = iters
    if max_time and fastest is not None:
        n_iters = choose_iters(iters, max_over_ranks(fastest), max_time)
    barrier()
    t0 = time.perf_counter()
    for _ in range(n_iters):
        call()
    mean = (time.perf_counter() - t0) / n_iters
    seconds = max_over_ranks(mean)
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return dict(size=nbytes, count=count, type="float", redop="sum", time_us=seconds * 1e6,
                algbw=algbw, busbw=algbw * bus_factor("all_reduce", world), wrong=None, iters=n_iters,
                world_size=world, collective="all_reduce", dtype="f32", warmup=warmup, in_place="yes")


def run_sizes(args, make_call, max_over_ranks, barrier, world: int, rank: int, transport: str,
              library: str) -> list[dict]:
    """Every size of --sizes; rank 0 prints a line per size (stdout) and writes --json at the end."""
    rows = []
    for size in args.sizes:
        row = measure(make_call, max_over_ranks, barrier, world, size, args.iters, args.warmup, args.max_time)
        row["transport"] = transport
        rows.append(row)
        if rank == 0:
            print(f"{row['size']:>12} {row['time_us']:>12.2f} us {row['busbw']:>10.3f} GB/s busbw "
                  f"({row['iters']} iters)", flush=True)
    if rank == 0 and args.json_path:
        tmp = Path(args.json_path + ".tmp")
        tmp.write_text(json.dumps({"library": library, "rows": rows}, indent=1) + "\n")
        tmp.replace(args.json_path)
    return rows
