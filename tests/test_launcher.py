"""shmcoll-run with real processes: environment, exit status, stopping ranks, no survivors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shmcoll.errors import InvalidArgument
from shmcoll.launch import launch_local
from shmcoll.launch.run_cli import main as cli_main

from bounds import LAUNCH_S, NEVER_S, REAP_S, RUN_HANG_S
from harness import REPO, assert_all_gone, launcher_cmd, subprocess_env

pytestmark = pytest.mark.multiprocess


def run_launcher(*args: str, timeout: float = RUN_HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run(launcher_cmd(*args), cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


# --- environment ------------------------------------------------------------------------------

def test_each_rank_gets_its_environment(job):
    prog = job.program('''
        import json
        from shmcoll.config import load_config
        c = load_config()
        env = {k: v for k, v in os.environ.items() if k.startswith("SHMCOLL_")}
        cfg = dict(rank=c.rank, world=c.world_size, local=c.local_rank, addr=c.master_addr,
                   port=c.master_port, job=c.job_id, secret=c.secret.decode())
        note(f"env{RANK}.json", json.dumps(dict(env=env, cfg=cfg, exe=sys.executable)))
    ''')
    n = 4
    res = run_launcher("-n", str(n), prog, str(job.dir))  # a .py program, not executable itself
    assert res.returncode == 0, res.stderr
    seen = [json.loads((job.dir / f"env{i}.json").read_text()) for i in range(n)]
    envs = [s["env"] for s in seen]
    assert [e["SHMCOLL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["SHMCOLL_LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    for e in envs:
        assert e["SHMCOLL_WORLD_SIZE"] == e["SHMCOLL_LOCAL_WORLD_SIZE"] == "4"
        assert e["SHMCOLL_MASTER_ADDR"] == "127.0.0.1"
        assert 0 < int(e["SHMCOLL_MASTER_PORT"]) <= 65535
    for key in ("SHMCOLL_SECRET", "SHMCOLL_MASTER_PORT", "SHMCOLL_JOB_ID"):
        assert len({e[key] for e in envs}) == 1, key
    assert len(envs[0]["SHMCOLL_SECRET"]) == 32
    cfgs = [s["cfg"] for s in seen]
    assert [c["rank"] for c in cfgs] == [0, 1, 2, 3] and [c["local"] for c in cfgs] == [0, 1, 2, 3]
    assert len({(c["port"], c["job"], c["secret"], c["world"]) for c in cfgs}) == 1
    assert all(s["exe"] == sys.executable for s in seen)


def test_fresh_secret_and_job_id_per_job(job):
    code = ("import os, sys; print(os.environ['SHMCOLL_SECRET'], os.environ['SHMCOLL_JOB_ID'], "
            "os.environ['SHMCOLL_MASTER_PORT'])")
    a = run_launcher("-n", "1", sys.executable, "-c", code)
    b = run_launcher("-n", "1", sys.executable, "-c", code)
    assert a.returncode == b.returncode == 0
    sa, ja, _ = a.stdout.split()
    sb, jb, _ = b.stdout.split()
    assert sa != sb and ja != jb


def test_program_arguments_pass_through(job):
    code = "import sys, os; print(os.environ['SHMCOLL_RANK'], sys.argv[1:])"
    res = run_launcher("-n", "2", sys.executable, "-c", code, "-n", "5", "--", "--timeout")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["0 ['-n', '5', '--', '--timeout']",
                                               "1 ['-n', '5', '--', '--timeout']"]


# --- failures ---------------------------------------------------------------------------------

def test_failing_rank_status_propagates_and_others_stop(job):
    prog = job.program(f'''
        started()
        spawn_helper()
        if RANK == 1:
            all_started()
            sys.exit(3)
        block({NEVER_S})
    ''')
    t0 = time.monotonic()
    res = run_launcher("-n", "3", prog, str(job.dir))
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    assert elapsed < LAUNCH_S < NEVER_S
    assert "rank 1" in res.stderr and "status 3" in res.stderr
    assert len(job.pids()) == 3
    assert_all_gone(job.pids() + job.pids("helper"))
    assert not list(job.dir.glob("*.survived"))


def test_rank_killed_by_sigkill_gives_137(job):
    prog = job.program(f'''
        started()
        if RANK == 2:
            all_started()
            os.kill(os.getpid(), signal.SIGKILL)
        block({NEVER_S})
    ''')
    t0 = time.monotonic()
    res = run_launcher("-n", "3", prog, str(job.dir))
    assert res.returncode == 137, res.stderr
    assert time.monotonic() - t0 < LAUNCH_S
    assert "rank 2" in res.stderr and "SIGKILL" in res.stderr
    assert_all_gone(job.pids())


def test_rank_ignoring_sigterm_is_killed(job):
    prog = job.program(f'''
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        started()
        if RANK == 0:
            all_started()
            sys.exit(5)
        block({NEVER_S})
    ''')
    t0 = time.monotonic()
    res = run_launcher("-n", "2", prog, str(job.dir))
    assert res.returncode == 5, res.stderr
    assert time.monotonic() - t0 < LAUNCH_S
    assert_all_gone(job.pids())


def test_timeout_stops_everything(job):
    prog = job.program(f'''
        started()
        block({NEVER_S})
    ''')
    t0 = time.monotonic()
    res = run_launcher("--timeout", "1.5", "-n", "2", prog, str(job.dir))
    assert res.returncode == 124, res.stderr
    assert 1.5 <= time.monotonic() - t0 < LAUNCH_S
    assert "timeout" in res.stderr
    assert_all_gone(job.pids())


def test_program_not_found():
    res = run_launcher("-n", "2", "/nonexistent/shmcoll-program")
    assert res.returncode == 127
    assert "cannot start" in res.stderr


# --- signals to the launcher ------------------------------------------------------------------

def start_launcher(*args: str) -> subprocess.Popen:
    return subprocess.Popen(launcher_cmd(*args), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_to_launcher_stops_all_ranks(job):
    prog = job.program(f'''
        started()
        spawn_helper()
        block({NEVER_S})
    ''')
    launcher = start_launcher("-n", "3", prog, str(job.dir))
    try:
        job.wait_started(3)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=LAUNCH_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - t0 < LAUNCH_S
        assert "SIGTERM" in err
    finally:
        launcher.kill()
        launcher.wait(timeout=REAP_S)
    assert_all_gone(job.pids() + job.pids("helper"))


def test_sigint_is_forwarded_to_every_rank(job):
    prog = job.program(f'''
        def on_int(signum, frame):
            note(f"rank{{RANK}}.sigint", "1")
            os._exit(0)
        signal.signal(signal.SIGINT, on_int)
        started()
        block({NEVER_S})
    ''')
    launcher = start_launcher("-n", "2", prog, str(job.dir))
    try:
        job.wait_started(2)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=LAUNCH_S)
        assert launcher.returncode == 130, err
    finally:
        launcher.kill()
        launcher.wait(timeout=REAP_S)
    assert sorted(p.name for p in job.dir.glob("*.sigint")) == ["rank0.sigint", "rank1.sigint"]
    assert_all_gone(job.pids())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_ranks_die_with_a_killed_launcher(job):
    prog = job.program(f'''
        started()
        block({NEVER_S})
    ''')
    launcher = start_launcher("-n", "2", prog, str(job.dir))
    try:
        job.wait_started(2)
        launcher.kill()
        launcher.wait(timeout=REAP_S)
    finally:
        launcher.kill()
    assert_all_gone(job.pids())


# --- usage --------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["-n", "0", "true"], ["-n", "-1", "true"], ["-n", "x", "true"],
                                  ["true"], ["-n", "2"], ["-n", "2", "--bogus", "true"]])
def test_usage_errors_exit_2(args):
    res = run_launcher(*args)
    assert res.returncode == 2
    assert "usage" in res.stderr


def test_main_returns_status_in_process(capsys):
    assert cli_main(["-n", "0", "true"]) == 2
    assert cli_main(["--help"]) == 0
    assert "usage" in capsys.readouterr().out
    assert cli_main(["-n", "2", sys.executable, "-c", "pass"]) == 0


def test_launch_local_in_process(tmp_path):
    with pytest.raises(InvalidArgument):
        launch_local(0, ["true"])
    out = tmp_path / "out"
    code = "import os, sys; open(sys.argv[1] + os.environ['SHMCOLL_RANK'], 'w').write(os.environ['X'])"
    env = {"X": "given", "PATH": os.environ.get("PATH", "")}
    assert launch_local(2, [sys.executable, "-c", code, str(out)], env=env, master_port=4242) == 0
    assert (tmp_path / "out0").read_text() == (tmp_path / "out1").read_text() == "given"
    assert launch_local(1, [sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
