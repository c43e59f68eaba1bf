"""Jobs over a hostfile without extra machines: the rsh quoting against a real shell, --tag-output, and
real jobs whose "rsh" is a script that drops the host and execs the rest (two hosts in name, one
machine), so supervision across hosts is tested everywhere, without root; and the remote supervisor
alone. The parser and the rest of the hostfile in one process are in test_hostfile.py.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmcoll.launch import remote
from shmcoll.launch.multihost import rsh_argv, rsh_is_shell, supervisor_argv

from bounds import LAUNCH_S, NEVER_S, REAP_S, RUN_HANG_S
from harness import REPO, alive, assert_all_gone, launcher_cmd, subprocess_env, wait_until

pytestmark = pytest.mark.multiprocess

FAKE_RSH = '#!/bin/sh\n# a direct-exec rsh (like ip netns exec): drop the host, exec the rest here\nshift\nexec "$@"\n'
# Like ssh: drop the options (-o X) and the host, join the rest with spaces and let a shell parse it.
FAKE_SSH = '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift 2; done\nshift\nexec sh -c "$*"\n'


# --- the rsh command line -------------------------------------------------------------------------

WEIRD = ["plain", "two words", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "back\\slash", "*", "", "a;b|c&d",
         "new\nline", "-n"]
SHOW_ARGV = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *WEIRD]


@pytest.mark.parametrize("rsh", [["ssh"], ["/usr/bin/ssh", "-o", "BatchMode=yes"], ["rsh"]])
def test_ssh_gets_one_shell_string_that_round_trips(rsh):
    argv = rsh_argv(rsh, "node1", SHOW_ARGV)
    assert rsh_is_shell(rsh)
    assert argv[:len(rsh) + 1] == [*rsh, "node1"] and len(argv) == len(rsh) + 2
    # ssh joins what follows the host with spaces and the remote login shell parses it:
    remote_line = " ".join(argv[len(rsh) + 1:])
    out = subprocess.run(["sh", "-c", remote_line], capture_output=True, text=True, timeout=RUN_HANG_S)
    assert json.loads(out.stdout) == WEIRD, out.stderr


@pytest.mark.parametrize("rsh", [["ip", "netns", "exec"], ["/usr/bin/docker", "exec"], ["sh", "/x/fake rsh"]])
def test_direct_exec_rsh_gets_argv_as_is(rsh):
    argv = rsh_argv(rsh, "ns1", SHOW_ARGV)
    assert not rsh_is_shell(rsh)
    assert argv == [*rsh, "ns1", *SHOW_ARGV]
    out = subprocess.run(argv[len(rsh) + 1:], capture_output=True, text=True, timeout=RUN_HANG_S)
    assert json.loads(out.stdout) == WEIRD, out.stderr


# --- --tag-output -------------------------------------------------------------------------------

def chatty_program(tmp_path: Path) -> str:
    """Each rank writes long lines in small flushed pieces to stdout and stderr."""
    path = tmp_path / "chatty.py"
    path.write_text(
        "import os, sys\n"
        "r = os.environ['SHMCOLL_RANK']\n"
        "for k in range(150):\n"
        "    for stream in (sys.stdout, sys.stderr):\n"
        "        for piece in ('line-', r, '-', str(k), '-', 'x' * 300, '\\n'):\n"
        "            stream.write(piece); stream.flush()\n"
        "sys.stdout.write('no newline at the end ' + r); sys.stdout.flush()\n")
    return str(path)


def check_tagged(text: str, ranks: int) -> list[str]:
    """Every line is one whole line of one rank, all 150 of each rank are there; the unfinished tails."""
    lines = text.splitlines()
    pattern = re.compile(r"^\[(\d)\] line-(\d)-(\d+)-x{300}$")
    tails = [ln for ln in lines if "no newline" in ln]
    body = [ln for ln in lines if "no newline" not in ln and not ln.startswith("shmcoll-run:")]
    for ln in body:
        m = pattern.match(ln)
        assert m and m.group(1) == m.group(2), f"mangled line: {ln[:80]!r}"
    for r in range(ranks):
        assert sorted(int(pattern.match(ln).group(3)) for ln in body if ln.startswith(f"[{r}] ")) == list(range(150))
    return tails


def test_tag_output_local(tmp_path):
    res = subprocess.run(launcher_cmd("--tag-output", "-n", "3", chatty_program(tmp_path)), cwd=REPO,
                         env=subprocess_env(), capture_output=True, text=True, timeout=RUN_HANG_S)
    assert res.returncode == 0, res.stderr[-2000:]
    tails = check_tagged(res.stdout, 3)
    assert sorted(tails) == [f"[{r}] no newline at the end {r}" for r in range(3)]
    assert check_tagged(res.stderr, 3) == []


# --- real jobs through a fake rsh -----------------------------------------------------------------

def fake_rsh(job, kind: str = "exec") -> str:
    """An --rsh that runs everything on this machine: direct exec, or through a shell like ssh."""
    if kind == "exec":
        (job.dir / "fake rsh").write_text(FAKE_RSH)
        return f"sh {shlex.quote(str(job.dir / 'fake rsh'))}"
    ssh = job.dir / "fake bin" / "ssh"  # the name is what marks it as ssh-like
    ssh.parent.mkdir(exist_ok=True)
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    return f"{shlex.quote(str(ssh))} -o BatchMode=yes"


def hostfile_cmd(job, hostfile: str, *args: str, rsh: str = "exec") -> list[str]:
    """The launcher on a hostfile, with a fake rsh."""
    (job.dir / "hosts").write_text(hostfile)
    return launcher_cmd("--hostfile", str(job.dir / "hosts"), "--rsh", fake_rsh(job, rsh), *args)


def run_hostfile(job, hostfile: str, *args: str, cwd=REPO, rsh: str = "exec") -> subprocess.CompletedProcess:
    return subprocess.run(hostfile_cmd(job, hostfile, *args, rsh=rsh), cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=RUN_HANG_S)


def supervisor_pids(job) -> list[int]:
    return job.pids("sup")


ENV_PROGRAM = '''
    import json
    note(f"sup{RANK}.pid", str(os.getppid()))
    env = {k: v for k, v in os.environ.items() if k.startswith("SHMCOLL_")}
    note(f"env{RANK}.json", json.dumps(dict(env=env, cwd=os.getcwd(), exe=sys.executable)))
'''


@pytest.mark.parametrize("rsh", ["exec", "ssh"])
def test_hostfile_ranks_get_their_environment(job, tmp_path, rsh):
    prog = job.program(ENV_PROGRAM)
    workdir = tmp_path / "work dir"
    workdir.mkdir()
    res = run_hostfile(job, "alpha slots=2\nbeta slots=2\n", "-n", "3", "--master-addr", "127.0.0.1",
                       "--master-port", "4321", prog, str(job.dir), cwd=workdir, rsh=rsh)
    assert res.returncode == 0, res.stderr
    seen = [json.loads((job.dir / f"env{i}.json").read_text()) for i in range(3)]
    envs = [s["env"] for s in seen]
    assert [(e["SHMCOLL_RANK"], e["SHMCOLL_LOCAL_RANK"], e["SHMCOLL_LOCAL_WORLD_SIZE"], e["SHMCOLL_HOST_ID"])
            for e in envs] == [("0", "0", "2", "alpha"), ("1", "1", "2", "alpha"), ("2", "0", "1", "beta")]
    for e in envs:
        rendezvous = (e["SHMCOLL_WORLD_SIZE"], e["SHMCOLL_MASTER_ADDR"], e["SHMCOLL_MASTER_PORT"])
        assert rendezvous == ("3", "127.0.0.1", "4321")
    for key in ("SHMCOLL_SECRET", "SHMCOLL_JOB_ID"):
        assert len({e[key] for e in envs}) == 1 and envs[0][key]
    assert all(s["cwd"] == str(workdir) and s["exe"] == sys.executable for s in seen)
    assert_all_gone(supervisor_pids(job))


def test_hostfile_default_rendezvous_is_the_first_host(job):
    prog = job.program(ENV_PROGRAM)
    res = run_hostfile(job, "localhost\n127.0.0.1 slots=2\n", prog, str(job.dir))  # all slots: 3 ranks
    assert res.returncode == 0, res.stderr
    envs = [json.loads((job.dir / f"env{i}.json").read_text())["env"] for i in range(3)]
    assert {e["SHMCOLL_MASTER_ADDR"] for e in envs} == {"localhost"}
    assert [e["SHMCOLL_HOST_ID"] for e in envs] == ["localhost", "127.0.0.1", "127.0.0.1"]
    assert 1024 <= int(envs[0]["SHMCOLL_MASTER_PORT"]) <= 65535


def test_hostfile_tag_output(job, tmp_path):
    res = run_hostfile(job, "alpha slots=1\nbeta slots=1\n", "--tag-output", "--master-addr", "127.0.0.1",
                       chatty_program(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(check_tagged(res.stdout, 2)) == ["[0] no newline at the end 0", "[1] no newline at the end 1"]
    check_tagged(res.stderr, 2)


@pytest.mark.parametrize("rsh", ["exec", "ssh"])
def test_failing_remote_rank_stops_every_host(job, rsh):
    prog = job.program(f'''
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        spawn_helper()
        if RANK == 2:
            all_started()
            sys.exit(3)
        block({NEVER_S})
    ''')
    t0 = time.monotonic()
    res = run_hostfile(job, "alpha slots=2\nbeta slots=2\n", "--master-addr", "127.0.0.1", prog, str(job.dir),
                       rsh=rsh)
    assert res.returncode == 3, res.stderr
    assert time.monotonic() - t0 < LAUNCH_S < NEVER_S
    assert "rank 2 (on beta" in res.stderr and "status 3" in res.stderr
    assert len(job.pids()) == 4
    assert_all_gone(job.pids() + job.pids("helper") + supervisor_pids(job))
    assert not list(job.dir.glob("*.survived"))


def start_hostfile(job, hostfile: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(hostfile_cmd(job, hostfile, "--master-addr", "127.0.0.1", *args), cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigint_reaches_every_remote_rank(job):
    prog = job.program(f'''
        def on_int(signum, frame):
            note(f"rank{{RANK}}.sigint", "1")
            os._exit(0)
        signal.signal(signal.SIGINT, on_int)
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        block({NEVER_S})
    ''')
    launcher = start_hostfile(job, "alpha slots=2\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(3)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=LAUNCH_S)
        assert launcher.returncode == 130, err
    finally:
        launcher.kill()
        launcher.wait(timeout=REAP_S)
    assert sorted(p.name for p in job.dir.glob("*.sigint")) == ["rank0.sigint", "rank1.sigint", "rank2.sigint"]
    assert_all_gone(job.pids() + supervisor_pids(job))


def test_sigterm_stops_remote_ranks_that_ignore_it(job):
    prog = job.program(f'''
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        spawn_helper()
        block({NEVER_S})
    ''')
    launcher = start_hostfile(job, "alpha slots=1\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(2)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=LAUNCH_S)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - t0 < LAUNCH_S
    finally:
        launcher.kill()
        launcher.wait(timeout=REAP_S)
    assert_all_gone(job.pids() + job.pids("helper") + supervisor_pids(job))


def test_remote_ranks_die_with_a_killed_launcher(job):
    # No helper processes here: a supervisor killed outright cannot sweep its rank's helpers (the
    # rank itself goes through its parent-death signal), as with a SIGKILLed local launcher.
    prog = job.program(f'''
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        block({NEVER_S})
    ''')
    launcher = start_hostfile(job, "alpha slots=1\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(2)
        launcher.kill()  # no cleanup at all: rsh processes and supervisors must go on their own
        launcher.wait(timeout=REAP_S)
    finally:
        launcher.kill()
    assert_all_gone(job.pids() + supervisor_pids(job))


def test_missing_rsh_or_program(job, tmp_path):
    (tmp_path / "hosts").write_text("alpha\n")
    res = subprocess.run(launcher_cmd("--hostfile", str(tmp_path / "hosts"), "--rsh", "/nonexistent/rsh", "true"),
                         cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=RUN_HANG_S)
    assert res.returncode == 127 and "cannot start '/nonexistent/rsh'" in res.stderr
    res = run_hostfile(job, "alpha\nbeta\n", "--master-addr", "127.0.0.1", "/nonexistent/program")
    assert res.returncode == 127 and "on alpha: cannot start '/nonexistent/program'" in res.stderr


# --- the remote supervisor alone ------------------------------------------------------------------

def start_supervisor() -> subprocess.Popen:
    return subprocess.Popen(supervisor_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=subprocess_env())


def send_spec(sup: subprocess.Popen, argv: list[str], cwd: str) -> None:
    sup.stdin.write(remote.spec_line(argv, {"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "1"}, cwd, 0, "here"))
    sup.stdin.flush()


def test_supervisor_kills_its_program_when_stdin_closes(job):
    prog = job.program(f'''
        started()
        spawn_helper()
        block({NEVER_S})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        wait_until(lambda: job.pids("helper") or sup.poll() is not None, LAUNCH_S, "the rank's helper to start")
        assert sup.poll() is None
        assert all(alive(p) for p in job.pids() + job.pids("helper"))
        sup.stdin.close()  # what the launcher does to stop a rank, or what ssh does when it dies
        assert sup.wait(timeout=LAUNCH_S) == 128 + signal.SIGTERM
    finally:
        sup.kill()
        sup.wait(timeout=REAP_S)
    assert_all_gone(job.pids() + job.pids("helper"))


def test_supervisor_stops_its_program_on_sighup(job):
    prog = job.program(f'''
        started()
        block({NEVER_S})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        sup.send_signal(signal.SIGHUP)  # sshd hanging up
        assert sup.wait(timeout=LAUNCH_S) == 128 + signal.SIGTERM
    finally:
        sup.kill()
        sup.wait(timeout=REAP_S)
    assert_all_gone(job.pids())


def test_supervisor_forwards_signals_and_passes_the_status(job):
    prog = job.program(f'''
        def on_int(signum, frame):
            note("rank0.sigint", "1")
            os._exit(7)
        signal.signal(signal.SIGINT, on_int)
        started()
        block({NEVER_S})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        sup.stdin.write(remote.signal_line(signal.SIGINT))
        sup.stdin.flush()
        assert sup.wait(timeout=LAUNCH_S) == 7
    finally:
        sup.kill()
        sup.wait(timeout=REAP_S)
    assert (job.dir / "rank0.sigint").exists()


@pytest.mark.parametrize("spec, status, words", [
    (b"not json\n", 1, "no valid spec"),
    (remote.spec_line(["/nonexistent/x"], {}, "/", 0, "h"), 127, "cannot start '/nonexistent/x'"),
    (remote.spec_line(["true"], {}, "/nonexistent/dir", 0, "h"), 1, "cannot change to directory"),
])
def test_supervisor_start_failures(spec, status, words):
    res = subprocess.run(supervisor_argv(), input=spec, capture_output=True, timeout=RUN_HANG_S, env=subprocess_env())
    assert res.returncode == status
    assert words in res.stderr.decode()


