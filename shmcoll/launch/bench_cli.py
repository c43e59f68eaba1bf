"""`shmcoll-bench`: an nccl-tests style sweep over message sizes for one collective.

Started outside a job with `-n N`, it re-runs itself as N local ranks through `launch_local` and
returns the job's status; the ranks see SHMCOLL_RANK (or any launcher's rank variable) and join with
`shmcoll.init()` instead of spawning again, which is also how it runs under `shmcoll-run` or mpirun.
Rank 0 prints the table (and writes --json); every rank measures (bench_core.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shmcoll.config import RANK_VARS, TRANSPORTS, load_config
from shmcoll.errors import InvalidArgument

from .argtypes import int_in, number_above
from .bench_core import (COLLECTIVES, DTYPE_NAMES, IN_PLACE, OPS, Row, Spec, UsageError,
                         measure, parse_size, resolve_dtype, sweep, transport_name)

PROG = "shmcoll-bench"
EXIT_WRONG = 1    # --check found wrong elements (or a collective failed)
EXIT_USAGE = 2
# (header, width): the data columns of nccl-tests, one mode (in-place or not, see the header line)
COLUMNS = (("size(B)", 12), ("count", 12), ("type", 9), ("redop", 6), ("time(us)", 11),
           ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7))


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time one collective over a sweep of message sizes and print nccl-tests style rows:\n"
                    "size(B) count type redop time(us) algbw(GB/s) busbw(GB/s) #wrong",
        epilog="Sizes are bytes with optional binary suffixes (8, 1K, 64K, 1M, 64M). For all_gather a size is\n"
               "the total output: each rank sends size/N/itemsize elements (rounded down, at least 1); for\n"
               "all_reduce and broadcast count = size/itemsize (at least 1). The size column shows the bytes\n"
               "really moved. barrier ignores -b/-e/-f and prints one row with size 0.\n"
               "time(us) is each rank's mean over the timed iterations, maximum over ranks. algbw = size/time;\n"
               "busbw = algbw * 2(N-1)/N (all_reduce), (N-1)/N (all_gather), 1 (broadcast).\n"
               "Iteration cap: when the fastest warmup call (slowest rank) says --iters calls would take more\n"
               "than --max-time seconds, fewer are timed (about --max-time worth, but at least 3); the JSON rows\n"
               "record the iterations really timed. With --warmup 0 there is no cap.\n"
               "Without -n, run it under a launcher: shmcoll-run -n N shmcoll-bench ... (or mpirun).\n"
               "Exit status: 0; 1 when --check finds wrong elements or a collective fails; 2 usage errors.")
    p.add_argument("-n", "--np", dest="n", type=int_in(1), default=None, metavar="N",
                   help="start N ranks on this host (not needed inside a job started by a launcher)")
    p.add_argument("--collective", "-c", choices=COLLECTIVES, default="all_reduce", metavar="NAME",
                   help=f"{', '.join(COLLECTIVES)} (default all_reduce; broadcast from rank 0)")
    p.add_argument("-b", "--minbytes", dest="min_bytes", type=_size, default=8, metavar="MIN",
                   help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", dest="max_bytes", type=_size, default=64 << 20, metavar="MAX",
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", dest="factor", type=number_above(1.0, False), default=2.0,
                   metavar="FACTOR", help="multiply the size by this after each step, > 1 (default 2)")
    p.add_argument("--dtype", "-d", choices=tuple(DTYPE_NAMES), default="f32",
                   help="element type (default f32; bf16 needs ml_dtypes)")
    p.add_argument("--op", "-o", choices=tuple(OPS), default="sum",
                   help="reduction for all_reduce (default sum; ignored by the others)")
    p.add_argument("--iters", type=int_in(1), default=20, metavar="K",
                   help="timed iterations per size (default 20; see the iteration cap below)")
    p.add_argument("--warmup", type=int_in(0), default=5, metavar="K",
                   help="untimed iterations per size before timing (default 5)")
    p.add_argument("--max-time", dest="max_time", type=number_above(0.0, True), default=2.0,
                   metavar="SECONDS", help="aim for at most this long per size in the timed loop; "
                   "0 disables the cap (default 2)")
    p.add_argument("--check", action="store_true",
                   help="after timing, one call on known inputs compared with an exact float64 reference; "
                        "#wrong is the sum over ranks (else N/A)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                   help="rank 0 also writes the rows as a JSON list here")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="transport passed to shmcoll.init (default: SHMCOLL_TRANSPORT, else auto: "
                        "shared memory on one host)")
    p.add_argument("--hosts", type=int_in(1), default=None, metavar="H",
                   help="simulate H hosts on this machine: ranks are split into H equal runs, each with "
                        "its own SHMCOLL_HOST_ID (to try the hierarchy: shared memory inside, TCP between)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options checked as a whole; raises SystemExit like argparse (2 on a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.sizes = [0] if args.collective == "barrier" else sweep(args.min_bytes, args.max_bytes, args.factor)
        args.np_dtype = resolve_dtype(args.dtype)
    except UsageError as e:
        parser.error(str(e))
    if args.json_path is not None:
        parent = Path(args.json_path).resolve().parent
        if not parent.is_dir():
            parser.error(f"--json: directory {str(parent)!r} does not exist")
    return args


def in_job(environ=None) -> bool:
    """True when a launcher (shmcoll-run, mpirun, srun, torchrun ...) gave this process a rank."""
    env = os.environ if environ is None else environ
    return any((env.get(name) or "").strip() for name in RANK_VARS)


# ---- rank 0's output ----

def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_header(args, world: int, transport: str) -> list[str]:
    coll = args.collective
    dtype = "-" if coll == "barrier" else f"{args.dtype} ({DTYPE_NAMES[args.dtype]})"
    op = args.op if coll == "all_reduce" else "none"
    labels = "".join(label.rjust(width) for label, width in COLUMNS)
    return [
        f"# {PROG}: collective {coll}, world size {world}, transport {transport}, dtype {dtype}, op {op}, "
        f"in-place {IN_PLACE[coll]}",
        f"# iters {args.iters}, warmup {args.warmup}, max-time {args.max_time:g} s, check {'on' if args.check else 'off'}",
        "#",
        "#" + labels[1:],
    ]


def format_row(row: Row) -> str:
    cells = (str(row.size), str(row.count), row.type, row.redop, f"{row.time_us:.2f}",
             _cell(row.algbw, ".2f"), _cell(row.busbw, ".2f"), "N/A" if row.wrong is None else str(row.wrong))
    return "".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS))


def format_footer(rows: list[Row], check: bool) -> list[str]:
    lines = []
    if check:
        wrong = sum(r.wrong or 0 for r in rows)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    bus = [r.busbw for r in rows if r.busbw is not None]
    if bus:
        lines.append(f"# Avg bus bandwidth    : {sum(bus) / len(bus):.4f} GB/s")
    return lines


class Progress:
    """A transient line on stderr per size, only on a terminal; erased before the row is printed."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def show(self, k: int, total: int, size: int, coll: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{PROG}: {coll} {size} B ({k}/{total}) ...\x1b[K")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


