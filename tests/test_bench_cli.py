"""shmcoll-bench: sweeps in real processes (table, JSON, --check, --cold, --compare, --plot, exit status)
and its pure parts in one (the peers' launching and ratio math: tests/test_bench_compare.py)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmcoll.bench import buffers, cli, collectives, inputs, table
from shmcoll.bench.adapters import GLOO, OPENMPI
from shmcoll.bench.buffers import MAX_COLD_BUFFERS, Plan, plan, read_llc, rotating
from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.descriptor import Collective, Payload, Sizing
from shmcoll.bench.inputs import (
    UsageError,
    block_values,
    parse_float32_sizes,
    parse_size,
    parse_world_sizes,
    payload,
    reduce_expected,
    reduce_input,
    sweep,
    v_lengths,
)
from shmcoll.bench.measure import Spec, check_once, choose_iters, make_row, measure
from shmcoll.bench.options import build_parser
from shmcoll.bench.results import Row
from shmcoll.rendezvous.launchers import RANK_VARS, WORLD_SIZE_VARS
from shmcoll.types import ReduceKind

from bounds import RUN_HANG_S, TEST_HANG_S

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLUMNS = ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
SMALL = ["-b", "8", "-e", "64K", "-f", "8", "--iters", "3", "--warmup", "1"]
SMALL_SIZES = [8, 64, 512, 4096, 32768]
TYPE_NAMES = {"f16": ("half", 2), "bf16": ("bfloat16", 2), "f32": ("float", 4), "f64": ("double", 8)}


def clean_env() -> dict:
    """The test's environment without any launcher's rank variables: the CLI must spawn, not join."""
    return {k: v for k, v in os.environ.items() if k not in RANK_VARS and k not in WORLD_SIZE_VARS}


def bench(*args: str, launcher: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [*launcher, sys.executable, "-m", "shmcoll.bench.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=RUN_HANG_S)


def split_sections(stdout: str) -> dict[str, list[str]]:
    """'shmcoll' -> shmcoll's lines, then one entry per '# peer: NAME' section and 'ratios' for the last table."""
    sections, name = {"shmcoll": []}, "shmcoll"
    for ln in stdout.splitlines():
        if ln.startswith("# peer: "):
            name = ln[len("# peer: "):].split()[0].rstrip(":")
        elif ln.startswith("# shmcoll time / peer time") or ln.startswith("# no peer ran"):
            name = "ratios"
        sections.setdefault(name, []).append(ln)
    return sections


def parse_table(stdout: str) -> tuple[str, list[list[str]]]:
    """(first header line, data rows split into cells) of shmcoll's table; asserts the column header is exact."""
    lines = split_sections(stdout)["shmcoll"]
    assert lines and lines[0].startswith("# shmcoll-bench:"), stdout
    return lines[0], table_rows(lines)


def table_rows(lines: list[str]) -> list[list[str]]:
    """The data rows of one section, each checked to sit right under the one column header."""
    headers = [ln for ln in lines if ln.startswith("#") and ln[1:].split() == COLUMNS]
    assert len(headers) == 1, "\n".join(lines)
    rows = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    for ln in lines:
        if ln.strip() and not ln.startswith("#"):
            assert len(ln) == len(headers[0]), f"columns not aligned:\n{headers[0]}\n{ln}"
    assert all(len(r) == len(COLUMNS) for r in rows), "\n".join(lines)
    return rows


