"""Hostfile jobs without extra machines: the parser and placement as tables, the rsh quoting against a
real shell, --tag-output, and real jobs whose "rsh" is a script that drops the host and execs the rest
(two hosts in name, one machine), so supervision across hosts is tested everywhere, without root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shmcoll.errors import InvalidArgument
from shmcoll.launch import remote
from shmcoll.launch.hostfile import Host, Placement, parse_hostfile, place_ranks, read_hostfile
from shmcoll.launch.multihost import forwarded_env, rsh_argv, rsh_is_shell, supervisor_argv
from shmcoll.launch.run_cli import main as cli_main
from shmcoll.launch.run_cli import parse_args
from shmcoll.launch.tagout import LineTagger
from test_launcher import LONG, PROMPT, REPO, alive, assert_all_gone, job, launcher_cmd, launcher_env  # noqa: F401

FAKE_RSH = '#!/bin/sh\n# a direct-exec rsh (like ip netns exec): drop the host, exec the rest here\nshift\nexec "$@"\n'
# Like ssh: drop the options (-o X) and the host, join the rest with spaces and let a shell parse it.
FAKE_SSH = '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift 2; done\nshift\nexec sh -c "$*"\n'


# --- hostfile parsing ---------------------------------------------------------------------------

def test_parse_hostfile_merges_and_keeps_order():
    text = "# cluster\n\nnodeB slots=2   # rack 1\n  nodeA\nnodeB slots=3\n10.0.0.7 slots=4#x\nnode-c.example.org\n"
    assert parse_hostfile(text) == [Host("nodeB", 5), Host("nodeA", 1), Host("10.0.0.7", 4),
                                    Host("node-c.example.org", 1)]


@pytest.mark.parametrize("text, line, words", [
    ("a\nb max_slots=2\n", 2, "unexpected 'max_slots=2'"),
    ("a slots=0\n", 1, "slots must be an integer >= 1, got '0'"),
    ("\n\na slots=-1\n", 3, "got '-1'"),
    ("a slots=abc\n", 1, "got 'abc'"),
    ("a slots=\n", 1, "got ''"),
    ("a slots=2.5\n", 1, "got '2.5'"),
    ("a slots 2\n", 1, "unexpected 'slots'"),
    ("a\nb slots=2 c\n", 2, "unexpected 'c'"),
    ("a slots=1 slots=2\n", 1, "slots given twice"),
    ("# x\n-oProxyCommand=evil\n", 2, "bad host name '-oProxyCommand=evil'"),
    ("user@host\n", 1, "bad host name 'user@host'"),
    ("a\n\nb/c slots=1\n", 3, "bad host name 'b/c'"),
])
def test_parse_hostfile_errors_name_file_and_line(text, line, words):
    with pytest.raises(InvalidArgument) as e:
        parse_hostfile(text, "hosts.txt")
    assert str(e.value).startswith(f"hosts.txt:{line}: ")
    assert words in str(e.value)


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n   # another\n"])
def test_parse_hostfile_without_hosts(text):
    with pytest.raises(InvalidArgument, match="hosts.txt: no hosts"):
        parse_hostfile(text, "hosts.txt")


def test_read_hostfile(tmp_path):
    (tmp_path / "h").write_text("x slots=2\n")
    assert read_hostfile(str(tmp_path / "h")) == [Host("x", 2)]
    with pytest.raises(InvalidArgument, match="cannot read hostfile"):
        read_hostfile(str(tmp_path / "missing"))


# --- placement ----------------------------------------------------------------------------------

HOSTS = [Host("a", 2), Host("b", 3), Host("c", 1)]


def test_place_ranks_fills_each_host_in_order():
    assert place_ranks(HOSTS, 4) == [Placement(0, "a", 0, 2), Placement(1, "a", 1, 2),
                                     Placement(2, "b", 0, 2), Placement(3, "b", 1, 2)]
    assert [(p.host, p.local_rank, p.local_world_size) for p in place_ranks(HOSTS)] == [
        ("a", 0, 2), ("a", 1, 2), ("b", 0, 3), ("b", 1, 3), ("b", 2, 3), ("c", 0, 1)]
    assert place_ranks(HOSTS, 1) == [Placement(0, "a", 0, 1)]


def test_place_ranks_refuses_oversubscription():
    with pytest.raises(InvalidArgument, match=r"7 ranks requested but the hostfile has only 6 slots \(a=2, b=3, c=1\)"):
        place_ranks(HOSTS, 7)
    with pytest.raises(InvalidArgument):
        place_ranks(HOSTS, 0)


# --- the rsh command line -------------------------------------------------------------------------

WEIRD = ["plain", "two words", "it's", 'say "hi"', "$HOME", "`id`", "$(id)", "back\\slash", "*", "", "a;b|c&d",
         "new\nline", "-n"]
SHOW_ARGV = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *WEIRD]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rsh", [["ssh"], ["/usr/bin/ssh", "-o", "BatchMode=yes"], ["rsh"]])
def test_ssh_gets_one_shell_string_that_round_trips(rsh):
    argv = rsh_argv(rsh, "node1", SHOW_ARGV)
    assert rsh_is_shell(rsh)
    assert argv[:len(rsh) + 1] == [*rsh, "node1"] and len(argv) == len(rsh) + 2
    # ssh joins what follows the host with spaces and the remote login shell parses it:
    out = subprocess.run(["sh", "-c", " ".join(argv[len(rsh) + 1:])], capture_output=True, text=True, timeout=20)
    assert json.loads(out.stdout) == WEIRD, out.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rsh", [["ip", "netns", "exec"], ["/usr/bin/docker", "exec"], ["sh", "/x/fake rsh"]])
def test_direct_exec_rsh_gets_argv_as_is(rsh):
    argv = rsh_argv(rsh, "ns1", SHOW_ARGV)
    assert not rsh_is_shell(rsh)
    assert argv == [*rsh, "ns1", *SHOW_ARGV]
    out = subprocess.run(argv[len(rsh) + 1:], capture_output=True, text=True, timeout=20)
    assert json.loads(out.stdout) == WEIRD, out.stderr


def test_supervisor_argv_is_this_python_and_the_script():
    argv = supervisor_argv()
    assert argv == [sys.executable, str(Path(remote.__file__).resolve())]
    quoted = rsh_argv(["ssh"], "h", supervisor_argv("/opt/my python/bin/python3"))[-1]
    assert shlex.split(quoted)[0] == "/opt/my python/bin/python3"


def test_forwarded_env_is_shmcoll_path_and_exports():
    base = {"SHMCOLL_TIMEOUT": "9", "PATH": "/bin", "HOME": "/root", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/p"}
    env = forwarded_env(base, ["OMP_NUM_THREADS", "FOO=bar", "UNSET_NAME"])
    assert env["SHMCOLL_TIMEOUT"] == "9" and env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "2"
    assert env["FOO"] == "bar" and "HOME" not in env and "UNSET_NAME" not in env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/p"  # the user's entries keep priority


# --- --tag-output -------------------------------------------------------------------------------

def test_line_tagger_keeps_partial_lines():
    t = LineTagger(b"[3] ")
    assert t.feed(b"hel") == b""
    assert t.feed(b"lo\nwor") == b"[3] hello\n"
    assert t.feed(b"ld\n\nx") == b"[3] world\n[3] \n"
    assert t.flush() == b"[3] x\n"
    assert t.flush() == b""


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


@pytest.mark.timeout(30)
def test_tag_output_local(tmp_path):
    res = subprocess.run(launcher_cmd("--tag-output", "-n", "3", chatty_program(tmp_path)), cwd=REPO,
                         env=launcher_env(), capture_output=True, text=True, timeout=25)
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
    return subprocess.run(hostfile_cmd(job, hostfile, *args, rsh=rsh), cwd=cwd, env=launcher_env(),
                          capture_output=True, text=True, timeout=25)


def supervisor_pids(job) -> list[int]:
    return job.pids("sup")


ENV_PROGRAM = '''
    import json
    note(f"sup{RANK}.pid", str(os.getppid()))
    env = {k: v for k, v in os.environ.items() if k.startswith("SHMCOLL_")}
    note(f"env{RANK}.json", json.dumps(dict(env=env, cwd=os.getcwd(), exe=sys.executable)))
'''


@pytest.mark.timeout(30)
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
        assert (e["SHMCOLL_WORLD_SIZE"], e["SHMCOLL_MASTER_ADDR"], e["SHMCOLL_MASTER_PORT"]) == ("3", "127.0.0.1", "4321")
    for key in ("SHMCOLL_SECRET", "SHMCOLL_JOB_ID"):
        assert len({e[key] for e in envs}) == 1 and envs[0][key]
    assert all(s["cwd"] == str(workdir) and s["exe"] == sys.executable for s in seen)
    assert_all_gone(supervisor_pids(job))


@pytest.mark.timeout(30)
def test_hostfile_default_rendezvous_is_the_first_host(job):
    prog = job.program(ENV_PROGRAM)
    res = run_hostfile(job, "localhost\n127.0.0.1 slots=2\n", prog, str(job.dir))  # all slots: 3 ranks
    assert res.returncode == 0, res.stderr
    envs = [json.loads((job.dir / f"env{i}.json").read_text())["env"] for i in range(3)]
    assert {e["SHMCOLL_MASTER_ADDR"] for e in envs} == {"localhost"}
    assert [e["SHMCOLL_HOST_ID"] for e in envs] == ["localhost", "127.0.0.1", "127.0.0.1"]
    assert 1024 <= int(envs[0]["SHMCOLL_MASTER_PORT"]) <= 65535


@pytest.mark.timeout(30)
def test_hostfile_tag_output(job, tmp_path):
    res = run_hostfile(job, "alpha slots=1\nbeta slots=1\n", "--tag-output", "--master-addr", "127.0.0.1",
                       chatty_program(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(check_tagged(res.stdout, 2)) == ["[0] no newline at the end 0", "[1] no newline at the end 1"]
    check_tagged(res.stderr, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rsh", ["exec", "ssh"])
def test_failing_remote_rank_stops_every_host(job, rsh):
    prog = job.program(f'''
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        spawn_helper()
        if RANK == 2:
            all_started()
            sys.exit(3)
        block({LONG})
    ''')
    t0 = time.monotonic()
    res = run_hostfile(job, "alpha slots=2\nbeta slots=2\n", "--master-addr", "127.0.0.1", prog, str(job.dir),
                       rsh=rsh)
    assert res.returncode == 3, res.stderr
    assert time.monotonic() - t0 < PROMPT < LONG
    assert "rank 2 (on beta" in res.stderr and "status 3" in res.stderr
    assert len(job.pids()) == 4
    assert_all_gone(job.pids() + job.pids("helper") + supervisor_pids(job))
    assert not list(job.dir.glob("*.survived"))


def start_hostfile(job, hostfile: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(hostfile_cmd(job, hostfile, "--master-addr", "127.0.0.1", *args), cwd=REPO,
                            env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(30)
def test_sigint_reaches_every_remote_rank(job):
    prog = job.program(f'''
        def on_int(signum, frame):
            note(f"rank{{RANK}}.sigint", "1")
            os._exit(0)
        signal.signal(signal.SIGINT, on_int)
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        block({LONG})
    ''')
    launcher = start_hostfile(job, "alpha slots=2\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(3)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=PROMPT)
        assert launcher.returncode == 130, err
    finally:
        launcher.kill()
        launcher.wait(timeout=5)
    assert sorted(p.name for p in job.dir.glob("*.sigint")) == ["rank0.sigint", "rank1.sigint", "rank2.sigint"]
    assert_all_gone(job.pids() + supervisor_pids(job))


@pytest.mark.timeout(30)
def test_sigterm_stops_remote_ranks_that_ignore_it(job):
    prog = job.program(f'''
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        spawn_helper()
        block({LONG})
    ''')
    launcher = start_hostfile(job, "alpha slots=1\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(2)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=PROMPT)
        assert launcher.returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - t0 < PROMPT
    finally:
        launcher.kill()
        launcher.wait(timeout=5)
    assert_all_gone(job.pids() + job.pids("helper") + supervisor_pids(job))


@pytest.mark.timeout(30)
def test_remote_ranks_die_with_a_killed_launcher(job):
    # No helper processes here: a supervisor killed outright cannot sweep its rank's helpers (the
    # rank itself goes through its parent-death signal), as with a SIGKILLed local launcher.
    prog = job.program(f'''
        note(f"sup{{RANK}}.pid", str(os.getppid()))
        started()
        block({LONG})
    ''')
    launcher = start_hostfile(job, "alpha slots=1\nbeta slots=1\n", prog, str(job.dir))
    try:
        job.wait_started(2)
        launcher.kill()  # no cleanup at all: rsh processes and supervisors must go on their own
        launcher.wait(timeout=5)
    finally:
        launcher.kill()
    assert_all_gone(job.pids() + supervisor_pids(job))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hostfile, args, words", [
    ("alpha slots=2\n", ["-n", "3"], "3 ranks requested but the hostfile has only 2 slots"),
    ("alpha slots=2\nbeta slots=x\n", [], "hosts:2: slots must be an integer"),
])
def test_hostfile_usage_errors(tmp_path, capsys, hostfile, args, words):
    (tmp_path / "hosts").write_text(hostfile)
    assert cli_main(["--hostfile", str(tmp_path / "hosts"), *args, "/nonexistent/program"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--rsh", "ssh -p 2"], ["--master-addr", "h"], ["-x", "A"], []])
def test_hostfile_options_need_a_hostfile(capsys, args):
    assert cli_main([*args, "true"]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and ("only apply with --hostfile" in err or "-n N is required" in err)


def test_cli_options_stop_at_the_program():
    args = parse_args(["--hostfile", "h", "-x", "A", "-x", "B=1", "--tag-output", "prog", "-x", "C", "--rsh", "r"])
    assert (args.hostfile, args.export, args.tag_output, args.n, args.rsh) == ("h", ["A", "B=1"], True, None, "ssh")
    assert args.command == ["prog", "-x", "C", "--rsh", "r"]


@pytest.mark.timeout(30)
def test_missing_rsh_or_program(job, tmp_path):
    (tmp_path / "hosts").write_text("alpha\n")
    res = subprocess.run(launcher_cmd("--hostfile", str(tmp_path / "hosts"), "--rsh", "/nonexistent/rsh", "true"),
                         cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=25)
    assert res.returncode == 127 and "cannot start '/nonexistent/rsh'" in res.stderr
    res = run_hostfile(job, "alpha\nbeta\n", "--master-addr", "127.0.0.1", "/nonexistent/program")
    assert res.returncode == 127 and "on alpha: cannot start '/nonexistent/program'" in res.stderr


# --- the remote supervisor alone ------------------------------------------------------------------

def start_supervisor() -> subprocess.Popen:
    return subprocess.Popen(supervisor_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=launcher_env())


def send_spec(sup: subprocess.Popen, argv: list[str], cwd: str) -> None:
    sup.stdin.write(remote.spec_line(argv, {"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "1"}, cwd, 0, "here"))
    sup.stdin.flush()


@pytest.mark.timeout(30)
def test_supervisor_kills_its_program_when_stdin_closes(job):
    prog = job.program(f'''
        started()
        spawn_helper()
        block({LONG})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        while not job.pids("helper"):
            assert sup.poll() is None
            time.sleep(0.01)
        assert all(alive(p) for p in job.pids() + job.pids("helper"))
        sup.stdin.close()  # what the launcher does to stop a rank, or what ssh does when it dies
        assert sup.wait(timeout=PROMPT) == 128 + signal.SIGTERM
    finally:
        sup.kill()
        sup.wait(timeout=5)
    assert_all_gone(job.pids() + job.pids("helper"))


@pytest.mark.timeout(30)
def test_supervisor_stops_its_program_on_sighup(job):
    prog = job.program(f'''
        started()
        block({LONG})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        sup.send_signal(signal.SIGHUP)  # sshd hanging up
        assert sup.wait(timeout=PROMPT) == 128 + signal.SIGTERM
    finally:
        sup.kill()
        sup.wait(timeout=5)
    assert_all_gone(job.pids())


@pytest.mark.timeout(30)
def test_supervisor_forwards_signals_and_passes_the_status(job):
    prog = job.program(f'''
        def on_int(signum, frame):
            note("rank0.sigint", "1")
            os._exit(7)
        signal.signal(signal.SIGINT, on_int)
        started()
        block({LONG})
    ''')
    sup = start_supervisor()
    try:
        send_spec(sup, [sys.executable, prog, str(job.dir)], str(REPO))
        job.wait_started(1)
        sup.stdin.write(remote.signal_line(signal.SIGINT))
        sup.stdin.flush()
        assert sup.wait(timeout=PROMPT) == 7
    finally:
        sup.kill()
        sup.wait(timeout=5)
    assert (job.dir / "rank0.sigint").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("spec, status, words", [
    (b"not json\n", 1, "no valid spec"),
    (remote.spec_line(["/nonexistent/x"], {}, "/", 0, "h"), 127, "cannot start '/nonexistent/x'"),
    (remote.spec_line(["true"], {}, "/nonexistent/dir", 0, "h"), 1, "cannot change to directory"),
])
def test_supervisor_start_failures(spec, status, words):
    res = subprocess.run(supervisor_argv(), input=spec, capture_output=True, timeout=20, env=launcher_env())
    assert res.returncode == status
    assert words in res.stderr.decode()


def test_control_lines_keep_what_shares_the_specs_read():
    r, w = os.pipe()
    with os.fdopen(r, "rb", buffering=0) as reader:
        control = remote.Control(reader.fileno())
        with os.fdopen(w, "wb", buffering=0) as writer:
            writer.write(remote.spec_line(["prog"], {}, "/", 1, "h") + remote.signal_line(2) + b"stop 15 0.5")
            spec = remote.read_spec(control, time.monotonic() + 5)
            assert (spec["argv"], spec["rank"], spec["host"]) == (["prog"], 1, "h")
            assert control.lines(5) == ["signal 2"]
            assert remote.read_spec(control, time.monotonic() + 0.05) is None  # nothing more came
        assert control.lines(5) == ["stop 15 0.5", None]  # at end of file an unfinished line still counts
