"""bench/cost_model.py and cost_terms.py: the step counts against the textbook formulas where they
must agree, the fit recovering known parameters, the selection column asked of select.py itself; and
(multiprocess) hosts_rank.py --algorithm really running the named algorithm across simulated hosts,
by the exact bytes each rank sends to each other rank.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import numpy as np
import pytest

import shmcoll
from shmcoll.algorithms import select
from shmcoll.algorithms.select import Algorithm

from bounds import WAIT_HANG_S
from harness import load_bench_script, run_ranks

hosts_rank = load_bench_script("hosts_rank")
hosts_compare = load_bench_script("hosts_compare")
cost_terms = load_bench_script("cost_terms")
cost_model = load_bench_script("cost_model")
Steps, Machine, Point = cost_terms.Steps, cost_terms.Machine, cost_terms.Point
OS, RD, RING, HD = Algorithm.ONE_SHOT, Algorithm.RECURSIVE_DOUBLING, Algorithm.RING, Algorithm.HALVING_DOUBLING
S = 64 << 10  # divisible by every power of two of hosts below, in float32 elements


# ---- step counts ----

def rowed(messages, wire, reduced):
    return Steps(messages=messages, wire=wire, reduced=reduced)


def by_python(messages, wire, reduced):
    return Steps(py_messages=messages, py_wire=wire, reduced=reduced)


def duplexed(steps, wire, reduced):
    return Steps(steps=steps, wire=wire, reduced=reduced)


@pytest.mark.parametrize("h", [2, 4, 8, 64, 1024])
def test_powers_of_two_count_as_the_textbook_formulas(h):
    """One column, one chunk per step: one-shot alpha + (H-1)S(beta+gamma) (H-1 messages, see the module
    docstring), recursive doubling log2 H (alpha + S beta + S gamma), ring 2(H-1) alpha + 2(H-1)/H S beta
    + (H-1)/H S gamma, halving-doubling the ring's bytes in 2 log2 H messages. The exchanges of two
    hosts' one-shot and of recursive doubling run in a row of C calls, a ring's and a halving's steps
    one C call each, one-shot among more hosts through Python."""
    lg = int(math.log2(h))
    one_shot = rowed if h == 2 else by_python
    assert cost_terms.crossing(OS, h, S) == one_shot(h - 1, (h - 1) * S, (h - 1) * S)
    assert cost_terms.crossing(RD, h, S) == rowed(lg, lg * S, lg * S)
    assert cost_terms.crossing(RING, h, S) == duplexed(2 * (h - 1), 2 * (h - 1) / h * S, (h - 1) / h * S)
    assert cost_terms.crossing(HD, h, S) == duplexed(2 * lg, 2 * (h - 1) / h * S, (h - 1) / h * S)


@pytest.mark.parametrize("h, core", [(3, 2), (6, 4), (1000, 512)])
def test_hosts_past_a_power_of_two_add_the_fold(h, core):
    """doubling.doubling_steps: the array given away and taken back around the core (two messages,
    one fold), in the row of C calls with the core's exchanges where they fit one."""
    lg = int(math.log2(core))
    fold = rowed(2, 2 * S, S)
    assert cost_terms.crossing(RD, h, S) == rowed(lg, lg * S, lg * S) + fold
    hd = cost_terms.crossing(HD, h, S)
    assert hd == duplexed(2 * lg, 2 * (core - 1) / core * S, (core - 1) / core * S) + fold


def test_a_fold_past_a_rows_limit_goes_through_python():
    from shmcoll.transport.tcp import SWAP_MAX_BYTES

    big = 2 * SWAP_MAX_BYTES
    assert cost_terms.crossing(RD, 3, big) == by_python(3, 3 * big, 2 * big)


def test_exchanges_past_a_rows_limit_go_through_python():
    """One-shot and recursive doubling of more than SWAP_MAX_BYTES send and receive in Python."""
    from shmcoll.transport.tcp import SWAP_MAX_BYTES

    assert cost_terms.crossing(OS, 2, SWAP_MAX_BYTES) == rowed(1, SWAP_MAX_BYTES, SWAP_MAX_BYTES)
    big = 2 * SWAP_MAX_BYTES
    assert cost_terms.crossing(OS, 2, big) == by_python(1, big, big)
    assert cost_terms.crossing(RD, 4, big) == by_python(2, 2 * big, 2 * big)


