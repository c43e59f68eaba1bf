"""Every environment setting shmcoll reads, resolved in one place into a frozen Config.

Launchers disagree on names (torchrun, Open MPI, MPICH/PMI, Slurm), so each setting has an ordered
list of fallbacks; the first non-empty one wins and an explicit argument beats all of them. Nothing
here opens a socket or touches shared memory: the only I/O is reading the environment and the
kernel's boot id, so the module is unit-testable with plain dicts.

External launchers (README, "Running under mpirun, torchrun and srun"): the variable that supplied
the rank names the launcher, which words the errors (how to export the rendezvous address there) and
adds the launcher's own job identity to the derived job id. Under torchrun, MASTER_PORT belongs to
torch (its agent serves a TCPStore there), so shmcoll's rendezvous takes the next port
(`torchrun_port`) unless SHMCOLL_MASTER_PORT or an explicit argument says otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from shmcoll.errors import InvalidArgument

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
HOST_ID_VAR = "SHMCOLL_HOST_ID"
TIMEOUT_VAR = "SHMCOLL_TIMEOUT"
SECRET_VAR = "SHMCOLL_SECRET"
JOB_ID_VAR = "SHMCOLL_JOB_ID"
DEBUG_VAR = "SHMCOLL_DEBUG"
CHUNK_BYTES_VAR = "SHMCOLL_CHUNK_BYTES"
ONE_SHOT_BYTES_VAR = "SHMCOLL_ONE_SHOT_BYTES"
SHM_SLOT_BYTES_VAR = "SHMCOLL_SHM_SLOT_BYTES"
SHM_SLOTS_VAR = "SHMCOLL_SHM_SLOTS"
SPIN_US_VAR = "SHMCOLL_SPIN_US"
BOARD_BYTES_VAR = "SHMCOLL_SHM_BOARD_BYTES"
TRANSPORT_VAR = "SHMCOLL_TRANSPORT"
TRANSPORTS = ("auto", "hier", "tcp", "shm")
# torchrun sets both for every worker (every torch since 1.9); either one means "under torchrun".
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"  # "True": torchrun's agent serves a TCPStore on MASTER_PORT

DEFAULT_TIMEOUT = 300.0
SINGLE_RANK_ADDR = "127.0.0.1"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

# Job ids end up inside POSIX shared-memory and semaphore names: keep them short and path-safe.
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Tuning:
    """The performance knobs, each one named environment variable (see README, "Environment")."""

    chunk_bytes: int = 1 << 20  # SHMCOLL_CHUNK_BYTES: frame size when large arrays stream through a ring
    one_shot_bytes: int = 16 << 10  # SHMCOLL_ONE_SHOT_BYTES: all-reduce at or below this is one-shot
    debug: bool = False  # SHMCOLL_DEBUG: log each collective's start and end to stderr
    shm_slot_bytes: int = 256 << 10  # SHMCOLL_SHM_SLOT_BYTES: payload bytes of one shared-memory slot
    shm_slots: int = 8  # SHMCOLL_SHM_SLOTS: slots in each ring (one ring per ordered pair of local ranks)
    spin_us: int = 200  # SHMCOLL_SPIN_US: microseconds a waiter spins (yielding) before sleeping;
    # 200, not 50: a board wait that gives up sooner naps, oversleeps (60-100 us), and then its peer
    # waits on it in turn; at 50, 2-rank 512 B all-reduces ran at 100 us in 2 of 3 runs, not 11
    shm_board_bytes: int = 256 << 10  # SHMCOLL_SHM_BOARD_BYTES: smaller all-reduces, broadcasts, all-gathers use the board


@dataclass(frozen=True)
class Config:
    """One rank's view of its job; every rank of a job must resolve the same addr/port/job_id."""

    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str
    master_port: int
    host_id: str
    timeout: float
    secret: bytes | None
    job_id: str
    debug: bool
    tuning: Tuning = Tuning()
    transport: str = "auto"  # init(transport=...), else SHMCOLL_TRANSPORT, else "auto"
    local_world_size: int | None = None  # ranks on this host, when the launcher says (for checks only)
    launcher: str = ""  # Launcher.name of what supplied the rank ("torchrun", "Open MPI's mpirun", ...)
    master_port_from: str = ""  # where master_port came from, for error messages (the torchrun rule says so)
    # torchrun's agent store (MASTER_ADDR, MASTER_PORT) when the torchrun rule moved the port and the
    # agent serves it: a place every rank can already reach, to publish a port rank 0 really bound
    torch_agent_store: tuple[str, int] | None = None


