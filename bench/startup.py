"""What it costs to start a job: shmcoll against OpenMPI (mpi4py), N ranks on this host, in one run.

A collective library's per-call speed is only half of what a user waits for: a job of many short
runs (tests, sweeps, launches under a scheduler) pays the launcher, the imports, the rendezvous and
the first call every time, and every rank holds its memory for the whole job. This script measures
that, for each world size in --ranks, each library in its own job, one after the other:

  shmcoll   shmcoll-run -n N python bench/startup_rank.py shmcoll OUTDIR
  openmpi   mpirun --allow-run-as-root --oversubscribe -np N --bind-to none --mca mpi_yield_when_idle 1
            python bench/startup_rank.py openmpi OUTDIR

Each rank (bench/startup_rank.py; its docstring lists every mark) imports numpy and the library,
initialises it (shmcoll.init() / MPI.Init_thread), makes one 1 MiB float32 SUM all-reduce in place,
reads its memory (/proc/self/status) and the /dev/shm files it maps (/proc/self/maps), closes the
library and writes one JSON file. Every time is seconds since the driver started the launcher: the
driver passes its time.time() in STARTUP_BENCH_LAUNCHED_AT, and ranks on the same host read the
same clock. The table's columns:

  whole job        launcher started -> launcher exited, timed by the driver
  start            the last rank's first line of Python (launcher + fork/exec + interpreter start)
  import           max over ranks of (after importing numpy and the library - first line)
  init             max over ranks of (after init - after import)
  first call       max over ranks of (after the first all-reduce - before it)
  shm reserved     rank 0's /dev/shm files: the bytes of each that rank 0 maps, summed
  RSS per rank     VmRSS after the first call, the largest rank's / the median rank's
  named objects    the distinct /dev/shm files rank 0 maps (unlinked ones count: "(deleted)" in maps)

A second table gives the timeline (each mark, the last rank's) and a third the memory in parts
(RssAnon, RssShmem, RssFile) and the /dev/shm files of all ranks together. One sample per job: on a
small or busy machine run it twice before believing a difference under ~20%.

Without mpirun or mpi4py (or with --no-mpi) only shmcoll is measured, and a line says why. Every job
is stopped (its whole process group) after --timeout seconds. Exit status 0; 1 when a job failed or
timed out; 2 on a usage error.

    python bench/startup.py                          # --ranks 8,16,32
    python bench/startup.py --ranks 4,8 --json /tmp/startup.json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmcoll.bench.inputs import UsageError, parse_world_sizes
from shmcoll.bench.peer_jobs import EXIT_TIMEOUT, child_env, missing_reason, run_command, tail

RANK_PROGRAM = Path(__file__).resolve().with_name("startup_rank.py")
LAUNCHED_AT_VAR = "STARTUP_BENCH_LAUNCHED_AT"  # read by startup_rank.py
SHMCOLL, OPENMPI = "shmcoll", "openmpi"
MIB = 1 << 20
TIMELINE = ("process_start", "program_start", "after_import", "after_init", "before_first", "after_first",
            "before_close", "after_close")
MAIN_COLUMNS = ("ranks", "library", "whole job (s)", "start (s)", "import (s)", "init (s)", "first call (s)",
                "shm reserved (MiB)", "RSS per rank max/median (MiB)", "named objects")


@dataclass
class Job:
    """One launch of N ranks of one library, and what its ranks wrote."""

    library: str
    ranks: int
    command: list[str]
    status: str = "ok"          # ok, failed, timed out, skipped
    reason: str = ""
    whole_s: float = 0.0
    per_rank: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---- launching ----

def shmcoll_command(n: int, outdir: Path) -> list[str]:
    launcher = shutil.which("shmcoll-run")
    launcher_cmd = [launcher] if launcher else [sys.executable, "-m", "shmcoll.launch.run_cli"]
    return [*launcher_cmd, "-n", str(n), sys.executable, str(RANK_PROGRAM), SHMCOLL, str(outdir)]


def openmpi_command(n: int, outdir: Path, mpirun: str) -> list[str]:
    return [shutil.which(mpirun) or mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(n),
            "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
            sys.executable, str(RANK_PROGRAM), OPENMPI, str(outdir)]


def run_job(library: str, n: int, args: argparse.Namespace, workdir: Path) -> Job:
    outdir = Path(tempfile.mkdtemp(prefix=f"{library}-{n}-", dir=workdir))
    cmd = shmcoll_command(n, outdir) if library == SHMCOLL else openmpi_command(n, outdir, args.mpirun)
    job = Job(library, n, cmd)
    print(f"# $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = child_env()
    env[LAUNCHED_AT_VAR] = repr(time.time())
    started = time.monotonic()
    rc, out, err = run_command(cmd, args.timeout, env)
    job.whole_s = time.monotonic() - started
    print(f"#   -> exit {rc} after {job.whole_s:.2f} s", file=sys.stderr, flush=True)
    job.per_rank = read_rank_files(outdir)
    judge(job, rc, out + err)
    return job


def read_rank_files(outdir: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(p.read_text()) for p in outdir.glob("rank-*.json")), key=lambda r: r["rank"])


def judge(job: Job, rc: int, output: str) -> None:
    """ok only when the launcher exited 0 and every rank wrote a right result."""
    if rc == EXIT_TIMEOUT:
        job.status, job.reason = "timed out", f"killed after the timeout: {tail(output)}"
    elif rc != 0:
        job.status, job.reason = "failed", f"exit {rc}: {tail(output)}"
    elif len(job.per_rank) != job.ranks:
        job.status, job.reason = "failed", f"{len(job.per_rank)} of {job.ranks} ranks wrote results"
    elif not all(r["result_ok"] for r in job.per_rank):
        job.status, job.reason = "failed", "a rank's all-reduce result was wrong"


def skipped(library: str, n: int, reason: str) -> Job:
    return Job(library, n, [], status="skipped", reason=reason)


# ---- summarising one job ----

def latest(job: Job, mark: str) -> float:
    """The last rank's time of a mark, seconds since launch."""
    return max(r["times"][mark] for r in job.per_rank)


