"""The board under stress (bench/board_stress.py): back-to-back small all-reduces over shared memory,
values changing every round, ranks held back at random, every result checked by every rank; at 2,
3 and 4 ranks on this machine's cores (oversubscribed from 3 on a 2-core machine, where spinning
waiters must give the core away). The bench script runs a million rounds; this runs fewer."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bounds import TEST_HANG_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess  # every test here launches a job
ROUNDS = 8_000


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_rank_checks_every_round_of_board_stress(n):
    run = subprocess.run([sys.executable, "-m", "shmcoll.launch.run_cli", "-n", str(n), "--timeout", "100",
                          str(ROOT / "bench" / "board_stress.py"), "--rounds", str(ROUNDS),
                          "--delay-every", "16", "--seed", str(n)],
                         cwd=ROOT, capture_output=True, text=True, timeout=TEST_HANG_S - 10)
    # (the default transport of ranks that share a host is shared memory: the board)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = re.findall(r"board_stress: rank (\d+) of (\d+) over (\w+): (\d+) rounds .* wrong results (\d+)", run.stdout)
    assert sorted(int(line[0]) for line in lines) == list(range(n)), run.stdout
    for _, size, transport, rounds, wrong in lines:
        assert (int(size), transport, int(rounds), int(wrong)) == (n, "shm", ROUNDS, 0), run.stdout