def default_host_id() -> str:
    """hostname:boot_id, so a rebooted host or a cloned container name never looks like the same memory."""
    host = socket.gethostname()
    boot = _read_boot_id()
    return f"{host}:{boot}" if boot else host


def _read_boot_id() -> str | None:
    """The kernel's per-boot UUID, or None where /proc is unavailable (macOS, restricted sandboxes)."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _lookup(environ: Mapping[str, str], names: tuple[str, ...], *, strip: bool = True) -> tuple[str, str] | None:
    """(name, value) of the first variable that is set and not blank, in priority order."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, (value.strip() if strip else value)
    return None


def _hint(names: tuple[str, ...]) -> str:
    """'SHMCOLL_RANK (or RANK, OMPI_COMM_WORLD_RANK, ...)' for error messages."""
    return names[0] if len(names) == 1 else f"{names[0]} (or {', '.join(names[1:])})"


def _as_int(value: object, what: str, names: tuple[str, ...]) -> int:
    """Integer from an explicit argument or an environment string; bools and floats are refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise InvalidArgument(f"{what} must be an integer, got {value!r}; set {_hint(names)}")


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
    "Slurm's srun", "export them before srun (srun passes the environment on): "
    'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT=<free port>',
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
    return _lookup(environ, TORCHRUN_VARS) is not None


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
        return _as_int(explicit, f"{what} argument", names), None
    found = _lookup(environ, names)
    if found is None:
        return None, None
    return _as_int(found[1], f"{what} ({found[0]})", names), found[0]


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
    missing = [f"{what}: set {_hint(names)} or pass {arg}=" for value, what, names, arg in (
        (r, "rank", RANK_VARS, "rank"), (world, "world size", WORLD_SIZE_VARS, "world_size"))
        if value is None]
    if not missing:
        return
    found = rank_src or world_src
    launcher = launcher_of(found, environ)
    where = (f" ({found} is set, by {launcher.name}, which sets both: is this process really one of "
             f"its ranks?)" if launcher in EXTERNAL_LAUNCHERS else " (shmcoll-run sets both)")
    raise InvalidArgument("not set: " + "; ".join(missing) + where)


def _resolve_ranks(rank, world_size, environ) -> tuple[int, int, int | None, str | None]:
    """rank, world_size, local rank and the rank's source variable, validated against each other."""
    world, world_src = _resolve_int(world_size, environ, WORLD_SIZE_VARS, "world size")
    r, rank_src = _resolve_int(rank, environ, RANK_VARS, "rank")
    _missing_ranks(r, world, rank_src, world_src, environ)
    _check_one_launcher(rank_src, world_src)
    if world < 1:
        raise InvalidArgument(f"world size must be >= 1, got {world}; set {_hint(WORLD_SIZE_VARS)}")
    if not 0 <= r < world:
        raise InvalidArgument(f"rank {r} is out of range for world size {world}; set {_hint(RANK_VARS)}")
    local, _ = _resolve_int(None, environ, LOCAL_RANK_VARS, "local rank")
    if local is not None and not 0 <= local < world:
        raise InvalidArgument(
            f"local rank {local} is out of range for world size {world}; set {_hint(LOCAL_RANK_VARS)}")
    return r, world, local, rank_src


def _resolve_local_world(local: int | None, world: int, environ) -> int | None:
    """Ranks on this host when the launcher says; it must hold the local rank and fit the world."""
    n, src = _resolve_int(None, environ, LOCAL_WORLD_SIZE_VARS, "local world size")
    if n is None:
        return None
    if not 1 <= n <= world or (local is not None and local >= n):
        raise InvalidArgument(
            f"local world size {n} ({src}) does not fit world size {world} and local rank {local}; "
            f"set {_hint(LOCAL_WORLD_SIZE_VARS)}")
    return n


def _torchrun_rule_applies(explicit_port, environ) -> bool:
    """The port comes from MASTER_PORT (nothing shmcoll-specific or explicit) in a torchrun worker."""
    found = _lookup(environ, MASTER_PORT_VARS)
    return explicit_port is None and found is not None and found[0] == "MASTER_PORT" and under_torchrun(environ)


