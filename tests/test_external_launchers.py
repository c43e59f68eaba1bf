"""Real external launchers: OpenMPI's mpirun and torchrun start ranks that call shmcoll.init() with
no arguments, and tests/programs/external_launcher_check.py checks numbering and collectives exactly.

mpirun missing -> skip, unless SHMCOLL_REQUIRE_MPIRUN=1 (CI sets it once OpenMPI is installed),
which turns the skip into a failure so a broken install cannot pass silently. torch missing -> skip.
A process started with no launcher at all runs as a group of one. Slurm's srun: tests/test_slurm_launch.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys

import pytest

from bounds import LAUNCH_S, REAP_S, RUN_HANG_S, WAIT_HANG_S
from harness import REPO, free_port, launcher_cmd

pytestmark = pytest.mark.multiprocess

PROGRAM = str(REPO / "tests" / "programs" / "external_launcher_check.py")
# One launcher run takes 1-4 s here; RUN_HANG_S is its hang guard. Inside, the ranks' group timeout
# (SHMCOLL_TIMEOUT) and then their watchdog (CHECK_DEADLINE) end a hung rank on its own before that.
RANK_TIMEOUT_S = str(WAIT_HANG_S)
CHECK_DEADLINE_S = str(int(RUN_HANG_S) - 5)
REQUIRE_MPIRUN = "SHMCOLL_REQUIRE_MPIRUN"
# Whatever a surrounding launcher, CI job or earlier export left behind must not leak into the runs.
_LAUNCHER_PREFIXES = ("SHMCOLL_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                   "MASTER_PORT", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}
OK_LINE = re.compile(r"^OK rank=(\d+) world=(\d+) transport=(\w+)$", re.M)
# a rank's stdout may carry terminal colour codes (a library that colours its output), stripped before matching
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, with the repo importable."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["SHMCOLL_TIMEOUT"] = RANK_TIMEOUT_S
    env["CHECK_DEADLINE"] = CHECK_DEADLINE_S
    env.update(extra)
    return env


def run_bounded(argv: list[str], env: dict[str, str], timeout: float = RUN_HANG_S) -> tuple[int, str]:
    """(exit status, stdout+stderr) of a launcher run, which is stopped with its ranks on a hang.

    The launcher gets its own session so that on timeout the whole tree (launcher and ranks) is
    signalled: SIGTERM first so mpirun/torchrun can stop their ranks, then SIGKILL.
    """
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        out = _stop_tree(proc)
        pytest.fail(f"{argv[0]} did not finish within {timeout:g} s; output:\n{out}")


def _stop_tree(proc: subprocess.Popen) -> str:
    """SIGTERM the launcher's process group, SIGKILL what is left after REAP_S; the output so far."""
    for sig, grace in ((signal.SIGTERM, REAP_S), (signal.SIGKILL, REAP_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=grace)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def assert_all_ok(rc: int, out: str, n: int, transport: str | None = None) -> None:
    """Exit status 0 and exactly one OK line from each of ranks 0..n-1, each seeing world size n."""
    assert rc == 0, f"exit status {rc}; output:\n{out}"
    oks = OK_LINE.findall(ANSI.sub("", out))
    assert sorted(int(r) for r, _, _ in oks) == list(range(n)), out
    assert {int(w) for _, w, _ in oks} == {n}, out
    if transport is not None:
        assert {t for _, _, t in oks} == {transport}, out


# --- OpenMPI's mpirun --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mpirun() -> str:
    """Path of Open MPI's mpirun; skip without it (fail under SHMCOLL_REQUIRE_MPIRUN=1)."""
    path = shutil.which("mpirun")
    problem = None if path else "mpirun is not on PATH (install openmpi-bin)"
    if path:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=RUN_HANG_S)
        if "Open MPI" not in version.stdout + version.stderr:
            problem = f"{path} is not Open MPI's mpirun: {version.stdout.strip()[:200]!r}"
    if problem:
        if os.environ.get(REQUIRE_MPIRUN) == "1":
            pytest.fail(f"{problem}, but {REQUIRE_MPIRUN}=1 says it must be tested")
        pytest.skip(problem)
    return path


def mpirun_cmd(mpirun: str, n: int, *exports: str, program: list[str] | None = None) -> list[str]:
    """The README's command line, plus what a 2-core container needs: run as root, 3 ranks on 2
    cores (--oversubscribe) and no pinning of several spinning ranks to one core (--bind-to none)."""
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(n)]
    for name in ("PYTHONPATH", "SHMCOLL_TIMEOUT", "CHECK_DEADLINE"):
        argv += ["-x", name]  # forwarded so that ranks on other hosts would get them too
    for e in exports:
        argv += ["-x", e]
    return argv + (program or [sys.executable, PROGRAM, "mpirun"])


@pytest.mark.parametrize("n", [3, 2])
def test_mpirun_init_from_its_variables(mpirun, n):
    port = free_port()
    argv = mpirun_cmd(mpirun, n, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}")
    rc, out = run_bounded(argv + ["--expect-port", str(port)], clean_env())
    assert_all_ok(rc, out, n)


