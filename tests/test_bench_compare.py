"""bench/compare.py: one tiny real run (table, JSON, ratios, plot), and the skip messages for missing peers;
and the peer machinery it shares with `shmcoll-bench --compare` (shmcoll/bench/peer_jobs.py, peers.py and
the descriptors' unsupported()): launching with a timeout, skip and failure reasons, the ratio math.

OpenMPI/mpi4py and torch are optional here: where one is missing, its skip message is asserted
instead of its rows. A second run hides them on purpose, so the skip paths always run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmcoll.bench import table
from shmcoll.bench.adapters import GLOO, OPENMPI
from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.peer_jobs import PeerRun, compare_doc, missing_reason, ratios, run_command, run_peer, with_ratios
from shmcoll.rendezvous.launchers import LOCAL_RANK_VARS, RANK_VARS, WORLD_SIZE_VARS

from bounds import RUN_HANG_S
from harness import load_bench_script

REPO = Path(__file__).resolve().parents[1]
COMPARE = REPO / "bench" / "compare.py"


compare_report = load_bench_script("compare_report")
PeerResult, compare, targets = compare_report.PeerResult, compare_report.compare, compare_report.targets

TINY = ["-n", "2", "--sizes", "8,64K", "--transports", "tcp", "--iters", "20", "--warmup", "2",
        "--max-time", "0.3", "--timeout", "40"]
SIZES = [8, 65536]
LABELS = {8: "8 B", 65536: "64 KiB"}


def env_without_ranks(**extra) -> dict:
    drop = set(RANK_VARS) | set(WORLD_SIZE_VARS) | set(LOCAL_RANK_VARS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def compare_run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(COMPARE), *TINY, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_HANG_S, env=env or env_without_ranks())


def mpi_installed() -> bool:
    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def times_table(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    """(peer names from the header, size label -> cells) of the time/busbw table."""
    lines = stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("#") and ln.split()[1:2] == ["size"])
    names = re.findall(r"(\S+) us\s+GB/s", header)
    start = lines.index(header) + 1
    body = {}
    for ln in lines[start:start + len(SIZES)]:
        label = " ".join(ln.split()[:2])
        body[label] = ln.split()[2:]
        assert len(ln) == len(header), f"columns not aligned:\n{header}\n{ln}"
    return names, body


def ratio_lines(stdout: str, peer: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"# {peer}: ratios"))
    return {" ".join(ln.split()[:2]): ln.split()[2:] for ln in lines[at + 2:at + 2 + len(SIZES)]}


@pytest.mark.multiprocess
def test_tiny_run_table_json_ratios(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = compare_run("--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    peers = doc["peers"]
    assert doc["config"]["world_size"] == 2 and doc["config"]["sizes"] == SIZES
    assert peers["shmcoll-tcp"]["status"] == "ok"
    expected = {"shmcoll-tcp": True, "openmpi": mpi_installed(), "gloo": torch_installed()}
    for name, present in expected.items():
        if present:
            assert peers[name]["status"] == "ok", peers[name]
        else:
            assert peers[name]["status"] == "skipped"
            assert f"SKIPPED {name}: {peers[name]['reason']}" in proc.stdout
    ran = [name for name, present in expected.items() if present]

    rows = {(r["peer"], r["size"]): r for r in doc["rows"]}
    assert set(rows) == {(p, s) for p in ran for s in SIZES}
    for r in rows.values():
        assert r["time_us"] > 0 and r["iters"] >= 3 and r["dtype"] == "f32" and r["in_place"] == "yes"
        assert math.isclose(r["busbw"], r["size"] / (r["time_us"] * 1e-6) / 1e9 * 1.0, rel_tol=1e-9)  # 2(n-1)/n = 1

    names, body = times_table(proc.stdout)
    assert names == ran
    for size in SIZES:
        cells = body[LABELS[size]]
        assert len(cells) == 2 * len(ran)
        for k, peer in enumerate(ran):
            assert float(cells[2 * k]) == pytest.approx(rows[peer, size]["time_us"], abs=0.006)
            assert float(cells[2 * k + 1]) == pytest.approx(rows[peer, size]["busbw"], abs=0.0006)

    table = ratio_lines(proc.stdout, "shmcoll-tcp")
    for rec in doc["comparison"]:
        mine = rows["shmcoll-tcp", rec["size"]]["time_us"]
        mpi_max, gloo_min = targets(2, rec["size"])
        cells = table[LABELS[rec["size"]]]
        assert rec["openmpi_target_max"] == mpi_max and rec["gloo_target_min"] == gloo_min
        if "openmpi" in ran:
            ratio = mine / rows["openmpi", rec["size"]]["time_us"]
            assert rec["shmcoll_over_openmpi"] == pytest.approx(ratio, rel=1e-9)
            assert rec["openmpi_target_met"] == (ratio <= mpi_max)
            assert float(cells[0].rstrip("x")) == pytest.approx(ratio, abs=0.006)
            assert cells[2] == ("yes" if ratio <= mpi_max else "NO")
        else:
            assert rec["shmcoll_over_openmpi"] is None and cells[0] == "-"
        if "gloo" in ran:
            ratio = rows["gloo", rec["size"]]["time_us"] / mine
            assert rec["gloo_over_shmcoll"] == pytest.approx(ratio, rel=1e-9)
            assert rec["gloo_target_met"] == (ratio >= gloo_min)
            assert float(cells[3].rstrip("x")) == pytest.approx(ratio, abs=0.006)
            assert cells[5] == ("yes" if ratio >= gloo_min else "NO")
        else:
            assert rec["gloo_over_shmcoll"] is None and cells[3] == "-"

    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot written to {png}" in proc.stdout
    else:
        assert "matplotlib is not installed" in proc.stdout and not png.exists()


@pytest.mark.multiprocess
def test_missing_peers_are_skipped_with_reasons(tmp_path):
    """No mpirun, and torch and matplotlib hidden behind modules that fail to import."""
    shadow = tmp_path / "shadow"
    for mod in ("torch", "matplotlib"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(f"raise ImportError('{mod} hidden by the test')\n")
    env = env_without_ranks(PYTHONPATH=os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "c.json"
    proc = compare_run("--mpirun", "/nonexistent/mpirun", "--json", str(out), "--plot", str(tmp_path / "c.png"),
                       env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SKIPPED openmpi: '/nonexistent/mpirun' not found on PATH" in proc.stdout
    assert re.search(r"SKIPPED gloo: .*torch is not importable \(torch hidden by the test\)", proc.stdout)
    assert "matplotlib is not installed" in proc.stdout and not (tmp_path / "c.png").exists()
    doc = json.loads(out.read_text())
    assert {k: v["status"] for k, v in doc["peers"].items()} == {
        "shmcoll-tcp": "ok", "openmpi": "skipped", "gloo": "skipped"}
    assert {r["peer"] for r in doc["rows"]} == {"shmcoll-tcp"}
    names, _ = times_table(proc.stdout)
    assert names == ["shmcoll-tcp"]
    assert "# shmcoll-tcp: 0 of 0 targets met (4 not judged" in proc.stdout


def test_compare_ratios_and_targets_alone():
    shm, mpi, gloo = PeerResult("shmcoll-x"), PeerResult("openmpi"), PeerResult("gloo")
    shm.merge([{"size": 8, "time_us": 8.0}, {"size": 1 << 20, "time_us": 100.0}, {"size": 96, "time_us": 9.0}])
    shm.merge([{"size": 8, "time_us": 10.0}])  # best of rounds: the lower time stays
    mpi.merge([{"size": 8, "time_us": 1.0}, {"size": 1 << 20, "time_us": 100.0}])
    gloo.merge([{"size": 8, "time_us": 400.0}, {"size": 1 << 20, "time_us": 250.0}])
    recs = {r["size"]: r for r in compare(2, shm, mpi, gloo, [8, 96, 1 << 20])}
    assert recs[8]["shmcoll_over_openmpi"] == 8.0 and recs[8]["openmpi_target_met"] is False
    assert recs[8]["gloo_over_shmcoll"] == 50.0 and recs[8]["gloo_target_met"] is True
    assert recs[1 << 20]["openmpi_target_met"] is True and recs[1 << 20]["gloo_target_met"] is False
    assert recs[96]["openmpi_target_met"] is None and recs[96]["gloo_target_min"] is None
    assert targets(4, 8) == (2.0, None) and targets(4, 1 << 20) == (1.0, None) and targets(3, 8) == (None, None)
    assert targets(4, 96) == (None, None)


# ---- the peer machinery shared with shmcoll-bench --compare ----

MINE = [{"size": 8, "time_us": 10.0}, {"size": 64, "time_us": 30.0}, {"size": 512, "time_us": 5.0}]
THEIRS = [{"size": 8, "time_us": 2.0, "wrong": 0}, {"size": 64, "time_us": 60.0, "wrong": 3}]


def test_ratios_on_synthetic_rows():
    assert ratios(MINE, THEIRS) == {8: 5.0, 64: 0.5, 512: None}
    peer = PeerRun(OPENMPI, library="x", rows=THEIRS)
    assert peer.wrong == 3
    assert [(r["peer"], r["shmcoll_over_peer"]) for r in with_ratios(MINE, peer)] == [(OPENMPI, 5.0), (OPENMPI, 0.5)]
    doc = compare_doc(MINE, [peer, PeerRun(GLOO, status="skipped", reason="torch is not installed")])
    assert [(r["peer"], r["size"]) for r in doc["rows"]] == [("shmcoll", 8), ("shmcoll", 64), ("shmcoll", 512),
                                                             (OPENMPI, 8), (OPENMPI, 64)]
    assert doc["peers"][GLOO] == {"status": "skipped", "reason": "torch is not installed", "library": "",
                                  "command": ""}


def test_ratio_table_and_peer_sections_as_printed():
    lines = table.format_ratios(MINE, [PeerRun(OPENMPI, rows=THEIRS), PeerRun(GLOO, status="skipped")])
    assert lines[1] == "# shmcoll time / peer time, per size (below 1: shmcoll is faster)"
    assert lines[2].split() == ["#", "size(B)", OPENMPI]  # a skipped peer gets no column
    assert [ln.split() for ln in lines[3:]] == [["8", "5x"], ["64", "0.5x"], ["512", "-"]]
    assert all(len(ln) == len(lines[2]) for ln in lines[3:])
    assert table.format_ratios(MINE, [PeerRun(GLOO, status="skipped")])[-1] == "# no peer ran: nothing to compare"
    assert table.format_peer(PeerRun(GLOO, status="failed", reason="exit 1: boom"), 2, False) == [
        "#", "# peer: gloo: failed: exit 1: boom"]


def test_what_each_peer_cannot_run():
    def unsupported(peer, collective, dtype, op):
        return COLLECTIVES[collective].unsupported(peer, dtype, op)

    for dtype in ("f16", "bf16"):
        assert f"no {dtype} datatype" in unsupported(OPENMPI, "all_reduce", dtype, "sum")
        assert unsupported(OPENMPI, "all_gather", dtype, "sum") is None  # moved as bytes
        assert unsupported(GLOO, "all_reduce", dtype, "avg") is None
    assert "no average" in unsupported(OPENMPI, "all_reduce", "f32", "avg")
    assert unsupported(OPENMPI, "broadcast", "f32", "avg") is None  # op ignored outside all_reduce
    assert unsupported(OPENMPI, "barrier", "f16", "avg") is None


def test_a_missing_mpirun_or_an_unsupported_sweep_is_skipped_without_launching(tmp_path):
    assert "'/nonexistent/mpirun' not found on PATH" in missing_reason(OPENMPI, "/nonexistent/mpirun")
    run = run_peer(OPENMPI, 2, [], "all_reduce", "f32", "sum", tmp_path, 30, mpirun="/nonexistent/mpirun")
    assert (run.status, run.command, run.rows) == ("skipped", "", [])
    run = run_peer(OPENMPI, 2, [], "all_reduce", "f16", "sum", tmp_path, 30)
    assert run.status == "skipped" and "no f16 datatype" in run.reason and run.command == ""


@pytest.mark.multiprocess
@pytest.mark.skipif(not mpi_installed(), reason="mpi4py not installed")
def test_a_peer_job_that_fails_is_reported_with_its_status(tmp_path):
    run = run_peer(OPENMPI, 2, ["--size-list", "8"], "all_reduce", "f32", "sum", tmp_path, 30, mpirun="false")
    assert run.status == "failed" and run.reason.startswith("exit 1: ") and run.rows == []
    assert run.command.split()[:3] == [shutil.which("false"), "--allow-run-as-root", "--oversubscribe"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.multiprocess
def test_a_peer_job_past_its_timeout_is_killed_with_its_children():
    """A hung peer (here: a child that never ends) costs the timeout, then its whole process group dies."""
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(120)']); print(p.pid, flush=True); time.sleep(120)")
    t0 = time.monotonic()
    rc, out, err = run_command([sys.executable, "-c", code], timeout=2.0)
    assert rc == 124 and "killed after the 2 s timeout" in err and time.monotonic() - t0 < 10
    grandchild = int(out.split()[0])
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the kernel's reaping, bounded: not hiding a race
    assert _gone(grandchild)