def longest(job: Job, start: str, end: str) -> float:
    """The longest step from one mark to the next over the ranks."""
    return max(r["times"][end] - r["times"][start] for r in job.per_rank)


def max_median(values: list[float]) -> dict[str, float]:
    return {"max": max(values), "median": statistics.median(values)}


def memory_mib(job: Job, name: str) -> dict[str, float]:
    return max_median([r["memory_kib"].get(name, 0) / 1024 for r in job.per_rank])


def shm_files(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Distinct /dev/shm files over these ranks (by device and inode) and their mapped MiB, summed."""
    sizes: dict[tuple[str, int], int] = {}
    for r in ranks:
        for f in r["dev_shm"]:
            key = (f["device"], f["inode"])
            sizes[key] = max(sizes.get(key, 0), f["mapped_bytes"])
    return {"files": len(sizes), "mib": sum(sizes.values()) / MIB}


def summarize(job: Job) -> dict[str, Any]:
    return {
        "whole_job_s": job.whole_s,
        "start_s": latest(job, "program_start"),
        "import_s": longest(job, "program_start", "after_import"),
        "init_s": longest(job, "after_import", "after_init"),
        "first_call_s": longest(job, "before_first", "after_first"),
        "close_s": longest(job, "before_close", "after_close"),
        "timeline_s": {mark: latest(job, mark) for mark in TIMELINE},
        "rss_mib": memory_mib(job, "VmRSS"),
        "rss_anon_mib": memory_mib(job, "RssAnon"),
        "rss_shmem_mib": memory_mib(job, "RssShmem"),
        "rss_file_mib": memory_mib(job, "RssFile"),
        "hwm_mib": memory_mib(job, "VmHWM"),
        "dev_shm_rank0": shm_files([r for r in job.per_rank if r["rank"] == 0]),
        "dev_shm_all_ranks": shm_files(job.per_rank),
        "library_version": job.per_rank[0]["library"],
    }


# ---- output ----

def markdown(header: tuple[str, ...] | list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]


def pair(stats: dict[str, float]) -> str:
    return f"{stats['max']:.0f} / {stats['median']:.0f}"


def main_row(job: Job, s: dict[str, Any] | None) -> list[str]:
    if s is None:
        return [str(job.ranks), job.library, job.status, *["-"] * (len(MAIN_COLUMNS) - 3)]
    return [str(job.ranks), job.library, f"{s['whole_job_s']:.2f}", f"{s['start_s']:.2f}", f"{s['import_s']:.2f}",
            f"{s['init_s']:.3f}", f"{s['first_call_s']:.3f}", f"{s['dev_shm_rank0']['mib']:.1f}",
            pair(s["rss_mib"]), str(s["dev_shm_rank0"]["files"])]


def timeline_table(done: list[tuple[Job, dict[str, Any]]]) -> list[str]:
    header = ["ranks", "library", *TIMELINE, "launcher exit"]
    rows = [[str(job.ranks), job.library, *(f"{s['timeline_s'][m]:.2f}" for m in TIMELINE), f"{job.whole_s:.2f}"]
            for job, s in done]
    return markdown(header, rows)


def memory_table(done: list[tuple[Job, dict[str, Any]]]) -> list[str]:
    header = ["ranks", "library", "VmRSS max/med", "RssAnon max/med", "RssShmem max/med", "RssFile max/med",
              "VmHWM max", "/dev/shm files, all ranks", "/dev/shm MiB, all ranks"]
    rows = [[str(job.ranks), job.library, pair(s["rss_mib"]), pair(s["rss_anon_mib"]), pair(s["rss_shmem_mib"]),
             pair(s["rss_file_mib"]), f"{s['hwm_mib']['max']:.0f}", str(s["dev_shm_all_ranks"]["files"]),
             f"{s['dev_shm_all_ranks']['mib']:.1f}"] for job, s in done]
    return markdown(header, rows)


def report(jobs: list[Job], summaries: list[dict[str, Any] | None]) -> list[str]:
    done = [(job, s) for job, s in zip(jobs, summaries) if s is not None]
    lines = ["", *markdown(MAIN_COLUMNS, [main_row(job, s) for job, s in zip(jobs, summaries)])]
    lines += ["", "Timeline: seconds since the launcher started, the last rank's (memory in MiB below)", ""]
    lines += timeline_table(done) + [""] + memory_table(done)
    libraries = sorted({f"{job.library}: {s['library_version']}" for job, s in done})
    notes = [f"{job.library} at {job.ranks} ranks {job.status}: {job.reason}" for job in jobs if not job.ok]
    return lines + [""] + [f"# {text}" for text in libraries + notes]


def write_json(path: Path, args: argparse.Namespace, jobs: list[Job], summaries: list[dict[str, Any] | None]) -> None:
    doc = {"config": {"ranks": args.ranks, "timeout_s": args.timeout, "cpus": os.cpu_count(),
                      "python": sys.version.split()[0]},
           "jobs": [{"library": job.library, "ranks": job.ranks, "status": job.status, "reason": job.reason,
                     "command": shlex.join(job.command), "summary": s, "per_rank": job.per_rank}
                    for job, s in zip(jobs, summaries)]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


# ---- command line ----

def rank_list(text: str) -> list[int]:
    """'8,16,32' -> [8, 16, 32] (argparse type)."""
    try:
        return parse_world_sizes(text, 1)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=rank_list, default=[8, 16, 32], help="world sizes (default 8,16,32)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before one job is killed (default 600)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every measurement here")
    p.add_argument("--no-mpi", action="store_true", help="measure shmcoll only")
    p.add_argument("--mpirun", default="mpirun", help="the mpirun to use (default: mpirun on PATH)")
    return p


def libraries(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The libraries to launch, and why OpenMPI is not among them (None when it is)."""
    why_not = "--no-mpi" if args.no_mpi else missing_reason(OPENMPI, args.mpirun)
    return ([SHMCOLL] if why_not else [SHMCOLL, OPENMPI]), why_not


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chosen, why_not_mpi = libraries(args)
    print(f"# startup: ranks {','.join(map(str, args.ranks))} on {os.cpu_count()} CPUs, libraries "
          f"{', '.join(chosen)}; one job at a time, timeout {args.timeout:g} s each", flush=True)
    if why_not_mpi:
        print(f"# OpenMPI not measured: {why_not_mpi}", flush=True)
    jobs = []
    with tempfile.TemporaryDirectory(prefix="shmcoll-startup-") as tmp:
        for n in args.ranks:
            jobs += [run_job(library, n, args, Path(tmp)) for library in chosen]
            if why_not_mpi and not args.no_mpi:
                jobs.append(skipped(OPENMPI, n, why_not_mpi))
    summaries = [summarize(job) if job.ok else None for job in jobs]
    print("\n".join(report(jobs, summaries)), flush=True)
    if args.json:
        write_json(args.json, args, jobs, summaries)
    return 0 if all(job.ok or job.status == "skipped" for job in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
