"""`shmcoll-bench`: an nccl-tests style sweep over message sizes for one collective.

Started outside a job with `-n N`, it re-runs itself as N local ranks through `launch_local`; the
ranks see SHMCOLL_RANK (or any launcher's rank variable) and join with `shmcoll.init()` instead of
spawning again, which is also how it runs under `shmcoll-run` or mpirun. Every rank measures
(measure.py); rank 0 prints the table (table.py). Whoever started the sweep writes --json and
--plot: rank 0 inside an external job; the spawning process with -n, which gets rank 0's rows
through a file (--rows-to) and, with --compare, then runs the peers as jobs of their own
(peer_jobs.py, each rank in peers.py). The options and their --help are in options.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import shmcoll
from shmcoll.config import load_config
from shmcoll.errors import InvalidArgument
from shmcoll.launch.local import launch_local
from shmcoll.rendezvous.launchers import RANK_VARS

from .adapters import PEERS
from .collectives import COLLECTIVES
from .descriptor import Payload, Sizing
from .measure import Spec, measure
from .options import PROG, parse_args
from .peer_jobs import PeerRun, compare_doc, run_peer
from .plot import plot
from .results import Row, write_json
from .table import Progress, format_footer, format_header, format_peer, format_ratios, format_row

EXIT_WRONG = 1    # --check found wrong elements (or a collective failed)
EXIT_USAGE = 2


def in_job(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (shmcoll-run, mpirun, srun, torchrun ...) gave this process a rank."""
    env = os.environ if environ is None else environ
    return any((env.get(name) or "").strip() for name in RANK_VARS)


def transport_name(pg: shmcoll.ProcessGroup) -> str:
    """A short name for the transport the group really runs on, with its hosts when it spans several."""
    t = pg.transport
    return t.name if t.topology is None else f"{t.name} ({t.topology.describe()})"


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# ---- one rank ----

def run_rank(args: argparse.Namespace) -> int:
    """One rank of the job: join, sweep, print (rank 0), and agree on the exit status."""
    try:
        cfg = load_config()
    except InvalidArgument as e:
        _say(f"cannot join the job: {e}")
        return EXIT_USAGE
    rank = cfg.rank
    if args.n is not None and args.n != cfg.world_size:  # every rank says so: the first to exit ends the job
        _say(f"rank {rank}: -n {args.n} does not match this job's world size {cfg.world_size} "
             "(leave -n out when a launcher starts the ranks)")
        return EXIT_USAGE
    if args.hosts is not None:
        os.environ["SHMCOLL_HOST_ID"] = f"simulated-host-{rank * args.hosts // cfg.world_size}"
    spec = Spec.from_args(args)
    rows: list[Row] = []
    try:
        with shmcoll.init(transport=args.transport) as pg:
            lead = pg.rank == 0
            transport = transport_name(pg)
            if lead:
                print("\n".join(format_header(spec, pg.world_size, transport)), flush=True)
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
                context = spec.json_context(pg.world_size, transport)
                _deliver(args, [r.to_json(**context) for r in rows])
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


def _deliver(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Rank 0's results: to the spawning process when there is one, else to --json and --plot."""
    if args.rows_to is not None:
        write_json(args.rows_to, rows)
        return
    if args.json_path is not None:
        write_json(args.json_path, rows)
    if args.plot is not None:
        draw(args, {"shmcoll": rows}, rows[0]["world_size"])


def draw(args: argparse.Namespace, lines: dict[str, list[dict[str, Any]]], world: int) -> None:
    """--plot; its one-line outcome goes to stdout when drawn, to stderr when not (matplotlib missing)."""
    spec = Spec.from_args(args)
    coll = spec.collective
    dtype = args.dtype if coll.payload is Payload.ARRAY else "bytes"
    what = f"{coll.name}, {world} ranks, {dtype}" + (f" {args.op}" if coll.reduces else "")
    ok, message = plot(args.plot, lines, f"{PROG}: {what}, {'cold' if args.cold else 'warm'} buffers",
                       f"size ({coll.sizing.axis})")
    if ok:
        print(f"# {message}", flush=True)
    else:
        _say(message)


# ---- the spawning process ----

def peer_sweep(args: argparse.Namespace) -> list[str]:
    """shmcoll-bench's sweep as peers.py's options: the very sizes and policy shmcoll just ran."""
    out = ["--collective", args.collective, "--dtype", args.dtype, "--op", args.op, "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--max-time", repr(args.max_time)]
    if COLLECTIVES[args.collective].sizing is not Sizing.NOTHING:
        out += ["--size-list", ",".join(map(str, args.sizes))]
    return out + ["--check"] * args.check + ["--cold"] * args.cold


def run_peers(args: argparse.Namespace, workdir: Path) -> list[PeerRun]:
    """Each peer as its own N-rank job, one after the other, with a transient progress line.

    SIGTERM becomes KeyboardInterrupt meanwhile, so a peer's job (in a session of its own) is
    stopped with this process instead of outliving it.
    """
    progress, runs = Progress(sys.stderr.isatty()), []
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for peer in PEERS:
            progress.say(f"peer {peer}: {args.n} ranks, {len(args.sizes)} size(s) ...")
            runs.append(run_peer(peer, args.n, peer_sweep(args), args.collective, args.dtype, args.op, workdir,
                                 args.peer_timeout, args.mpirun, args.mpirun_args))
            progress.clear()
    finally:
        signal.signal(signal.SIGTERM, old)
    return runs


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signum)


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """-n: shmcoll's job, then (--compare) the peers' jobs; this process writes --json and --plot."""
    with tempfile.TemporaryDirectory(prefix="shmcoll-bench-") as tmp:
        rows_to = Path(tmp) / "shmcoll.json"
        rc = launch_local(args.n, [sys.executable, "-m", "shmcoll.bench.cli", *argv, "--rows-to", str(rows_to)])
        if rc not in (0, EXIT_WRONG) or not rows_to.exists():
            return rc
        mine = json.loads(rows_to.read_text())
        try:
            peers = run_peers(args, Path(tmp)) if args.compare else []
        except KeyboardInterrupt as e:  # the peer's job was stopped on the way out (run_command)
            return 128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT)
    if args.compare:
        lines = [line for p in peers for line in format_peer(p, args.n, args.check)]
        print("\n".join(lines + format_ratios(mine, peers)), flush=True)
    if args.json_path is not None:
        write_json(args.json_path, compare_doc(mine, peers) if args.compare else mine)
    if args.plot is not None:
        draw(args, {"shmcoll": mine, **{p.name: p.rows for p in peers if p.rows}}, args.n)
    peers_bad = any(p.status == "failed" or p.wrong for p in peers)
    return rc or (EXIT_WRONG if peers_bad else 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # usage error or --help: report the status instead of exiting
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if in_job():
        if args.compare and args.rows_to is None:
            _say("--compare runs OpenMPI and gloo as jobs of their own after shmcoll's, so it needs -n N "
                 "(run shmcoll-bench -n N directly, not under a launcher)")
            return EXIT_USAGE
        return run_rank(args)
    if args.n is None:
        _say("not inside a job: give -n N to start N local ranks, or start it with shmcoll-run / mpirun")
        return EXIT_USAGE
    return spawn(args, argv)


if __name__ == "__main__":
    sys.exit(main())
