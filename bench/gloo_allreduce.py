"""torch.distributed's gloo all-reduce (float32 SUM, in place), timed like shmcoll-bench (peer_timing.py).

Each call is `dist.all_reduce(t)` on a contiguous float32 CPU tensor (in place, synchronous).

    python bench/gloo_allreduce.py -n 2 --sizes 8,1K,64K --json /tmp/gloo.json

Without --rank it is the launcher: it picks a free localhost port, starts N copies of itself with
--rank 0..N-1 (OMP_NUM_THREADS=1 unless set, as torchrun does), and fails fast when one fails.
Each rank joins with init_method tcp://127.0.0.1:PORT. Rank 0 prints a line per size and writes
--json. Exit status 3 (one line on stderr) when torch or its gloo backend is missing.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works uninstalled too

from peer_timing import add_policy_args, run_sizes  # noqa: E402

EXIT_MISSING = 3
POLL_S = 0.05


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv: list[str]) -> int:
    """Start the N ranks; the first failing rank's status stops the others and is returned."""
    port = free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(r), "--port", str(port)], env=env)
             for r in range(args.n)]
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                return bad[0]
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"gloo_allreduce: timed out after {args.timeout:g} s", file=sys.stderr)
                return 124
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_rank(args) -> int:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"gloo_allreduce: torch is not importable ({e}); pip install torch", file=sys.stderr)
        return EXIT_MISSING
    if not (dist.is_available() and dist.is_gloo_available()):
        print(f"gloo_allreduce: torch {torch.__version__} was built without the gloo backend", file=sys.stderr)
        return EXIT_MISSING
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.n, timeout=timedelta(seconds=args.timeout))
    try:
        def make_call(elems: int):
            t = torch.ones(elems, dtype=torch.float32)
            return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM)

        def max_over_ranks(value: float) -> float:
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        run_sizes(args, make_call, max_over_ranks, dist.barrier, args.n, args.rank, "gloo",
                  f"torch {torch.__version__} gloo")
    finally:
        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description="torch.distributed gloo in-place float32 SUM all_reduce timings")
    p.add_argument("-n", type=int, default=2, help="world size (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (default 300)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    add_policy_args(p)
    args = p.parse_args(argv)
    if args.rank is None:
        return launch(args, argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main())
