"""bench/torch_compare.py: one --quick run through torch.distributed (table, adapter line, JSON), and
the driver's guard against hung or failed ranks.

Only the shape of the output is asserted (rows for both backends, positive times and ratios, the JSON
saying what the table says), never a ratio's value: the machines that run this are noisy.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bounds import LAUNCH_S, REAP_S, RUN_HANG_S
from harness import load_bench_script

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "torch_compare.py"
TIME_CELL = re.compile(r"^(\d+\.\d) (us|ms)$")
RATIO_CELL = re.compile(r"^(\d+(?:\.\d+)?(?:e[+-]\d+)?)x$")
ADAPTER_LINE = re.compile(r"^adapter overhead: (-?\d+\.\d) us \(")
DDP_LINE = re.compile(r"^DDP at (\d+) ranks without communication \(.*\): (\d+\.\d) ms in gloo's job, "
                      r"(\d+\.\d) ms in shmcoll's; communication adds (-?\d+\.\d) ms with gloo, "
                      r"(-?\d+\.\d) ms with shmcoll$")
#: --quick launches two jobs (gloo's ranks, then shmcoll's), each bounded like any launched job.
QUICK_RUN_S = 2 * RUN_HANG_S


def _torch():
    """torch, or a skip where it is not installed (imported by the tests, not at collection)."""
    return pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")


def _load_driver():
    """bench/torch_compare.py as a module; its rank module first (the driver imports it)."""
    load_bench_script("torch_compare_rank")
    return load_bench_script("torch_compare")


def _table_rows(out: str) -> list[list[str]]:
    """The markdown table's body: one list of stripped cells per row."""
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0] == "| what | ranks | gloo | shmcoll | shmcoll/gloo |", out
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


@pytest.mark.timeout(QUICK_RUN_S + LAUNCH_S)
def test_quick_run_prints_both_backends_and_writes_the_same_json(tmp_path):
    _torch()
    path = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=QUICK_RUN_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.splitlines()[0].startswith("# $ ") and "torch_compare.py --quick --json" in out.splitlines()[0]
    rows = _table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [("all_reduce 8 B", "2"), ("all_reduce 64 KiB", "2"), ("DDP step", "2")]
    for what, _, gloo, shm, ratio in rows:
        for cell in (gloo, shm):
            m = TIME_CELL.match(cell)
            assert m and float(m.group(1)) > 0, f"{what}: {cell!r}"
            assert m.group(2) == ("ms" if what == "DDP step" else "us")
        m = RATIO_CELL.match(ratio)
        assert m and float(m.group(1)) > 0, f"{what}: {ratio!r}"

    doc = json.loads(path.read_text())
    assert doc["errors"] == [] and len(doc["rows"]) == len(rows)
    for cells, row in zip(rows, doc["rows"]):
        assert cells == [row["what"], str(row["ranks"]), f"{row['gloo']:.1f} {row['unit']}",
                         f"{row['shmcoll']:.1f} {row['unit']}", f"{row['ratio']:.3g}x"]
    adapter = [m for ln in out.splitlines() if (m := ADAPTER_LINE.match(ln))]
    overhead = doc["adapter_overhead"]
    assert len(adapter) == 1 and adapter[0].group(1) == f"{overhead['overhead_us']:.1f}", out
    assert overhead["torch_path_us"] + overhead["own_us"] == pytest.approx(overhead["overhead_us"])
    assert f"torch's own path {overhead['torch_path_us']:.1f} us" in adapter[0].string
    _assert_ddp_line_follows_the_json(out, doc)
    assert f"# malloc: GLIBC_TUNABLES={doc['malloc']} in every rank" in out and doc["malloc"]


def _assert_ddp_line_follows_the_json(out: str, doc: dict) -> None:
    """One line per DDP world size: each job's step without communication, and each step less it."""
    lines = [m for ln in out.splitlines() if (m := DDP_LINE.match(ln))]
    ddp_rows = [r for r in doc["rows"] if r["kind"] == "ddp"]
    assert len(lines) == len(ddp_rows) == 1, out
    (m,), (row,) = lines, ddp_rows
    gloo_alone, shm_alone = row["no_comm"]["gloo"], row["no_comm"]["shmcoll"]
    assert gloo_alone > 0 and shm_alone > 0
    assert m.groups() == (str(row["ranks"]), f"{gloo_alone:.1f}", f"{shm_alone:.1f}",
                          f"{row['gloo'] - gloo_alone:.1f}", f"{row['shmcoll'] - shm_alone:.1f}")


def test_ranks_keep_freed_memory_unless_told_otherwise_or_already_set(monkeypatch):
    """Every rank gets the same malloc settings, whichever the backend; --default-malloc gives none,
    and settings already in the environment are the user's to keep."""
    _torch()
    driver = _load_driver()
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    keep = driver.parse_args(["--quick"]).malloc
    assert keep == driver.KEEP_HEAP and "trim_threshold" in keep
    assert driver.rank_env(1, 2, 29500, 1, keep)["GLIBC_TUNABLES"] == keep
    assert driver.parse_args(["--quick", "--default-malloc"]).malloc == ""
    assert "GLIBC_TUNABLES" not in driver.rank_env(1, 2, 29500, 1, "")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert driver.rank_env(1, 2, 29500, 1, keep)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def _sleepers(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
            for _ in range(count)]


def test_ranks_past_the_timeout_are_killed_and_reported():
    _torch()
    driver = _load_driver()
    procs = _sleepers(2)
    t0 = time.monotonic()
    why = driver.wait_ranks(procs, timeout_s=0.5)
    assert why == "rank(s) [0, 1] killed past the 0.5 s timeout"
    assert time.monotonic() - t0 < 0.5 + REAP_S and all(p.poll() is not None for p in procs)


def test_a_failed_rank_takes_the_others_down_after_the_grace(monkeypatch):
    _torch()
    driver = _load_driver()
    monkeypatch.setattr(driver, "GRACE_S", 0.5)
    procs = _sleepers(1) + [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)]
    why = driver.wait_ranks(procs, timeout_s=RUN_HANG_S)
    assert why == "rank 1 exited with 3; rank(s) [0] killed after the others failed"
    assert procs[0].poll() is not None
