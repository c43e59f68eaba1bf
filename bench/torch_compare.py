"""shmcoll against gloo through torch.distributed only: all_reduce per size, a DDP step, the adapter's cost.

Every number comes from the same calls a torch user makes, `dist.init_process_group(backend)` then
`dist.all_reduce(t)` or a DistributedDataParallel step, so the table says what switching the backend
string from "gloo" to "shmcoll" (after `import shmcoll.torch`) buys. Three measurements:

  all_reduce  float32 SUM, in place, on a CPU tensor of size/4 zeros (zeros, so that repeated sums
              stay finite), per size and backend at --ranks N. Time per call: `--reps` timed loops,
              each after a barrier, timed on rank 0 with time.perf_counter; the median loop is reported.
              Warm-up calls first (20 for small sizes, down to 2 at 64 MiB); the iterations of a loop
              adapt to the size: about 0.25 s by the slowest rank's warm-up, 3 to 2000 calls.
  DDP step    forward + backward + SGD step of DistributedDataParallel (default settings) around
              --layers x Linear(1024, 1024) with ReLU between (16: 64 MiB of float32 gradients) on a
              batch of 8, at each of --ddp-ranks; a few untimed steps, a barrier, then --steps steps
              timed one by one on rank 0; the median step. Then the same on a fresh model whose comm
              hook returns each bucket as it is: a line under the table gives that step without
              communication in each backend's job, and what communication adds to each step.
  adapter     at 8 B in the shmcoll ranks, after the sizes: dist.all_reduce(t) minus the wrapped shmcoll
              group's own all_reduce on a numpy array (dist.group.WORLD.shmcoll_group), their timed
              loops alternating; the medians' difference.

Each check of a result runs outside the timed loops: every all_reduce size first sums rank + 1 once
and compares; after the DDP steps every rank's parameters must equal rank 0's exactly.

This script is the driver: for every world size and backend it starts the ranks as fresh processes
(bench/torch_compare_rank.py, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), which
make the measurements asked for at that size, all_reduce before DDP. Nothing carries over between
backends (a gloo rank does not even import shmcoll). Every rank runs torch.set_num_threads(--threads,
default 1), with OMP_NUM_THREADS the same, and glibc's malloc told to keep freed memory in the heap
(KEEP_HEAP; --default-malloc leaves glibc's defaults, under which a DDP step's time depends on each
rank's heap layout, whichever the backend). A job is killed past --timeout seconds, a rank that fails
takes the others down after a short grace and its error is reported, and the other jobs still run.
Rank 0 hands its results back through a file. The header (with the exact command) is printed first,
progress goes to stderr, the table comes last. Exit status: 0; 1 when a job failed or a check found a
wrong result (its cells say "error"); 2 on a usage error.

    python bench/torch_compare.py                       # sizes 8 B..64 MiB at 2 ranks, DDP at 2 and 4
    python bench/torch_compare.py --quick --json /tmp/torch_compare.json
    python bench/torch_compare.py --sizes 8,1M --ranks 4 --ddp-ranks 2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch_compare_rank import BATCH, WIDTH, Policy

from shmcoll.bench.inputs import UsageError, parse_float32_sizes, parse_world_sizes
from shmcoll.bench.peer_jobs import child_env
from shmcoll.bench.plot import human

BACKENDS = ("gloo", "shmcoll")
DEFAULT_SIZES = "8,64K,1M,16M,64M"
QUICK_SIZES = "8,64K"
RANK_SCRIPT = Path(__file__).resolve().with_name("torch_compare_rank.py")
GRACE_S = 10.0                         # how long the other ranks get to exit once one rank failed
#: glibc's malloc settings every rank of both backends runs with (unless --default-malloc, or
#: GLIBC_TUNABLES is set already): a fixed mmap threshold and a trim threshold of 1 GiB, so freed
#: gradients stay in the heap. With glibc's defaults, whether a process hands the top of its heap
#: back to the kernel after each step, and takes 15-20 ms of page faults in the next, depends on
#: its heap's layout: one rank or both, under either backend, from one run to the next.
KEEP_HEAP = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
EXIT_FAILED = 1

# 16 layers: 16 x (1024 x 1024 + 1024) float32 parameters, 64 MiB of gradients (3 DDP buckets).
# --quick: 4 layers (16 MiB, still 2 buckets, each past the adapter's inline size), loops of ~10 ms.
FULL = Policy(rep_s=0.25, reps=5, max_iters=2000, steps=20, ddp_warmup=3, layers=16, timeout_s=300.0)
QUICK = Policy(rep_s=0.01, reps=3, max_iters=50, steps=2, ddp_warmup=1, layers=4, timeout_s=60.0)


# ---- the driver ----

@dataclass
class Job:
    """One set of ranks: one backend at one world size, making the measurements in `jobs`."""

    backend: str
    ranks: int
    jobs: list[str]
    seconds: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def free_port() -> int:
    """A TCP port nobody listens on now, for torch's store (rank 0 binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, threads: int, malloc: str) -> dict[str, str]:
    """torch's env:// variables for one rank, without any outer launcher's rank variables, and
    `malloc` as glibc's tunables where given (and none are set already)."""
    env = child_env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "OMP_NUM_THREADS": str(threads)})
    if malloc:
        env.setdefault("GLIBC_TUNABLES", malloc)
    return env