# ---- running ----

def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def run_rank(args) -> int:
    """One rank of the job: join, sweep, print (rank 0), and agree on the exit status."""
    import shmcoll

    try:
        cfg = load_config()
    except InvalidArgument as e:
        _say(f"cannot join the job: {e}")
        return EXIT_USAGE
    rank = cfg.rank
    if args.n is not None and args.n != cfg.world_size:
        if rank == 0:
            _say(f"-n {args.n} does not match this job's world size {cfg.world_size} "
                 "(leave -n out when a launcher starts the ranks)")
        return EXIT_USAGE
    if args.hosts is not None:
        os.environ["SHMCOLL_HOST_ID"] = f"simulated-host-{rank * args.hosts // cfg.world_size}"
    spec = Spec(args.collective, args.dtype, args.op, args.iters, args.warmup, args.check, args.max_time)
    rows: list[Row] = []
    try:
        with shmcoll.init(transport=args.transport) as pg:
            lead = pg.rank == 0
            transport = transport_name(pg)
            if lead:
                print("\n".join(format_header(args, pg.world_size, transport)), flush=True)
            progress = Progress(lead and sys.stderr.isatty())
            for k, size in enumerate(args.sizes, 1):
                progress.show(k, len(args.sizes), size, args.collective)
                row = measure(pg, spec, args.np_dtype, size)
                progress.clear()
                rows.append(row)
                if lead:
                    print(format_row(row), flush=True)
            if lead:
                print("\n".join(["#", *format_footer(rows, args.check)]), flush=True)
                if args.json_path is not None:
                    _write_json(args, rows, pg.world_size, transport)
    except shmcoll.CollectiveError as e:
        _say(f"rank {rank}: {e}")
        return EXIT_WRONG
    except (OSError, MemoryError) as e:  # e.g. --json unwritable, or a size too large for memory
        _say(f"rank {rank}: {type(e).__name__}: {e}")
        return EXIT_WRONG
    except KeyboardInterrupt:
        return 130
    wrong = sum(r.wrong or 0 for r in rows)
    return EXIT_WRONG if wrong else 0


def _write_json(args, rows: list[Row], world: int, transport: str) -> None:
    dtype = None if args.collective == "barrier" else args.dtype
    context = dict(world_size=world, collective=args.collective, transport=transport, dtype=dtype,
                   warmup=args.warmup, in_place=IN_PLACE[args.collective])
    tmp = Path(args.json_path + ".tmp")
    tmp.write_text(json.dumps([r.to_json(**context) for r in rows], indent=1) + "\n")
    tmp.replace(args.json_path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # usage error or --help: report the status instead of exiting
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if in_job():
        return run_rank(args)
    if args.n is None:
        _say("not inside a job: give -n N to start N local ranks, or start it with shmcoll-run / mpirun")
        return EXIT_USAGE
    from .local import launch_local

    return launch_local(args.n, [sys.executable, "-m", "shmcoll.launch.bench_cli", *argv])


if __name__ == "__main__":
    sys.exit(main())
