"""Real Slurm: srun starts ranks that call shmcoll.init() with no arguments, on a one-node cluster that
this module starts itself (tools/slurm.sh, from the Debian packages slurm-wlm and munge, as root).

The ranks run tests/programs/external_launcher_check.py: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID must
be the group's numbering, and each rank reports where it met the others.

Slurm missing (or not root) -> skip, unless SHMCOLL_REQUIRE_SLURM=1 (CI sets it once slurm-wlm and
munge are installed), which turns the skip into a failure so a broken install cannot pass silently.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
from test_external_launchers import ANSI, OK_LINE, PROGRAM, clean_env, run_bounded

from bounds import WAIT_HANG_S
from harness import REPO, free_port, shm_names_of

pytestmark = pytest.mark.multiprocess

SLURM_SH = str(REPO / "tools" / "slurm.sh")
REQUIRE_SLURM = "SHMCOLL_REQUIRE_SLURM"
# tools/slurm.sh gives each of its waits (munged, slurmctld, the node idle, a first srun) this deadline,
# and reports its daemons' logs when one runs out; a start or stop that outlives START_HANG_S is killed
# (inside the first test's TEST_HANG_S, which covers the module fixture's start).
SLURM_SH_DEADLINE_S = int(WAIT_HANG_S)
START_HANG_S = 3 * SLURM_SH_DEADLINE_S
PID_LINE = re.compile(r"^PID (?P<pid>\d+) addr=(?P<addr>\S+) port=(?P<port>\d+) from=(?P<origin>.*)$", re.M)


def _problem() -> str | None:
    """Why this machine cannot run a Slurm here, or None."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # where the daemons live
    missing = [name for name in ("srun", "salloc", "slurmctld", "slurmd", "munged")
               if shutil.which(name, path=path) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (install slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "tools/slurm.sh starts Slurm's daemons and writes /etc/slurm/slurm.conf: it needs root"
    return None


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm, up for this module and stopped after it."""
    problem = _problem()
    if problem:
        if os.environ.get(REQUIRE_SLURM) == "1":
            pytest.fail(f"{problem}, but {REQUIRE_SLURM}=1 says it must be tested")
        pytest.skip(problem)
    env = {**clean_env(), "SLURM_SH_DEADLINE": str(SLURM_SH_DEADLINE_S)}
    try:
        start = subprocess.run([SLURM_SH, "start"], env=env, capture_output=True, text=True, timeout=START_HANG_S)
        assert start.returncode == 0, f"tools/slurm.sh start failed:\n{start.stdout}{start.stderr}"
        yield
    finally:
        stop = subprocess.run([SLURM_SH, "stop"], env=env, capture_output=True, text=True, timeout=START_HANG_S)
        assert stop.returncode == 0, f"tools/slurm.sh stop failed:\n{stop.stdout}{stop.stderr}"


@pytest.fixture(scope="module")
def rank_cmd(slurm) -> list[str]:
    """How srun starts one rank: external_launcher_check.py, which also reports its rendezvous."""
    return [sys.executable, PROGRAM, "srun", "--report-rendezvous"]


def check_run(rc: int, out: str, n: int, steps: int = 1) -> list[dict[str, str]]:
    """Exit status 0, one OK line from each of ranks 0..n-1 of every step (assert_all_ok's check, per step),
    and nothing left in /dev/shm by any rank; each rank's PID line as a dict."""
    assert rc == 0, f"exit status {rc}; output:\n{out}"
    out = ANSI.sub("", out)
    oks = OK_LINE.findall(out)
    assert sorted(int(r) for r, _, _ in oks) == sorted(list(range(n)) * steps), out
    assert {int(w) for _, w, _ in oks} == {n}, out
    ranks = [m.groupdict() for m in PID_LINE.finditer(out)]
    assert len(ranks) == n * steps, out
    assert shm_names_of([int(r["pid"]) for r in ranks]) == [], "shared memory left behind by srun's ranks"
    return ranks


@pytest.mark.parametrize("n, extra", [(2, []), (4, ["-O"])], ids=["n2", "n4-overcommit"])
def test_srun_without_master_variables(rank_cmd, n, extra):
    """srun -n 2, and srun -n 4 -O (4 ranks on 2 CPUs): nothing exported, the rendezvous comes from Slurm's
    own variables, and every rank agrees on it."""
    rc, out = run_bounded(["srun", "-n", str(n), *extra, *rank_cmd], clean_env())
    ranks = check_run(rc, out, n)
    # the step's first (only) host, named as slurm.sh named the node, and a port derived from the job
    assert {r["addr"] for r in ranks} == {socket.gethostname().split(".")[0]}, out
    assert len({r["port"] for r in ranks}) == 1, out
    assert all(r["origin"].startswith("derived from SLURM_JOB_ID") for r in ranks), out


def test_two_steps_in_one_allocation(rank_cmd):
    """Two srun steps one after the other in one salloc: both meet (with the same derived port or not)."""
    step = shlex.join(["srun", "-n", "2", *rank_cmd])
    rc, out = run_bounded(["salloc", "-n", "2", "sh", "-c", f"{step} && {step}"], clean_env())
    check_run(rc, out, 2, steps=2)


def test_srun_explicit_master_wins(rank_cmd):
    """MASTER_ADDR/MASTER_PORT exported before srun (srun passes them on) are used as given."""
    port = free_port()
    rc, out = run_bounded(["srun", "-n", "2", *rank_cmd, "--expect-port", str(port)],
                          clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    ranks = check_run(rc, out, 2)
    assert {(r["addr"], r["port"], r["origin"]) for r in ranks} == {("127.0.0.1", str(port), "MASTER_PORT")}, out