def start_ranks(job: Job, spec: dict[str, Any], threads: int, malloc: str,
                logs: list[Path]) -> list[subprocess.Popen]:
    """job.ranks processes of the rank script, each in a session of its own (so killpg reaches only it)."""
    cmd = [sys.executable, str(RANK_SCRIPT), json.dumps(spec)]
    port = free_port()
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, env=rank_env(rank, job.ranks, port, threads, malloc), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
    return procs


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every rank still running (each is its own process group), then reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(timeout=GRACE_S)


def wait_ranks(procs: list[subprocess.Popen], timeout_s: float) -> str:
    """'' when every rank exits 0 in time; else why not. Stragglers are killed either way."""
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    try:
        while None in (codes := [p.poll() for p in procs]):  # every rank polled: any() would stop early
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                break
            time.sleep(0.05)
    finally:
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        kill(procs)
    bad = {r: p.returncode for r, p in enumerate(procs) if p.returncode != 0 and r not in running}
    why = [f"rank {r} exited with {rc}" for r, rc in bad.items()]
    if running:
        why.append(f"rank(s) {running} killed " + ("after the others failed" if bad else
                                                   f"past the {timeout_s:g} s timeout"))
    return "; ".join(why)


def log_tail(path: Path, lines: int = 12) -> str:
    """A rank's last lines (where its traceback is), indented to sit under the error."""
    kept = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-lines:]
    return "\n".join(f"      {ln}" for ln in kept) or "      (no output)"


def run_job(job: Job, spec: dict[str, Any], threads: int, malloc: str, timeout_s: float, tmp: Path) -> Job:
    """Start the ranks, wait for them, and read rank 0's result; on failure the ranks' last lines."""
    name = f"{job.backend}-{job.ranks}"
    spec = {**spec, "jobs": job.jobs, "backend": job.backend, "result_file": str(tmp / f"{name}.json")}
    logs = [tmp / f"{name}-rank{r}.log" for r in range(job.ranks)]
    say(f"{' and '.join(job.jobs)} over {job.backend} at {job.ranks} ranks ...", sys.stderr)
    t0 = time.monotonic()
    why = wait_ranks(start_ranks(job, spec, threads, malloc, logs), timeout_s)
    job.seconds = time.monotonic() - t0
    if not why:
        job.result = json.loads(Path(spec["result_file"]).read_text())
    else:
        job.error = why + "".join(f"\n    rank {r}:\n{log_tail(log)}" for r, log in enumerate(logs))
    say(f"  -> {'ok' if not why else 'FAILED: ' + why} after {job.seconds:.1f} s", sys.stderr)
    return job


def say(msg: str, stream=None) -> None:
    print(f"# {msg}", file=stream or sys.stdout, flush=True)


def plan_jobs(args: argparse.Namespace) -> list[Job]:
    """One job per world size and backend (gloo first), doing what --ranks and --ddp-ranks ask at that
    size: one start-up per backend and size, the slowest part of a --quick run."""
    jobs = []
    for n in sorted(set(args.ranks) | set(args.ddp_ranks)):
        wanted = [name for name, sizes in (("all_reduce", args.ranks), ("ddp", args.ddp_ranks)) if n in sizes]
        jobs += [Job(b, n, wanted) for b in BACKENDS]
    return jobs


# ---- the report ----

def ratio(shm: float | None, gloo: float | None) -> float | None:
    return shm / gloo if shm is not None and gloo else None