def test_large_arrays_stream_in_frames_of_chunk_bytes():
    """A 4 MiB ring between 2 hosts: 2 steps of a 2 MiB segment, 2 frames of 1 MiB each; halving-doubling
    swaps the same 2 MiB in 2 frames each way; one-shot and recursive doubling send one frame."""
    big = 4 << 20
    assert cost_terms.crossing(RING, 2, big).steps == 4
    assert cost_terms.crossing(HD, 2, big).steps == 4
    assert cost_terms.crossing(HD, 4, big).steps == 2 * (2 + 1)  # 2 MiB in 2 frames, 1 MiB in 1
    assert cost_terms.crossing(RING, 2, big, chunk_bytes=4 << 20).steps == 2
    assert cost_terms.crossing(RD, 2, big).py_messages == cost_terms.crossing(OS, 2, big).py_messages == 1


def test_two_level_adds_the_host_phases():
    """Two ranks per host: TWO_LEVEL_ONE_SHOT reduces the whole array in one board step in the host
    (one shared-memory message of S, one fold), then among 4 hosts the leader crosses with it and
    hands it on (one more message of S), between 2 both columns cross; in TWO_LEVEL each rank folds
    its half out of its peer's array and writes it, finished, into the peer's (two waits on the
    board, S read and written), and each column crosses with its half."""
    small = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL_ONE_SHOT, RD, 4, 2, S)
    assert small == cost_terms.crossing(RD, 4, S) + Steps(calls=1, reduced=S, local_messages=2, local_bytes=2 * S)
    by_column = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL_ONE_SHOT, OS, 2, 2, S)
    assert by_column == cost_terms.crossing(OS, 2, S) + Steps(calls=1, reduced=S, local_messages=1, local_bytes=S)
    large = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, RING, 4, 2, S)
    host = Steps(calls=1, reduced=S // 2, local_messages=2, local_bytes=S)
    assert large == cost_terms.crossing(RING, 4, S // 2) + host
    assert cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, HD, 8, 1, S) == cost_terms.crossing(HD, 8, S) + Steps(1)


def test_the_host_step_is_one_board_step_where_the_array_fits_an_entry():
    """4 ranks per host: one board step (one message) up to a board entry (board_bytes_for(4)),
    above it a one-shot over the rings (3 messages), none for a rank alone on its host."""
    from shmcoll.transport.shm_layout import board_bytes_for

    entry = board_bytes_for(4)
    assert cost_terms.in_host_messages(4, 8) == cost_terms.in_host_messages(4, entry) == 1
    assert cost_terms.in_host_messages(4, entry + 64) == 3
    assert cost_terms.in_host_messages(1, 8) == 0
    small = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL_ONE_SHOT, OS, 2, 4, 1024)
    assert small == cost_terms.crossing(OS, 2, 1024) + Steps(calls=1, reduced=3 * 1024, local_messages=1,
                                                             local_bytes=3 * 1024)


def test_ranks_that_share_cores_scale_the_phases_they_are_busy_in():
    """4 hosts x 2 ranks on 2 cores: every phase at 8 ranks / 2 cores, except TWO_LEVEL_ONE_SHOT's
    crossing, where only the 4 leaders run (4 / 2); each message across hosts also waits for the
    other ranks on its core (1 or 3). At a core each, nothing is scaled."""
    small = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL_ONE_SHOT, RD, 4, 2, S, cores=2)
    host = Steps(calls=1, reduced=S, local_messages=2, local_bytes=2 * S)
    crossing = cost_terms.crossing(RD, 4, S)
    assert small == crossing.times(2) + Steps(shared_messages=crossing.crossings) + host.times(4)
    large = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, RING, 4, 2, S, cores=2)
    alone = cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, RING, 4, 2, S)
    assert large == alone.times(4) + Steps(shared_messages=3 * alone.crossings)
    assert cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, RING, 4, 2, S, cores=8) == \
        cost_terms.all_reduce_steps(Algorithm.TWO_LEVEL, RING, 4, 2, S)


# ---- the forcing and the selection, asked of select.py ----

