"""Every environment setting shmcoll reads, resolved in one place into a frozen Config.

Where a rank stands in its job (rank, world size, rendezvous address) comes from whichever launcher
started it; rendezvous/launchers.py knows their variables. This module adds shmcoll's own
settings (timeout, secret, job id, transport, tuning knobs) and resolves everything into one
Config. Nothing here opens a socket or touches shared memory: the only I/O is reading the
environment and the kernel's boot id, so the module is unit-testable with plain dicts.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import InvalidArgument
from .rendezvous.host_id import default_host_id
from .rendezvous.launchers import (
    Launcher,
    as_int,
    launcher_key,
    launcher_of,
    lookup,
    resolve_local_world,
    resolve_master,
    resolve_ranks,
    torch_agent_store,
)

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
SINGLE_COPY_VAR = "SHMCOLL_SINGLE_COPY"
OVERLAP_VAR = "SHMCOLL_OVERLAP"
TCP_CONGESTION_VAR = "SHMCOLL_TCP_CONGESTION"
TRANSPORTS = ("auto", "hier", "tcp", "shm")

DEFAULT_TIMEOUT = 300.0

# Job ids end up inside POSIX shared-memory names: keep them short and path-safe.
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Tuning:
    """The performance knobs, each one named environment variable (see README, "Environment")."""

    chunk_bytes: int = 1 << 20  # SHMCOLL_CHUNK_BYTES: frame size when large arrays stream through a ring
    #: SHMCOLL_ONE_SHOT_BYTES: an all-reduce at or below this goes in one step (one_shot_bytes_for)
    one_shot_bytes: int | None = None
    debug: bool = False  # SHMCOLL_DEBUG: log each collective's start and end to stderr
    shm_slot_bytes: int = 256 << 10  # SHMCOLL_SHM_SLOT_BYTES: payload bytes of one shared-memory slot
    shm_slots: int = 8  # SHMCOLL_SHM_SLOTS: slots in each channel block (shm_layout.py)
    spin_us: int | None = None  # SHMCOLL_SPIN_US: microseconds a waiter spins before it sleeps
    # (unset: spin_seconds for shared memory, tcp_spin_seconds for TCP)
    #: SHMCOLL_SHM_BOARD_BYTES: calls up to this size use the board; None: by the local rank count
    #: (transport/shm_layout.board_bytes_for)
    shm_board_bytes: int | None = None
    #: SHMCOLL_SINGLE_COPY: whether large all-reduces on one host read peers' arrays directly where
    #: the host allows it (algorithms/single_copy.py)
    single_copy: bool = True
    #: SHMCOLL_OVERLAP: whether a large all-reduce across hosts works in its host while its pieces
    #: cross hosts (algorithms/overlap.py); None: by the cores (overlaps_across_hosts)
    overlap: bool | None = None
    #: SHMCOLL_TCP_CONGESTION: the TCP connections' congestion control: "auto", "system" or an
    #: algorithm's name (net/congestion.py)
    tcp_congestion: str = "auto"


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



def _resolve_timeout(explicit, environ) -> float:
    """Positive finite seconds; an infinite wait would defeat the no-hang guarantee."""
    if explicit is None:
        found = lookup(environ, (TIMEOUT_VAR,))
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


def _resolve_flag(environ, name: str, default: bool) -> bool:
    """A switch: 1, true, yes or on; 0, false, no or off. Typos are reported, not ignored."""
    found = lookup(environ, (name,))
    if found is None:
        return default
    value = found[1].lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise InvalidArgument(f"{name} must be 1 or 0, got {found[1]!r}")


_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,14}$")  # a kernel congestion control's name


def _resolve_name(environ, name: str, default: str) -> str:
    found = lookup(environ, (name,))
    if found is None:
        return default
    value = found[1].strip().lower()
    if not _NAME_RE.match(value):
        raise InvalidArgument(f"{name} must be auto, system or an algorithm's name (as cubic), got {found[1]!r}")
    return value


def _resolve_int_setting(environ, name: str, default: int, low: int) -> int:
    found = lookup(environ, (name,))
    if found is None:
        return default
    value = as_int(found[1], name, (name,))
    if not low <= value <= 1 << 30:
        raise InvalidArgument(f"{name} must be an integer between {low} and {1 << 30}, got {value}")
    return value


#: How long a shared-memory wait spins before it sleeps, when every local rank has a core of its own:
#: through a peer's millisecond of lateness, because a process woken from sleep takes 100 us and more
#: to run again here (bench/straggler_wake.py: 130 us after a late rank's arrival at 200 us of spin,
#: 31 us at 1500), and a rank that spins on its own core takes nothing from anyone (MPI spins always).
SPIN_US_OWN_CORE = 2000
#: ... and when ranks outnumber cores: a spinning rank delays the one it waits for (it yields, but
#: keeps competing for the core), so it goes to sleep sooner.
SPIN_US_SHARED_CORES = 200


def spin_seconds(tuning: Tuning, sharing: int) -> float:
    """How long this rank's shared-memory waits spin: SHMCOLL_SPIN_US if set, else by whether the
    job's ranks on this machine (`sharing`: its host's, or more where several hosts share one
    kernel) outnumber the cores this process may run on."""
    if tuning.spin_us is not None:
        return tuning.spin_us * 1e-6
    return (SPIN_US_OWN_CORE if sharing <= _cores() else SPIN_US_SHARED_CORES) * 1e-6


#: The one-step all-reduce's largest size in a group on one host (over TCP or shared-memory rings:
#: a board takes small calls first) ...
ONE_SHOT_BYTES_ONE_HOST = 16 << 10
#: ... and across hosts, where each step is a network latency: one step among the host leaders (and
#: a column slice up to this size in one step across) beat the ring and halving-doubling at 64 KiB
#: on every layout measured, 1.5-2x, and tied at 1 MiB; the fitted model puts the crossing at
#: 181-362 KiB with one or two ranks per host (bench/cost_model.py, bench/README.md). The steps
#: across, exchanges and the hand-offs of hosts past a power of two, run in a row of C calls up to
#: this size (transport/tcp.py's swap_row, which takes up to SWAP_MAX_BYTES): 2 hosts x 1, 2 x 2
#: and 4 x 1 at 192 and 256 KiB took 10-30% less time in one step than around the ring (2 x 2, 192
#: KiB: 190-196 us against 240-272), 3 x 1 about 40% less (192 KiB: 507-691 us against 899-1106;
#: 256 KiB 680-775 against 1034-1036). Past it the exchanges go through Python, and one step took
#: 2-3 times the ring's (2 x 1 at 384 KiB: 334-348 us against 111-113).
ONE_SHOT_BYTES_ACROSS_HOSTS = 256 << 10


def one_shot_bytes_for(tuning: Tuning, hosts: int) -> int:
    """The one-step all-reduce's largest size: SHMCOLL_ONE_SHOT_BYTES if set, else by how many hosts
    the group spans (alike on every rank of the group, as the selection needs)."""
    if tuning.one_shot_bytes is not None:
        return tuning.one_shot_bytes
    return ONE_SHOT_BYTES_ONE_HOST if hosts == 1 else ONE_SHOT_BYTES_ACROSS_HOSTS


#: How long a wait for a TCP peer's frame polls the socket before it sleeps in poll on it
#: (transport/tcp.py), where each rank has a core of its own; where ranks outnumber cores it sleeps
#: at once, since a spinning reader there only takes the core from the rank it waits for.
TCP_SPIN_US_OWN_CORE = 200


def tcp_spin_seconds(tuning: Tuning, sharing: int) -> float:
    """How long this rank's TCP waits poll their socket first: SHMCOLL_SPIN_US if set, else by
    whether the job's ranks on this machine (as spin_seconds) outnumber its cores."""
    if tuning.spin_us is not None:
        return tuning.spin_us * 1e-6
    return TCP_SPIN_US_OWN_CORE * 1e-6 if sharing <= _cores() else 0.0


