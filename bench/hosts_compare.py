"""shmcoll across network-namespace "hosts", against OpenMPI and gloo, and the link they all share.

Run as root on one machine (iproute2; OpenMPI with mpi4py, and torch, are optional):

    python bench/hosts_compare.py                          # 2x2 and 4x1; 8x1 too on 8 CPUs or more
    python bench/hosts_compare.py --layout 2x2,4x1,8x1 --rounds 3 --json /tmp/hosts.json

tools/netns.sh makes the hosts (PREFIX1..PREFIXn, a fresh prefix per run; taken down at the end, also
after a failure or Ctrl-C). A layout HxK is H hosts with K ranks each; A+B+... is hosts of A, B, ...
ranks (uneven hosts, say 1+3). Every column of its table is
one job per round, each rank bench/hosts_rank.py timing a float32 SUM all_reduce (or --collective C)
with the loop shmcoll-bench uses (so the columns differ only in the library):

  shmcoll two-level  shmcoll-run --hostfile F --rsh "ip netns exec" hosts_rank.py shmcoll --transport hier
  shmcoll flat TCP   the same with --transport tcp (a ring over TCP between every pair of ranks)
  OpenMPI            mpirun --host H1:K,H2:K,... --mca plm_rsh_agent AGENT, btl self,vader,tcp on the
                     hosts' subnet, mpi_yield_when_idle 1, --bind-to none; AGENT runs each daemon with
                     `ip netns exec HOST unshare --uts` under the hostname HOST: vader names its segments
                     after the hostname, and hosts sharing the machine's name collide (the ranks segfault)
  gloo               shmcoll-run as above, -x GLOO_SOCKET_IFNAME=eth0, torch.distributed gloo

--link-rate 10gbit gives every host a link of that rate each way (tools/netns.sh's NETNS_RATE), as
a NIC has: veth alone moves bytes as fast as the CPU copies them, so its "wire" is CPU time.
--rounds R runs every column R times, alternating, and keeps each size's best time. Then "the link":
one Python socket stream from host 1 to host 2, and then one each way at once (GB/s per direction),
under the congestion control shmcoll's connections take: the most one such connection carries here,
each end sending from (or receiving into) one cache-hot MiB; and one each way at once through 64 MiB
arrays, which every copy reads from or writes to memory, as a large call's data is. Last, for an
all-reduce, each layout's use of the link from 16 MiB: the bytes each host must send and receive
across hosts, 2 (H - 1) / H x S, per call time, for shmcoll and OpenMPI, against both figures.
A library that is not installed is a column of n/a with the reason below the table. Every job is
killed after --timeout seconds, and whatever it left in the namespaces with it. Exit status 0; 1
when a job failed; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from hosts_rank import TIMED

from shmcoll.bench.adapters import GLOO, OPENMPI
from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.descriptor import Sizing
from shmcoll.bench.inputs import UsageError, parse_float32_sizes
from shmcoll.bench.peer_jobs import EXIT_TIMEOUT, GRACE_S, child_env, missing_reason, run_command, tail
from shmcoll.bench.plot import human

REPO = Path(__file__).resolve().parents[1]
NETNS = REPO / "tools" / "netns.sh"
RANK = REPO / "bench" / "hosts_rank.py"
REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
DEFAULT_SIZES = "8,1K,64K,1M,16M,64M"
HIER, TCP = "hier", "tcp"
COLUMNS = {HIER: "shmcoll two-level", TCP: "shmcoll flat TCP", OPENMPI: "OpenMPI", GLOO: "gloo"}
SKIPPED = "skipped"  # a column's status where --columns leaves it out
LINK_PORT = 45123  # free in any fresh namespace
LINK_SPAN = 64 << 20  # the data-sized streams' arrays: past every cache, as a large call's data
LINK_USE_FROM = 16 << 20  # all-reduces from this size have their use of the link worked out: the bytes set their time
SETUP_S = 60.0     # netns.sh up/down, ip netns pids
AGENT = """#!/bin/sh
# mpirun's rsh agent, written by bench/hosts_compare.py: mpirun runs "AGENT HOST COMMAND" with the
# command as one string for a shell. Run it in namespace HOST, under the hostname HOST.
host=$1; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"
"""


@dataclass(frozen=True)
class Layout:
    """`hosts` hosts of `per_host` ranks each; or, where `sizes` says, of those many ranks each
    (uneven hosts: per_host is then the largest)."""

    hosts: int
    per_host: int
    sizes: tuple[int, ...] = ()

    @classmethod
    def of_sizes(cls, sizes: tuple[int, ...]) -> Layout:
        return cls(len(sizes), sizes[0]) if len(set(sizes)) == 1 else cls(len(sizes), max(sizes), sizes)

    def ranks_on(self, host: int) -> int:
        return self.sizes[host] if self.sizes else self.per_host

    @property
    def name(self) -> str:
        return "+".join(map(str, self.sizes)) if self.sizes else f"{self.hosts}x{self.per_host}"

    @property
    def title(self) -> str:
        if self.sizes:
            return f"{self.hosts} hosts of {' + '.join(map(str, self.sizes))} ranks"
        return f"{self.hosts} hosts x {self.per_host} rank{'s' * (self.per_host > 1)}"

    @property
    def world(self) -> int:
        return sum(self.ranks_on(h) for h in range(self.hosts))


@dataclass(frozen=True)
class Hosts:
    """The namespaces tools/netns.sh made: PREFIX1..PREFIX<count> on SUBNET.0/24."""

    prefix: str
    subnet: str
    count: int

    def name(self, i: int) -> str:
        return f"{self.prefix}{i + 1}"


@dataclass
class Column:
    """One column of one layout over every round: its best time per size, or why it has none."""

    name: str
    status: str = "ok"  # ok, n/a (not installed here), skipped (--columns), failed (in some round)
    reason: str = ""
    library: str = ""
    transport: str = ""
    best_us: dict[int, float] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    def merge(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.best_us[r["size"]] = min(self.best_us.get(r["size"], math.inf), r["time_us"])

    def describe(self) -> dict[str, Any]:
        return dict(title=COLUMNS[self.name], status=self.status, reason=self.reason, library=self.library,
                    transport=self.transport, commands=self.commands)


# ---- processes ----

def sh(*cmd: str, timeout: float = SETUP_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env=env)


def reap(hosts: Hosts) -> None:
    """SIGKILL whatever still runs in the hosts' namespaces (this run made them, so it is all ours):
    a timed-out job's ranks, an mpirun daemon that outlived mpirun. Nothing outlives its job."""
    for i in range(hosts.count):
        for pid in sh("ip", "netns", "pids", hosts.name(i)).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def namespaces(count: int, link_rate: str | None = None) -> Iterator[Hosts]:
    """`count` fresh hosts under a unique prefix, on links of link_rate each way where given (else
    veth's own speed); always taken down, processes in them first."""
    prefix = "hc" + secrets.token_hex(3)
    hosts = Hosts(prefix, "", count)
    try:
        up = sh("bash", str(NETNS), "up", str(count), prefix, env={**os.environ, "NETNS_RATE": link_rate or ""})
        found = re.search(r" on (\d+\.\d+\.\d+)\.0/24", up.stdout)
        if up.returncode != 0 or not found:
            raise SystemExit(f"hosts_compare.py: tools/netns.sh up {count} {prefix} failed: {tail(up.stderr)}")
        hosts = Hosts(prefix, found.group(1), count)
        yield hosts
    finally:
        reap(hosts)
        down = sh("bash", str(NETNS), "down", prefix)
        if down.returncode != 0:
            print(f"# tools/netns.sh down {prefix} failed: {tail(down.stderr)}", file=sys.stderr, flush=True)


