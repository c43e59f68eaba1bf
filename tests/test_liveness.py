"""ProcessWatch: which peer processes have exited, with pidfds polled together or, where pidfds
are missing, one look per process. A killed process that nobody has reaped yet (a zombie) has
exited: it will never answer. Real child processes, killed for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shmcoll.transport.liveness import ProcessWatch

from bounds import WAIT_HANG_S
from harness import wait_until

pytestmark = pytest.mark.multiprocess


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "one-look-each"])
def test_exited_names_killed_and_reaped_processes_only(pidfds):
    watch = ProcessWatch()
    watch._pidfds = watch._pidfds and pidfds
    alive, zombie, reaped = _sleeper(), _sleeper(), _sleeper()
    try:
        pids = [alive.pid, zombie.pid, reaped.pid]
        assert watch.exited(pids) == set()
        zombie.send_signal(signal.SIGKILL)  # not waited for: a zombie until the finally below
        reaped.send_signal(signal.SIGKILL)
        reaped.wait(WAIT_HANG_S)
        wait_until(lambda: watch.exited(pids) == {zombie.pid, reaped.pid}, WAIT_HANG_S,
                   "the killed processes to count as exited", interval=0.002)
        assert watch.exited([alive.pid]) == set()
        assert watch.exited([0]) == set()  # a peer that has not registered its pid yet
    finally:
        for proc in (alive, zombie, reaped):
            proc.kill()
            proc.wait(WAIT_HANG_S)
        watch.close()


def test_a_pid_that_is_gone_before_the_first_look_has_exited():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(WAIT_HANG_S)
    watch = ProcessWatch()
    try:
        assert watch.exited([proc.pid, os.getpid()]) == {proc.pid}
    finally:
        watch.close()