#: How long the native steps across hosts (kernels.swap_row: the small all-reduce's exchanges;
#: kernels.duplex: a large call's ring steps, counted from the last byte moved) poll their sockets,
#: yielding the core between looks, before they sleep in poll: TCP_SPIN_US_OWN_CORE, even where
#: ranks outnumber cores. Their waits are short, and a wake-up from sleep costs more than the core
#: a yielding poll takes from others (4 namespace hosts of one rank on 2 cores, 8-byte all-reduce:
#: 101-123 us against 194; 2 + 2 ranks, whose host peers on a board need the core too: 8 B 41 us
#: against 44.5, 64 KiB 85-90 against 90-94, 1 MiB 1334-1355 against 1374-1403). Python's waits
#: do not spin there: they would hold the GIL against the reader thread (1 MiB across hosts took
#: 10% longer).
def native_spin_seconds(tuning: Tuning) -> float:
    """How long this rank's native exchanges with TCP peers poll first: SHMCOLL_SPIN_US if set."""
    return TCP_SPIN_US_OWN_CORE * 1e-6 if tuning.spin_us is None else tuning.spin_us * 1e-6


#: A large all-reduce across hosts overlaps its in-host phases with its pieces' step across hosts
#: (algorithms/overlap.py) where the job's ranks on this machine have two cores each: the rank's and
#: its helper thread's. Where they have fewer, the two threads take turns on the cores with the
#: kernel's TCP copies: 2 + 2 namespace hosts on 2 cores, 16 MiB, 32-36 ms overlapped against 29-32
#: in turn. Even on links slower than the veth pairs (a token bucket of 4 Gbit/s each way per host,
#: tools/netns.sh's NETNS_RATE) it gained little there, 64 MiB 174-182 ms against 178-185, 16 MiB
#: even: each rank took 85 ms of CPU per 64 MiB call (60 of them in the kernel), so the 4 ranks
#: needed 170 ms of the 2 cores whatever overlapped.
def overlaps_across_hosts(tuning: Tuning, sharing: int) -> bool:
    """Whether this rank's large all-reduces across hosts overlap (SHMCOLL_OVERLAP, where set):
    `sharing` as for spin_seconds."""
    if tuning.overlap is not None:
        return tuning.overlap
    return 2 * sharing <= _cores()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_tuning(environ: Mapping[str, str] | None = None) -> Tuning:
    """The tuning knobs from the environment (defaults where unset)."""
    env = os.environ if environ is None else environ
    return Tuning(
        chunk_bytes=_resolve_int_setting(env, CHUNK_BYTES_VAR, Tuning.chunk_bytes, 64),
        one_shot_bytes=(_resolve_int_setting(env, ONE_SHOT_BYTES_VAR, 0, 0)
                        if lookup(env, (ONE_SHOT_BYTES_VAR,)) else None),
        debug=_resolve_flag(env, DEBUG_VAR, False),
        shm_slot_bytes=_resolve_int_setting(env, SHM_SLOT_BYTES_VAR, Tuning.shm_slot_bytes, 64) // 64 * 64,
        shm_slots=_resolve_int_setting(env, SHM_SLOTS_VAR, Tuning.shm_slots, 2),
        spin_us=_resolve_int_setting(env, SPIN_US_VAR, 0, 0) if lookup(env, (SPIN_US_VAR,)) else None,
        shm_board_bytes=(_resolve_int_setting(env, BOARD_BYTES_VAR, 0, 0) // 64 * 64
                         if lookup(env, (BOARD_BYTES_VAR,)) else None),
        single_copy=_resolve_flag(env, SINGLE_COPY_VAR, True),
        overlap=_resolve_flag(env, OVERLAP_VAR, False) if lookup(env, (OVERLAP_VAR,)) else None,
        tcp_congestion=_resolve_name(env, TCP_CONGESTION_VAR, Tuning.tcp_congestion),
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



def _resolve_job_id(environ, addr: str, port: int, world: int, launcher: Launcher) -> str:
    """SHMCOLL_JOB_ID as given (validated, since it lands in shm names), else derived."""
    found = lookup(environ, (JOB_ID_VAR,))
    if found is None:
        return derive_job_id(addr, port, world, launcher_key(launcher, environ))
    if not _JOB_ID_RE.match(found[1]):
        raise InvalidArgument(
            f"{JOB_ID_VAR} must be 1-64 characters of [A-Za-z0-9_.-], got {found[1]!r}")
    return found[1]


def _resolve_transport(explicit, environ) -> str:
    if explicit is None:
        found = lookup(environ, (TRANSPORT_VAR,))
        explicit = found[1] if found else "auto"
        where = f"{TRANSPORT_VAR}={explicit!r}"
    else:
        where = f"transport={explicit!r}"
    if explicit not in TRANSPORTS:
        raise InvalidArgument(f"{where}: the transport must be one of {', '.join(TRANSPORTS)}")
    return explicit


def _own_settings(env: Mapping[str, str], timeout, transport) -> dict:
    """The Config fields shmcoll reads itself, whoever numbered the ranks: this host's id
    (SHMCOLL_HOST_ID, else the kernel's boot id), the timeout, the job secret, debug, tuning and
    transport."""
    host = lookup(env, (HOST_ID_VAR,))
    secret = lookup(env, (SECRET_VAR,), strip=False)
    return {
        "host_id": host[1] if host else default_host_id(),
        "timeout": _resolve_timeout(timeout, env),
        "secret": secret[1].encode("utf-8") if secret else None,
        "debug": _resolve_flag(env, DEBUG_VAR, False),
        "tuning": load_tuning(env),
        "transport": _resolve_transport(transport, env),
    }


def load_config(*, rank=None, world_size=None, master_addr=None, master_port=None, timeout=None,
                transport=None, environ: Mapping[str, str] | None = None) -> Config:
    """Resolve one rank's Config: explicit arguments, then the environment, then defaults."""
    env = os.environ if environ is None else environ
    r, world, local, rank_src = resolve_ranks(rank, world_size, env)
    launcher = launcher_of(rank_src, env)
    addr, port, port_from = resolve_master(master_addr, master_port, world, launcher, env)
    return Config(
        rank=r,
        world_size=world,
        local_rank=local,
        master_addr=addr,
        master_port=port,
        job_id=_resolve_job_id(env, addr, port, world, launcher),
        **_own_settings(env, timeout, transport),
        local_world_size=resolve_local_world(local, world, env),
        launcher=launcher.name,
        master_port_from=port_from,
        torch_agent_store=torch_agent_store(master_port, env) if world > 1 else None,
    )


def framework_config(rank: int, world_size: int, timeout: float, job_id: str, store_address: str,
                     environ: Mapping[str, str] | None = None) -> Config:
    """A rank's Config when a framework has already numbered the ranks and hands shmcoll its store
    (shmcoll.torch): rank, world size, timeout and job id come from it; the host grouping, secret,
    transport and tuning come from the environment exactly as for init()."""
    env = os.environ if environ is None else environ
    return Config(rank=rank, world_size=world_size, local_rank=None, master_addr=store_address, master_port=0,
                  job_id=job_id, launcher="torch.distributed", **_own_settings(env, timeout, None))
