"""What launchers put in the environment, and how a rank reads its place in the job from it.

Launchers disagree on names (torchrun, Open MPI, MPICH/PMI, Slurm), so each setting has an ordered
list of fallbacks; the first non-empty one wins and an explicit argument beats all of them. The
variable that supplied the rank names the launcher, which words the errors (how to export the
rendezvous address there) and adds the launcher's own job identity to the derived job id.

Under torchrun, MASTER_PORT belongs to torch (its agent serves a TCPStore there), so shmcoll's
rendezvous takes the next port but one (`torchrun_port`) unless SHMCOLL_MASTER_PORT or an explicit
argument says otherwise. Under srun, a rendezvous address or port that nobody set comes from the
job step (`slurm_master`). With no rank and no world size anywhere, the process is a group of one.
No I/O: only the environment mapping it is given.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InvalidArgument

RANK_VARS = ("SHMCOLL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
WORLD_SIZE_VARS = ("SHMCOLL_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARS = (
    "SHMCOLL_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
)
LOCAL_WORLD_SIZE_VARS = (
    "SHMCOLL_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
)
MASTER_ADDR_VARS = ("SHMCOLL_MASTER_ADDR", "MASTER_ADDR")
MASTER_PORT_VARS = ("SHMCOLL_MASTER_PORT", "MASTER_PORT")
# torchrun sets both for every worker (every torch since 1.9); either one means "under torchrun".
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"  # "True": torchrun's agent serves a TCPStore on MASTER_PORT
SINGLE_RANK_ADDR = "127.0.0.1"


def lookup(environ: Mapping[str, str], names: tuple[str, ...], *, strip: bool = True) -> tuple[str, str] | None:
    """(name, value) of the first variable that is set and not blank, in priority order."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, (value.strip() if strip else value)
    return None


def hint(names: tuple[str, ...]) -> str:
    """'SHMCOLL_RANK (or RANK, OMPI_COMM_WORLD_RANK, ...)' for error messages."""
    return names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"


