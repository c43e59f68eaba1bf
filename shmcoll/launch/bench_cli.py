"""`shmcoll-bench`: an nccl-tests style sweep over message sizes for one collective.

Started outside a job with `-n N`, it re-runs itself as N local ranks through `launch_local`; the
ranks see SHMCOLL_RANK (or any launcher's rank variable) and join with `shmcoll.init()` instead of
spawning again, which is also how it runs under `shmcoll-run` or mpirun. Every rank measures
(bench_core.py); rank 0 prints the table. Whoever started the sweep writes --json and --plot: rank 0
inside an external job; the spawning process with -n, which gets rank 0's rows through a file
(--rows-to) and, with --compare, then runs the peers as jobs of their own (bench_compare.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from shmcoll.config import TRANSPORTS, load_config
from shmcoll.rendezvous.launchers import RANK_VARS
from shmcoll.errors import InvalidArgument

from .argtypes import int_in, number_above
from .bench_buffers import MAX_COLD_BUFFERS, capped_up_to, llc
from .bench_core import (COLLECTIVES, DTYPE_NAMES, IN_PLACE, OPS, PER_RANK_BLOCKS, REDUCING, SPLIT_INPUT, Row, Spec,
                         UsageError, has_dtype, measure, parse_size, resolve_dtype, sweep, transport_name)
from .bench_compare import PeerRun, compare_doc, ratios, run_peer
from .bench_peers import PEERS
from .bench_plot import plot

PROG = "shmcoll-bench"
EXIT_WRONG = 1    # --check found wrong elements (or a collective failed)
EXIT_USAGE = 2
# (header, width): the data columns of nccl-tests, one mode (in-place or not, see the header line)
COLUMNS = (("size(B)", 12), ("count", 12), ("type", 9), ("redop", 6), ("time(us)", 11),
           ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7))
RATIO_WIDTH = 12


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
        epilog="Sizes are bytes with optional binary suffixes (8, 1K, 64K, 1M, 64M). For all_gather and gather a\n"
               "size is the total output: each rank sends size/N/itemsize elements (rounded down, at least 1);\n"
               "for reduce_scatter and all_to_all it is each rank's input (N blocks of size/N/itemsize elements),\n"
               "for scatter the root's input (N such blocks); for all_reduce, reduce and broadcast\n"
               "count = size/itemsize (at least 1). The size column shows the bytes really moved. barrier\n"
               "ignores -b/-e/-f and prints one row with size 0. Rooted collectives (broadcast, reduce, gather,\n"
               "scatter, broadcast_object) use root 0; reduce's --check looks at the root's result only.\n"
               "all_gather_v: a size is the total output, as for all_gather, but rank r sends 1 element plus a\n"
               "share of the rest weighted r+1 (uneven lengths); --check compares the contents and the lengths.\n"
               "broadcast_object / all_gather_object move a pickled bytes object (--dtype is ignored, type\n"
               "'bytes'): the root's payload / all ranks' payloads together (size/N bytes each).\n"
               "time(us) is each rank's mean over the timed iterations, maximum over ranks. algbw = size/time;\n"
               "busbw = algbw * 2(N-1)/N (all_reduce), (N-1)/N (all_gather, reduce_scatter, all_to_all),\n"
               "1 (broadcast, reduce), as in nccl-tests' PERFORMANCE.md; gather and scatter are not defined there,\n"
               "shmcoll-bench uses (N-1)/N for them (the root's own block does not travel), and for\n"
               "all_gather_v and all_gather_object (as all_gather); broadcast_object: 1 (as broadcast).\n"
               "gloo has no all_gather_v: its row pads every rank to the longest length and all_gathers.\n"
               "Iteration cap: when the fastest warmup call (slowest rank) says --iters calls would take more\n"
               "than --max-time seconds, fewer are timed (about --max-time worth, but at least 3); the JSON rows\n"
               "record the iterations really timed. With --warmup 0 there is no cap.\n"
               "Without -n, run it under a launcher: shmcoll-run -n N shmcoll-bench ... (or mpirun).\n"
               "--compare (only with -n): after shmcoll's job, the same sweep, timing and check run through\n"
               "OpenMPI (mpi4py, under mpirun) and torch gloo, each as its own N-rank job, one after the other;\n"
               "a peer that is not installed or cannot run this collective/dtype/op is reported as skipped.\n"
               "--plot without matplotlib: the sweep runs and prints as usual, one line says why no plot.\n"
               "Exit status: 0; 1 when --check finds wrong elements (shmcoll's or a peer's), a collective\n"
               "fails or a peer fails (not when it is skipped); 2 usage errors.")
    p.add_argument("-n", "--np", dest="n", type=int_in(1), default=None, metavar="N",
                   help="start N ranks on this host (not needed inside a job started by a launcher)")
    p.add_argument("--collective", "-c", choices=COLLECTIVES, default="all_reduce", metavar="NAME",
                   help=f"{', '.join(COLLECTIVES)} (default all_reduce; broadcast, reduce, gather, scatter and "
                        "broadcast_object are rooted at rank 0)")
    p.add_argument("-b", "--minbytes", dest="min_bytes", type=_size, default=8, metavar="MIN",
                   help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", dest="max_bytes", type=_size, default=64 << 20, metavar="MAX",
                   help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", dest="factor", type=number_above(1.0, False), default=2.0,
                   metavar="FACTOR", help="multiply the size by this after each step, > 1 (default 2)")
    p.add_argument("--dtype", "-d", choices=tuple(DTYPE_NAMES), default="f32",
                   help="element type (default f32; bf16 needs ml_dtypes)")
    p.add_argument("--op", "-o", choices=tuple(OPS), default="sum",
                   help="reduction for all_reduce, reduce_scatter and reduce (default sum; ignored by the others)")
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
    """Options checked as a whole; raises SystemExit like argparse (2 on a usage error)."""
    parser = build_parser() if parser is None else parser
    args = parser.parse_args(argv)
    try:
        args.sizes = [0] if args.collective == "barrier" else sweep(args.min_bytes, args.max_bytes, args.factor)
        args.np_dtype = resolve_dtype(args.dtype)
    except UsageError as e:
        parser.error(str(e))
    if args.plot is not None and args.collective == "barrier":
        parser.error("--plot draws bus bandwidth against size; a barrier has neither")
    for flag, path in (("--json", args.json_path), ("--plot", args.plot)):
        parent = Path(path).resolve().parent if path is not None else None
        if parent is not None and not parent.is_dir():
            parser.error(f"{flag}: directory {str(parent)!r} does not exist")
    return args


def in_job(environ=None) -> bool:
    """True when a launcher (shmcoll-run, mpirun, srun, torchrun ...) gave this process a rank."""
    env = os.environ if environ is None else environ
    return any((env.get(name) or "").strip() for name in RANK_VARS)


# ---- rank 0's output ----

def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def buffers_note(cold: bool, llc_bytes: int, llc_from: str) -> str:
    """What the timed loop's buffers were: warm (one, reused) or cold (rotating past the LLC)."""
    if not cold:
        return "buffers warm (one per size, reused by every call)"
    return (f"buffers cold (each call on the next of buffers totalling more than the {llc_bytes >> 20} MiB "
            f"last-level cache, {llc_from}; sizes up to {capped_up_to(llc_bytes)} B are capped at "
            f"{MAX_COLD_BUFFERS} buffers)")