def result(jobs: list[Job], kind: str, backend: str, ranks: int) -> dict[str, Any]:
    """What rank 0 measured for `kind` over `backend` at `ranks`; empty when that job failed."""
    job = next(j for j in jobs if (j.backend, j.ranks) == (backend, ranks))
    return job.result.get(kind, {})


def records(jobs: list[Job], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One record per table row: (what, ranks, gloo, shmcoll, ratio), in the table's unit."""
    rows = []
    for n in args.ranks:
        by_backend = {b: {r["size"]: r for r in result(jobs, "all_reduce", b, n).get("rows", [])}
                      for b in BACKENDS}
        for size in args.sizes:
            gloo, shm = (by_backend[b].get(size, {}).get("median_us") for b in BACKENDS)
            rows.append({"what": f"all_reduce {human(size)}", "kind": "all_reduce", "size": size, "ranks": n,
                         "unit": "us", "gloo": gloo, "shmcoll": shm, "ratio": ratio(shm, gloo)})
    for n in args.ddp_ranks:
        gloo, shm = (result(jobs, "ddp", b, n).get("median_ms") for b in BACKENDS)
        no_comm = {b: result(jobs, "ddp", b, n).get("no_comm_median_ms") for b in BACKENDS}
        rows.append({"what": "DDP step", "kind": "ddp", "ranks": n, "unit": "ms", "gloo": gloo, "shmcoll": shm,
                     "ratio": ratio(shm, gloo), "no_comm": no_comm})
    return rows


def cell(value: float | None, unit: str) -> str:
    return "error" if value is None else f"{value:.1f} {unit}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per size or DDP world size, both backends and shmcoll's time over gloo's."""
    lines = ["| what | ranks | gloo | shmcoll | shmcoll/gloo |", "|---|---|---|---|---|"]
    for r in rows:
        ratio_text = "-" if r["ratio"] is None else f"{r['ratio']:.3g}x"
        lines.append(f"| {r['what']} | {r['ranks']} | {cell(r['gloo'], r['unit'])} | "
                     f"{cell(r['shmcoll'], r['unit'])} | {ratio_text} |")
    return lines


def adapter_line(adapter: dict[str, Any] | None, ranks: int) -> str:
    if adapter is None:
        return "adapter overhead: error (the shmcoll all_reduce job failed)"
    return (f"adapter overhead: {adapter['overhead_us']:.1f} us (dist.all_reduce {adapter['torch_us']:.1f} us - "
            f"shmcoll_group.all_reduce {adapter['direct_us']:.1f} us, {human(adapter['size'])}, {ranks} ranks); "
            f"of it torch's own path {adapter['torch_path_us']:.1f} us (a Python group that only makes the "
            f"shmcoll call: {adapter['floor_us']:.1f} us) and shmcoll.torch's {adapter['own_us']:.1f} us")


def ddp_line(row: dict[str, Any]) -> str:
    """What communication adds to a DDP step: each backend's step less the same job's step without it."""
    base = row["no_comm"]
    if None in (row["gloo"], row["shmcoll"], *base.values()):
        return f"DDP at {row['ranks']} ranks without communication: error (a DDP job failed)"
    added = {b: row[b] - base[b] for b in BACKENDS}
    return (f"DDP at {row['ranks']} ranks without communication (a comm hook that returns each bucket as it is): "
            f"{base['gloo']:.1f} ms in gloo's job, {base['shmcoll']:.1f} ms in shmcoll's; communication adds "
            f"{added['gloo']:.1f} ms with gloo, {added['shmcoll']:.1f} ms with shmcoll")


def header(args: argparse.Namespace, command: str) -> list[str]:
    """The exact command, then what was measured and how, in a few comment lines."""
    p = args.policy
    return [f"$ {command}",
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s) per rank; "
            "shmcoll/gloo = shmcoll's time / gloo's (below 1: shmcoll is faster)",
            "malloc: " + (f"GLIBC_TUNABLES={args.malloc} in every rank of both backends (unless set already), so "
                          "no rank returns its freed gradients to the kernel after each step"
                          if args.malloc else "glibc's defaults (--default-malloc)"),
            f"all_reduce: float32 SUM in place; median of {p.reps} timed loops (each after a barrier, "
            f"about {p.rep_s:g} s, at most {p.max_iters} calls), rank 0's time per call",
            f"DDP step: forward + backward + SGD, {p.layers} x Linear({WIDTH}, {WIDTH}) ({p.grad_bytes / 2**20:.1f} "
            f"MiB of float32 gradients), batch {BATCH}; median of {p.steps} steps after {p.ddp_warmup} untimed, "
            "rank 0's time; then the same step on a fresh model whose comm hook communicates nothing"]