def as_int(value: object, what: str, names: tuple[str, ...]) -> int:
    """Integer from an explicit argument or an environment string; bools and floats are refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise InvalidArgument(f"{what} must be an integer, got {value!r}; set {hint(names)}")



@dataclass(frozen=True)
class Launcher:
    """One way ranks get started: its name for messages, and what its users must export."""

    name: str
    how_to_set_master: str  # the exact way to give every rank MASTER_ADDR/MASTER_PORT under it
    job_vars: tuple[str, ...] = ()  # identical on every rank of one job: mixed into the derived job id


ARGUMENTS = Launcher("init() arguments", "pass master_addr= and master_port= to init() on every rank")
SHMCOLL_RUN = Launcher("shmcoll", "set SHMCOLL_MASTER_ADDR and SHMCOLL_MASTER_PORT for every rank (shmcoll-run does)")
GENERIC = Launcher("RANK/WORLD_SIZE", "export MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port> to every rank")
TORCHRUN = Launcher(
    "torchrun", "torchrun sets MASTER_ADDR and MASTER_PORT itself: start the program with torchrun, "
    "or set SHMCOLL_MASTER_ADDR and SHMCOLL_MASTER_PORT", ("TORCHELASTIC_RUN_ID",))
MPIRUN = Launcher(
    "Open MPI's mpirun", "export them to every rank: "
    "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...",
    ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"))
MPIEXEC = Launcher(
    "mpiexec (PMI)", "export them to every rank: "
    "mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT <free port> ...")
SRUN = Launcher(
    "Slurm's srun", "srun's SLURM_STEP_NODELIST and SLURM_JOB_ID give them when set; else export them before "
    'srun (it passes the environment on): export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" '
    "| head -n 1) MASTER_PORT=<free port>",
    ("SLURM_JOB_ID", "SLURM_STEP_ID"))

EXTERNAL_LAUNCHERS = (TORCHRUN, MPIRUN, MPIEXEC, SRUN)  # the ones whose errors explain how to export
_LAUNCHER_OF_VAR = {
    "SHMCOLL_RANK": SHMCOLL_RUN, "SHMCOLL_WORLD_SIZE": SHMCOLL_RUN,
    "OMPI_COMM_WORLD_RANK": MPIRUN, "OMPI_COMM_WORLD_SIZE": MPIRUN,
    "PMI_RANK": MPIEXEC, "PMI_SIZE": MPIEXEC,
    "SLURM_PROCID": SRUN, "SLURM_NTASKS": SRUN,
}


def under_torchrun(environ: Mapping[str, str]) -> bool:
    """True in a torchrun worker: torch then owns MASTER_PORT (see torchrun_port)."""
    return lookup(environ, TORCHRUN_VARS) is not None


def launcher_of(source: str | None, environ: Mapping[str, str]) -> Launcher:
    """The launcher behind the variable that supplied a rank (None: an explicit argument).

    RANK/WORLD_SIZE are torchrun's when its TORCHELASTIC_* variables are present, else some
    generic launcher's. Keyed on the rank's source, not on which variables exist, so that one
    launcher started inside another (torchrun under srun) is named by the one that numbered ranks.
    """
    if source is None:
        return ARGUMENTS
    if source in ("RANK", "WORLD_SIZE"):
        return TORCHRUN if under_torchrun(environ) else GENERIC
    return _LAUNCHER_OF_VAR[source]


TORCHRUN_PORT_STEP = 2


def torchrun_port(master_port: int) -> int:
    """shmcoll's rendezvous port under torchrun: MASTER_PORT + 2 (MASTER_PORT - 2 above 65533).

    torchrun's agent serves its own TCPStore on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), or,
    in older torch, worker rank 0 does once the program calls init_process_group: either way the
    port is torch's. Every rank computes the same neighbour without talking, and a user can open
    it in a firewall; SHMCOLL_MASTER_PORT or init(master_port=) overrides it.

    Why 2 and not 1: with --standalone or a c10d rendezvous, torch takes MASTER_PORT from bind(0),
    which Linux gives an odd port, while it gives outgoing connections even ports (since 4.6). So
    MASTER_PORT + 1 is where the job's own client sockets land (seen here: "address in use" in 2 of
    30 torchrun runs on a busy host); MASTER_PORT + 2 keeps the listener's parity.
    """
    step = TORCHRUN_PORT_STEP
    return master_port + step if master_port <= 65535 - step else master_port - step



def _resolve_int(explicit, environ, names, what) -> tuple[int | None, str | None]:
    """(value, source): the explicit argument first (source None), then the environment fallbacks."""
    if explicit is not None:
        return as_int(explicit, f"{what} argument", names), None
    found = lookup(environ, names)
    if found is None:
        return None, None
    return as_int(found[1], f"{what} ({found[0]})", names), found[0]


def _check_one_launcher(rank_src: str | None, world_src: str | None) -> None:
    """Refuse a rank from one launcher's variables and a world size from another's.

    That mix means a stale export (RANK left in the shell, then mpirun): every rank would take the
    same rank and the rendezvous would fail obscurely. SHMCOLL_* and arguments are deliberate
    overrides, so they may be combined with anything.
    """
    if rank_src is None or world_src is None or "SHMCOLL_" in rank_src + world_src:
        return
    if RANK_VARS.index(rank_src) != WORLD_SIZE_VARS.index(world_src):  # both list launchers in one order
        raise InvalidArgument(
            f"the rank comes from {rank_src} but the world size from {world_src}: two launchers' "
            f"variables are mixed (a stale export in the shell?); unset the stale one, or set "
            f"SHMCOLL_RANK and SHMCOLL_WORLD_SIZE")


def _missing_ranks(r, world, rank_src, world_src, environ) -> None:
    """InvalidArgument naming what to set when the rank or the world size is not found."""
    missing = [f"{what}: set {hint(names)} or pass {arg}=" for value, what, names, arg in (
        (r, "rank", RANK_VARS, "rank"), (world, "world size", WORLD_SIZE_VARS, "world_size"))
        if value is None]
    if not missing:
        return
    found = rank_src or world_src
    launcher = launcher_of(found, environ)
    where = (f" ({found} is set, by {launcher.name}, which sets both: is this process really one of "
             f"its ranks?)" if launcher in EXTERNAL_LAUNCHERS else " (shmcoll-run sets both)")
    raise InvalidArgument("not set: " + "; ".join(missing) + where)


def resolve_ranks(rank, world_size, environ) -> tuple[int, int, int | None, str | None]:
    """rank, world_size, local rank and the rank's source variable, validated against each other."""
    world, world_src = _resolve_int(world_size, environ, WORLD_SIZE_VARS, "world size")
    r, rank_src = _resolve_int(rank, environ, RANK_VARS, "rank")
    if r is None and world is None:
        return 0, 1, None, None  # no launcher at all: a group of one, as an MPI program without mpirun
    _missing_ranks(r, world, rank_src, world_src, environ)
    assert r is not None and world is not None  # _missing_ranks raised otherwise
    _check_one_launcher(rank_src, world_src)
    if world < 1:
        raise InvalidArgument(f"world size must be >= 1, got {world}; set {hint(WORLD_SIZE_VARS)}")
    if not 0 <= r < world:
        raise InvalidArgument(f"rank {r} is out of range for world size {world}; set {hint(RANK_VARS)}")
    local, _ = _resolve_int(None, environ, LOCAL_RANK_VARS, "local rank")
    if local is not None and not 0 <= local < world:
        raise InvalidArgument(
            f"local rank {local} is out of range for world size {world}; set {hint(LOCAL_RANK_VARS)}")
    return r, world, local, rank_src


