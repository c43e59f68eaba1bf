"""shmcoll against OpenMPI (mpi4py) and torch.distributed (gloo) on this host, in one run.

Every peer does the same thing: a float32 SUM all-reduce, in place, over a buffer of ones
(count = size / 4), at world size N, timed by one piece of code, shmcoll.bench.measure.measure (the
peers run it through shmcoll/bench/peers.py and its adapters, as `shmcoll-bench --compare` does):
--warmup untimed calls, then up to --iters timed calls, cut to about --max-time seconds (never
below 3) when the fastest warmup call of the slowest rank says so; time per call = each rank's mean
over the timed calls, the slowest rank's. The peers run one after the other, never at once:

  shmcoll   python -m shmcoll.bench.cli (shmcoll-bench) -n N --transport T --json ...,
            once per transport asked for (--transports, default shm,tcp)
  openmpi   mpirun --allow-run-as-root --oversubscribe -n N python -m shmcoll.bench.peers openmpi ...
            (comm.Allreduce(MPI.IN_PLACE, buf) on a numpy float32 array)
  gloo      shmcoll-run -n N python -m shmcoll.bench.peers gloo ...
            (dist.all_reduce(t) on a float32 CPU tensor)

With --hosts H the shmcoll ranks pretend to be on H hosts (SHMCOLL_HOST_ID); `--transports hier,tcp`
then times the two-level algorithms against the flat TCP ring and prints their ratio:

  python bench/compare.py -n 4 --hosts 2 --transports hier,tcp --peers shmcoll --sizes 1M,64M --rounds 3

A peer that is not installed, or a shmcoll transport whose init raises, is skipped with the reason
printed; the others still run. Every launch is killed after --timeout seconds. Exit status 0; 1
when a peer failed (not skipped) or timed out; 2 on a usage error. Missed targets do not change it.

    python bench/compare.py -n 2 --plot /tmp/compare.png --json /tmp/compare.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from compare_report import GLOO, MPI, PeerResult, compare, human, plot, ratio_table, times_table, write_json

from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.inputs import UsageError, parse_size, sweep
from shmcoll.bench.peer_jobs import run_command, run_peer, tail

DEFAULT_SIZES = "8,1K,64K,1M,16M,64M"
PEER_NAMES = ("shmcoll", MPI, GLOO)
BUSY_WARN = 0.2  # warn when more than this fraction of the CPUs was busy before the run


def say(msg: str) -> None:
    print(f"# {msg}", flush=True)


def size_list(text: str) -> list[int]:
    """'8,1K,64K' -> [8, 1024, 65536] (argparse type)."""
    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_args(args) -> list[str]:
    return ["--iters", str(args.iters), "--warmup", str(args.warmup), "--max-time", f"{args.max_time:g}"]


def load_rows(path: Path) -> tuple[str, list[dict]]:
    doc = json.loads(path.read_text())
    return (doc.get("library", ""), doc["rows"]) if isinstance(doc, dict) else ("", doc)


def size_groups(sizes: list[int]) -> list[tuple[list[int], float]]:
    """shmcoll-bench takes a geometric sweep: one launch when the sizes form one, else one per size."""
    if len(sizes) > 1:
        factor = sizes[1] / sizes[0]
        if factor > 1 and sweep(sizes[0], sizes[-1], factor) == sizes:
            return [(sizes, factor)]
    return [([s], 2.0) for s in sizes]


def run_shmcoll(transport: str, args, tmp: Path) -> PeerResult:
    """shmcoll-bench over one transport; skipped when its first launch cannot run that transport.

    A shmcoll-bench that does not take --transport T by name gets one try with --transport auto,
    kept only when the JSON says the group really ran over T.
    """
    res = PeerResult(f"shmcoll-{transport}")
    try:
        res.library = f"shmcoll {importlib.metadata.version('shmcoll')}"
    except importlib.metadata.PackageNotFoundError:
        res.library = "shmcoll (not installed, from this checkout)"
    transport_arg = transport
    for k, (group, factor) in enumerate(size_groups(args.sizes)):
        out = tmp / f"shmcoll-{transport}-{k}.json"
        cmd = [sys.executable, "-m", "shmcoll.bench.cli", "-n", str(args.n), "--transport", transport_arg,
               "-b", str(group[0]), "-e", str(group[-1]), "-f", repr(factor), *policy_args(args),
               "--json", str(out), *(["--hosts", str(args.hosts)] if args.hosts else [])]
        rc, err, rows, used = _bench(res, cmd, out, args.timeout)
        why = ""
        if rc == 2 and "invalid choice" in err and k == 0 and transport != "auto":
            why = f"shmcoll-bench does not accept --transport {transport}"
            cmd[cmd.index("--transport") + 1] = transport_arg = "auto"
            rc, err, rows, used = _bench(res, cmd, out, args.timeout)
            why += ", and with --transport auto "
        if rc == 0 and (used == transport or transport in ("auto", "hier")):
            res.merge(rows)
            if k == 0:
                res.library += f", over {used}" + (f" (through --transport {transport_arg})"
                                                   if transport_arg != transport else "")
            continue
        if rc == 0:
            why += f"the group ran over {used!r}, not {transport!r}"
        elif rc == 124:
            why += f"it timed out: {tail(err)}"
        else:
            why += f"shmcoll.init(transport={transport_arg!r}) or the run failed (exit {rc}): {tail(err)}"
        return _give_up(res, k, why, failed=rc == 124)
    return res


def _bench(res: PeerResult, cmd: list[str], out: Path, timeout: float):
    """One shmcoll-bench launch: (status, stderr, rows, the transport its JSON names)."""
    rc, _, err = launch(res, cmd, timeout)
    rows = load_rows(out)[1] if rc == 0 else []
    return rc, err, rows, rows[0].get("transport") if rows else None


def _give_up(res: PeerResult, launches_done: int, why: str, failed: bool) -> PeerResult:
    """The first launch failing means the transport is not there (skip), unless it timed out."""
    res.status = "partial" if launches_done or res.rows else "failed" if failed else "skipped"
    res.reason = why
    return res


def launch(res: PeerResult, cmd: list[str], timeout: float) -> tuple[int, str, str]:
    text = shlex.join(cmd)
    res.commands.append(text)
    print(f"# $ {text}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    rc, out, err = run_command(cmd, timeout)
    print(f"#   -> exit {rc} after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return rc, out, err


def run_library(name: str, args, tmp: Path) -> PeerResult:
    """OpenMPI or gloo through shmcoll-bench's own peer runner: float32 SUM all-reduce at these sizes."""
    sweep_args = ["--collective", "all_reduce", "--dtype", "f32", "--op", "sum", *policy_args(args),
                  "--size-list", ",".join(map(str, args.sizes))]
    print(f"# running {name} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    run = run_peer(name, args.n, sweep_args, "all_reduce", "f32", "sum", tmp, args.timeout, args.mpirun,
                   args.mpirun_args)
    print(f"#   -> {run.status} after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    res = PeerResult(name, status=run.status, reason=run.reason, library=run.library,
                     commands=[run.command] if run.command else [])
    res.merge(run.rows)
    return res


