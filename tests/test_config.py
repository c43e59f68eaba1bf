"""shmcoll.config: environment fallbacks, explicit arguments and validation, with plain dicts."""

from __future__ import annotations

import socket

import pytest

from shmcoll import config as cfg
from shmcoll.config import Config, default_host_id, load_config
from shmcoll.errors import InvalidArgument

pytestmark = pytest.mark.timeout(10)

BASE = {"SHMCOLL_RANK": "1", "SHMCOLL_WORLD_SIZE": "4",
        "SHMCOLL_MASTER_ADDR": "10.0.0.1", "SHMCOLL_MASTER_PORT": "29500"}


def env(**kw: str) -> dict[str, str]:
    return {**BASE, **kw}


def without(*names: str, **kw: str) -> dict[str, str]:
    e = env(**kw)
    for n in names:
        e.pop(n, None)
    return e


# --- fallbacks in priority order -------------------------------------------------------------

FALLBACKS = [
    ("rank", cfg.RANK_VARS, {"SHMCOLL_WORLD_SIZE": "99"}),
    ("world_size", cfg.WORLD_SIZE_VARS, {"SHMCOLL_RANK": "0"}),
    ("local_rank", cfg.LOCAL_RANK_VARS, {"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "99"}),
]


@pytest.mark.parametrize("field,names,rest", FALLBACKS)
def test_int_fallbacks_in_priority_order(field, names, rest):
    base = {"SHMCOLL_MASTER_ADDR": "h", "SHMCOLL_MASTER_PORT": "1", **rest}
    # Variable i set to 10+i, along with every lower-priority one: variable i must win.
    for i, name in enumerate(names):
        e = dict(base)
        for j in range(i, len(names)):
            e[names[j]] = str(10 + j)
        assert getattr(load_config(environ=e), field) == 10 + i, name


@pytest.mark.parametrize("field,names,rest", FALLBACKS)
def test_int_fallbacks_skip_empty(field, names, rest):
    e = {"SHMCOLL_MASTER_ADDR": "h", "SHMCOLL_MASTER_PORT": "1", **rest}
    e.update({n: "" for n in names[:-1]})
    e[names[0]] = "  "  # blank counts as unset too
    e[names[-1]] = "7"
    assert getattr(load_config(environ=e), field) == 7


def test_master_addr_and_port_fallbacks():
    plain = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "11"}
    c = load_config(environ=plain)
    assert (c.master_addr, c.master_port) == ("a", 11)
    c = load_config(environ={**plain, "SHMCOLL_MASTER_ADDR": "b", "SHMCOLL_MASTER_PORT": "22"})
    assert (c.master_addr, c.master_port) == ("b", 22)
    # each setting resolves on its own; empty values fall through
    c = load_config(environ={**plain, "SHMCOLL_MASTER_ADDR": "", "SHMCOLL_MASTER_PORT": "33"})
    assert (c.master_addr, c.master_port) == ("a", 33)


def test_local_rank_absent_is_none():
    assert load_config(environ=env()).local_rank is None


def test_explicit_arguments_win():
    c = load_config(rank=2, world_size=3, master_addr="x", master_port=7, timeout=5,
                    environ=env(SHMCOLL_TIMEOUT="9"))
    assert (c.rank, c.world_size, c.master_addr, c.master_port, c.timeout) == (2, 3, "x", 7, 5.0)


def test_explicit_arguments_alone_suffice():
    c = load_config(rank=0, world_size=2, master_addr="127.0.0.1", master_port=1234, environ={})
    assert (c.rank, c.world_size, c.master_port) == (0, 2, 1234)


def test_defaults_to_os_environ(monkeypatch):
    for n in (*cfg.RANK_VARS, *cfg.WORLD_SIZE_VARS, *cfg.MASTER_ADDR_VARS, *cfg.MASTER_PORT_VARS):
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setenv("SHMCOLL_RANK", "0")
    monkeypatch.setenv("SHMCOLL_WORLD_SIZE", "1")
    assert load_config().world_size == 1


def test_config_is_frozen():
    c = load_config(environ=env())
    assert isinstance(c, Config)
    with pytest.raises(Exception):
        c.rank = 3


# --- validation -----------------------------------------------------------------------------

def raises(environ=None, **kw) -> str:
    with pytest.raises(InvalidArgument) as info:
        load_config(environ=env() if environ is None else environ, **kw)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_missing_rank_names_variables():
    msg = raises(without("SHMCOLL_RANK"))
    for n in cfg.RANK_VARS:
        assert n in msg


def test_missing_world_size_names_variables():
    msg = raises(without("SHMCOLL_WORLD_SIZE"))
    for n in cfg.WORLD_SIZE_VARS:
        assert n in msg
    assert "SHMCOLL_RANK" not in msg


def test_missing_both_names_both():
    msg = raises({})
    assert "SHMCOLL_RANK" in msg and "SHMCOLL_WORLD_SIZE" in msg


@pytest.mark.parametrize("var,value", [("SHMCOLL_RANK", "one"), ("SHMCOLL_RANK", "1.5"),
                                       ("SHMCOLL_WORLD_SIZE", "4x"), ("SHMCOLL_LOCAL_RANK", "a"),
                                       ("SHMCOLL_MASTER_PORT", "http")])
def test_non_integer(var, value):
    msg = raises(env(**{var: value}))
    assert var in msg and repr(value) in msg


def test_non_integer_explicit():
    assert "SHMCOLL_RANK" in raises(rank="zero")
    assert "SHMCOLL_RANK" in raises(rank=1.0)
    assert "SHMCOLL_WORLD_SIZE" in raises(world_size=True)


@pytest.mark.parametrize("world", ["0", "-3"])
def test_world_size_below_one(world):
    assert "SHMCOLL_WORLD_SIZE" in raises(env(SHMCOLL_WORLD_SIZE=world))


@pytest.mark.parametrize("rank", ["4", "-1", "100"])
def test_rank_out_of_range(rank):
    msg = raises(env(SHMCOLL_RANK=rank))
    assert "SHMCOLL_RANK" in msg and "out of range" in msg


def test_explicit_rank_out_of_range():
    assert "out of range" in raises(rank=5)


def test_local_rank_out_of_range():
    assert "SHMCOLL_LOCAL_RANK" in raises(env(SHMCOLL_LOCAL_RANK="4"))


@pytest.mark.parametrize("port", ["-1", "65536", "99999"])
def test_bad_port(port):
    assert "SHMCOLL_MASTER_PORT" in raises(env(SHMCOLL_MASTER_PORT=port))


def test_bad_explicit_port():
    assert "65535" in raises(master_port=70000)


@pytest.mark.parametrize("port", ["0", "65535"])
def test_port_bounds_accepted(port):
    assert load_config(environ=env(SHMCOLL_MASTER_PORT=port)).master_port == int(port)


@pytest.mark.parametrize("t", ["0", "-1", "abc", "nan", "inf", ""])
def test_bad_timeout(t):
    if t == "":
        assert load_config(environ=env(SHMCOLL_TIMEOUT=t)).timeout == 300.0
    else:
        assert "SHMCOLL_TIMEOUT" in raises(env(SHMCOLL_TIMEOUT=t))


@pytest.mark.parametrize("t", [0, -2.5, "x", float("nan")])
def test_bad_explicit_timeout(t):
    assert "timeout" in raises(timeout=t)


def test_missing_master_addr():
    msg = raises(without("SHMCOLL_MASTER_ADDR"))
    assert "SHMCOLL_MASTER_ADDR" in msg and "MASTER_ADDR" in msg


def test_missing_master_port():
    msg = raises(without("SHMCOLL_MASTER_PORT"))
    assert "SHMCOLL_MASTER_PORT" in msg and "MASTER_PORT" in msg


def test_bad_job_id():
    assert "SHMCOLL_JOB_ID" in raises(env(SHMCOLL_JOB_ID="a/b"))


def test_bad_debug():
    assert "SHMCOLL_DEBUG" in raises(env(SHMCOLL_DEBUG="maybe"))


# --- world size 1 ---------------------------------------------------------------------------

def test_world_one_defaults():
    c = load_config(environ={"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "1"})
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (0, 1, "127.0.0.1", 0)


def test_world_one_keeps_given_endpoint():
    c = load_config(environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (c.master_addr, c.master_port) == ("h", 5)
    c = load_config(environ={"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})
    assert (c.master_addr, c.master_port) == ("h", 0)


def test_world_one_explicit():
    c = load_config(rank=0, world_size=1, environ={})
    assert (c.master_addr, c.master_port, c.timeout, c.secret, c.debug) == ("127.0.0.1", 0, 300.0, None, False)


# --- host id, secret, timeout, debug, job id ------------------------------------------------

def test_default_host_id_shape():
    hid = default_host_id()
    host = socket.gethostname()
    try:
        with open(cfg.BOOT_ID_PATH) as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    assert hid == (f"{host}:{boot}" if boot else host)
    assert hid == default_host_id()


def test_default_host_id_without_boot_id(monkeypatch, tmp_path):
    monkeypatch.setattr(cfg, "BOOT_ID_PATH", str(tmp_path / "missing"))
    assert default_host_id() == socket.gethostname()


def test_host_id_from_env():
    assert load_config(environ=env(SHMCOLL_HOST_ID="node-a")).host_id == "node-a"
    assert load_config(environ=env(SHMCOLL_HOST_ID="")).host_id == default_host_id()


def test_secret():
    assert load_config(environ=env()).secret is None
    assert load_config(environ=env(SHMCOLL_SECRET="")).secret is None
    assert load_config(environ=env(SHMCOLL_SECRET="s3cr\u00e9t")).secret == "s3cr\u00e9t".encode()


def test_timeout_parsing():
    assert load_config(environ=env()).timeout == 300.0
    assert load_config(environ=env(SHMCOLL_TIMEOUT="2.5")).timeout == 2.5
    assert load_config(environ=env(SHMCOLL_TIMEOUT=" 60 ")).timeout == 60.0
    assert isinstance(load_config(environ=env(SHMCOLL_TIMEOUT="7")).timeout, float)


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False), ("1", True),
                                            ("true", True), ("off", False)])
def test_debug(value, expected):
    e = env() if value is None else env(SHMCOLL_DEBUG=value)
    assert load_config(environ=e).debug is expected


def test_job_id_deterministic_across_calls_and_ranks():
    a = load_config(environ=env())
    b = load_config(environ=env(SHMCOLL_RANK="3"))
    assert a.job_id == b.job_id == load_config(environ=env()).job_id
    assert a.job_id.isascii() and len(a.job_id) <= 32
    other = load_config(environ=env(SHMCOLL_MASTER_PORT="29501"))
    assert other.job_id != a.job_id


def test_job_id_from_env():
    assert load_config(environ=env(SHMCOLL_JOB_ID="job-42")).job_id == "job-42"
    assert load_config(environ=env(SHMCOLL_JOB_ID="")).job_id == load_config(environ=env()).job_id


def test_environment_not_mutated():
    e = env()
    before = dict(e)
    load_config(environ=e, rank=0)
    assert e == before