def expected_sizes(collective: str, n: int, itemsize: int, sizes=SMALL_SIZES) -> list[int]:
    if collective == "barrier":
        return [0]
    if collective in ("all_gather", "gather", "reduce_scatter", "all_to_all", "scatter"):
        return [max(1, s // (n * itemsize)) * n * itemsize for s in sizes]
    return [max(1, s // itemsize) * itemsize for s in sizes]


def factor(collective: str, n: int) -> float | None:
    """nccl-tests' PERFORMANCE.md (gather and scatter are not there: shmcoll-bench uses (n-1)/n)."""
    share = (n - 1) / n
    return {"all_reduce": 2 * share, "all_gather": share, "broadcast": 1.0, "reduce_scatter": share,
            "reduce": 1.0, "all_to_all": share, "gather": share, "scatter": share}.get(collective)


def assert_sweep(proc, collective: str, n: int, dtype: str = "f32", op: str = "sum", check: bool = True):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, rows = parse_table(proc.stdout)
    assert f"collective {collective}" in first and f"world size {n}" in first
    assert "transport shm" in first and "in-place" in first  # auto picks shared memory on one host
    assert f"dtype {dtype}" in first if collective != "barrier" else "dtype -" in first
    type_name, itemsize = TYPE_NAMES[dtype]
    assert [int(r[0]) for r in rows] == expected_sizes(collective, n, itemsize)
    f = factor(collective, n)
    for size, count, typ, redop, time_us, algbw, busbw, wrong in rows:
        assert float(time_us) > 0
        assert wrong == ("0" if check else "N/A")
        if collective == "barrier":
            assert (size, count, typ, redop, algbw, busbw) == ("0", "0", "-", "none", "-", "-")
            continue
        assert int(size) == int(count) * itemsize and typ == type_name
        assert redop == (op if collective in ("all_reduce", "reduce_scatter", "reduce") else "none")
        assert abs(float(busbw) - float(algbw) * f) <= 0.016  # both rounded to 0.01
    return rows


# ---- real processes ----

@pytest.mark.multiprocess
@pytest.mark.parametrize("collective, n", [("all_reduce", 2), ("all_reduce", 3), ("all_gather", 3), ("broadcast", 3),
                                           ("barrier", 2)])
def test_sweep_with_check_and_json(tmp_path, n, collective):
    out = tmp_path / "rows.json"
    proc = bench("-n", str(n), "--collective", collective, *SMALL, "--check", "--json", str(out))
    rows = assert_sweep(proc, collective, n)
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert ("buffers n/a" if collective == "barrier" else "buffers warm") in proc.stdout.splitlines()[1]
    data = json.loads(out.read_text())
    assert len(data) == len(rows)
    for row, cells in zip(data, rows):
        assert row["world_size"] == n and row["collective"] == collective and row["transport"] == "shm"
        assert row["iters"] == 3 and row["wrong"] == 0 and row["cold"] is False and row["buffers"] == 1
        assert (row["size"], row["count"]) == (int(cells[0]), int(cells[1]))
        assert f"{row['time_us']:.2f}" == cells[4]
        if collective == "barrier":
            assert row["algbw"] is None and row["busbw"] is None
        else:
            assert row["algbw"] == pytest.approx(row["size"] / row["time_us"] / 1e3, rel=1e-9)
            assert row["busbw"] == pytest.approx(row["algbw"] * factor(collective, n), rel=1e-9)


@pytest.mark.parametrize("dtype,op,collective", [
    ("f16", "sum", "all_reduce"), ("bf16", "avg", "all_reduce"),  # (every op of every type: test_kernels.py)
    ("bf16", "sum", "all_gather"), ("f16", "sum", "broadcast"),
])
@pytest.mark.multiprocess
def test_half_types_and_ops_check(dtype, op, collective):
    proc = bench("-n", "3", "--collective", collective, "--dtype", dtype, "--op", op, *SMALL, "--check")
    assert_sweep(proc, collective, 3, dtype=dtype, op=op)


@pytest.mark.multiprocess
def test_without_check_prints_na_and_runs_under_shmcoll_run():
    """Inside a job (started by shmcoll-run, no -n) it joins instead of spawning."""
    proc = bench("-c", "broadcast", *SMALL, launcher=(sys.executable, "-m", "shmcoll.launch.run_cli", "-n", "2"))
    assert_sweep(proc, "broadcast", 2, check=False)
    assert "Out of bounds" not in proc.stdout


@pytest.mark.multiprocess
def test_n_conflicting_with_the_job_is_a_usage_error():
    """Every rank says so (whichever exits first ends the job), prefixed with its rank."""
    proc = bench("-n", "3", *SMALL, launcher=(sys.executable, "-m", "shmcoll.launch.run_cli", "-n", "2"))
    assert proc.returncode == 2
    assert re.search(r"shmcoll-bench: rank [01]: -n 3 does not match this job's world size 2 \(leave -n out",
                     proc.stderr), proc.stderr


@pytest.mark.multiprocess
def test_bad_arguments_exit_2_from_the_command_line():
    proc = bench("-n", "2", "-f", "1")
    assert proc.returncode == 2
    assert "usage: shmcoll-bench" in proc.stderr and "-f/--stepfactor: must be a finite number > 1" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args,message", [
    (["-n", "0"], "must be >= 1"),
    (["-n", "x"], "not an integer"),
    (["-n", "2", "-b", "0"], "at least 1 byte"),
    (["-n", "2", "-b", "12Q"], "not a size"),
    (["-n", "2", "-e", "-5"], "not a size"),
    (["-n", "2", "-f", "1"], "> 1"),
    (["-n", "2", "-f", "0.5"], "> 1"),
    (["-n", "2", "-b", "1M", "-e", "1K"], "MIN <= MAX"),
    (["-n", "2", "--collective", "alltoallv"], "invalid choice"),
    (["-n", "2", "--dtype", "f8"], "invalid choice"),
    (["-n", "2", "--op", "mean"], "invalid choice"),
    (["-n", "2", "--iters", "0"], "must be >= 1"),
    (["-n", "2", "--warmup", "-1"], "must be >= 0"),
    (["-n", "2", "--max-time", "nan"], "finite"),
    (["-n", "2", "--transport", "udp"], "invalid choice"),
    (["-n", "2", "--json", "/nonexistent-dir/x.json"], "does not exist"),
    (["-n", "2", "--plot", "/nonexistent-dir/x.png"], "does not exist"),
    (["-n", "2", "-c", "barrier", "--plot", "x.png"], "a barrier has neither"),
    (["-n", "2", "--peer-timeout", "0"], "> 0"),
    (["-n", "2", "--bogus"], "unrecognized"),
])
def test_usage_errors(capsys, args, message):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_outside_a_job_without_n_is_a_usage_error(capsys, monkeypatch):
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["-e", "1K"]) == 2
    assert "give -n N" in capsys.readouterr().err


def test_bf16_without_ml_dtypes_is_a_clear_usage_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` raise ImportError
    assert cli.main(["-n", "2", "--dtype", "bf16"]) == 2
    assert "ml_dtypes" in capsys.readouterr().err


def test_wrong_results_are_counted_and_exit_1(capsys, monkeypatch, tmp_path):
    """A single in-process rank with a corrupted reference: #wrong > 0, FAILED, status 1, JSON still written."""
    for name in RANK_VARS + WORLD_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHMCOLL_RANK", "0")
    monkeypatch.setenv("SHMCOLL_WORLD_SIZE", "1")
    monkeypatch.setattr(collectives, "reduce_expected", lambda op, n, i: np.full(len(i), 1234.0))
    out = tmp_path / "rows.json"
    rc = cli.main(["-b", "8", "-e", "64", "-f", "8", "--iters", "1", "--warmup", "0", "--check",
                         "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1, text
    _, rows = parse_table(text)
    assert [r[-1] for r in rows] == ["2", "16"] and "FAILED" in text
    assert [r["wrong"] for r in json.loads(out.read_text())] == [2, 16]


# ---- pure parts ----

@pytest.mark.parametrize("text,value", [
    ("8", 8), ("1K", 1024), ("64k", 65536), ("1M", 1 << 20), ("64M", 64 << 20), ("2G", 2 << 30),
    ("1KB", 1024), ("4MiB", 4 << 20), (" 16 ", 16),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "1.5K", "K", "-8", "8X", "1KK"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_parse_float32_sizes():
    assert parse_float32_sizes("64K, 8,1,10,8,") == [4, 8, 65536]
    assert parse_float32_sizes("") == []
    with pytest.raises(UsageError):
        parse_float32_sizes("8,1.5K")


def test_parse_world_sizes():
    assert parse_world_sizes("8,16, 32", 1) == [8, 16, 32]
    assert parse_world_sizes("2,4,", 2) == [2, 4]
    for text, least in [("", 1), ("0", 1), ("4,x", 1), ("1,2", 2), ("2.5", 2)]:
        with pytest.raises(UsageError, match=f"world sizes of at least {least}"):
            parse_world_sizes(text, least)


def test_sweep():
    assert sweep(8, 64 << 20, 2)[-1] == 64 << 20 and len(sweep(8, 64 << 20, 2)) == 24
    assert sweep(8, 65536, 8) == SMALL_SIZES
    assert sweep(8, 100, 8) == [8, 64]
    assert sweep(5, 5, 2) == [5]
    assert sweep(1, 4, 1.1) == [1, 2, 3, 4]  # never stalls on a factor that rounds back down
    with pytest.raises(UsageError):
        sweep(1, 8, 1)


def test_layout_follows_nccl_tests():
    assert COLLECTIVES["all_reduce"].layout(8, 3, 4) == (2, 2, 8)
    assert COLLECTIVES["all_reduce"].layout(3, 3, 4) == (1, 1, 4)  # at least one element
    assert COLLECTIVES["all_gather"].layout(4096, 3, 4) == (341, 1023, 4092)  # total output, per rank rounded down
    assert COLLECTIVES["all_gather"].layout(8, 3, 4) == (1, 3, 12)
    assert COLLECTIVES["broadcast"].layout(10, 2, 2) == (5, 5, 10)
    assert COLLECTIVES["barrier"].layout(1 << 20, 4, 4) == (0, 0, 0)


def test_choose_iters():
    assert choose_iters(20, 0.001, 2.0) == 20
    assert choose_iters(20, 0.5, 2.0) == 4
    assert choose_iters(20, 10.0, 2.0) == 3  # never below 3
    assert choose_iters(2, 10.0, 2.0) == 2  # nor above what was asked
    assert choose_iters(20, 10.0, 0) == 20  # 0: no cap
    assert choose_iters(20, None, 2.0) == 20  # no warmup, no estimate


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("op", list(ReduceKind))
def test_reduce_reference_is_exact_in_every_type(n, op):
    """Inputs and every partial result are exactly representable even in bfloat16, in any order."""
    import ml_dtypes

    i = np.arange(1000, dtype=np.int64)
    inputs = [reduce_input(op, r, n, i) for r in range(n)]
    fold = {ReduceKind.SUM: np.add, ReduceKind.AVG: np.add, ReduceKind.PROD: np.multiply,
            ReduceKind.MIN: np.minimum, ReduceKind.MAX: np.maximum}[op]
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        for order in (range(n), reversed(range(n))):
            acc = None
            for r in order:
                x = inputs[r].astype(dtype)
                assert np.array_equal(x.astype(np.float64), inputs[r])
                acc = x if acc is None else fold(acc, x)
            result = acc.astype(np.float64) / (n if op is ReduceKind.AVG else 1)
            assert np.array_equal(result, reduce_expected(op, n, i))


class _FakeGroup:
    """One rank of a world of n whose collectives return the values every other rank would send,
    with `corrupt` elements damaged."""

    def __init__(self, rank, n, corrupt=0):
        self.rank, self.world_size, self.corrupt = rank, n, corrupt

    def _damage(self, arr):
        arr[:self.corrupt] = 99
        return arr

    def all_reduce(self, buf, op):
        i = np.arange(len(buf), dtype=np.int64)
        buf[...] = reduce_expected(op, self.world_size, i).astype(buf.dtype)
        self._damage(buf)

    def all_gather(self, local):
        i = np.arange(len(local), dtype=np.int64)
        blocks = [block_values(r, i).astype(local.dtype) for r in range(self.world_size)]
        return self._damage(np.concatenate(blocks))

    def broadcast(self, root, buf):
        buf[...] = block_values(root, np.arange(len(buf), dtype=np.int64)).astype(buf.dtype)
        self._damage(buf)


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast"])
@pytest.mark.parametrize("corrupt", [0, 5])
def test_check_counts_damaged_elements(collective, corrupt, monkeypatch):
    monkeypatch.setattr(inputs, "CHECK_CHUNK", 7)  # exercise the sliced comparison
    spec = Spec(COLLECTIVES[collective], "f32", "prod", 1, 0, True, 0)
    count = 150 if collective == "all_gather" else 50
    assert check_once(_FakeGroup(1, 3, corrupt), spec, np.empty(50, np.float32), count) == corrupt


def test_row_format_is_right_aligned_under_the_header():
    header = table.format_header(Spec(COLLECTIVES["all_gather"], "bf16", "sum", 3, 1, False, 2.0), 4, "tcp")
    assert "world size 4" in header[0] and "transport tcp" in header[0] and "in-place no" in header[0]
    assert "dtype bf16" in header[0]
    row = Row(1024, 512, "bfloat16", "none", 12.345, 0.08294, 0.0622, None, 3)
    line = table.format_row(row)
    cells = ["1024", "512", "bfloat16", "none", "12.35", "0.08", "0.06", "N/A"]
    assert line.split() == cells and len(line) == len(header[-1])
    edge = 0
    for (label, width), cell in zip(table.COLUMNS, cells):
        edge += width
        assert line[edge - len(cell):edge] == cell and header[-1][edge - len(label):edge] == label


# ---- --cold, --plot and --compare in real processes ----

def not_installed(*what: str) -> list[str]:
    """Which of mpirun / Python modules are missing here (the CI installs them all)."""
    return [w for w in what if (shutil.which(w) if w == "mpirun" else importlib.util.find_spec(w)) is None]


def hiding_env(tmp_path: Path, *modules: str) -> dict:
    """clean_env() whose PYTHONPATH starts with packages that raise ImportError, in every child process."""
    shadow = tmp_path / "shadow"
    for mod in modules:
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(f"raise ImportError('{mod} hidden by the test')\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    return env


def assert_png(path: Path) -> None:
    """A real PNG that matplotlib drew (axes, lines and labels make it tens of KB; an empty one is < 5 KB)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 8000, len(data)


@pytest.mark.multiprocess
@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_cold_buffers_with_check(tmp_path, collective):
    """--cold rotates past the last-level cache and --check still finds every result right."""
    out = tmp_path / "rows.json"
    proc = bench("-n", "2", "-c", collective, *SMALL, "--check", "--cold", "--json", str(out))
    assert_sweep(proc, collective, 2)
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "buffers cold" in proc.stdout.splitlines()[1]
    llc_bytes = read_llc()[0]
    for row in json.loads(out.read_text()):
        per_rank = row["size"] // 2 if collective == "all_gather" else row["size"]
        assert row["cold"] is True and row["wrong"] == 0
        assert row["buffers"] == plan(per_rank, True, llc_bytes).count >= 2


@pytest.mark.multiprocess
def test_compare_and_plot_with_the_peers_installed(tmp_path):
    """OpenMPI and gloo rows with numbers, same sizes; ratios in the table and JSON; a drawn PNG."""
    missing = not_installed("mpirun", "mpi4py", "torch", "matplotlib")
    if missing:
        pytest.skip(f"not installed here: {', '.join(missing)}")
    out, png = tmp_path / "rows.json", tmp_path / "busbw.png"
    proc = bench("-n", "2", *SMALL, "--check", "--compare", "--plot", str(png), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = split_sections(proc.stdout)
    mine = table_rows(sections["shmcoll"])
    doc = json.loads(out.read_text())
    by_peer = {}
    for row in doc["rows"]:
        by_peer.setdefault(row["peer"], {})[row["size"]] = row
    for peer, library in (("openmpi", "Open MPI"), ("gloo", "gloo")):
        assert sections[peer][0].startswith(f"# peer: {peer} (") and library in sections[peer][0]
        assert doc["peers"][peer]["status"] == "ok" and library in doc["peers"][peer]["library"]
        rows = table_rows(sections[peer])
        assert [r[:4] for r in rows] == [r[:4] for r in mine]  # size, count, type, redop
        for size, _count, _type, _redop, time_us, _algbw, _busbw, wrong in rows:
            row = by_peer[peer][int(size)]
            assert float(time_us) > 0 and wrong == "0" and f"{row['time_us']:.2f}" == time_us
            assert row["busbw"] == pytest.approx(row["algbw"] * 1.0)  # 2(n-1)/n = 1 at n=2
            assert row["shmcoll_over_peer"] == pytest.approx(by_peer["shmcoll"][int(size)]["time_us"] / row["time_us"])
    ratio_lines = [ln.split() for ln in sections["ratios"] if ln.strip() and not ln.startswith("#")]
    assert sections["ratios"][1].split()[1:] == ["size(B)", "openmpi", "gloo"]
    assert [int(r[0]) for r in ratio_lines] == [int(r[0]) for r in mine]
    for size, mpi, gloo in ratio_lines:
        assert mpi == f"{by_peer['openmpi'][int(size)]['shmcoll_over_peer']:.3g}x"
        assert gloo == f"{by_peer['gloo'][int(size)]['shmcoll_over_peer']:.3g}x"
    assert f"# plot written to {png}" in proc.stdout
    assert_png(png)


@pytest.mark.multiprocess
def test_compare_and_plot_with_the_peers_hidden(tmp_path):
    """Missing peers and matplotlib: skipped with the reason, a one-line plot message, exit 0."""
    out, png = tmp_path / "rows.json", tmp_path / "busbw.png"
    proc = bench("-n", "2", "-b", "8", "-e", "64", "-f", "8", "--iters", "2", "--warmup", "0", "--compare",
                 "--plot", str(png), "--json", str(out), env=hiding_env(tmp_path, "mpi4py", "torch", "matplotlib"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mpi_reason = ("mpi4py is not importable (mpi4py hidden by the test)" if shutil.which("mpirun")
                  else "'mpirun' not found on PATH")
    assert f"# peer: openmpi: skipped: {mpi_reason}" in proc.stdout
    assert "# peer: gloo: skipped: torch is not importable (torch hidden by the test)" in proc.stdout
    assert "# no peer ran: nothing to compare" in proc.stdout
    plot_lines = [ln for ln in proc.stderr.splitlines() if "--plot" in ln]
    assert len(plot_lines) == 1 and "matplotlib is not installed" in plot_lines[0] and not png.exists()
    doc = json.loads(out.read_text())
    assert {k: v["status"] for k, v in doc["peers"].items()} == {"openmpi": "skipped", "gloo": "skipped"}
    assert {r["peer"] for r in doc["rows"]} == {"shmcoll"} and len(doc["rows"]) == 2


def test_compare_inside_a_job_is_a_usage_error(capsys, monkeypatch):
    """Peers need jobs of their own (run after shmcoll's), which a rank of someone else's job cannot start."""
    monkeypatch.setenv("SHMCOLL_RANK", "0")
    monkeypatch.setenv("SHMCOLL_WORLD_SIZE", "1")
    assert cli.main(["-e", "8", "--compare"]) == 2
    err = capsys.readouterr().err
    assert "--compare runs OpenMPI and gloo as jobs of their own" in err and "needs -n N" in err


def test_plot_inside_a_job_is_drawn_by_rank_0(capsys, monkeypatch, tmp_path):
    if not_installed("matplotlib"):
        pytest.skip("matplotlib is not installed here")
    for name in RANK_VARS + WORLD_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHMCOLL_RANK", "0")
    monkeypatch.setenv("SHMCOLL_WORLD_SIZE", "1")
    png = tmp_path / "one.png"
    assert cli.main(["-c", "broadcast", "-b", "8", "-e", "64K", "-f", "8", "--iters", "1", "--warmup", "0",
                          "--plot", str(png)]) == 0  # broadcast: busbw = algbw > 0 even at n=1
    assert f"# plot written to {png}" in capsys.readouterr().out
    assert_png(png)


# typed-array collectives besides nccl-tests' first four: their data is split in rank blocks
# (reduce_scatter, all_to_all, gather, scatter) or reduced onto a root (reduce)
BLOCK_COLLECTIVES = ["reduce_scatter", "reduce", "all_to_all", "gather", "scatter"]
BLOCK_IN_PLACE = {"reduce_scatter": "no", "reduce": "yes", "all_to_all": "no", "gather": "no", "scatter": "no"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("collective", BLOCK_COLLECTIVES)
def test_block_collectives_sweep_with_check_and_json(tmp_path, collective):
    """2 ranks, a small sweep: every row checked against the float64 reference (0 wrong), JSON fields."""
    out = tmp_path / "rows.json"
    proc = bench("-n", "2", "--collective", collective, *SMALL, "--check", "--json", str(out))
    rows = assert_sweep(proc, collective, 2)
    first = proc.stdout.splitlines()[0]
    assert f"in-place {BLOCK_IN_PLACE[collective]}" in first
    assert f"op {'sum' if collective in ('reduce_scatter', 'reduce') else 'none'}" in first
    assert "# Out of bounds values : 0 OK" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data) == len(rows) == len(SMALL_SIZES)
    for row, cells in zip(data, rows):
        assert row["collective"] == collective and row["world_size"] == 2 and row["dtype"] == "f32"
        assert row["in_place"] == BLOCK_IN_PLACE[collective] and row["wrong"] == 0 and row["iters"] == 3
        assert (row["size"], row["count"]) == (int(cells[0]), int(cells[1]))
        assert row["count"] % 2 == 0 or collective == "reduce"  # n equal blocks
        assert row["algbw"] == pytest.approx(row["size"] / row["time_us"] / 1e3, rel=1e-9)
        assert row["busbw"] == pytest.approx(row["algbw"] * factor(collective, 2), rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.parametrize("collective,op", [("reduce_scatter", "max"), ("reduce", "prod"), ("all_to_all", "sum")])
def test_block_collectives_at_3_ranks_cold_and_other_ops(collective, op):
    proc = bench("-n", "3", "--collective", collective, "--op", op, "--dtype", "f16", *SMALL, "--check", "--cold")
    assert_sweep(proc, collective, 3, dtype="f16", op=op)
    assert "buffers cold" in proc.stdout.splitlines()[1]


class _BrokenBlocks:
    """A group whose block collectives damage `corrupt` elements of their result (on rank 0 only)."""

    def __init__(self, rank, n, corrupt):
        self.rank, self.world_size, self.corrupt = rank, n, corrupt

    def _bad(self, arr):
        if arr is not None and self.rank == 0:
            arr[:self.corrupt] += 1000
        return arr

    def reduce_scatter(self, buf, op):
        n, block = self.world_size, len(buf) // self.world_size
        i = np.arange(len(buf))
        full = reduce_expected(op, n, i).astype(buf.dtype)
        return self._bad(full[self.rank * block:(self.rank + 1) * block].copy())

    def reduce(self, root, buf, op):
        buf[:] = reduce_expected(op, self.world_size, np.arange(len(buf)))
        self._bad(buf)

    def all_to_all(self, buf):
        n, block = self.world_size, len(buf) // self.world_size
        i = np.arange(block) + self.rank * block
        return self._bad(np.concatenate([block_values(s, i) for s in range(n)]).astype(buf.dtype))

    def gather(self, root, buf):
        if self.rank != root:
            return None
        i = np.arange(len(buf))
        return self._bad(np.concatenate([block_values(r, i) for r in range(self.world_size)]).astype(buf.dtype))

    def scatter(self, root, buf):
        block = 8
        return self._bad(block_values(root, np.arange(block) + self.rank * block).astype(np.float32))


@pytest.mark.parametrize("collective", BLOCK_COLLECTIVES)
@pytest.mark.parametrize("corrupt", [0, 3])
def test_check_of_block_collectives_counts_damaged_elements(collective, corrupt):
    """The check's reference is what each rank must hold; reduce and gather look at the root only."""
    n = 2
    spec = Spec(COLLECTIVES[collective], "f32", "sum", 1, 0, True, 0)
    elems, count, _ = COLLECTIVES[collective].layout(64, n, 4)
    for rank in range(n):
        got = check_once(_BrokenBlocks(rank, n, corrupt), spec, np.empty(elems, np.float32), count)
        assert got == (corrupt if rank == 0 else 0), (collective, rank)


def test_block_collectives_peer_support():
    """OpenMPI cannot reduce 16-bit floats or average (skip reasons); everything else runs on both peers."""
    for coll in ("reduce_scatter", "reduce"):
        assert "no f16 datatype to reduce" in COLLECTIVES[coll].unsupported(OPENMPI, "f16", "sum")
        assert "no average reduction" in COLLECTIVES[coll].unsupported(OPENMPI, "f32", "avg")
        assert COLLECTIVES[coll].unsupported(GLOO, "f16", "avg") is None
    for coll in ("all_to_all", "gather", "scatter"):
        assert COLLECTIVES[coll].unsupported(OPENMPI, "f16", "sum") is None
        assert COLLECTIVES[coll].unsupported(GLOO, "bf16", "sum") is None


def check_compare_rows(tmp_path, collective: str, n: int, maxbytes: str, bus) -> None:
    """--compare for one collective at n ranks: OpenMPI and gloo rows with shmcoll's sizes, checked,
    0 wrong, busbw = algbw * bus(n); or, without a peer installed, its skip reason."""
    out = tmp_path / "rows.json"
    proc = bench("-n", str(n), "--collective", collective, "-b", "64", "-e", maxbytes, "-f", "8", "--iters", "2",
                 "--warmup", "1", "--check", "--compare", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sections = split_sections(proc.stdout)
    mine = table_rows(sections["shmcoll"])
    doc = json.loads(out.read_text())
    for peer, needs in (("openmpi", ("mpirun", "mpi4py")), ("gloo", ("torch",))):
        status = doc["peers"][peer]["status"]
        if not_installed(*needs):
            assert status == "skipped" and doc["peers"][peer]["reason"], doc["peers"][peer]
            assert sections[peer][0].startswith(f"# peer: {peer}: skipped: ")
            continue
        assert status == "ok", doc["peers"][peer]
        rows = table_rows(sections[peer])
        assert [r[:4] for r in rows] == [r[:4] for r in mine] and rows  # size, count, type, redop
        assert all(r[7] == "0" for r in rows), rows
        for row in (r for r in doc["rows"] if r["peer"] == peer):
            assert row["collective"] == collective and row["wrong"] == 0
            assert row["busbw"] == pytest.approx(row["algbw"] * bus(n))


#: the compare machinery is one for every collective, and every descriptor's OpenMPI and gloo calls
#: are checked by test_every_collective_runs_and_checks_through_every_library: whole compare runs
#: for one block collective with a result on every rank and one rooted one are enough
COMPARED_BLOCK_COLLECTIVES = ["reduce_scatter", "scatter"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("collective", COMPARED_BLOCK_COLLECTIVES)
def test_block_collectives_compare_rows(tmp_path, collective):
    """OpenMPI (Reduce_scatter_block, Scatter) and gloo, at 2 ranks."""
    check_compare_rows(tmp_path, collective, 2, "4K", lambda n: factor(collective, n))


# ---- --cold and the bandwidth math, in one process ----

def test_bus_factors_and_sizes_follow_nccl_tests():
    """nccl-tests' PERFORMANCE.md: busbw = algbw * 2(n-1)/n, (n-1)/n, 1; all_gather's size is the whole output."""
    assert [COLLECTIVES["all_reduce"].bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    assert [COLLECTIVES["all_gather"].bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 0.5, 0.75, 0.875]
    assert [COLLECTIVES["broadcast"].bus_factor(n) for n in (1, 2, 4)] == [1.0, 1.0, 1.0]
    assert COLLECTIVES["barrier"].bus_factor(4) is None
    # per rank, total count, total bytes
    assert COLLECTIVES["all_gather"].layout(1 << 20, 4, 4) == (65536, 262144, 1 << 20)
    # ReduceScatter and AllToAll: (n-1)/n of the total size S; Reduce: 1; gather/scatter (not in nccl-tests): (n-1)/n
    for coll in ("reduce_scatter", "all_to_all", "gather", "scatter"):
        assert [COLLECTIVES[coll].bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 0.5, 0.75, 0.875], coll
    assert [COLLECTIVES["reduce"].bus_factor(n) for n in (1, 2, 4)] == [1.0, 1.0, 1.0]
    # the size is one rank's whole input (n blocks) for reduce_scatter, all_to_all and scatter (the root's) ...
    for coll in ("reduce_scatter", "all_to_all", "scatter"):
        assert COLLECTIVES[coll].layout(1 << 20, 4, 4) == (262144, 262144, 1 << 20), coll
        assert COLLECTIVES[coll].layout(100, 3, 4) == (24, 24, 96), coll  # rounded down to n equal blocks
    # ... the root's whole output for gather (each rank sends one block), count = size / itemsize for reduce
    assert COLLECTIVES["gather"].layout(1 << 20, 4, 4) == (65536, 262144, 1 << 20)
    assert COLLECTIVES["reduce"].layout(100, 3, 4) == (25, 25, 100)


@pytest.mark.parametrize("collective,n,algbw,busbw", [
    ("all_reduce", 4, 4.096, 6.144), ("all_gather", 4, 4.096, 3.072), ("broadcast", 4, 4.096, 4.096),
    ("all_reduce", 2, 4.096, 4.096), ("barrier", 4, None, None),
])
def test_make_row_bandwidths_on_synthetic_times(collective, n, algbw, busbw):
    size = 0 if collective == "barrier" else 4096
    row = make_row(Spec(COLLECTIVES[collective], "f32", "sum", 5, 0, False, 0), n, size // 4, size, 1e-6, None, 5, 3)
    assert row.time_us == pytest.approx(1.0) and row.buffers == 3 and row.iters == 5
    assert (row.algbw, row.busbw) == ((None, None) if algbw is None else (pytest.approx(algbw), pytest.approx(busbw)))
    assert make_row(Spec(COLLECTIVES["all_reduce"], "f32", "sum", 1, 0, False, 0), 2, 1, 4, 0.0, None, 1).algbw == 0.0


@pytest.mark.parametrize("text,value", [("32768K", 32 << 20), ("1M", 1 << 20), ("48K", 48 << 10), ("512", 512),
                                        ("lots", None), ("", None)])
def test_parse_cache_size(text, value):
    assert buffers.parse_cache_size(text) == value


def _fake_cache(root: Path, entries) -> Path:
    for k, (level, kind, size) in enumerate(entries):
        d = root / "cpu0" / "cache" / f"index{k}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return root / "cpu0" / "cache"


def test_read_llc_takes_the_highest_level_and_defaults_to_32_mib(tmp_path):
    full = _fake_cache(tmp_path / "a", [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "1024K"),
                                        (3, "Unified", "32768K")])
    assert read_llc(full) == (32 << 20, "L3 of cpu0")
    no_l3 = _fake_cache(tmp_path / "b", [(1, "Data", "32K"), (2, "Unified", "2M"), (3, "Unified", "garbage")])
    assert read_llc(no_l3)[0] == 2 << 20
    assert read_llc(tmp_path / "missing")[0] == buffers.DEFAULT_LLC == 32 << 20


@pytest.mark.parametrize("nbytes", [1, 8, 100, 512, 513, 4096, 1 << 20, 31 << 20, 64 << 20])
def test_cold_plan_exceeds_the_llc_unless_capped(nbytes):
    llc_bytes = 32 << 20
    assert plan(nbytes, False, llc_bytes) == Plan(1, plan(nbytes, False, llc_bytes).stride)
    p = plan(nbytes, True, llc_bytes)
    assert p.stride % 64 == 0 and nbytes <= p.stride < nbytes + 64 and 2 <= p.count <= MAX_COLD_BUFFERS
    if p.stride > buffers.capped_up_to(llc_bytes):
        assert p.span > llc_bytes  # enough ...
        assert p.count == 2 or (p.count - 1) * p.stride <= llc_bytes  # ... and no more than needed
    else:
        assert p.count == MAX_COLD_BUFFERS


def test_rotating_views_are_disjoint_line_aligned_and_shuffled():
    views = rotating(np.dtype(np.float32), 20, Plan(64, 128))
    assert len(views) == 64 and all(len(v) == 20 and (v == 1).all() for v in views)
    starts = [v.ctypes.data for v in views]
    base = min(starts)
    assert sorted(s - base for s in starts) == [128 * k for k in range(64)]
    assert starts != sorted(starts)  # the prefetcher cannot follow a shuffled order
    assert not any(np.shares_memory(a, b) for a, b in zip(views, views[1:]))
    assert len(rotating(np.dtype(np.float16), 5, Plan(1, 64))) == 1


class _RecordingGroup:
    """A world of one that records the address of every buffer it is asked to reduce."""

    rank, world_size = 0, 1

    def __init__(self):
        self.seen = []

    def all_reduce(self, buf, op):
        self.seen.append(buf.ctypes.data)

    def all_gather(self, local):
        return np.array(local, copy=True)

    def barrier(self):
        pass


@pytest.mark.parametrize("cold", [False, True])
def test_cold_loop_moves_to_fresh_memory_on_every_call(monkeypatch, cold):
    monkeypatch.setattr("shmcoll.bench.measure.llc", lambda: (64 << 10, "test"))
    g = _RecordingGroup()
    row = measure(g, Spec(COLLECTIVES["all_reduce"], "f32", "sum", 50, 2, False, 0, cold), np.dtype(np.float32), 4096)
    expected = plan(4096, cold, 64 << 10).count  # 17 buffers of 4 KiB > the 64 KiB "LLC"
    assert row.buffers == expected and len(g.seen) == 52 and len(set(g.seen)) == expected
    if cold:
        assert expected == 17 and all(a != b for a, b in zip(g.seen, g.seen[1:]))
        assert len(set(g.seen)) * 4096 > 64 << 10


# ---- all_gather_v and the pickled-object collectives (uneven lengths, bytes objects) ----

UNEVEN_AND_OBJECTS = ["all_gather_v", "broadcast_object", "all_gather_object"]
UNEVEN_AND_OBJECT_FACTOR = {"all_gather_v": lambda n: (n - 1) / n, "broadcast_object": lambda n: 1.0,
                 "all_gather_object": lambda n: (n - 1) / n}


def uneven_and_object_sizes(collective: str, n: int, itemsize: int) -> list[int]:
    """all_gather_v: n * (size / n / itemsize) elements; all_gather_object: n * (size / n) bytes;
    broadcast_object: the size itself."""
    if collective == "broadcast_object":
        return SMALL_SIZES
    return [max(1, s // (n * itemsize)) * n * itemsize for s in SMALL_SIZES]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [3])
@pytest.mark.parametrize("collective", UNEVEN_AND_OBJECTS)
def test_uneven_and_object_collectives_sweep_with_check(tmp_path, n, collective):
    """Every size checked (contents and all_gather_v's lengths, the objects byte for byte): 0 wrong; the
    object rows ignore --dtype (type 'bytes', JSON dtype null); busbw = algbw * the documented factor."""
    out = tmp_path / "rows.json"
    proc = bench("-n", str(n), "--collective", collective, "--dtype", "f16", *SMALL, "--check", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, rows = parse_table(proc.stdout)
    assert f"collective {collective}" in first and f"world size {n}" in first and "in-place no" in first
    objects = collective != "all_gather_v"
    assert ("dtype - (pickled bytes objects)" if objects else "dtype f16 (half)") in first
    itemsize = 1 if objects else 2
    assert [int(r[0]) for r in rows] == uneven_and_object_sizes(collective, n, itemsize)
    assert "# Out of bounds values : 0 OK" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data) == len(rows) == len(SMALL_SIZES)
    for row, cells in zip(data, rows):
        assert cells[2:4] == (["bytes", "none"] if objects else ["half", "none"]) and cells[7] == "0"
        assert row["dtype"] == (None if objects else "f16") and row["collective"] == collective
        assert row["size"] == row["count"] * itemsize and row["wrong"] == 0
        assert row["busbw"] == pytest.approx(row["algbw"] * UNEVEN_AND_OBJECT_FACTOR[collective](n), rel=1e-9)


@pytest.mark.parametrize("total,n,lengths", [(2, 2, [1, 1]), (16, 2, [5, 11]), (15, 3, [3, 5, 7]),
                                             (3, 3, [1, 1, 1]), (100, 4, [10, 20, 30, 40])])
def test_all_gather_v_lengths_differ_and_sum_to_the_count(total, n, lengths):
    assert v_lengths(total, n) == lengths
    layouts = [COLLECTIVES["all_gather_v"].layout(total * 4, n, 4, r) for r in range(n)]
    assert layouts == [(k, total, total * 4) for k in lengths]


class _BrokenUnevenAndObjects:
    """all_gather_v / broadcast_object / all_gather_object that damage their result on rank 0 (`how`)."""

    def __init__(self, rank, n, how):
        self.rank, self.world_size, self.how = rank, n, how

    def all_gather_v(self, buf):
        lengths = v_lengths(16, self.world_size)
        out = np.concatenate([block_values(r, np.arange(k)) for r, k in enumerate(lengths)])
        if self.rank == 0 and self.how == "data":
            out[-2:] += 1000
        if self.rank == 0 and self.how == "lengths":
            lengths = lengths[::-1]  # same total, wrong split
        return out.astype(buf.dtype), lengths

    def _obj(self, r, nbytes):
        data = payload(r, nbytes)
        if self.rank == 0 and self.how == "data":
            return data[:-2] + bytes(b ^ 1 for b in data[-2:])
        return data[:-1] if self.rank == 0 and self.how == "lengths" else data

    def broadcast_object(self, root, obj):
        return self._obj(root, 32)

    def all_gather_object(self, obj):
        return [self._obj(r, len(obj)) for r in range(self.world_size)]


@pytest.mark.parametrize("collective", UNEVEN_AND_OBJECTS)
@pytest.mark.parametrize("how,wrong", [("none", 0), ("data", 2), ("lengths", 1)])
def test_check_of_uneven_and_object_collectives_counts_damage(collective, how, wrong):
    """Damaged contents count per element/byte (all_gather_object: in both ranks' objects); all_gather_v's
    lengths list counts per wrong entry (reversed at n=2: both), a truncated object per missing byte;
    rank 1's results are always right."""
    n = 2
    spec = Spec(COLLECTIVES[collective], "f32", "sum", 1, 0, True, 0)
    dtype = np.dtype(np.uint8 if collective in ("broadcast_object", "all_gather_object") else np.float32)
    size = 32 if collective == "broadcast_object" else 16 * dtype.itemsize
    expect = {("all_gather_v", "lengths"): 2, ("all_gather_object", "data"): 4,
              ("all_gather_object", "lengths"): 2}.get((collective, how), wrong)
    for rank in range(n):
        elems, count, _ = COLLECTIVES[collective].layout(size, n, dtype.itemsize, rank)
        got = check_once(_BrokenUnevenAndObjects(rank, n, how), spec, np.empty(elems, dtype), count)
        assert got == (expect if rank == 0 else 0), (collective, how, rank, got)


@pytest.mark.multiprocess
@pytest.mark.parametrize("collective", ["all_gather_v"])  # (as for the block collectives)
def test_uneven_and_object_collectives_compare_rows(tmp_path, collective):
    """OpenMPI (Allgatherv, pickling bcast) and gloo (padded all_gather, broadcast_object_list), at 3 ranks."""
    check_compare_rows(tmp_path, collective, 3, "512", UNEVEN_AND_OBJECT_FACTOR[collective])


# ---- every registered descriptor ----

@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_every_descriptor_is_complete_and_consistent(name):
    """What the table, the JSON and --help derive from a descriptor holds together, at any size and world."""
    coll = COLLECTIVES[name]
    assert isinstance(coll, Collective) and coll.name == name and not inspect.isabstract(type(coll))
    assert coll.in_place in ("yes", "no", "n/a") and isinstance(coll.sizing, Sizing)
    no_data = coll.sizing is Sizing.NOTHING
    assert (coll.payload is Payload.NOTHING) == no_data == (coll.in_place == "n/a")
    assert coll.payload.type_column("f16") == {Payload.ARRAY: "half", Payload.BYTES: "bytes",
                                               Payload.NOTHING: "-"}[coll.payload]
    for n in (1, 2, 3, 4, 8):
        factor = coll.bus_factor(n)
        assert (factor is None) == no_data and (factor is None or 0 <= factor <= 2)
    for n, itemsize in ((1, 4), (3, 2), (4, 8), (5, 1)):
        for size in (1, 8, 1000, 12345, 1 << 20):
            layouts = [coll.layout(size, n, itemsize, r) for r in range(n)]
            assert len({(count, nbytes) for _, count, nbytes in layouts}) == 1  # every rank reports the same
            elems = [e for e, _, _ in layouts]
            _, count, nbytes = layouts[0]
            assert nbytes == count * itemsize
            if no_data:
                assert elems == [0] * n and count == 0
                continue
            assert min(elems) >= 1 and nbytes <= max(size, n * itemsize)
            if coll.sizing in (Sizing.OUTPUT_BLOCKS, Sizing.UNEVEN_BLOCKS):  # the ranks' inputs make the output
                assert sum(elems) == count
            else:
                assert elems == [count] * n and (coll.sizing is Sizing.BUFFER or count % n == 0)
    for peer in (OPENMPI, GLOO):
        reason = coll.unsupported(peer, "f32", "sum")
        assert reason is None or reason.strip()
    words = " ".join(build_parser().format_help().split())

    def listed(pattern: str) -> set[str]:
        return set(re.findall(r"\w+", re.search(pattern, words).group(1))) - {"and"}
    assert name in listed(r"-c NAME (.*?) \(default all_reduce;")
    assert (name in listed(r"\(default all_reduce; (.*?) are rooted at rank 0\)")) == coll.rooted
    assert (name in listed(r"reduction for (.*?) \(default sum;")) == coll.reduces


# every registered collective through one library, at 2 ranks, checked: f32 warm at 8 B and 4 KiB, f16
# cold at 64 KiB (cold sizes below the cap rotate through tens of thousands of buffers, which peers'
# adapters wrap one by one: seconds per collective through gloo)
EVERY_COLLECTIVE = """
import json, sys
import numpy as np
from shmcoll.bench.adapters import SHMCOLL, open_group
from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.inputs import resolve_dtype
from shmcoll.bench.measure import Spec, measure
import shmcoll

library = sys.argv[1]
group = shmcoll.init() if library == SHMCOLL else open_group(library, 60)
results = {}
for coll in COLLECTIVES.values():
    for dtype, op, cold, sizes in (("f32", "sum", False, (8, 4096)), ("f16", "max", True, (65536,))):
        if coll.unsupported(library, dtype, op) is None:
            spec = Spec(coll, dtype, op, 2, 1, True, 0, cold)
            results[f"{coll.name} {dtype} {op}"] = [measure(group, spec, resolve_dtype(dtype), size, library).wrong
                                                    for size in sizes]
if group.rank == 0:
    print(json.dumps(results))
group.close()
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("library", ["shmcoll", OPENMPI, GLOO])
def test_every_collective_runs_and_checks_through_every_library(library):
    """Each registered descriptor's calls for shmcoll, OpenMPI and gloo give exact results (0 wrong)."""
    needs = {"shmcoll": (), OPENMPI: ("mpirun", "mpi4py"), GLOO: ("torch",)}[library]
    if not_installed(*needs):
        pytest.skip(f"not installed here: {', '.join(not_installed(*needs))}")
    rank = [sys.executable, "-c", EVERY_COLLECTIVE, library]
    launcher = (["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"] if library == OPENMPI
                else [sys.executable, "-m", "shmcoll.launch.run_cli", "-n", "2"])
    proc = subprocess.run([*launcher, *rank], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=TEST_HANG_S - 10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = {f"{c.name} {dtype} {op}" for c in COLLECTIVES.values() for dtype, op in (("f32", "sum"), ("f16", "max"))
                if c.unsupported(library, dtype, op) is None}
    assert set(results) == expected and len(expected) >= len(COLLECTIVES)
    assert all(wrong == ([0] if " f16 " in key else [0, 0]) for key, wrong in results.items()), results