def resolve_local_world(local: int | None, world: int, environ) -> int | None:
    """Ranks on this host when the launcher says; it must hold the local rank and fit the world."""
    n, src = _resolve_int(None, environ, LOCAL_WORLD_SIZE_VARS, "local world size")
    if n is None:
        return None
    if not 1 <= n <= world or (local is not None and local >= n):
        raise InvalidArgument(
            f"local world size {n} ({src}) does not fit world size {world} and local rank {local}; "
            f"set {hint(LOCAL_WORLD_SIZE_VARS)}")
    return n


def _torchrun_rule_applies(explicit_port, environ) -> bool:
    """The port comes from MASTER_PORT (nothing shmcoll-specific or explicit) in a torchrun worker."""
    found = lookup(environ, MASTER_PORT_VARS)
    return explicit_port is None and found is not None and found[0] == "MASTER_PORT" and under_torchrun(environ)


def _resolve_port(explicit, environ) -> tuple[int | None, str]:
    """The rendezvous port and a phrase saying where it came from (the torchrun rule applied)."""
    p, src = _resolve_int(explicit, environ, MASTER_PORT_VARS, "master port")
    if p is None:
        return None, ""
    if not 0 <= p <= 65535:
        raise InvalidArgument(f"master port must be in 0..65535, got {p}; set {hint(MASTER_PORT_VARS)}")
    if _torchrun_rule_applies(explicit, environ):
        return torchrun_port(p), (f"MASTER_PORT {p} moved to {torchrun_port(p)}: under torchrun, torch "
                                  f"serves its own store on MASTER_PORT; set SHMCOLL_MASTER_PORT to choose")
    return p, src or "init(master_port=)"


SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_PORT_BASE = 20000


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist, without running scontrol: "node[07-09,12],gpu1" gives
    "node07", "rack[1-2]-n[3-4]" gives "rack1-n3" (each bracket's first number, padding kept)."""
    host, rest = [], nodelist.strip()
    while rest and rest[0] != ",":
        if rest[0] == "[":
            close = rest.find("]")
            if close < 0:
                raise InvalidArgument(f"cannot read the Slurm node list {nodelist!r}: a '[' is not closed")
            host.append(rest[1:close].split(",")[0].split("-")[0])
            rest = rest[close + 1:]
        else:
            host.append(rest[0])
            rest = rest[1:]
    if not host:
        raise InvalidArgument(f"cannot read the Slurm node list {nodelist!r}: no host in it")
    return "".join(host)


def slurm_port(environ: Mapping[str, str]) -> int:
    """SLURM_PORT_BASE + (SLURM_JOB_ID mod 4000) x 10 + SLURM_STEP_ID mod 10: the same on every rank
    of a step, different for a job's first ten steps, and for jobs whose ids differ below 4000."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    step = environ.get("SLURM_STEP_ID", "").strip()
    job_number = int(job) if job.isdigit() else zlib.crc32(job.encode())
    step_number = int(step) if step.isdigit() else 0
    return SLURM_PORT_BASE + (job_number % 4000) * 10 + step_number % 10


def slurm_master(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Where an srun step meets when nothing names it: the first host of its node list, where
    task 0 runs under every distribution but an arbitrary one, and slurm_port; None outside a
    Slurm job step. Task 0 itself checks that it runs there (SLURM_NODEID 0), since it serves
    the rendezvous."""
    nodes = lookup(environ, SLURM_NODELIST_VARS)
    if nodes is None or lookup(environ, ("SLURM_JOB_ID",)) is None:
        return None
    first = first_slurm_host(nodes[1])
    if environ.get("SLURM_PROCID", "").strip() == "0" and environ.get("SLURM_NODEID", "0").strip() not in ("", "0"):
        raise InvalidArgument(
            f"task 0 runs on node {environ['SLURM_NODEID'].strip()} of the step, not on its first host {first!r}, "
            f"where the others would look for it: {SRUN.how_to_set_master}")
    return first, slurm_port(environ)


def resolve_master(addr, port, world, launcher: Launcher, environ) -> tuple[str, int, str]:
    """Rendezvous endpoint and the port's origin; a single rank needs none (loopback, port 0).
    Under srun, what is not set comes from the step (slurm_master)."""
    if addr is None:
        found = lookup(environ, MASTER_ADDR_VARS)
        addr = found[1] if found else None
    elif not isinstance(addr, str) or not addr.strip():
        raise InvalidArgument(f"master_addr must be a non-empty string, got {addr!r}")
    p, port_from = _resolve_port(port, environ)
    slurm = slurm_master(environ) if launcher is SRUN and world > 1 and (not addr or p is None) else None
    if slurm is not None:
        addr = addr or slurm[0]
        if p is None:
            p, port_from = slurm[1], f"derived from SLURM_JOB_ID and SLURM_STEP_ID ({slurm[1]})"
    if world == 1:
        return (addr.strip() if addr else SINGLE_RANK_ADDR), (p if p is not None else 0), port_from
    under = f" under {launcher.name}" if launcher in EXTERNAL_LAUNCHERS else ""
    if not addr:
        raise InvalidArgument(
            f"rendezvous address is not set for world size {world}{under}; set {hint(MASTER_ADDR_VARS)}"
            f"{' and ' + hint(MASTER_PORT_VARS) if p is None else ''}: {launcher.how_to_set_master}")
    if p is None:
        raise InvalidArgument(
            f"rendezvous port is not set (address {addr!r}){under}; set {hint(MASTER_PORT_VARS)}: "
            f"{launcher.how_to_set_master}")
    return addr.strip(), p, port_from


def torch_agent_store(explicit_port, environ) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of torchrun's agent store, when the torchrun rule applied and the
    agent says it serves one (TORCHELASTIC_USE_AGENT_STORE=True); None otherwise."""
    addr = lookup(environ, ("MASTER_ADDR",))
    if addr is None or not _torchrun_rule_applies(explicit_port, environ) \
            or environ.get(AGENT_STORE_VAR, "").strip() != "True":
        return None
    return addr[1], int(environ["MASTER_PORT"].strip())



def launcher_key(launcher: Launcher, environ: Mapping[str, str]) -> str:
    """The launcher's job identity: its job_vars that are set, which it sets alike on every rank.

    Deliberately not TORCHELASTIC_RESTART_COUNT: each torchrun agent counts only its own restarts,
    so nodes disagree after one node's workers fail, and ranks with different job ids cannot meet.
    """
    parts = [f"{n}={v}" for n in launcher.job_vars if (v := environ.get(n, "").strip())]
    return ",".join(parts)