def _resolve_port(explicit, environ) -> tuple[int | None, str]:
    """The rendezvous port and a phrase saying where it came from (the torchrun rule applied)."""
    p, src = _resolve_int(explicit, environ, MASTER_PORT_VARS, "master port")
    if p is None:
        return None, ""
    if not 0 <= p <= 65535:
        raise InvalidArgument(f"master port must be in 0..65535, got {p}; set {_hint(MASTER_PORT_VARS)}")
    if _torchrun_rule_applies(explicit, environ):
        return torchrun_port(p), (f"MASTER_PORT {p} moved to {torchrun_port(p)}: under torchrun, torch "
                                  f"serves its own store on MASTER_PORT; set SHMCOLL_MASTER_PORT to choose")
    return p, src or "init(master_port=)"


def _resolve_master(addr, port, world, launcher: Launcher, environ) -> tuple[str, int, str]:
    """Rendezvous endpoint and the port's origin; a single rank needs none (loopback, port 0)."""
    if addr is None:
        found = _lookup(environ, MASTER_ADDR_VARS)
        addr = found[1] if found else None
    elif not isinstance(addr, str) or not addr.strip():
        raise InvalidArgument(f"master_addr must be a non-empty string, got {addr!r}")
    p, port_from = _resolve_port(port, environ)
    if world == 1:
        return (addr.strip() if addr else SINGLE_RANK_ADDR), (p if p is not None else 0), port_from
    under = f" under {launcher.name}" if launcher in EXTERNAL_LAUNCHERS else ""
    if not addr:
        raise InvalidArgument(
            f"rendezvous address is not set for world size {world}{under}; set {_hint(MASTER_ADDR_VARS)}"
            f"{' and ' + _hint(MASTER_PORT_VARS) if p is None else ''}: {launcher.how_to_set_master}")
    if p is None:
        raise InvalidArgument(
            f"rendezvous port is not set (address {addr!r}){under}; set {_hint(MASTER_PORT_VARS)}: "
            f"{launcher.how_to_set_master}")
    return addr.strip(), p, port_from


