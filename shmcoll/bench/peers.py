"""One rank of a peer library's job for `shmcoll-bench --compare`: OpenMPI (mpi4py) or torch gloo.

    mpirun --allow-run-as-root --oversubscribe -n 2 python -m shmcoll.bench.peers openmpi ARGS
    shmcoll-run -n 2 python -m shmcoll.bench.peers gloo ARGS

ARGS are shmcoll-bench's sweep options (--collective, --dtype, --op, --iters, --warmup, --max-time,
--check, --cold, -b/-e/-f) plus --size-list (exact sizes) and --rows-to PATH, where rank 0 writes
{"library": ..., "rows": [...]}. A missing library prints one MISSING line on stderr and exits 3.

The rank joins through its library's adapter (adapters.py) and measures every size with
measure.measure, the very loop, warmup, iteration cap and check that time shmcoll; the collective's
descriptor builds the library's calls. Which (collective, dtype, op) a peer cannot run is decided
before launching (the descriptor's unsupported()). torch.distributed has no all_gather_v: gloo's
row pads to the longest length (collectives.AllGatherV).
"""

from __future__ import annotations

import argparse
import sys

from .adapters import OPENMPI, PEERS, open_group
from .measure import Spec, measure
from .options import build_parser, parse_args
from .results import write_json

MISSING = "shmcoll-bench peer missing:"  # the line a rank prints when its library is not importable
EXIT_MISSING = 3
EXIT_USAGE = 2


def _size_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_peer_args(argv: list[str]) -> argparse.Namespace:
    """shmcoll-bench's own options and checks, plus the peer's name, --size-list and --timeout."""
    p = build_parser()
    p.prog = "python -m shmcoll.bench.peers"
    p.add_argument("peer", choices=PEERS)
    p.add_argument("--size-list", dest="size_list", type=_size_list, default=None, metavar="B1,B2,...",
                   help="exactly these sizes in bytes instead of the -b/-e/-f sweep")
    p.add_argument("--timeout", type=float, default=300.0, help="gloo's own collective timeout (seconds)")
    args = parse_args(argv, p)
    if args.size_list is not None:
        args.sizes = args.size_list
    return args


def run(args: argparse.Namespace) -> int:
    """Join the peer's job, measure every size with measure.measure, rank 0 writes the rows."""
    try:
        group = open_group(args.peer, args.timeout)
    except ImportError as e:
        module = e.name or ("mpi4py" if args.peer == OPENMPI else "torch")
        print(f"{MISSING} {module} is not importable ({e})", file=sys.stderr, flush=True)
        return EXIT_MISSING
    spec = Spec.from_args(args)
    try:
        rows = [measure(group, spec, args.np_dtype, size, args.peer) for size in args.sizes]
        if group.rank == 0 and args.rows_to:
            context = {**spec.json_context(group.world_size, args.peer), "peer": args.peer}
            write_json(args.rows_to, {"library": group.library, "rows": [r.to_json(**context) for r in rows]})
    finally:
        group.close()
    return 1 if any(r.wrong for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_peer_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
