"""An alpha-beta-gamma cost model of shmcoll's all-reduce across hosts, fitted from namespace hosts.

Run as root on one machine (iproute2; matplotlib for --plot):

    python bench/cost_model.py measure --out bench/cost-model.json        # 2x1,...,4x2: 9 minutes here
    python bench/cost_model.py fit bench/cost-model.json --plot bench/cost-model.png --json /tmp/fit.json

`measure` runs every across-host algorithm (ONE_SHOT, RECURSIVE_DOUBLING, RING, HALVING_DOUBLING),
each forced at every size with hosts_rank.py --algorithm, over network-namespace hosts brought up
and taken down by hosts_compare.py's machinery (one job per layout and algorithm per round; best of
the rounds), and writes one JSON of points (algorithm, hosts, ranks per host, size, seconds).

`fit` fits one machine's parameters (cost_terms.py) by non-negative least squares on the relative
error, prints measured against predicted for every point (over 30% off is flagged), then the
predicted time of each algorithm from 2 to 1,024 hosts beside what select.py picks there and what
the model finds fastest, and the crossovers. Exit status 0; 1 when a measurement job failed; 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

from cost_terms import (
    ALGORITHMS,
    NAMES,
    TERMS,
    Machine,
    Point,
    all_reduce_steps,
    fit,
    log2_hosts,
    predict,
    relative_error,
    route,
    steps_of,
)
from hosts_compare import HIER, Column, layouts_arg, namespaces, run_job, sizes_arg, unwind_on_sigterm

from shmcoll.algorithms import select
from shmcoll.bench.plot import human
from shmcoll.config import SPIN_US_VAR, Tuning, one_shot_bytes_for

DEFAULT_LAYOUTS = "2x1,4x1,8x1,2x2,4x2"
DEFAULT_SIZES = "8,1K,64K,1M,4M,16M"
PREDICT_SIZES = "8,1K,64K,1M,16M"
TOLERANCE = 0.30  # the model should be within this of every measured point
SHORT = {"one-shot": "OS", "recursive-doubling": "RD", "ring": "ring", "halving-doubling": "HD"}


# ---- measure ----

def measure(args: argparse.Namespace) -> int:
    """Every layout x algorithm, round after round, over hosts made for this run; the JSON of points."""
    t0 = time.monotonic()
    if args.spin_us is not None:
        os.environ[SPIN_US_VAR] = str(args.spin_us)  # shmcoll-run passes SHMCOLL_* on to every rank
    runs: dict[tuple[str, str], list[Column]] = {}
    with tempfile.TemporaryDirectory(prefix="cost-model-") as tmp, \
            namespaces(max(lay.hosts for lay in args.layouts)) as hosts:
        for r in range(args.rounds):
            print(f"# round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
            for lay in args.layouts:
                for name in args.algorithms:
                    col = Column(HIER)
                    run_job(col, lay, hosts, Path(tmp), args, algorithm=name)
                    runs.setdefault((lay.name, name), []).append(col)
    points, failed = [], []
    for lay in args.layouts:
        for name in args.algorithms:
            cols = runs[(lay.name, name)]
            failed += [{"layout": lay.name, "algorithm": name, "reason": c.reason} for c in cols if c.status != "ok"]
            for size in args.sizes:
                times = [c.best_us[size] * 1e-6 for c in cols if size in c.best_us]
                if times:
                    points.append({**asdict(Point(name, lay.hosts, lay.per_host, size, min(times))), "rounds": times})
    cores = len(os.sched_getaffinity(0))  # what every rank of every "host" shares
    doc = {"command": shlex.join(sys.orig_argv), "cores": cores, "seconds": time.monotonic() - t0,
           "config": {"layouts": [lay.name for lay in args.layouts], "sizes": args.sizes, "rounds": args.rounds,
                      "max_time": args.max_time, "iters": args.iters, "warmup": args.warmup,
                      "spin_us": os.environ.get(SPIN_US_VAR)},
           "points": points, "failed": failed}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# {len(points)} points in {doc['seconds']:.0f} s, written to {args.out}", flush=True)
    for f in failed:
        print(f"# failed: {f['layout']} {f['algorithm']}: {f['reason']}", flush=True)
    return 1 if failed else 0


# ---- fit and report ----

def load(path: str) -> tuple[list[Point], int | None]:
    doc = json.loads(Path(path).read_text())
    names = {f.name for f in fields(Point)}
    return [Point(**{k: v for k, v in p.items() if k in names}) for p in doc["points"]], doc.get("cores")


def fitted_lines(m: Machine, cores: int | None) -> list[str]:
    unit = {"beta": "ns/B", "beta_py": "ns/B", "gamma": "ns/B", "beta_local": "ns/B"}
    cells = [f"{t} = {getattr(m, t) * 1e9:.3f} {unit[t]}" if t in unit else f"{t} = {getattr(m, t) * 1e6:.1f} us"
             for t in TERMS]
    over = f"ranks / {cores} cores" if cores else "not modelled"
    rates = [f"1/{t} = {1 / getattr(m, t) / 1e9:.2f} GB/s" for t in unit if getattr(m, t) > 0]
    return ["## fitted machine (seconds per term; oversubscription: " + over + ")", "", "  ".join(cells),
            "(" + ", ".join(rates) + ")", ""]


def error_table(m: Machine, points: list[Point], cores: int | None) -> tuple[list[str], int]:
    """Measured against predicted for every point; and how many are over TOLERANCE."""
    lines = ["## measured vs predicted (float32 SUM all_reduce, us per call)", "",
             "| layout | algorithm | size | measured | predicted | error |", "|---" * 6 + "|"]
    over = 0
    for p in sorted(points, key=lambda p: (p.per_host, p.hosts, p.algorithm, p.size)):
        pred = predict(m, p, cores)
        err = relative_error(pred, p.seconds)
        flag = " **over 30%**" if abs(err) > TOLERANCE else ""
        over += bool(flag)
        lines.append(f"| {p.hosts}x{p.per_host} | {p.algorithm} | {human(p.size)} | {p.seconds * 1e6:.1f} "
                     f"| {pred * 1e6:.1f} | {err:+.0%}{flag} |")
    typical = statistics.median([abs(relative_error(predict(m, p, cores), p.seconds)) for p in points])
    lines += ["", f"{over} of {len(points)} points over {TOLERANCE:.0%}; median |error| {typical:.0%}", ""]
    return lines, over


def predicted(m: Machine, hosts: int, per_host: int, size: int) -> dict[str, float]:
    """Each algorithm's predicted seconds, run as a forced job runs it (each rank with its own core)."""
    return {name: predict(m, Point(name, hosts, per_host, size, 1.0), None) for name in ALGORITHMS}