def column_labels() -> str:
    return "#" + "".join(label.rjust(width) for label, width in COLUMNS)[1:]


def format_header(args, world: int, transport: str) -> list[str]:
    coll = args.collective
    dtype = f"{args.dtype} ({DTYPE_NAMES[args.dtype]})" if has_dtype(coll) else \
        "- (pickled bytes objects)" if coll != "barrier" else "-"
    op = args.op if coll in REDUCING else "none"
    buffers = "buffers n/a" if coll == "barrier" else buffers_note(getattr(args, "cold", False), *llc())
    return [
        f"# {PROG}: collective {coll}, world size {world}, transport {transport}, dtype {dtype}, op {op}, "
        f"in-place {IN_PLACE[coll]}",
        f"# iters {args.iters}, warmup {args.warmup}, max-time {args.max_time:g} s, check {'on' if args.check else 'off'}"
        f", {buffers}",
        "#",
        column_labels(),
    ]


def _fields(row: Row | dict) -> dict:
    return row if isinstance(row, dict) else asdict(row)


def format_row(row: Row | dict) -> str:
    """One data line, right-aligned under column_labels(); a Row or its JSON form (peers' rows)."""
    r = _fields(row)
    cells = (str(r["size"]), str(r["count"]), r["type"], r["redop"], f"{r['time_us']:.2f}",
             _cell(r["algbw"], ".2f"), _cell(r["busbw"], ".2f"), "N/A" if r["wrong"] is None else str(r["wrong"]))
    return "".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS))


def format_footer(rows: list[Row | dict], check: bool) -> list[str]:
    lines = []
    rows = [_fields(r) for r in rows]
    if check:
        wrong = sum(r["wrong"] or 0 for r in rows)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    bus = [r["busbw"] for r in rows if r["busbw"] is not None]
    if bus:
        lines.append(f"# Avg bus bandwidth    : {sum(bus) / len(bus):.4f} GB/s")
    return lines