@pytest.mark.parametrize("name", sorted(hosts_rank.FORCINGS))
def test_a_forced_job_crosses_by_its_algorithm_at_every_size(name):
    before = select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS
    for hosts in (2, 3, 4, 8, 1024):
        for per_host in (1, 2, 8):
            for size in (8, 16 << 10, 64 << 10, 1 << 20, 64 << 20):
                phases, across = cost_terms.forced_route(name, hosts, per_host, size)
                assert across is cost_terms.ALGORITHMS[name], (hosts, per_host, size, phases)
    assert (select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS) == before


def test_the_selection_column_is_what_select_answers(monkeypatch):
    """Change select.py's constants and the column follows: the model re-implements no threshold."""
    m = Machine(call=1e-5, alpha=5e-5, beta=1e-9, gamma=5e-10)
    assert cost_model.selected(m, 32, 1, 8)[0] == "recursive-doubling"
    assert cost_model.selected(m, 2, 1, 8 << 20)[0] == "ring"
    monkeypatch.setattr(select, "ONE_SHOT_MAX_HOSTS", 64)
    monkeypatch.setattr(select, "HALVING_FROM_HOSTS", 1)
    assert cost_model.selected(m, 32, 1, 8)[0] == "one-shot"
    assert cost_model.selected(m, 2, 1, 8 << 20)[0] == "halving-doubling"
    rows = [ln.split(" | ") for ln in cost_model.prediction_table(m, 1, [8, 1 << 20], 1024) if ln.startswith("| ")]
    picks = {(r[0].lstrip("| "), int(r[1])): r[6] for r in rows[1:]}
    assert picks[("8 B", 64)] == "OS" and picks[("8 B", 128)] == "RD"
    assert all(picks[("1 MiB", h)] == "HD" for h in cost_terms.log2_hosts(1024))


# ---- the fit ----

def _grid() -> list:
    return [Point(name, h, k, size, 1.0) for name in cost_terms.ALGORITHMS for h, k in
            [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)] for size in (8, 1024, 64 << 10, 1 << 20, 4 << 20)]


@pytest.mark.parametrize("cores", [None, 2])
def test_the_fit_recovers_known_parameters(cores):
    truth = Machine(call=8e-6, alpha=40e-6, beta=0.8e-9, gamma=0.3e-9, alpha_local=5e-6, beta_local=0.2e-9,
                    alpha_shared=30e-6 if cores else 0.0)  # nothing shares a core where cores is None
    points = [Point(p.algorithm, p.hosts, p.per_host, p.size, cost_terms.predict(truth, p, cores)) for p in _grid()]
    got = cost_terms.fit(points, cores)
    for term in cost_terms.TERMS:
        assert getattr(got, term) == pytest.approx(getattr(truth, term), rel=1e-6), term


def test_the_fit_keeps_every_parameter_non_negative():
    """Points that an unconstrained fit would explain with a negative gamma get gamma = 0 instead."""
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # b = 4 - x: the slope would be -1
    x = cost_terms.nnls(a, b)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)
    assert np.allclose(cost_terms.nnls(a, a @ [0.5, 2.0]), [0.5, 2.0])


def test_the_error_table_flags_points_past_30_percent():
    m = Machine(call=10e-6)
    points = [Point("one-shot", 2, 1, 8, 10e-6), Point("one-shot", 4, 1, 8, 10e-6 / 1.5)]
    lines, over = cost_model.error_table(m, points, None)
    assert over == 1
    rows = [ln for ln in lines if ln.startswith("| 2x1") or ln.startswith("| 4x1")]
    assert rows[0].endswith("| +0% |") and rows[1].endswith("| +50% **over 30%** |"), rows


def test_without_matplotlib_the_plot_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "m.png"
    message = cost_model.plot(str(png), Machine(call=1e-5), [], 1, [8], 16)
    assert "matplotlib is not installed" in message and "\n" not in message and not png.exists()


# ---- the forced algorithm really runs (multiprocess) ----

def expected_sent(name: str, rank: int, n: int, size: int) -> list[int]:
    """Bytes rank sends to each rank when n hosts of one rank each all-reduce `size` bytes by `name`
    (n a power of two, size divisible into n float32 segments)."""
    sent = [0] * n
    if name == "one-shot":
        sent = [0 if q == rank else size for q in range(n)]
    elif name == "recursive-doubling":
        for d in (1 << k for k in range(int(math.log2(n)))):
            sent[rank ^ d] = size
    elif name == "ring":
        sent[(rank + 1) % n] = 2 * (n - 1) * size // n
    elif name == "halving-doubling":
        for k, d in enumerate(reversed([1 << k for k in range(int(math.log2(n)))])):
            sent[rank ^ d] = 2 * size >> (k + 1)  # the halving step's half, and again in the doubling
    return sent


