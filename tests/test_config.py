"""shmcoll.config and rendezvous.launchers: environment fallbacks, explicit arguments and validation, with
plain dicts."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from shmcoll import config as cfg
from shmcoll.config import Config, load_config
from shmcoll.errors import InvalidArgument
from shmcoll.rendezvous import host_id
from shmcoll.rendezvous import launchers as lch
from shmcoll.rendezvous.host_id import default_host_id

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
    ("rank", lch.RANK_VARS, {"SHMCOLL_WORLD_SIZE": "99"}),
    ("world_size", lch.WORLD_SIZE_VARS, {"SHMCOLL_RANK": "0"}),
    ("local_rank", lch.LOCAL_RANK_VARS, {"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "99"}),
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
    for n in (*lch.RANK_VARS, *lch.WORLD_SIZE_VARS, *lch.MASTER_ADDR_VARS, *lch.MASTER_PORT_VARS):
        monkeypatch.delenv(n, raising=False)
    monkeypatch.setenv("SHMCOLL_RANK", "0")
    monkeypatch.setenv("SHMCOLL_WORLD_SIZE", "1")
    assert load_config().world_size == 1


def test_config_is_frozen():
    c = load_config(environ=env())
    assert isinstance(c, Config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 3


# --- validation -----------------------------------------------------------------------------

def raises(environ=None, **kw) -> str:
    with pytest.raises(InvalidArgument) as info:
        load_config(environ=env() if environ is None else environ, **kw)
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_missing_rank_names_variables():
    msg = raises(without("SHMCOLL_RANK"))
    for n in lch.RANK_VARS:
        assert n in msg


def test_missing_world_size_names_variables():
    msg = raises(without("SHMCOLL_WORLD_SIZE"))
    for n in lch.WORLD_SIZE_VARS:
        assert n in msg
    assert "SHMCOLL_RANK" not in msg


def test_no_launcher_at_all_is_a_group_of_one():
    """As an MPI program started without mpirun: `python train.py` runs alone."""
    c = load_config(environ={})
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (0, 1, "127.0.0.1", 0)


@pytest.mark.parametrize("kw", [{"rank": 0}, {"world_size": 1}])
def test_half_an_explicit_numbering_is_refused(kw):
    msg = raises({}, **kw)
    assert "not set" in msg


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
        with open(host_id.BOOT_ID_PATH) as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    assert hid == (f"{host}:{boot}" if boot else host)
    assert hid == default_host_id()


def test_default_host_id_without_boot_id(monkeypatch, tmp_path):
    monkeypatch.setattr(host_id, "BOOT_ID_PATH", str(tmp_path / "missing"))
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


# --- external launchers: each one's real variable set (captured from torch 2.13 and Open MPI 4.1) --

def torchrun_env(rank: int, world: int = 2, run_id: str = "468ea04f", restart: str = "0") -> dict[str, str]:
    """What torchrun --standalone --nproc-per-node 2 gives worker `rank` (MASTER_PORT is its agent's)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": "localhost", "MASTER_PORT": "39271", "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": restart, "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}


def mpirun_env(rank: int, world: int = 3, jobid: str = "855769089") -> dict[str, str]:
    """mpirun -np 3 -x MASTER_ADDR=10.0.0.1 -x MASTER_PORT=29500 on one host."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank), "OMPI_MCA_ess_base_jobid": jobid, "PMIX_NAMESPACE": jobid,
            "PMIX_RANK": str(rank), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def srun_env(rank: int, world: int = 4, job: str = "1234", step: str = "0") -> dict[str, str]:
    """srun -N2 -n4 after `export MASTER_ADDR=node01 MASTER_PORT=29500` (two tasks per node)."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_NPROCS": str(world),
            "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_JOB_ID": job,
            "SLURM_STEP_ID": step, "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_JOB_NODELIST": "node[01-02]",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def mpiexec_env(rank: int, world: int = 2) -> dict[str, str]:
    """MPICH's hydra: mpiexec -n 2 -genv MASTER_ADDR 10.0.0.2 -genv MASTER_PORT 29500."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": str(world), "PMI_FD": "6", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}


def srun_torchrun_env(rank: int) -> dict[str, str]:
    """torchrun started by srun (one agent per node): torchrun's numbering must win over Slurm's."""
    return {**srun_env(rank // 2, world=2), **torchrun_env(rank, world=4), "SLURM_LOCALID": "0"}


# launcher env builder, world size, expected (master_addr, master_port, local_world_size, launcher)
LAUNCHERS = {
    "torchrun": (torchrun_env, 2, ("localhost", 39273, 2, "torchrun")),
    "mpirun": (mpirun_env, 3, ("10.0.0.1", 29500, 3, "Open MPI's mpirun")),
    "srun": (srun_env, 4, ("node01", 29500, None, "Slurm's srun")),
    "mpiexec": (mpiexec_env, 2, ("10.0.0.2", 29500, 2, "mpiexec (PMI)")),
    "srun+torchrun": (srun_torchrun_env, 4, ("localhost", 39273, 4, "torchrun")),
}
LOCAL_RANK_OF = {"srun": lambda r: r % 2}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_variables_resolve(name):
    make, world, (addr, port, local_world, launcher) = LAUNCHERS[name]
    for rank in range(world):
        c = load_config(environ=make(rank))
        assert (c.rank, c.world_size) == (rank, world)
        assert c.local_rank == LOCAL_RANK_OF.get(name, lambda r: r)(rank)
        assert (c.master_addr, c.master_port, c.local_world_size, c.launcher) == (addr, port, local_world, launcher)
        assert c.secret is None  # nothing exported: no secret on any rank, so they still agree


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_ranks_agree_on_job_id(name):
    make, world, _ = LAUNCHERS[name]
    ids = {load_config(environ=make(rank)).job_id for rank in range(world)}
    assert len(ids) == 1
    if name != "mpiexec":  # hydra sets no job identity that every rank shares
        assert ids != {derive_job_id_of(make(0))}  # the launcher's identity is mixed in


def derive_job_id_of(e: dict[str, str]) -> str:
    """The job id of the same endpoint without any launcher identity."""
    c = load_config(environ=e)
    return cfg.derive_job_id(c.master_addr, c.master_port, c.world_size)


@pytest.mark.parametrize("make,change", [
    (torchrun_env, {"TORCHELASTIC_RUN_ID": "other-run"}),
    (mpirun_env, {"PMIX_NAMESPACE": "1", "OMPI_MCA_ess_base_jobid": "1"}),
    (srun_env, {"SLURM_STEP_ID": "1"}),
    (srun_env, {"SLURM_JOB_ID": "1235"}),
])
def test_another_launch_on_the_same_endpoint_gets_another_job_id(make, change):
    assert load_config(environ={**make(0), **change}).job_id != load_config(environ=make(0)).job_id


def test_torchrun_restart_count_does_not_change_the_job_id():
    """Each agent counts only its own restarts, so nodes can disagree: the count must not matter."""
    assert load_config(environ=torchrun_env(0, restart="0")).job_id == \
        load_config(environ=torchrun_env(1, restart="2")).job_id


def test_explicit_arguments_carry_no_launcher_identity():
    """init(rank=, world_size=, ...) gives the plain endpoint hash, whatever launcher surrounds it
    (tests and users compute it with derive_job_id(addr, port, world))."""
    c = load_config(rank=0, world_size=2, master_addr="127.0.0.1", master_port=5000, environ=srun_env(0))
    assert c.job_id == cfg.derive_job_id("127.0.0.1", 5000, 2)
    assert c.launcher == lch.ARGUMENTS.name


# --- precedence: explicit argument > SHMCOLL_* > generic > launcher-specific --------------------

LAYERS = [
    ("launcher", {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                  "MASTER_ADDR": "g", "MASTER_PORT": "2000"}),  # the rendezvous is always exported
    ("generic", {"RANK": "2", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "MASTER_ADDR": "g", "MASTER_PORT": "2000"}),
    ("shmcoll", {"SHMCOLL_RANK": "3", "SHMCOLL_WORLD_SIZE": "7", "SHMCOLL_LOCAL_RANK": "3",
                 "SHMCOLL_MASTER_ADDR": "s", "SHMCOLL_MASTER_PORT": "3000"}),
]
EXPECTED = {"launcher": (1, 5, 1, "g", 2000), "generic": (2, 6, 2, "g", 2000), "shmcoll": (3, 7, 3, "s", 3000)}


@pytest.mark.parametrize("top", range(len(LAYERS)))
def test_precedence_of_layers(top):
    """With layers 0..top present, the highest one wins every setting it has."""
    e = {}
    for _, layer in LAYERS[:top + 1]:
        e.update(layer)
    c = load_config(environ=e)
    assert (c.rank, c.world_size, c.local_rank, c.master_addr, c.master_port) == EXPECTED[LAYERS[top][0]]
    c = load_config(rank=4, world_size=8, master_addr="x", master_port=4000, environ=e)
    assert (c.rank, c.world_size, c.master_addr, c.master_port) == (4, 8, "x", 4000)


# --- the torchrun port rule -----------------------------------------------------------------

@pytest.mark.parametrize("given,port", [("29500", 29502), ("39271", 39273), ("65533", 65535), ("65534", 65532),
                                        ("65535", 65533), ("0", 2)])
def test_torchrun_takes_the_port_two_after_master_port(given, port):
    c = load_config(environ={**torchrun_env(0), "MASTER_PORT": given})
    assert c.master_port == port == lch.torchrun_port(int(given))
    assert "torchrun" in c.master_port_from and "SHMCOLL_MASTER_PORT" in c.master_port_from


@pytest.mark.parametrize("marker", lch.TORCHRUN_VARS)
def test_torchrun_is_recognised_by_either_variable(marker):
    e = {k: v for k, v in torchrun_env(0).items() if k not in lch.TORCHRUN_VARS}
    assert load_config(environ=e).master_port == 39271
    assert load_config(environ={**e, marker: "x"}).master_port == 39273


def test_torchrun_port_rule_also_with_explicit_ranks():
    """init(rank=int(os.environ["RANK"]), ...) under torchrun: MASTER_PORT is still torch's."""
    assert load_config(rank=1, world_size=2, environ=torchrun_env(1)).master_port == 39273


def test_torchrun_port_overrides():
    assert load_config(environ={**torchrun_env(0), "SHMCOLL_MASTER_PORT": "40000"}).master_port == 40000
    assert load_config(master_port=40001, environ=torchrun_env(0)).master_port == 40001
    assert load_config(environ={**torchrun_env(0), "SHMCOLL_MASTER_PORT": "40000"}).master_port_from == \
        "SHMCOLL_MASTER_PORT"


def test_master_port_kept_without_torchrun():
    for make in (mpirun_env, srun_env, mpiexec_env):
        assert load_config(environ=make(0)).master_port == 29500


# --- half-set launcher variables: the error says what to set, and how under that launcher ----

@pytest.mark.parametrize("make,drop,needles", [
    (mpirun_env, ("MASTER_ADDR", "MASTER_PORT"),
     ["under Open MPI's mpirun", "MASTER_ADDR", "MASTER_PORT", "mpirun -x MASTER_ADDR=", "-x MASTER_PORT="]),
    (mpirun_env, ("MASTER_PORT",),
     ["under Open MPI's mpirun", "set SHMCOLL_MASTER_PORT (or MASTER_PORT)", "'10.0.0.1'"]),
    (srun_env, ("MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
     ["under Slurm's srun", "before srun", "scontrol show hostnames", "MASTER_PORT="]),
    (srun_env, ("MASTER_ADDR", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
     ["under Slurm's srun", "set SHMCOLL_MASTER_ADDR (or MASTER_ADDR)"]),
    (mpiexec_env, ("MASTER_ADDR", "MASTER_PORT"), ["under mpiexec (PMI)", "-genv MASTER_ADDR", "-genv MASTER_PORT"]),
    (torchrun_env, ("MASTER_ADDR",), ["under torchrun", "torchrun sets MASTER_ADDR"]),
])
def test_missing_rendezvous_under_a_launcher(make, drop, needles):
    msg = raises({k: v for k, v in make(1).items() if k not in drop})
    for needle in needles:
        assert needle in msg, (needle, msg)


# --- srun with nothing exported: the step's first host, a port from the job and step ids ----

def _srun_bare(rank: int, **changes: str) -> dict[str, str]:
    e = {k: v for k, v in srun_env(rank).items() if not k.startswith("MASTER_")}
    e.update(changes)
    return e


def test_srun_without_exports_meets_at_the_steps_first_host():
    configs = [load_config(environ=_srun_bare(r)) for r in range(4)]
    assert {(c.master_addr, c.master_port) for c in configs} == {("node01", lch.slurm_port(srun_env(0)))}
    assert "SLURM_JOB_ID" in configs[0].master_port_from


def test_srun_port_differs_between_steps_and_jobs():
    ports = {lch.slurm_port({"SLURM_JOB_ID": job, "SLURM_STEP_ID": step})
             for job in ("1234", "1235") for step in ("0", "1", "2")}
    assert len(ports) == 6 and all(1024 < p <= 65535 for p in ports)


def test_srun_step_node_list_wins_over_the_jobs():
    e = _srun_bare(0, SLURM_STEP_NODELIST="gpu[3-4]", SLURM_JOB_NODELIST="node[01-08],gpu[3-4]")
    assert load_config(environ=e).master_addr == "gpu3"


def test_srun_exports_win_over_the_step():
    e = _srun_bare(0, MASTER_ADDR="10.1.2.3")
    c = load_config(environ=e)
    assert (c.master_addr, c.master_port) == ("10.1.2.3", lch.slurm_port(e))
    assert load_config(environ=srun_env(0)).master_port == 29500


def test_srun_task_zero_off_the_first_host_says_to_export():
    """An arbitrary distribution may put task 0 elsewhere: it serves the rendezvous, so it says so."""
    msg = raises(_srun_bare(0, SLURM_NODEID="1"))
    assert "task 0 runs on node 1" in msg and "'node01'" in msg and "MASTER_ADDR" in msg
    assert load_config(environ=_srun_bare(2, SLURM_NODEID="1")).master_addr == "node01"


@pytest.mark.parametrize("nodelist,first", [
    ("node01", "node01"), ("node[01-04]", "node01"), ("node[07-09,12],gpu1", "node07"), ("a,b", "a"),
    ("rack[1-2]-n[3-4]", "rack1-n3"), ("n[0012-0015]", "n0012"), (" node5 ", "node5"), ("x[4,2]", "x4"),
])
def test_first_slurm_host(nodelist, first):
    assert lch.first_slurm_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["node[01-04", ",node1", ""])
def test_unreadable_slurm_node_lists_are_refused(nodelist):
    with pytest.raises(InvalidArgument, match="Slurm node list"):
        lch.first_slurm_host(nodelist)


def test_missing_rendezvous_without_launcher_mentions_none():
    msg = raises({"RANK": "0", "WORLD_SIZE": "2"})
    assert "MASTER_ADDR" in msg and "under" not in msg and "mpirun" not in msg


def test_single_rank_under_a_launcher_needs_no_rendezvous():
    c = load_config(environ={k: v for k, v in mpirun_env(0, world=1).items() if not k.startswith("MASTER_")})
    assert (c.world_size, c.master_addr, c.master_port) == (1, "127.0.0.1", 0)


@pytest.mark.parametrize("e,needles", [
    ({"SLURM_PROCID": "1"}, ["SLURM_PROCID is set", "Slurm's srun", "SLURM_NTASKS", "world size"]),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_SIZE is set", "Open MPI's mpirun", "OMPI_COMM_WORLD_RANK"]),
])
def test_half_a_launchers_numbering(e, needles):
    msg = raises({**e, "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("e,rank_var,world_var", [
    ({**mpirun_env(1), "RANK": "0"}, "RANK", "OMPI_COMM_WORLD_SIZE"),  # RANK left exported in the shell
    ({**srun_env(1), "WORLD_SIZE": "8"}, "SLURM_PROCID", "WORLD_SIZE"),
    ({**srun_env(1), "OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK", "SLURM_NTASKS"),
])
def test_two_launchers_mixed_are_refused(e, rank_var, world_var):
    """A stale export must not give every rank the same number: say which two variables clash."""
    msg = raises(e)
    assert f"rank comes from {rank_var} but the world size from {world_var}" in msg
    assert "SHMCOLL_RANK and SHMCOLL_WORLD_SIZE" in msg


def test_shmcoll_variables_may_override_a_launchers():
    c = load_config(environ={**mpirun_env(1), "SHMCOLL_RANK": "0"})
    assert (c.rank, c.world_size) == (0, 3)
    c = load_config(environ={**srun_env(3), "SHMCOLL_WORLD_SIZE": "5"})
    assert (c.rank, c.world_size) == (3, 5)


@pytest.mark.parametrize("value", ["0", "4", "x"])
def test_bad_local_world_size(value):
    msg = raises({**mpirun_env(1), "OMPI_COMM_WORLD_LOCAL_SIZE": value})
    assert "OMPI_COMM_WORLD_LOCAL_SIZE" in msg


def test_local_rank_must_fit_local_world_size():
    assert "local world size" in raises({**mpirun_env(2), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_torch_agent_store_is_reported_only_where_torch_serves_one():
    """bootstrap may publish rank 0's real port there; it must be torch's endpoint or None."""
    assert load_config(environ=torchrun_env(1)).torch_agent_store == ("localhost", 39271)
    assert load_config(rank=1, world_size=2, environ=torchrun_env(1)).torch_agent_store == ("localhost", 39271)
    assert load_config(environ={**torchrun_env(1), "TORCHELASTIC_USE_AGENT_STORE": "False"}).torch_agent_store is None
    assert load_config(environ={**torchrun_env(1), "SHMCOLL_MASTER_PORT": "4000"}).torch_agent_store is None
    assert load_config(master_port=4000, environ=torchrun_env(1)).torch_agent_store is None
    assert load_config(environ=torchrun_env(0, world=1)).torch_agent_store is None
    for make in (mpirun_env, srun_env, mpiexec_env):
        assert load_config(environ=make(0)).torch_agent_store is None
    e = {**torchrun_env(1), "SHMCOLL_MASTER_ADDR": "10.1.1.1"}  # shmcoll elsewhere; torch's store stays
    assert load_config(environ=e).torch_agent_store == ("localhost", 39271)


def test_shared_memory_waits_spin_long_only_when_every_rank_has_a_core():
    cores = len(os.sched_getaffinity(0))
    unset = cfg.load_tuning({})
    assert unset.spin_us is None
    assert cfg.spin_seconds(unset, cores) == cfg.SPIN_US_OWN_CORE * 1e-6
    assert cfg.spin_seconds(unset, cores + 1) == cfg.SPIN_US_SHARED_CORES * 1e-6
    assert cfg.SPIN_US_SHARED_CORES < cfg.SPIN_US_OWN_CORE
    chosen = cfg.load_tuning({"SHMCOLL_SPIN_US": "0"})
    assert chosen.spin_us == 0 and cfg.spin_seconds(chosen, 1) == 0.0 == cfg.spin_seconds(chosen, cores + 1)
    with pytest.raises(cfg.InvalidArgument, match="SHMCOLL_SPIN_US"):
        cfg.load_tuning({"SHMCOLL_SPIN_US": "-5"})


def test_native_exchanges_spin_unless_told_otherwise():
    """The native exchange with TCP peers polls first, however many ranks share the cores, where
    the rank's other TCP waits sleep at once; SHMCOLL_SPIN_US decides alone."""
    unset = cfg.load_tuning({})
    assert cfg.native_spin_seconds(unset) == cfg.TCP_SPIN_US_OWN_CORE * 1e-6 > 0
    assert cfg.tcp_spin_seconds(unset, len(os.sched_getaffinity(0)) + 1) == 0.0
    assert cfg.native_spin_seconds(cfg.load_tuning({"SHMCOLL_SPIN_US": "30"})) == pytest.approx(30e-6)


def test_large_calls_across_hosts_overlap_where_every_rank_has_two_cores(monkeypatch):
    """Overlapping takes a helper thread per rank: by default only where the job's ranks on this
    machine have two cores each; SHMCOLL_OVERLAP decides alone, and a typo is an error."""
    monkeypatch.setattr(cfg, "_cores", lambda: 8)
    unset = cfg.load_tuning({})
    assert unset.overlap is None
    assert cfg.overlaps_across_hosts(unset, 4) and not cfg.overlaps_across_hosts(unset, 5)
    assert cfg.overlaps_across_hosts(cfg.load_tuning({"SHMCOLL_OVERLAP": "1"}), 64)
    assert not cfg.overlaps_across_hosts(cfg.load_tuning({"SHMCOLL_OVERLAP": "off"}), 1)
    with pytest.raises(cfg.InvalidArgument, match="SHMCOLL_OVERLAP"):
        cfg.load_tuning({"SHMCOLL_OVERLAP": "sometimes"})


def test_the_tcp_congestion_control_is_a_choice_or_a_name():
    assert cfg.load_tuning({}).tcp_congestion == "auto"
    assert cfg.load_tuning({"SHMCOLL_TCP_CONGESTION": " System "}).tcp_congestion == "system"
    assert cfg.load_tuning({"SHMCOLL_TCP_CONGESTION": "dctcp"}).tcp_congestion == "dctcp"
    for bad in ("two words", "x" * 16, "../reno"):
        with pytest.raises(cfg.InvalidArgument, match="SHMCOLL_TCP_CONGESTION must be"):
            cfg.load_tuning({"SHMCOLL_TCP_CONGESTION": bad})
