"""bench/compare.py: one tiny real run (table, JSON, ratios, plot), and the skip messages for missing peers.

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
from pathlib import Path

import pytest

from shmcoll.config import LOCAL_RANK_VARS, RANK_VARS, WORLD_SIZE_VARS

REPO = Path(__file__).resolve().parents[1]
COMPARE = REPO / "bench" / "compare.py"
sys.path.insert(0, str(REPO / "bench"))

from compare_report import PeerResult, compare, targets  # noqa: E402

TINY = ["-n", "2", "--sizes", "8,64K", "--transports", "tcp", "--iters", "20", "--warmup", "2",
        "--max-time", "0.3", "--timeout", "40"]
SIZES = [8, 65536]
LABELS = {8: "8 B", 65536: "64 KiB"}
RUN_S = 60  # the whole tiny run takes ~8 s; this is the hang guard


def env_without_ranks(**extra) -> dict:
    drop = set(RANK_VARS) | set(WORLD_SIZE_VARS) | set(LOCAL_RANK_VARS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def compare_run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(COMPARE), *TINY, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_S, env=env or env_without_ranks())


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
    assert targets(4, 8) == (2.0, None) and targets(3, 8) == (None, None)