def _torch_agent_store(explicit_port, environ) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) of torchrun's agent store, when the torchrun rule applied and the
    agent says it serves one (TORCHELASTIC_USE_AGENT_STORE=True); None otherwise."""
    addr = _lookup(environ, ("MASTER_ADDR",))
    if addr is None or not _torchrun_rule_applies(explicit_port, environ) \
            or environ.get(AGENT_STORE_VAR, "").strip() != "True":
        return None
    return addr[1], int(environ["MASTER_PORT"].strip())


def _resolve_timeout(explicit, environ) -> float:
    """Positive finite seconds; an infinite wait would defeat the no-hang guarantee."""
    if explicit is None:
        found = _lookup(environ, (TIMEOUT_VAR,))
        if found is None:
            return DEFAULT_TIMEOUT
        explicit = found[1]
    try:
        if isinstance(explicit, bool):
            raise TypeError
        value = float(explicit)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"timeout must be a number of seconds, got {explicit!r}; set {TIMEOUT_VAR}") from None
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"timeout must be a finite number of seconds > 0, got {explicit!r}; set {TIMEOUT_VAR}")
    return value


def _resolve_debug(environ) -> bool:
    """SHMCOLL_DEBUG=1 (or true/yes/on) enables debug output; typos are reported, not ignored."""
    found = _lookup(environ, (DEBUG_VAR,))
    if found is None:
        return False
    value = found[1].lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise InvalidArgument(f"{DEBUG_VAR} must be 1 or 0, got {found[1]!r}")


def _resolve_int_setting(environ, name: str, default: int, low: int) -> int:
    found = _lookup(environ, (name,))
    if found is None:
        return default
    value = _as_int(found[1], name, (name,))
    if not low <= value <= 1 << 30:
        raise InvalidArgument(f"{name} must be an integer between {low} and {1 << 30}, got {value}")
    return value


def load_tuning(environ: Mapping[str, str] | None = None) -> Tuning:
    """The tuning knobs from the environment (defaults where unset)."""
    env = os.environ if environ is None else environ
    return Tuning(
        chunk_bytes=_resolve_int_setting(env, CHUNK_BYTES_VAR, Tuning.chunk_bytes, 64),
        one_shot_bytes=_resolve_int_setting(env, ONE_SHOT_BYTES_VAR, Tuning.one_shot_bytes, 0),
        debug=_resolve_debug(env),
        shm_slot_bytes=_resolve_int_setting(env, SHM_SLOT_BYTES_VAR, Tuning.shm_slot_bytes, 64) // 64 * 64,
        shm_slots=_resolve_int_setting(env, SHM_SLOTS_VAR, Tuning.shm_slots, 2),
        spin_us=_resolve_int_setting(env, SPIN_US_VAR, Tuning.spin_us, 0),
        shm_board_bytes=_resolve_int_setting(env, BOARD_BYTES_VAR, Tuning.shm_board_bytes, 0) // 64 * 64,
    )


def derive_job_id(master_addr: str, master_port: int, world_size: int, launcher_key: str = "") -> str:
    """A name every rank computes alike without talking: a hash of the rendezvous endpoint.

    launcher_key (see launcher_key) adds the launcher's own job identity, so two runs that reuse an
    endpoint still differ. A single rank rendezvouses with nobody and often uses port 0, so two such
    processes on one host would collide; there the process id is mixed in (still stable across
    calls in one process).
    """
    key = f"{master_addr}:{master_port}"
    if launcher_key:
        key += f"/{launcher_key}"
    if world_size == 1:
        key += f"/pid{os.getpid()}"
    return "j" + hashlib.sha256(key.encode()).hexdigest()[:15]


def launcher_key(launcher: Launcher, environ: Mapping[str, str]) -> str:
    """The launcher's job identity: its job_vars that are set, which it sets alike on every rank.

    Deliberately not TORCHELASTIC_RESTART_COUNT: each torchrun agent counts only its own restarts,
    so nodes disagree after one node's workers fail, and ranks with different job ids cannot meet.
    """
    parts = [f"{n}={v}" for n in launcher.job_vars if (v := environ.get(n, "").strip())]
    return ",".join(parts)


def _resolve_job_id(environ, addr: str, port: int, world: int, launcher: Launcher) -> str:
    """SHMCOLL_JOB_ID as given (validated, since it lands in shm names), else derived."""
    found = _lookup(environ, (JOB_ID_VAR,))
    if found is None:
        return derive_job_id(addr, port, world, launcher_key(launcher, environ))
    if not _JOB_ID_RE.match(found[1]):
        raise InvalidArgument(
            f"{JOB_ID_VAR} must be 1-64 characters of [A-Za-z0-9_.-], got {found[1]!r}")
    return found[1]


def _resolve_transport(explicit, environ) -> str:
    if explicit is None:
        found = _lookup(environ, (TRANSPORT_VAR,))
        explicit = found[1] if found else "auto"
        where = f"{TRANSPORT_VAR}={explicit!r}"
    else:
        where = f"transport={explicit!r}"
    if explicit not in TRANSPORTS:
        raise InvalidArgument(f"{where}: the transport must be one of {', '.join(TRANSPORTS)}")
    return explicit


def load_config(*, rank=None, world_size=None, master_addr=None, master_port=None, timeout=None,
                transport=None, environ: Mapping[str, str] | None = None) -> Config:
    """Resolve one rank's Config: explicit arguments, then the environment, then defaults."""
    env = os.environ if environ is None else environ
    r, world, local, rank_src = _resolve_ranks(rank, world_size, env)
    launcher = launcher_of(rank_src, env)
    addr, port, port_from = _resolve_master(master_addr, master_port, world, launcher, env)
    host = _lookup(env, (HOST_ID_VAR,))
    secret = _lookup(env, (SECRET_VAR,), strip=False)
    return Config(
        rank=r,
        world_size=world,
        local_rank=local,
        master_addr=addr,
        master_port=port,
        host_id=host[1] if host else default_host_id(),
        timeout=_resolve_timeout(timeout, env),
        secret=secret[1].encode("utf-8") if secret else None,
        job_id=_resolve_job_id(env, addr, port, world, launcher),
        debug=_resolve_debug(env),
        tuning=load_tuning(env),
        transport=_resolve_transport(transport, env),
        local_world_size=_resolve_local_world(local, world, env),
        launcher=launcher.name,
        master_port_from=port_from,
        torch_agent_store=_torch_agent_store(master_port, env) if world > 1 else None,
    )