def run_mpi(args, tmp: Path) -> PeerResult:
    return run_library(MPI, args, tmp)


def run_gloo(args, tmp: Path) -> PeerResult:
    return run_library(GLOO, args, tmp)


def run_round(args, tmp: Path, prev: dict[str, PeerResult]) -> dict[str, PeerResult]:
    """Every peer once, one after the other; a peer skipped in an earlier round is not retried."""
    jobs = [(f"shmcoll-{t}", lambda t=t: run_shmcoll(t, args, tmp)) for t in args.transports
            if "shmcoll" in args.peers]
    jobs += [(name, lambda fn=fn: fn(args, tmp)) for name, fn in ((MPI, run_mpi), (GLOO, run_gloo))
             if name in args.peers]
    for name, job in jobs:
        old = prev.get(name)
        if old is not None and old.status == "skipped":
            continue
        new = job()
        if old is None:
            prev[name] = new
        else:
            old.merge(new.rows.values())
            old.commands += new.commands
            if new.status != "ok" and old.status == "ok":
                old.status, old.reason = "partial", new.reason
    return prev


def hier_vs_flat(hier: PeerResult, flat: PeerResult, sizes) -> list[str]:
    """The two-level algorithms' time over the flat TCP ring's, per size (< 1: the hierarchy wins)."""
    lines = ["# shmcoll-hier time / shmcoll-tcp time (below 1: the two-level algorithm is faster)"]
    for size in sizes:
        a, b = hier.rows.get(size), flat.rows.get(size)
        ratio = f"{a['time_us'] / b['time_us']:.2f}x" if a and b and b["time_us"] else "-"
        lines.append(human(size).rjust(12) + ratio.rjust(12))
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Columns and install steps: bench/README.md.")
    p.add_argument("-n", type=int, default=2, help="world size, at least 2 (default 2)")
    p.add_argument("--sizes", type=size_list, default=size_list(DEFAULT_SIZES), metavar="LIST",
                   help=f"comma-separated sizes in bytes, K/M/G suffixes allowed (default {DEFAULT_SIZES})")
    p.add_argument("--transports", default="shm,tcp", metavar="LIST",
                   help="shmcoll transports to run, comma-separated (default shm,tcp)")
    p.add_argument("--hosts", type=int, default=None, metavar="H",
                   help="shmcoll ranks simulate H hosts (shmcoll-bench --hosts): with --transports hier,tcp "
                        "this times the two-level algorithms against flat TCP; the peers stay on one host")
    p.add_argument("--peers", default=",".join(PEER_NAMES), metavar="LIST",
                   help=f"which of {', '.join(PEER_NAMES)} to run (default all)")
    p.add_argument("--iters", type=int, default=1000, help="timed calls per size at most (default 1000)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per size first (default 20)")
    p.add_argument("--max-time", dest="max_time", type=float, default=1.0,
                   help="aim for at most this many seconds of timed calls per size; 0: no cap (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every peer this many times, alternating, and keep each size's best time (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one launch is killed (default 300)")
    p.add_argument("--mpirun", default="mpirun", help="the mpirun to use (default: mpirun on PATH)")
    p.add_argument("--mpirun-args", dest="mpirun_args", default="", metavar="ARGS",
                   help="extra mpirun options, e.g. '--mca btl self,vader' (default none: OpenMPI's defaults)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every row and ratio here")
    p.add_argument("--plot", default=None, metavar="PNG", help="busbw against size, log-log, one line per peer")
    return p