def _forced_job(rank, n, port, name, sizes):
    """Force `name` (as hosts_rank.py does, before init), then each size's bytes to every rank over TCP."""
    if name:
        hosts_rank.force_algorithm(name)
    out = {}
    with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port,
                      timeout=WAIT_HANG_S) as pg:
        for size in sizes:
            before = pg.transport.traffic()["tcp"]
            x = np.full(size // 4, rank + 1.0, dtype=np.float32)
            pg.all_reduce(x)
            assert np.all(x == n * (n + 1) / 2)
            out[size] = [a - b for a, b in zip(pg.transport.traffic()["tcp"], before)]
    return out


SIZES = (16, 1 << 20)  # every algorithm at a size select gives a one-step path, and at one it gives halving-doubling


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(hosts_rank.FORCINGS))
def test_hosts_rank_algorithm_runs_that_algorithm(name, monkeypatch):
    """Four simulated hosts of one rank: each rank's bytes to each other rank are the named algorithm's."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(4, _forced_job, name, SIZES, init=False)
    for rank, out in enumerate(results):
        for size in SIZES:
            assert out[size] == expected_sent(name, rank, 4, size), (rank, size, out)


@pytest.mark.multiprocess
def test_unforced_jobs_run_what_select_picks(monkeypatch):
    """The control: without --algorithm 4 hosts recursively double 16 B and halve-and-double 1 MiB,
    so the test above tells the algorithms apart."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(4, _forced_job, None, SIZES, init=False)
    for rank, out in enumerate(results):
        assert out[16] == expected_sent("recursive-doubling", rank, 4, 16)
        assert out[1 << 20] == expected_sent("halving-doubling", rank, 4, 1 << 20)


def test_measure_jobs_time_all_reduce_by_the_forced_algorithm(tmp_path, monkeypatch):
    """`measure`'s options build hosts_compare's job line: every rank times all_reduce, forced."""
    monkeypatch.setattr(cost_model.os, "geteuid", lambda: 0)  # measure's own check: root and `ip`
    monkeypatch.setattr(cost_model.shutil, "which", lambda name: f"/sbin/{name}")
    args = cost_model.parse_args(["measure", "--out", str(tmp_path / "points.json")])
    hosts = hosts_compare.Hosts(prefix="h", subnet="10.9.9", count=2)
    cmd = hosts_compare.job_command(hosts_compare.HIER, hosts_compare.Layout(2, 1), hosts, tmp_path / "out.json",
                                    tmp_path, args, "ring")
    flags = dict(zip(cmd, cmd[1:]))
    assert (flags["--collective"], flags["--algorithm"], flags["--transport"]) == ("all_reduce", "ring", "hier")


@pytest.mark.multiprocess  # matplotlib's first import on a machine runs fc-list to build its font cache
def test_fit_reads_measure_json_and_writes_the_parameters(tmp_path, capsys):
    """`fit` end to end on measure's JSON form, made from known parameters: every point predicted to
    the microsecond, the fitted parameters written, a PNG drawn where matplotlib is installed."""
    truth = Machine(call=50e-6, alpha=120e-6, beta=0.9e-9, gamma=0.1e-9, alpha_local=40e-6, beta_local=0.4e-9,
                    alpha_shared=60e-6)
    points = [{**vars(p), "seconds": cost_terms.predict(truth, p, 2), "rounds": []} for p in _grid()]
    data, params, png = tmp_path / "m.json", tmp_path / "fit.json", tmp_path / "m.png"
    data.write_text(json.dumps({"cores": 2, "points": points}))
    assert cost_model.main(["fit", str(data), "--json", str(params), "--plot", str(png), "--top", "64"]) == 0
    out = capsys.readouterr().out
    assert f"0 of {len(points)} points over 30%" in out
    assert "| 4x2 | ring | 4 MiB |" in out and "| 64 | " in out and "| 128 | " not in out
    doc = json.loads(params.read_text())
    assert doc["cores"] == 2 and doc["machine"] == pytest.approx(vars(truth), rel=1e-6)
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in out and not png.exists()
    else:
        assert f"plot written to {png}" in out and png.stat().st_size > 20_000
