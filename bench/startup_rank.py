"""One rank of bench/startup.py: start a library, make one all-reduce, write down when each step ended.

Started by the driver under a launcher (`shmcoll-run` or `mpirun`) as
`python bench/startup_rank.py LIBRARY OUTDIR`, with STARTUP_BENCH_LAUNCHED_AT in the environment: the
driver's time.time() just before it started the launcher. Every time written here is seconds since
that moment (wall clock, same host, so the driver's and every rank's clocks are the same clock):

  process_start    the kernel's start time of this process (/proc/self/stat, clock ticks: 10 ms)
  program_start    this file's first statement after the standard-library imports
  after_import     numpy and the library imported (for OpenMPI: `from mpi4py import MPI` with
                   mpi4py.rc.initialize off, so the import loads libmpi but does not call MPI_Init)
  after_init       shmcoll.init() / MPI.Init_thread(MPI.THREAD_MULTIPLE) (what `from mpi4py import
                   MPI` does by default) returned
  before_first     a 1 MiB float32 buffer of ones allocated, the first call about to start
  after_first      the first all-reduce (float32 SUM, in place) returned on this rank
  before_close     the measurements below taken, pg.close() / MPI.Finalize() about to start
  after_close      pg.close() / MPI.Finalize() returned

Between after_first and before_close the rank reads /proc/self/status (VmRSS, RssAnon, RssShmem,
RssFile) and /proc/self/maps (the files under /dev/shm it maps), so memory is what a rank holds once
it has made its first call. Then it writes one JSON line to OUTDIR/rank-<rank>.json and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROGRAM_STARTED = time.time()

LAUNCHED_AT_VAR = "STARTUP_BENCH_LAUNCHED_AT"
FIRST_CALL_FLOATS = (1 << 20) // 4  # 1 MiB of float32
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssShmem", "RssFile")
DEV_SHM = "/dev/shm/"


def process_start_wall() -> float:
    """This process's start (fork) time as a time.time() value, to the kernel's clock tick.

    /proc/self/stat field 22 is the start in clock ticks since boot, on the boot-time clock; the wall
    time now minus how long ago that was on the same clock is the wall time it started.
    """
    stat = Path("/proc/self/stat").read_text()
    fields_after_name = stat[stat.rindex(")") + 2:].split()
    start_ticks = int(fields_after_name[19])  # field 22 counted from 1; fields 1-2 are pid and (name)
    since_boot = start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def memory_kib() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssShmem, RssFile from /proc/self/status, in KiB."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in STATUS_FIELDS:
            found[name] = int(value.split()[0])
    return found


def dev_shm_mappings() -> list[dict[str, Any]]:
    """Each distinct file under /dev/shm this process maps (deleted ones too, keyed by device and inode):
    its path as maps shows it and the bytes of it that are mapped (the union of its mapped ranges)."""
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    paths: dict[tuple[str, int], str] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or DEV_SHM not in parts[5]:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        offset, key = int(parts[2], 16), (parts[3], int(parts[4]))
        ranges.setdefault(key, []).append((offset, offset + hi - lo))
        paths[key] = parts[5]
    return [{"path": paths[key], "device": key[0], "inode": key[1], "mapped_bytes": union_length(spans)}
            for key, spans in ranges.items()]


def union_length(spans: list[tuple[int, int]]) -> int:
    """Bytes covered by half-open ranges that may overlap."""
    total, end = 0, -1
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


class Clock:
    """Seconds since the driver started the launcher, one named mark at a time."""

    def __init__(self) -> None:
        self.launched_at = float(os.environ[LAUNCHED_AT_VAR])
        self.marks: dict[str, float] = {}

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = (time.time() if at is None else at) - self.launched_at


def run_shmcoll(clock: Clock) -> dict[str, Any]:
    import importlib.metadata

    import numpy as np

    import shmcoll
    clock.mark("after_import")
    pg = shmcoll.init()
    clock.mark("after_init")
    buf = np.ones(FIRST_CALL_FLOATS, dtype=np.float32)
    clock.mark("before_first")
    pg.all_reduce(buf, shmcoll.ReduceKind.SUM)
    clock.mark("after_first")
    report = measure_process(pg.rank, pg.world_size, bool(buf[0] == pg.world_size))
    report["library"] = f"shmcoll {importlib.metadata.version('shmcoll')}"
    clock.mark("before_close")
    pg.close()
    clock.mark("after_close")
    return report


def run_openmpi(clock: Clock) -> dict[str, Any]:
    import mpi4py
    import numpy as np
    mpi4py.rc.initialize = False  # MPI_Init is timed on its own below
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    clock.mark("after_import")
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    clock.mark("after_init")
    comm = MPI.COMM_WORLD
    buf = np.ones(FIRST_CALL_FLOATS, dtype=np.float32)
    clock.mark("before_first")
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    clock.mark("after_first")
    report = measure_process(comm.rank, comm.size, bool(buf[0] == comm.size))
    version = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    report["library"] = f"{version} via mpi4py {mpi4py.__version__}"
    clock.mark("before_close")
    MPI.Finalize()
    clock.mark("after_close")
    return report


def measure_process(rank: int, world_size: int, result_ok: bool) -> dict[str, Any]:
    return {"rank": rank, "world_size": world_size, "pid": os.getpid(), "result_ok": result_ok,
            "memory_kib": memory_kib(), "dev_shm": dev_shm_mappings()}


RUNNERS = {"shmcoll": run_shmcoll, "openmpi": run_openmpi}


def main(argv: list[str]) -> int:
    library, outdir = argv[0], Path(argv[1])
    clock = Clock()
    clock.mark("process_start", process_start_wall())
    clock.mark("program_start", PROGRAM_STARTED)
    report = RUNNERS[library](clock)
    report["times"] = clock.marks
    (outdir / f"rank-{report['rank']}.json").write_text(json.dumps(report) + "\n")
    return 0 if report["result_ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
