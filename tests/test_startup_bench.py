"""bench/startup.py: one 2-rank shmcoll-only run (--no-mpi) has the table's columns, positive times and
a JSON that agrees with it; and, without starting anything, the pieces a rank reads /proc with.

Only the shape is asserted, never a time's value: the machines that run this are noisy.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bounds import RUN_HANG_S
from harness import REPO, load_bench_script

SCRIPT = REPO / "bench" / "startup.py"
COLUMNS = ["ranks", "library", "whole job (s)", "start (s)", "import (s)", "init (s)", "first call (s)",
           "shm reserved (MiB)", "RSS per rank max/median (MiB)", "named objects"]


startup = load_bench_script("startup")
startup_rank = load_bench_script("startup_rank")


def table_rows(stdout: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, body rows) of the first markdown table."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    cells = lambda ln: [c.strip() for c in ln.strip("|").split("|")]
    header_at = next(i for i, ln in enumerate(lines) if cells(ln)[:1] == ["ranks"])
    body = []
    for ln in lines[header_at + 2:]:
        if cells(ln)[:1] == ["ranks"]:
            break
        body.append(cells(ln))
    return cells(lines[header_at]), body


@pytest.mark.multiprocess
def test_two_ranks_without_mpi(tmp_path):
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "2", "--no-mpi", "--timeout", f"{RUN_HANG_S:g}",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=RUN_HANG_S + 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# OpenMPI not measured: --no-mpi" in proc.stdout
    header, body = table_rows(proc.stdout)
    assert header == COLUMNS
    assert len(body) == 1 and body[0][:2] == ["2", "shmcoll"]
    row = dict(zip(header, body[0]))
    for name in ("whole job (s)", "start (s)", "import (s)", "init (s)", "first call (s)", "shm reserved (MiB)"):
        assert float(row[name]) > 0, (name, proc.stdout)
    rss_max, rss_median = (float(x) for x in row["RSS per rank max/median (MiB)"].split("/"))
    assert rss_max >= rss_median > 0
    assert int(row["named objects"]) >= 1

    doc = json.loads(out.read_text())
    (job,) = doc["jobs"]
    assert job["library"] == "shmcoll" and job["status"] == "ok" and len(job["per_rank"]) == 2
    summary = job["summary"]
    assert float(row["whole job (s)"]) == pytest.approx(summary["whole_job_s"], abs=0.006)
    times = list(summary["timeline_s"].values())
    assert times == sorted(times)  # each mark at or after the one before
    assert summary["timeline_s"]["after_close"] <= summary["whole_job_s"]


def test_union_length_counts_overlaps_once():
    assert startup_rank.union_length([]) == 0
    assert startup_rank.union_length([(0, 10), (5, 20), (30, 40)]) == 30
    assert startup_rank.union_length([(0, 100), (10, 20)]) == 100


def test_dev_shm_files_merge_over_ranks():
    rank = lambda *files: {"dev_shm": [{"device": "00:1", "inode": i, "mapped_bytes": b} for i, b in files]}
    found = startup.shm_files([rank((1, 1 << 20), (2, 2 << 20)), rank((1, 3 << 20))])
    assert found == {"files": 2, "mib": 5.0}


def test_rank_list():
    assert startup.rank_list("8,16, 32") == [8, 16, 32]
    for bad in ("", "0", "4,x"):
        with pytest.raises(Exception, match="world size"):
            startup.rank_list(bad)