def parse_args(argv) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    args.peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if args.n < 2:
        p.error("-n must be at least 2")
    if args.iters < 1 or args.warmup < 0 or args.max_time < 0 or args.rounds < 1 or args.timeout <= 0:
        p.error("need --iters >= 1, --warmup >= 0, --max-time >= 0, --rounds >= 1, --timeout > 0")
    if bad := [x for x in args.peers if x not in PEER_NAMES]:
        p.error(f"unknown peer(s) {bad}; choose from {', '.join(PEER_NAMES)}")
    if not args.sizes:
        p.error("--sizes is empty")
    # every peer reports count * 4 bytes (count = size // 4, at least 1): key the rows by that
    args.sizes = sorted({COLLECTIVES["all_reduce"].layout(s, args.n, 4)[2] for s in args.sizes})
    for path in (args.json_path, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            p.error(f"directory of {path!r} does not exist")
    return args


def cpu_busy(seconds: float = 0.5) -> float | None:
    """Fraction of all CPUs busy over a short look (/proc/stat), before any peer runs; None off Linux."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    busy = cpu_busy()
    say(f"float32 SUM all-reduce, in place, world size {args.n}, {os.cpu_count()} CPUs; sizes "
        f"{', '.join(human(s) for s in args.sizes)}")
    if busy is not None:
        say(f"CPUs {busy:.0%} busy just before the run" + (
            ": other processes compete with the ranks, so times and ratios may be off; rerun on a quiet "
            "machine or with --rounds 3" if busy > BUSY_WARN else ""))
    cap = f"cut to about {args.max_time:g} s (at least 3)" if args.max_time else "(no time cap)"
    say(f"policy (every peer): {args.warmup} warmup calls, then up to {args.iters} timed calls {cap}; "
        f"time = each rank's mean, slowest rank; best of {args.rounds} round(s)")
    peers: dict[str, PeerResult] = {}
    with tempfile.TemporaryDirectory(prefix="shmcoll-compare-") as tmp:
        for _ in range(args.rounds):
            run_round(args, Path(tmp), peers)
    results = list(peers.values())
    for p in results:
        state = f"ok ({p.library})" if p.status == "ok" else \
            f"{p.status} (see the end)" if not p.ran else f"{p.status}: {p.reason}"
        say(f"{p.name}: {state}")
    print("#")
    if any(p.ran for p in results):
        print("\n".join(times_table(results, args.sizes, args.n)))
    else:
        say("no peer ran: nothing to compare")
    comparison = []
    for p in results:
        if p.name.startswith("shmcoll-") and p.ran:
            records = compare(args.n, p, peers.get(MPI), peers.get(GLOO), args.sizes)
            comparison += records
            print("#")
            print("\n".join(ratio_table(records, args.n)))
    if peers.get("shmcoll-hier") and peers.get("shmcoll-tcp") and peers["shmcoll-hier"].ran:
        print("#")
        print("\n".join(hier_vs_flat(peers["shmcoll-hier"], peers["shmcoll-tcp"], args.sizes)))
    noted = [p for p in results if p.status != "ok"]
    if noted:
        print("#")
        for p in noted:
            say(f"{p.status.upper()} {p.name}: {p.reason}")
    if args.json_path:
        config = dict(world_size=args.n, sizes=args.sizes, transports=args.transports, peers=args.peers,
                      iters=args.iters, warmup=args.warmup, max_time=args.max_time, rounds=args.rounds,
                      timeout=args.timeout, mpirun_args=args.mpirun_args, cpus=os.cpu_count(), cpu_busy_before=busy,
                      dtype="f32", op="sum", in_place=True)
        write_json(args.json_path, config, results, comparison)
        say(f"JSON written to {args.json_path}")
    if args.plot:
        say(plot(args.plot, [p for p in results if p.ran], args.n))
    return 1 if any(p.status in ("failed", "partial") for p in results) else 0


if __name__ == "__main__":
    sys.exit(main())