def test_mpirun_over_tcp(mpirun):
    """The TCP mesh path under mpirun too (every rank listens and connects, not only the store)."""
    argv = mpirun_cmd(mpirun, 3, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}", "SHMCOLL_TRANSPORT=tcp")
    rc, out = run_bounded(argv, clean_env())
    assert_all_ok(rc, out, 3, transport="NetTransport")


def test_mpirun_with_exported_secret(mpirun):
    """-x SHMCOLL_SECRET reaches every rank, and ranks holding it meet (the no-secret case is above)."""
    argv = mpirun_cmd(mpirun, 2, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}",
                      f"SHMCOLL_SECRET={secrets.token_hex(16)}", "SHMCOLL_TRANSPORT=tcp")
    rc, out = run_bounded(argv + ["--expect-secret"], clean_env())
    assert_all_ok(rc, out, 2, transport="NetTransport")


def test_mpirun_without_master_addr_says_what_to_export(mpirun):
    """Every rank fails at once with the exact -x flags to add; nothing waits for a timeout (the ranks'
    group timeout is longer than LAUNCH_S)."""
    program = [sys.executable, "-c", "import shmcoll; shmcoll.init()"]
    rc, out = run_bounded(mpirun_cmd(mpirun, 2, program=program), clean_env(), timeout=LAUNCH_S)
    assert rc != 0, out
    assert "InvalidArgument" in out, out
    assert "under Open MPI's mpirun" in out and "mpirun -x MASTER_ADDR=" in out, out


# --- no launcher -------------------------------------------------------------------------------

def test_no_launcher_runs_as_a_group_of_one():
    """`python train.py` with no launcher and nothing exported: a group of one, as an MPI program
    started without mpirun, whose collectives return its own data."""
    code = ("import numpy as np, shmcoll\n"
            "with shmcoll.init() as pg:\n"
            "    x = np.arange(4.0)\n"
            "    pg.all_reduce(x)\n"
            "    print(pg.rank, pg.world_size, x.tolist(), pg.all_gather(x).tolist())")
    rc, out = run_bounded([sys.executable, "-c", code], clean_env(), timeout=LAUNCH_S)
    assert rc == 0, out
    assert out.strip() == "0 1 [0.0, 1.0, 2.0, 3.0] [0.0, 1.0, 2.0, 3.0]", out


# --- torchrun ----------------------------------------------------------------------------------

def torchrun_cmd(*args: str) -> list[str]:
    """torchrun through this interpreter (its workers run under sys.executable too)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI installs torch==2.13.0)")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", *args]


def test_torchrun_standalone_uses_a_port_beside_torchs():
    """--standalone: torch's agent holds MASTER_PORT (a port it picked), shmcoll takes MASTER_PORT + 2."""
    argv = torchrun_cmd("--standalone", PROGRAM, "torchrun", "--expect-port", "MASTER_PORT+2")
    rc, out = run_bounded(argv, clean_env())
    assert_all_ok(rc, out, 2)


def test_torchrun_static_master_port():
    port = free_port()
    argv = torchrun_cmd("--master-addr", "127.0.0.1", "--master-port", str(port), PROGRAM, "torchrun",
                        "--expect-port", str(port + 2))
    rc, out = run_bounded(argv, clean_env())
    assert_all_ok(rc, out, 2)


def test_torchrun_shmcoll_master_port_overrides():
    """SHMCOLL_MASTER_PORT, exported to torchrun, is used as is (no +2), over a TCP mesh this time."""
    port = free_port()
    argv = torchrun_cmd("--standalone", PROGRAM, "torchrun", "--expect-port", str(port))
    rc, out = run_bounded(argv, clean_env(SHMCOLL_MASTER_PORT=str(port), SHMCOLL_TRANSPORT="tcp"))
    assert_all_ok(rc, out, 2, transport="NetTransport")


# --- the torch backend under each launcher -----------------------------------------------------

TORCH_PROGRAM = str(REPO / "tests" / "programs" / "torch_backend_check.py")


def test_torch_backend_under_mpirun(mpirun):
    """Open MPI names ranks OMPI_COMM_WORLD_*: importing shmcoll.torch gives env:// its RANK and WORLD_SIZE."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI installs torch==2.13.0)")
    argv = mpirun_cmd(mpirun, 2, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={free_port()}",
                      program=[sys.executable, TORCH_PROGRAM])
    rc, out = run_bounded(argv, clean_env())
    assert_all_ok(rc, out, 2, transport="shmcoll")


def test_torch_backend_under_torchrun():
    rc, out = run_bounded(torchrun_cmd("--standalone", TORCH_PROGRAM), clean_env())
    assert_all_ok(rc, out, 2, transport="shmcoll")


def test_torch_backend_under_shmcoll_run():
    """shmcoll-run sets only SHMCOLL_* variables: env:// gets its rank, size and endpoint from them."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (CI installs torch==2.13.0)")
    rc, out = run_bounded(launcher_cmd("-n", "3", sys.executable, TORCH_PROGRAM), clean_env())
    assert_all_ok(rc, out, 3, transport="shmcoll")
