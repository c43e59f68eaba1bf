"""The hostfile in one process: the parser and rank placement as tables, the remote side's command
line and environment, --tag-output's line tagger, the options that need a hostfile, and the remote
supervisor's control lines. Jobs over a hostfile are in test_hostfile_launch.py."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from shmcoll.errors import InvalidArgument
from shmcoll.launch import remote
from shmcoll.launch.hostfile import Host, Placement, parse_hostfile, place_ranks, read_hostfile
from shmcoll.launch.multihost import forwarded_env, rsh_argv, supervisor_argv
from shmcoll.launch.run_cli import main as cli_main
from shmcoll.launch.run_cli import parse_args
from shmcoll.launch.tagout import LineTagger

from bounds import CALL_DEADLINE_S

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


# --- the remote side's command line and environment ---------------------------------------

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


# --- options -----------------------------------------------------------------------------------

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


# --- the remote supervisor's control lines -------------------------------------------------------

def test_control_lines_keep_what_shares_the_specs_read():
    r, w = os.pipe()
    with os.fdopen(r, "rb", buffering=0) as reader:
        control = remote.Control(reader.fileno())
        with os.fdopen(w, "wb", buffering=0) as writer:
            writer.write(remote.spec_line(["prog"], {}, "/", 1, "h") + remote.signal_line(2) + b"stop 15 0.5")
            spec = remote.read_spec(control, time.monotonic() + CALL_DEADLINE_S)
            assert (spec["argv"], spec["rank"], spec["host"]) == (["prog"], 1, "h")
            assert control.lines(CALL_DEADLINE_S) == ["signal 2"]
            assert remote.read_spec(control, time.monotonic() + 0.05) is None  # nothing more came
        assert control.lines(CALL_DEADLINE_S) == ["stop 15 0.5", None]  # at end of file an unfinished line still counts
