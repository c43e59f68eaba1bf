"""The command line of `shmcoll-bench`: its options, their checks and the --help text.

Apart from cli.py so that a peer's rank (peers.py) parses the very same options, plus its own,
without importing the command that starts it. The collective choices, which of them take --op and
which are rooted come from the descriptors (collectives.py); the epilog documents the semantics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shmcoll.config import TRANSPORTS
from shmcoll.launch.argtypes import int_in, number_above

from .adapters import PEERS
from .collectives import COLLECTIVES
from .descriptor import Sizing
from .inputs import DTYPE_NAMES, OPS, UsageError, parse_size, resolve_dtype, sweep

PROG = "shmcoll-bench"
EPILOG = """\
Sizes are bytes with optional binary suffixes (8, 1K, 64K, 1M, 64M). For all_gather and gather a
size is the total output: each rank sends size/N/itemsize elements (rounded down, at least 1);
for reduce_scatter and all_to_all it is each rank's input (N blocks of size/N/itemsize elements),
for scatter the root's input (N such blocks); for all_reduce, reduce and broadcast
count = size/itemsize (at least 1). The size column shows the bytes really moved. barrier
ignores -b/-e/-f and prints one row with size 0. Rooted collectives (broadcast, reduce, gather,
scatter, broadcast_object) use root 0; reduce's --check looks at the root's result only.
all_gather_v: a size is the total output, as for all_gather, but rank r sends 1 element plus a
share of the rest weighted r+1 (uneven lengths); --check compares the contents and the lengths.
broadcast_object / all_gather_object move a pickled bytes object (--dtype is ignored, type
'bytes'): the root's payload / all ranks' payloads together (size/N bytes each).
time(us) is each rank's mean over the timed iterations, maximum over ranks. algbw = size/time;
busbw = algbw * 2(N-1)/N (all_reduce), (N-1)/N (all_gather, reduce_scatter, all_to_all),
1 (broadcast, reduce), as in nccl-tests' PERFORMANCE.md; gather and scatter are not defined there,
shmcoll-bench uses (N-1)/N for them (the root's own block does not travel), and for
all_gather_v and all_gather_object (as all_gather); broadcast_object: 1 (as broadcast).
gloo has no all_gather_v: its row pads every rank to the longest length and all_gathers.
Iteration cap: when the fastest warmup call (slowest rank) says --iters calls would take more
than --max-time seconds, fewer are timed (about --max-time worth, but at least 3); the JSON rows
record the iterations really timed. With --warmup 0 there is no cap.
Without -n, run it under a launcher: shmcoll-run -n N shmcoll-bench ... (or mpirun).
--compare (only with -n): after shmcoll's job, the same sweep, timing and check run through
OpenMPI (mpi4py, under mpirun) and torch gloo, each as its own N-rank job, one after the other;
a peer that is not installed or cannot run this collective/dtype/op is reported as skipped.
--plot without matplotlib: the sweep runs and prints as usual, one line says why no plot.
Exit status: 0; 1 when --check finds wrong elements (shmcoll's or a peer's), a collective
fails or a peer fails (not when it is skipped); 2 usage errors."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _listed(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def build_parser() -> argparse.ArgumentParser:
    rooted = _listed([c.name for c in COLLECTIVES.values() if c.rooted])
    reducing = _listed([c.name for c in COLLECTIVES.values() if c.reduces])
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time one collective over a sweep of message sizes and print nccl-tests style rows:\n"
                    "size(B) count type redop time(us) algbw(GB/s) busbw(GB/s) #wrong",
        epilog=EPILOG)
    p.add_argument("-n", "--np", dest="n", type=int_in(1), default=None, metavar="N",
                   help="start N ranks on this host (not needed inside a job started by a launcher)")
    p.add_argument("--collective", "-c", choices=tuple(COLLECTIVES), default="all_reduce", metavar="NAME",
                   help=f"{', '.join(COLLECTIVES)} (default all_reduce; {rooted} are rooted at rank 0)")
    p.add_argument("-b", "--minbytes", dest="min_bytes", type=_size, default=8, metavar="MIN",
                   help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", dest="max_bytes", type=_size, default=64 << 20, metavar="MAX",
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", dest="factor", type=number_above(1.0, False), default=2.0,
                   metavar="FACTOR", help="multiply the size by this after each step, > 1 (default 2)")
    p.add_argument("--dtype", "-d", choices=tuple(DTYPE_NAMES), default="f32",
                   help="element type (default f32; bf16 needs ml_dtypes)")
    p.add_argument("--op", "-o", choices=tuple(OPS), default="sum",
                   help=f"reduction for {reducing} (default sum; ignored by the others)")
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
                   help="also write the rows here as a JSON list (with --compare: {\"rows\": [...], \"peers\": {...}}, "
                        "every row with its \"peer\")")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="transport passed to shmcoll.init (default: SHMCOLL_TRANSPORT, else auto: "
                        "shared memory on one host)")
    p.add_argument("--hosts", type=int_in(1), default=None, metavar="H",
                   help="simulate H hosts on this machine: ranks are split into H equal runs, each with "
                        "its own SHMCOLL_HOST_ID (to try the hierarchy: shared memory inside, TCP between)")
    p.add_argument("--cold", action="store_true",
                   help="rotate each timed call through distinct buffers that together exceed the last-level "
                        "cache (from sysfs, else 32 MiB), so results are not flattered by a warm cache")
    p.add_argument("--compare", action="store_true",
                   help=f"after shmcoll's sweep, run the same sweep through {' and '.join(PEERS)} (when "
                        "installed) and print their rows and shmcoll's time / theirs; needs -n")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw busbw against size (log-log), one line per library; needs matplotlib")
    p.add_argument("--peer-timeout", dest="peer_timeout", type=number_above(0.0, False), default=600.0,
                   metavar="SECONDS", help="--compare: stop a peer's job after this long (default 600)")
    p.add_argument("--mpirun", default="mpirun", metavar="CMD", help="--compare: the mpirun to use (default: PATH's)")
    p.add_argument("--mpirun-args", dest="mpirun_args", default="", metavar="ARGS",
                   help="--compare: extra mpirun options, e.g. '--bind-to none' (default none)")
    p.add_argument("--rows-to", dest="rows_to", default=None, help=argparse.SUPPRESS)  # rank 0 -> spawner
    return p


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Options checked as a whole; raises SystemExit like argparse (2 on a usage error). Adds `sizes`
    (the sweep's sizes in bytes, [0] for a collective without data) and `np_dtype`."""
    parser = build_parser() if parser is None else parser
    args = parser.parse_args(argv)
    no_data = COLLECTIVES[args.collective].sizing is Sizing.NOTHING
    try:
        args.sizes = [0] if no_data else sweep(args.min_bytes, args.max_bytes, args.factor)
        args.np_dtype = resolve_dtype(args.dtype)
    except UsageError as e:
        parser.error(str(e))
    if args.plot is not None and no_data:
        parser.error(f"--plot draws bus bandwidth against size; a {args.collective} has neither")
    for flag, path in (("--json", args.json_path), ("--plot", args.plot)):
        parent = Path(path).resolve().parent if path is not None else None
        if parent is not None and not parent.is_dir():
            parser.error(f"{flag}: directory {str(parent)!r} does not exist")
    return args