def selected(m: Machine, hosts: int, per_host: int, size: int) -> tuple[str, float]:
    """What select.py picks (its across-host algorithm's name) and the model's time for it."""
    phases, across = route(hosts, per_host, size)
    return NAMES[across], m.seconds(all_reduce_steps(phases, across, hosts, per_host, size))


def prediction_table(m: Machine, per_host: int, sizes: list[int], top: int) -> list[str]:
    lines = [f"## predicted, {per_host} rank{'s' * (per_host > 1)} per host, each on its own core (us per call)", "",
             "| size | hosts | " + " | ".join(SHORT.values())
             + " | select picks | model's fastest | picked / fastest |",
             "|---" * 9 + "|"]
    for size in sizes:
        for hosts in log2_hosts(top):
            times = predicted(m, hosts, per_host, size)
            pick, t_pick = selected(m, hosts, per_host, size)
            best = min(times, key=times.__getitem__)
            lines.append(f"| {human(size)} | {hosts} | " + " | ".join(f"{times[a] * 1e6:.0f}" for a in ALGORITHMS)
                         + f" | {SHORT[pick]} | {SHORT[best]} | {t_pick / times[best]:.2f} |")
    return lines + ["", "OS one-shot, RD recursive doubling, HD halving-doubling", ""]


def crossovers(m: Machine, per_host: int, top: int) -> list[str]:
    """Where the model's fastest changes, beside select.py's thresholds as they are now."""
    def first_hosts(slow: str, fast: str, size: int) -> str:
        """The first host count at which `fast` beats `slow` by more than 1% (equal counts tie)."""
        for h in log2_hosts(top):
            t = predicted(m, h, per_host, size)
            if t[fast] < 0.99 * t[slow]:
                return str(h)
        return f"none up to {top}"
    grid = [int(4 * 2 ** (k / 2)) // 4 * 4 for k in range(49)]  # 4 B to 64 MiB in half-octaves
    lines = [f"## crossovers ({per_host} rank{'s' * (per_host > 1)} per host)", "",
             "recursive doubling faster than one-shot (8 B) from hosts: "
             f"{first_hosts('one-shot', 'recursive-doubling', 8)} (select: above ONE_SHOT_MAX_HOSTS = "
             f"{select.ONE_SHOT_MAX_HOSTS})"]
    for size in (1 << 20, 16 << 20):
        lines.append(f"halving-doubling faster than ring ({human(size)}) from hosts: "
                     f"{first_hosts('ring', 'halving-doubling', size)}"
                     f" (select: from HALVING_FROM_HOSTS = {select.HALVING_FROM_HOSTS})")
    lines.append("size from which ring or halving-doubling is faster than one-shot and recursive doubling:")
    for h in log2_hosts(top):
        at = next((s for s in grid if _large_wins(predicted(m, h, per_host, s))), None)
        lines.append(f"  {h} hosts: " + (f"about {human_approx(at)}" if at else f"none up to {human(grid[-1])}")
                     + f" (select: above one_shot_bytes = {human(one_shot_bytes_for(Tuning(), h))})")
    return lines + [""]


def human_approx(size: int) -> str:
    """A half-octave grid point in the nearest binary unit: 6144 -> '6 KiB', 92680 -> '90.5 KiB'."""
    for unit, name in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= unit:
            return f"{size / unit:.3g} {name}"
    return f"{size} B"


def _large_wins(t: dict[str, float]) -> bool:
    return min(t["ring"], t["halving-doubling"]) < min(t["one-shot"], t["recursive-doubling"])


def plot(path: str, m: Machine, points: list[Point], per_host: int, sizes: list[int], top: int,
         cores: int | None = None) -> str:
    """Predicted time against hosts (log-log), a panel per size: a line per algorithm with a core per
    rank, the algorithm select picks as a wide band under them; the measured points as circles, and
    the model on the measuring machine's cores beside them (dotted). A one-line message either way."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        return f"--plot {path} not written: matplotlib is not installed ({e}; pip install matplotlib)"
    hosts = log2_hosts(top)
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 4.4), squeeze=False)
    try:
        for ax, size in zip(axes[0], sizes):
            ax.plot(hosts, [selected(m, h, per_host, size)[1] * 1e6 for h in hosts], color="gold", lw=9,
                    alpha=0.5, solid_capstyle="round", label="select's pick")
            for i, name in enumerate(ALGORITHMS):
                ax.plot(hosts, [predicted(m, h, per_host, size)[name] * 1e6 for h in hosts], color=f"C{i}", label=name)
                seen = sorted((p for p in points if p.algorithm == name and p.size == size and p.per_host == per_host),
                              key=lambda p: p.hosts)
                ax.plot([p.hosts for p in seen], [p.seconds * 1e6 for p in seen], "o", color=f"C{i}", mfc="none")
                ax.plot([p.hosts for p in seen], [predict(m, p, cores) * 1e6 for p in seen], ":", color=f"C{i}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0f}"))
            ax.set_title(f"{human(size)}, {per_host} rank{'s' * (per_host > 1)} per host")
            ax.set_xlabel("hosts")
            ax.grid(True, which="major", alpha=0.4)
        axes[0][0].set_ylabel("us per all_reduce")
        axes[0][0].legend(fontsize=8, title=f"circles measured, dotted: model on {cores or 'own'} cores",
                          title_fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return f"plot written to {path}"


def report(args: argparse.Namespace) -> int:
    points, cores = load(args.path)
    if not points:
        print(f"cost_model.py: no points in {args.path}", file=sys.stderr)
        return 2
    cores = None if args.no_oversubscription else args.cores or cores
    m = fit(points, cores)
    lines, _ = error_table(m, points, cores)
    out = fitted_lines(m, cores) + lines + prediction_table(m, args.ranks_per_host, args.predict_sizes, args.top)
    print("\n".join(out + crossovers(m, args.ranks_per_host, args.top)), flush=True)
    if args.plot:
        print(plot(args.plot, m, points, args.ranks_per_host, args.plot_sizes, args.top, cores), flush=True)
    if args.json_path:
        doc = {"machine": asdict(m), "cores": cores, "points": [
            {**asdict(p), "predicted": predict(m, p, cores), "steps": asdict(steps_of(p, cores))} for p in points]}
        Path(args.json_path).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


# ---- the command line ----

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/cost_model.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time every algorithm over namespace hosts (root)")
    m.set_defaults(collective="all_reduce")  # what hosts_compare.job_command has every rank time
    m.add_argument("--out", required=True, help="the JSON of points to write")
    m.add_argument("--layout", dest="layouts", type=layouts_arg, default=layouts_arg(DEFAULT_LAYOUTS), metavar="LIST")
    m.add_argument("--sizes", type=sizes_arg, default=sizes_arg(DEFAULT_SIZES), metavar="LIST")
    m.add_argument("--algorithms", type=lambda s: s.split(","), default=list(ALGORITHMS), metavar="LIST")
    m.add_argument("--rounds", type=int, default=5, help="jobs per layout and algorithm; best time (default 5)")
    m.add_argument("--iters", type=int, default=1000)
    m.add_argument("--warmup", type=int, default=10)
    m.add_argument("--max-time", dest="max_time", type=float, default=0.3, help="seconds of timed calls per size")
    m.add_argument("--timeout", type=float, default=120.0, help="seconds before one job is killed")
    m.add_argument("--spin-us", dest="spin_us", type=lambda s: None if s == "library" else int(s), default=0,
                   help=f"{SPIN_US_VAR} of every rank, or 'library' for shmcoll's own choice (default 0: every "
                        "wait sleeps at once; see bench/README.md)")
    f = sub.add_parser("fit", help="fit, print the tables, plot")
    f.add_argument("path", help="measure's JSON")
    f.add_argument("--cores", type=int, default=None, help="cores the ranks shared (default: as measured)")
    f.add_argument("--no-oversubscription", action="store_true", help="fit as if every rank had its own core")
    f.add_argument("--ranks-per-host", type=int, default=1, help="of the predictions and the plot (default 1)")
    f.add_argument("--predict-sizes", type=sizes_arg, default=sizes_arg(PREDICT_SIZES), metavar="LIST")
    f.add_argument("--plot-sizes", type=sizes_arg, default=sizes_arg("8,64K,1M,16M"), metavar="LIST")
    f.add_argument("--top", type=int, default=1024, help="predict up to this many hosts (default 1024)")
    f.add_argument("--plot", default=None, metavar="PNG")
    f.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="the fitted parameters")
    args = p.parse_args(argv)
    if args.command == "measure":
        if any(a not in ALGORITHMS for a in args.algorithms) or args.rounds < 1 or args.timeout <= 0:
            p.error(f"--algorithms from {','.join(ALGORITHMS)}, --rounds >= 1, --timeout > 0")
        if any(lay.sizes for lay in args.layouts):
            p.error("the model's layouts are HOSTSxRANKS: hosts of one size")
        if os.geteuid() != 0 or shutil.which("ip") is None:
            p.error("measure needs root and iproute2 (the 'ip' command): the hosts are network namespaces")
    elif args.ranks_per_host < 1 or args.top < 2:
        p.error("--ranks-per-host >= 1 and --top >= 2")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "measure":
        unwind_on_sigterm()
        return measure(args)
    return report(args)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # the hosts are down by now (namespaces' finally)
        print("# interrupted; the hosts were taken down", file=sys.stderr, flush=True)
        sys.exit(130)
