"""A short soak (bench/soak.py): thousands of random calls of every kind the contract has, on the world
and on sub-groups made and closed along the way, checked exactly, over every transport (the hierarchy
over two simulated hosts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bounds import TEST_HANG_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess  # every test here launches a job

#: Every call of ProcessGroup in API.md (and each spawn_ form group.py has), as the soak names them:
#: written out here, not taken from the soak, so a kind the soak stops drawing fails the test.
COLLECTIVES = ["all_reduce", "reduce_scatter", "reduce", "broadcast", "all_gather", "all_gather_v", "gather",
               "scatter", "all_to_all"]
EVERY_KIND = {*COLLECTIVES, *(f"spawn_{name}" for name in COLLECTIVES), "all_reduce_typed", "broadcast_object",
              "all_gather_object", "barrier", "federated_average", "send_recv", "send_recv_f32", "split", "close"}

#: Each call's deadline in the soak (SHMCOLL_TIMEOUT), well inside the job's limit (--timeout 100):
#: a stuck call then fails with the library's own report (the call, the rank waited for, the calls
#: before it) instead of the launcher stopping a silent job.
CALL_TIMEOUT_S = 40


@pytest.mark.parametrize("transport, n, hosts, minutes", [
    ("hier", 4, 2, 0.35),  # the 20-second soak: shared memory and TCP at once
    ("shm", 3, 1, 0.15),
    ("tcp", 2, 1, 0.12),
])
def test_short_soak_finds_no_wrong_result_and_no_growth(transport, n, hosts, minutes):
    run = subprocess.run([sys.executable, "-m", "shmcoll.launch.run_cli", "-n", str(n), "--timeout", "100",
                          str(ROOT / "bench" / "soak.py"), "--minutes", str(minutes), "--max-bytes", str(1 << 20),
                          "--transport", transport, "--hosts", str(hosts), "--seed", str(n)],
                         cwd=ROOT, capture_output=True, text=True, timeout=TEST_HANG_S - 10,
                         env={**os.environ, "SHMCOLL_TIMEOUT": str(CALL_TIMEOUT_S)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"soak: {transport} transport," in run.stdout, run.stdout
    total = int(re.search(r": (\d+) collectives", run.stdout).group(1))
    assert total >= 500, run.stdout  # it really ran a soak, past the point where memory is sampled
    kinds = {kind: int(count) for kind, count in re.findall(r"(\w+)=(\d+)", re.search(r"kinds: (.*)", run.stdout)[1])}
    assert kinds.keys() == EVERY_KIND, run.stdout
    assert min(kinds.values()) >= 1, run.stdout  # every kind ran, none skipped in silence
    assert sum(kinds.values()) == total, run.stdout
    on_subgroups = int(re.search(r"sub-groups: \d+ made, up to \d+ live at once, (\d+) calls on them", run.stdout)[1])
    assert on_subgroups >= 1, run.stdout
    ranks = re.findall(r"wrong elements (\d+); resident (\d+) MiB after 500 calls, (\d+) MiB at the end", run.stdout)
    assert len(ranks) == n, run.stdout
    for wrong, warm, final in ranks:
        assert int(wrong) == 0, run.stdout + run.stderr  # stderr names the first wrong calls
        assert int(final) <= int(warm) + 64, run.stdout  # memory does not grow with the number of calls