def run_together(cmds: list[list[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Start every command at once; (status, stdout, stderr) of each, 124 for those still running at
    the timeout (their process groups are killed)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              start_new_session=True) for c in cmds]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                results.append((p.returncode, out, err))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, err = p.communicate()
                results.append((EXIT_TIMEOUT, out, err + "(timed out)"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results


# ---- the jobs ----

def unavailable(column: str, mpirun: str) -> str | None:
    """Why a column cannot run on this machine at all, or None."""
    if column == OPENMPI:
        return missing_reason(OPENMPI, mpirun) or (None if shutil.which("unshare") else
                                                   "the mpirun agent needs unshare (util-linux)")
    return missing_reason(GLOO) if column == GLOO else None


def job_command(column: str, layout: Layout, hosts: Hosts, out: Path, tmp: Path, args: argparse.Namespace,
                algorithm: str | None = None) -> list[str]:
    """The launcher line of one column's job on the first layout.hosts hosts; `algorithm` (shmcoll
    only) forces how its all-reduces cross hosts (hosts_rank.py --algorithm, for bench/cost_model.py)."""
    names = [hosts.name(i) for i in range(layout.hosts)]
    library = column if column in (OPENMPI, GLOO) else "shmcoll"
    rank = [str(RANK), library, str(out),
            ",".join(map(str, args.sizes)), "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--max-time", f"{args.max_time:g}", "--timeout", f"{args.timeout:g}", "--collective", args.collective]
    if column in (HIER, TCP):
        rank += ["--transport", column] + (["--algorithm", algorithm] if algorithm else [])
    if column == OPENMPI:
        subnet = f"{hosts.subnet}.0/24"
        return [shutil.which(args.mpirun) or args.mpirun, "--allow-run-as-root", "-np", str(layout.world),
                "--host", ",".join(f"{h}:{layout.ranks_on(i)}" for i, h in enumerate(names)),
                "--mca", "plm_rsh_agent", str(tmp / "agent.sh"), "--mca", "btl", "self,vader,tcp",
                "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
                "--mca", "mpi_yield_when_idle", "1", "--bind-to", "none", sys.executable, *rank]
    hostfile = tmp / f"hosts-{layout.name}"
    hostfile.write_text("".join(f"{h} slots={layout.ranks_on(i)}\n" for i, h in enumerate(names)))
    exports = ["-x", "GLOO_SOCKET_IFNAME=eth0", "-x", "OMP_NUM_THREADS=1"] if column == GLOO else []
    return [sys.executable, "-m", "shmcoll.launch.run_cli", "--hostfile", str(hostfile), "--rsh", "ip netns exec",
            "--timeout", f"{args.timeout:g}", *exports, *rank]


def run_job(col: Column, layout: Layout, hosts: Hosts, tmp: Path, args: argparse.Namespace,
            algorithm: str | None = None) -> None:
    """One round of one column: its rows merged into col, or col marked failed with the reason."""
    out = tmp / f"{layout.name}-{col.name}.json"
    out.unlink(missing_ok=True)
    cmd = job_command(col.name, layout, hosts, out, tmp, args, algorithm)
    col.commands.append(shlex.join(cmd))
    env = child_env({"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    t0 = time.monotonic()
    rc, _, err = run_command(cmd, args.timeout + GRACE_S, env)
    reap(hosts)
    what = COLUMNS[col.name] + (f" ({algorithm})" if algorithm else "")
    print(f"# {layout.name} {what}: exit {rc} after {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    if rc == 0 and out.exists():
        doc = json.loads(out.read_text())
        col.library, col.transport = doc["library"], doc["transport"]
        col.merge(doc["rows"])
        return
    col.status = "failed"
    col.reason = ("timed out: " if rc == EXIT_TIMEOUT else f"exit {rc}: ") + tail(err)


def run_layouts(hosts: Hosts, tmp: Path, args: argparse.Namespace) -> dict[str, dict[str, Column]]:
    """Every column of every layout, round after round; a column that is n/a, or that --columns
    leaves out, is never started."""
    (tmp / "agent.sh").write_text(AGENT)
    (tmp / "agent.sh").chmod(0o755)
    cols = {lay.name: {c: Column(c) for c in COLUMNS} for lay in args.layouts}
    for r in range(args.rounds):
        print(f"# round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for lay in args.layouts:
            for col in cols[lay.name].values():
                why = unavailable(col.name, args.mpirun)
                if col.name not in args.columns:
                    col.status, col.reason = SKIPPED, "left out by --columns"
                elif why:
                    col.status, col.reason = "n/a", why
                else:
                    run_job(col, lay, hosts, tmp, args)
    return cols


# ---- the link ----

def streams(hosts: Hosts, pairs: list[tuple[int, int]], seconds: float, timeout: float,
            span: list[str] | None = None) -> list[float | None]:
    """GB/s of one Python socket stream per (from, to) pair, all at once (None where one failed);
    span: hosts_rank.py's --span option for both ends (default one cache-hot MiB)."""
    ns, span = ["ip", "netns", "exec"], span or []
    recvs = [[*ns, hosts.name(b), sys.executable, str(RANK), "recv", str(LINK_PORT), *span] for _, b in pairs]
    sends = [[*ns, hosts.name(a), sys.executable, str(RANK), "send", hosts.name(b), str(LINK_PORT), f"{seconds:g}",
              *span] for a, b in pairs]
    results = run_together(recvs + sends, seconds + timeout)
    reap(hosts)
    rates: list[float | None] = []
    for rc, out, err in results[:len(pairs)]:
        doc = json.loads(out) if rc == 0 and out.strip() else None
        rates.append(doc["bytes"] / doc["seconds"] / 1e9 if doc and doc["seconds"] > 0 else None)
        if doc is None:
            print(f"# link: receiver exit {rc}: {tail(err)}", file=sys.stderr, flush=True)
    return rates


def measure_link(hosts: Hosts, args: argparse.Namespace) -> dict[str, Any]:
    a, b = hosts.name(0), hosts.name(1)
    one = streams(hosts, [(0, 1)], args.link_seconds, args.timeout)
    both = streams(hosts, [(0, 1), (1, 0)], args.link_seconds, args.timeout)
    data = streams(hosts, [(0, 1), (1, 0)], args.link_seconds, args.timeout, ["--span", str(LINK_SPAN)])

    def each_way(rates: list[float | None]) -> list[dict[str, Any]]:
        return [{"from": a, "to": b, "gbps": rates[0]}, {"from": b, "to": a, "gbps": rates[1]}]
    return {"seconds": args.link_seconds, "one_way": {"from": a, "to": b, "gbps": one[0]}, "both": each_way(both),
            "both_data_sized": {"span_bytes": LINK_SPAN, "streams": each_way(data)}}


# ---- output ----

def cell(value: float | None, col: Column) -> str:
    """A time, else why there is none (n/a, failed), else '-'."""
    return f"{value:.1f}" if value is not None else col.status if col.status != "ok" else "-"


def ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def table_rows(cols: dict[str, Column], sizes: list[int]) -> list[dict[str, Any]]:
    """Per size: each column's best time (us) and the two-level's time over OpenMPI's and gloo's."""
    rows = []
    for size in sizes:
        row: dict[str, Any] = {"size": size, **{c: cols[c].best_us.get(size) for c in COLUMNS}}
        for peer in (OPENMPI, GLOO):
            row[f"hier_over_{peer}"] = row[HIER] / row[peer] if row[HIER] and row[peer] else None
        rows.append(row)
    return rows


def without_data(collective: str) -> bool:
    """A call that moves no array (the barrier): timed once, as size 0."""
    return COLLECTIVES[collective].sizing is Sizing.NOTHING


def call_title(collective: str) -> str:
    """The timed call as the table's title names it: float32 SUM all_reduce, float32 broadcast, barrier."""
    if without_data(collective):
        return collective
    return f"float32 {'SUM ' * (collective in REDUCTIONS)}{collective}"


def table(layout: Layout, cols: dict[str, Column], rows: list[dict[str, Any]], rounds: int,
          collective: str = "all_reduce") -> list[str]:
    lines = [f"## {layout.title} ({layout.name}): "
             f"{call_title(collective)}, time per call in us, best of {rounds} "
             f"round{'s' * (rounds > 1)}", "",
             "| size | " + " | ".join(f"{t} (us)" for t in COLUMNS.values())
             + " | two-level / OpenMPI | two-level / gloo |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for row in rows:
        cells = [human(row["size"]), *(cell(row[c], cols[c]) for c in COLUMNS),
                 ratio(row[f"hier_over_{OPENMPI}"]), ratio(row[f"hier_over_{GLOO}"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for c in cols.values():
        what = c.library + (f", over {c.transport}" if c.transport else "")
        lines.append(f"# {COLUMNS[c.name]}: " + (what if c.status == "ok" else f"{c.status} ({c.reason})"))
    return lines + [""]


def link_lines(link: dict[str, Any], hosts: Hosts) -> list[str]:
    def rate(x: dict[str, Any]) -> str:
        return f"{x['from']} -> {x['to']} " + (f"{x['gbps']:.2f} GB/s" if x["gbps"] is not None else "failed")
    return [f"## the link: one Python socket stream between two hosts ({hosts.subnet}.0/24 through a bridge), "
            f"{link['seconds']:g} s each", "",
            f"one way: {rate(link['one_way'])}",
            "both directions at once, per direction: " + ", ".join(rate(x) for x in link["both"]),
            f"both directions at once through {link['both_data_sized']['span_bytes'] >> 20} MiB arrays, per direction: "
            + ", ".join(rate(x) for x in link["both_data_sized"]["streams"])]


def crossing_bytes(hosts: int, size: int) -> float:
    """Bytes each host must send, and receive, across hosts in an all-reduce of `size` bytes whose
    inputs are spread over `hosts` hosts: 2 (H - 1) / H x size (S between two hosts), what a ring or
    halving-doubling among the hosts sends, whichever rank of the host sends it."""
    return 2 * (hosts - 1) / hosts * size


def link_use(layouts: list[Layout], rows: dict[str, list[dict[str, Any]]],
             link: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layout and all-reduce of LINK_USE_FROM bytes or more, for shmcoll's two-level and
    OpenMPI: the GB/s each way per host of crossing_bytes, and its share of the link's streams both
    ways at once (the mean of the two directions) from a cache-hot MiB and through 64 MiB arrays."""
    def mean(figures: list[dict[str, Any]]) -> float | None:
        rates = [x["gbps"] for x in figures]
        return sum(rates) / len(rates) if None not in rates else None
    hot, data = mean(link["both"]), mean(link["both_data_sized"]["streams"])

    def use(hosts: int, row: dict[str, Any], col: str) -> dict[str, float | None]:
        gbps = crossing_bytes(hosts, row["size"]) / row[col] / 1e3 if row[col] else None
        return {"gbps": gbps, "of_hot": gbps / hot if gbps and hot else None,
                "of_data": gbps / data if gbps and data else None}
    return [{"layout": lay.name, "size": row["size"], **{col: use(lay.hosts, row, col) for col in (HIER, OPENMPI)}}
            for lay in layouts for row in rows[lay.name] if row["size"] >= LINK_USE_FROM]


def link_use_lines(uses: list[dict[str, Any]]) -> list[str]:
    """The table of link_use(); nothing where no size was large enough."""
    if not uses:
        return []

    def cell(x: dict[str, float | None]) -> str:
        if x["gbps"] is None:
            return "-"
        shares = " / ".join(f"{x[k]:.0%}" if x[k] is not None else "-" for k in ("of_hot", "of_data"))
        return f"{x['gbps']:.2f} GB/s ({shares})"
    return ["", f"## the link's use by the all-reduces of {human(LINK_USE_FROM)} and up: GB/s each way per host of "
            "the 2 (H - 1) / H x S bytes each host must send and receive across hosts (S between 2 hosts), and "
            "its share of the streams both ways at once (from a cache-hot MiB / through 64 MiB arrays)", "",
            f"| layout | size | {COLUMNS[HIER]} | {COLUMNS[OPENMPI]} |", "|---|---|---|---|",
            *(f"| {u['layout']} | {human(u['size'])} | {cell(u[HIER])} | {cell(u[OPENMPI])} |" for u in uses),
            "", "# without --link-rate the link between namespaces is the kernel's copies on the cores the ranks run "
            "on: more hosts, or several ranks' work inside a host, take cores from it"]


# ---- the run ----

def layouts_arg(text: str) -> list[Layout]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        sizes = tuple(int(m.group(2)) for _ in range(int(m.group(1)))) if m else _uneven(part)
        if not 2 <= len(sizes) <= 200 or min(sizes) < 1:
            raise argparse.ArgumentTypeError(f"a layout is HOSTSxRANKS or RANKS+RANKS+... with 2..200 hosts, "
                                             f"like 2x2 or 1+3: {part!r}")
        out.append(Layout.of_sizes(sizes))
    return out


def _uneven(part: str) -> tuple[int, ...]:
    """The host sizes of A+B+...; () where part is not such."""
    return tuple(map(int, part.split("+"))) if re.fullmatch(r"\d+(\+\d+)+", part) else ()


def columns_arg(text: str) -> list[str]:
    """'hier,openmpi' -> the columns to run, in the table's order."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"columns are some of {','.join(COLUMNS)}, got {text!r}")
    return [c for c in COLUMNS if c in names]


def sizes_arg(text: str) -> list[int]:
    """'8,1K,64K' -> [8, 1024, 65536]: float32 buffers, so whole multiples of 4 bytes."""
    try:
        return parse_float32_sizes(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    default_layout = "2x2,4x1" + (",8x1" if (os.cpu_count() or 1) >= 8 else "")
    p = argparse.ArgumentParser(prog="bench/hosts_compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="What is measured and how: bench/README.md.")
    p.add_argument("--layout", dest="layouts", type=layouts_arg, default=layouts_arg(default_layout),
                   metavar="LIST", help=f"HOSTSxRANKS or RANKS+RANKS+... (uneven hosts), comma-separated "
                                        f"(default here {default_layout}: 8x1 only on 8 CPUs or more, where 8 "
                                        "ranks do not just queue for the cores)")
    p.add_argument("--sizes", type=sizes_arg, default=sizes_arg(DEFAULT_SIZES), metavar="LIST",
                   help=f"bytes, K/M/G suffixes allowed (default {DEFAULT_SIZES})")
    p.add_argument("--collective", choices=TIMED, default="all_reduce",
                   help="what to time (default all_reduce; sizes as shmcoll-bench's: an all_gather's is every "
                        "rank's output; a barrier has one row, of size 0)")
    p.add_argument("--columns", type=columns_arg, default=list(COLUMNS), metavar="LIST",
                   help=f"what to run, comma-separated, of {','.join(COLUMNS)} (default all; the others' "
                        f"cells say {SKIPPED})")
    p.add_argument("--rounds", type=int, default=1, help="run every column R times, alternating; best time (default 1)")
    p.add_argument("--iters", type=int, default=1000, help="timed calls per size at most (default 1000)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per size first, fewer from 4 MiB (default 20)")
    p.add_argument("--max-time", dest="max_time", type=float, default=0.5,
                   help="aim for this many seconds of timed calls per size (default 0.5)")
    p.add_argument("--link-seconds", dest="link_seconds", type=float, default=2.0,
                   help="how long each link stream sends (default 2)")
    p.add_argument("--link-rate", dest="link_rate", default=None, metavar="RATE",
                   help="give every host a link of RATE each way (tc's syntax: 10gbit; NETNS_RATE of tools/netns.sh)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before one job is killed (default 300)")
    p.add_argument("--mpirun", default="mpirun", help="the mpirun to use (default: mpirun on PATH)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    if not args.layouts or args.rounds < 1 or args.iters < 1 or args.warmup < 0 or args.max_time < 0 \
            or args.link_seconds <= 0 or args.timeout <= 0:
        p.error("need a layout, --rounds >= 1, --iters >= 1, --warmup >= 0, --max-time >= 0, "
                "--link-seconds > 0 and --timeout > 0")
    if without_data(args.collective):
        args.sizes = [0]  # a barrier: one row, whatever --sizes says
    if os.geteuid() != 0 or shutil.which("ip") is None:
        p.error("needs root and iproute2 (the 'ip' command): the hosts are network namespaces")
    return args


def unwind_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the stack unwinds and the namespaces go down."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signum)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    command = shlex.join(sys.orig_argv)
    print(f"# $ {command}", flush=True)
    unwind_on_sigterm()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hosts-compare-") as tmp, \
            namespaces(max(lay.hosts for lay in args.layouts), args.link_rate) as hosts:
        links = f", links of {args.link_rate} each way" if args.link_rate else ""
        print(f"# hosts {hosts.name(0)}..{hosts.name(hosts.count - 1)} on {hosts.subnet}.0/24 (tools/netns.sh){links}",
              flush=True)
        cols = run_layouts(hosts, Path(tmp), args)
        link = measure_link(hosts, args)
    doc: dict[str, Any] = {"command": command, "config": {k: v for k, v in vars(args).items() if k != "layouts"},
                           "layouts": {}, "link": link}
    doc["config"]["layouts"] = [lay.name for lay in args.layouts]
    for lay in args.layouts:
        rows = table_rows(cols[lay.name], args.sizes)
        print("\n" + "\n".join(table(lay, cols[lay.name], rows, args.rounds, args.collective)), flush=True)
        doc["layouts"][lay.name] = {"hosts": lay.hosts, "ranks_per_host": lay.per_host,
                                    "ranks_on_hosts": [lay.ranks_on(h) for h in range(lay.hosts)], "rows": rows,
                                    "columns": {c.name: c.describe() for c in cols[lay.name].values()}}
    print("\n".join(link_lines(link, hosts)), flush=True)
    if args.collective == "all_reduce":
        doc["link_use"] = link_use(args.layouts, {n: lay["rows"] for n, lay in doc["layouts"].items()}, link)
        print("\n".join(link_use_lines(doc["link_use"])), flush=True)
    doc["seconds"] = time.monotonic() - t0
    print(f"\n# took {doc['seconds']:.0f} s", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1) + "\n")
    failed = any(c.status == "failed" for lc in cols.values() for c in lc.values())
    figures = [link["one_way"], *link["both"], *link["both_data_sized"]["streams"]]
    return 1 if failed or any(x["gbps"] is None for x in figures) else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt as e:  # the hosts are down by now (namespaces' finally)
        print("# interrupted; the hosts were taken down", file=sys.stderr, flush=True)
        sys.exit(128 + (e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT))