def format_peer(run: PeerRun, n: int, check: bool) -> list[str]:
    """A peer's section under shmcoll's table: its status line, then (when it ran) the same columns."""
    if run.status != "ok":
        return ["#", f"# peer: {run.name}: {run.status}: {run.reason}"]
    how = "under mpirun" if run.name == "openmpi" else "started by shmcoll-run"
    return ["#", f"# peer: {run.name} ({run.library}): {n} ranks {how}, same sweep, timing and check, "
                 "run after shmcoll's", column_labels(), *map(format_row, run.rows), *format_footer(run.rows, check)]


def format_ratios(mine: list[dict], peers: list[PeerRun]) -> list[str]:
    """A short table: per size, shmcoll's time / each peer's that ran (below 1: shmcoll is faster)."""
    ran = [p for p in peers if p.rows]
    if not ran:
        return ["#", "# no peer ran: nothing to compare"]
    table = {p.name: ratios(mine, p.rows) for p in ran}
    lines = ["#", "# shmcoll time / peer time, per size (below 1: shmcoll is faster)",
             "#" + "size(B)".rjust(11) + "".join(p.name.rjust(RATIO_WIDTH) for p in ran)]
    for r in mine:
        cells = (table[p.name].get(r["size"]) for p in ran)
        lines.append(str(r["size"]).rjust(12) + "".join(("-" if c is None else f"{c:.3g}x").rjust(RATIO_WIDTH)
                                                         for c in cells))
    return lines


class Progress:
    """A transient line on stderr per size, only on a terminal; erased before the row is printed."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def show(self, k: int, total: int, size: int, coll: str) -> None:
        self.say(f"{coll} {size} B ({k}/{total}) ...")

    def say(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{PROG}: {text}\x1b[K")
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
    spec = Spec(args.collective, args.dtype, args.op, args.iters, args.warmup, args.check, args.max_time, args.cold)
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
                _deliver(args, json_rows(args, rows, pg.world_size, transport))
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


def json_rows(args, rows: list[Row], world: int, transport: str) -> list[dict]:
    """The rows in --json's form: each with the job's context."""
    dtype = args.dtype if has_dtype(args.collective) else None
    context = dict(world_size=world, collective=args.collective, transport=transport, dtype=dtype,
                   warmup=args.warmup, in_place=IN_PLACE[args.collective], cold=args.cold)
    return [r.to_json(**context) for r in rows]


def _deliver(args, rows: list[dict]) -> None:
    """Rank 0's results: to the spawning process when there is one, else to --json and --plot."""
    if args.rows_to is not None:
        write_json(args.rows_to, rows)
        return
    if args.json_path is not None:
        write_json(args.json_path, rows)
    if args.plot is not None:
        draw(args, {"shmcoll": rows}, rows[0]["world_size"])


def write_json(path: str, doc) -> None:
    """Replace `path` at once, so a reader never sees half a file."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def draw(args, lines: dict[str, list[dict]], world: int) -> None:
    """--plot; its one-line outcome goes to stdout when drawn, to stderr when not (matplotlib missing)."""
    dtype = args.dtype if has_dtype(args.collective) else "bytes"
    what = f"{args.collective}, {world} ranks, {dtype}" + (f" {args.op}" if args.collective in REDUCING else "")
    ok, message = plot(args.plot, lines, f"shmcoll-bench: {what}, {'cold' if args.cold else 'warm'} buffers",
                       "size (bytes" + (", all ranks' output)" if args.collective in PER_RANK_BLOCKS
                                         else ", one rank's input)" if args.collective in SPLIT_INPUT else ")"))
    if ok:
        print(f"# {message}", flush=True)
    else:
        _say(message)


def peer_sweep(args) -> list[str]:
    """shmcoll-bench's sweep as bench_peers options: the very sizes and policy shmcoll just ran."""
    out = ["--collective", args.collective, "--dtype", args.dtype, "--op", args.op, "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--max-time", repr(args.max_time)]
    if args.collective != "barrier":
        out += ["--size-list", ",".join(map(str, args.sizes))]
    return out + ["--check"] * args.check + ["--cold"] * args.cold


def run_peers(args, workdir: Path) -> list[PeerRun]:
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


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signum)


def spawn(args, argv: list[str]) -> int:
    """-n: shmcoll's job, then (--compare) the peers' jobs; this process writes --json and --plot."""
    from .local import launch_local

    with tempfile.TemporaryDirectory(prefix="shmcoll-bench-") as tmp:
        rows_to = Path(tmp) / "shmcoll.json"
        rc = launch_local(args.n, [sys.executable, "-m", "shmcoll.launch.bench_cli", *argv, "--rows-to", str(rows_to)])
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