def report(jobs: list[Job], args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Print the table, the adapter's overhead and any errors; return the JSON document."""
    rows = records(jobs, args)
    adapter = result(jobs, "all_reduce", "shmcoll", args.ranks[0]).get("adapter")
    ddp_lines = [ddp_line(r) for r in rows if r["kind"] == "ddp"]
    print("\n".join(["", *table(rows), "", adapter_line(adapter, args.ranks[0]), *ddp_lines]), flush=True)
    errors = [f"{' and '.join(j.jobs)} over {j.backend} at {j.ranks} ranks: {j.error}" for j in jobs if j.error]
    for e in errors:
        print(f"error: {e}", flush=True)
    return {"command": command, "policy": asdict(args.policy), "threads": args.threads, "malloc": args.malloc,
            "rows": rows,
            "adapter_overhead": adapter, "errors": errors,
            "jobs": [asdict(j) for j in jobs]}


# ---- options ----

def int_list(text: str) -> list[int]:
    """'2,4' -> [2, 4] (argparse type): world sizes, each at least 2."""
    try:
        return parse_world_sizes(text, 2)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_list(text: str) -> list[int]:
    """'8,64K,1M' -> [8, 65536, 1048576] (argparse type); each rounded down to whole float32s."""
    try:
        sizes = parse_float32_sizes(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("--sizes is empty")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/torch_compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="What is measured and how: the module docstring and bench/README.md.")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: sizes {QUICK_SIZES}, DDP at 2 ranks, {QUICK.steps} steps, short loops")
    p.add_argument("--sizes", type=size_list, default=None, metavar="LIST",
                   help=f"all_reduce sizes in bytes, K/M/G suffixes allowed (default {DEFAULT_SIZES})")
    p.add_argument("--ranks", type=int_list, default=None, metavar="LIST", help="all_reduce world sizes (default 2)")
    p.add_argument("--ddp-ranks", dest="ddp_ranks", type=int_list, default=None, metavar="LIST",
                   help="DDP world sizes (default 2,4; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help=f"timed DDP steps (default {FULL.steps})")
    p.add_argument("--reps", type=int, default=None, help=f"timed all_reduce loops per size (default {FULL.reps})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"Linear(1024, 1024) layers of the DDP model (default {FULL.layers}: 64 MiB of gradients; "
                        f"--quick {QUICK.layers})")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every rank (default 1)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds before one job's ranks are killed (default {FULL.timeout_s:g}; --quick "
                        f"{QUICK.timeout_s:g})")
    p.add_argument("--default-malloc", dest="malloc", action="store_const", const="", default=KEEP_HEAP,
                   help="run the ranks with glibc's own malloc settings (default: GLIBC_TUNABLES=" + KEEP_HEAP + ")")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the results here")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, with --quick's or the full run's defaults for what was not given."""
    p = build_parser()
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    args.sizes = args.sizes or size_list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.ranks = args.ranks or [2]
    args.ddp_ranks = args.ddp_ranks or ([2] if args.quick else [2, 4])
    overrides = {"steps": args.steps, "reps": args.reps, "layers": args.layers, "timeout_s": args.timeout}
    args.policy = Policy(**{**asdict(base), **{k: v for k, v in overrides.items() if v is not None}})
    pol = args.policy
    if min(pol.steps, pol.reps, pol.layers, args.threads) < 1 or pol.timeout_s <= 0:
        p.error("need --steps, --reps, --layers and --threads of at least 1, and --timeout > 0")
    if args.json_path and not Path(args.json_path).resolve().parent.is_dir():
        p.error(f"directory of {args.json_path!r} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = shlex.join(sys.orig_argv) if argv is None else shlex.join(["python", "bench/torch_compare.py", *argv])
    for line in header(args, command):
        say(line)
    spec = {"sizes": args.sizes, "threads": args.threads, "policy": asdict(args.policy)}
    with tempfile.TemporaryDirectory(prefix="torch-compare-") as tmp:
        jobs = [run_job(j, spec, args.threads, args.malloc, args.policy.timeout_s, Path(tmp)) for j in plan_jobs(args)]
    doc = report(jobs, args, command)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1) + "\n")
        say(f"wrote {args.json_path}")
    return EXIT_FAILED if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
