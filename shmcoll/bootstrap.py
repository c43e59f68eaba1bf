"""init(): read the configuration, meet the other ranks through the rendezvous store, and return a
ProcessGroup over the chosen transport.

Rank 0 serves the store. Every rank publishes its host id and release (ranks running different
installs fail here, before anything is built); when all ranks share a host (and the
transport allows it) they build shared memory; across hosts the hierarchy: shared memory per host
plus TCP between hosts (transport="tcp": TCP between every pair), each rank saying whether it
overlaps its large all-reduces' in-host phases with their steps across hosts, since the ranges are
cut in pieces for that only where some rank does. Each rank listens on the
interface it used to reach rank 0 (so multi-homed hosts pick a routable one). Rank 0 shuts the
store down as soon as the new transport has carried one barrier: by then every rank is done with it.
Everything after the store is up is join_over_store, which takes any store with set/get/wait: the
torch backend (shmcoll.torch) passes torch's own.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import time
import weakref
from functools import partial

from .config import Config, load_config, native_spin_seconds, overlaps_across_hosts, spin_seconds, tcp_spin_seconds
from .errors import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    InvalidArgument,
    PeerLost,
    ShmSetupError,
    error_of_kind,
)
from .group import ProcessGroup
from .net.congestion import check_congestion, set_congestion
from .net.mesh import connect_mesh, open_listener
from .net.sockets import Deadline
from .rendezvous.host_id import kernel_id
from .rendezvous.store import ABORT_KEY, RendezvousStore, StoreAbort, StoreClient, StoreServer
from .transport import frame
from .transport.base import Transport
from .transport.hierarchical import HierarchicalTransport
from .transport.mailbox import Mailbox
from .transport.shm import ShmTransport
from .transport.shm_layout import MAGIC, Layout, board_bytes_for, fit_layout, shm_budget
from .transport.shm_segment import Segment, attach_segment, create_segment, free_bytes, name_prefix, unlink_names
from .transport.tcp import NetTransport
from .transport.topology import Topology

_open_groups: weakref.WeakSet[ProcessGroup] = weakref.WeakSet()
_LINGER_SECONDS = 3.0


def init(rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, timeout: float | None = None, *, transport: str | None = None) -> ProcessGroup:
    """Join the job and return its ProcessGroup (see API.md, "Getting a group").

    transport: "auto" (the default; also "hier") picks shared memory when every rank is on this host
    and TCP otherwise; "shm" and "tcp" force one. Unset, SHMCOLL_TRANSPORT decides, else "auto".
    """
    cfg = load_config(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                      timeout=timeout, transport=transport)
    if cfg.world_size == 1:
        return alone(cfg)
    return _rendezvous(cfg, time.monotonic() + cfg.timeout)


def alone(cfg: Config) -> ProcessGroup:
    """A group of one: nobody to meet, nothing to share."""
    group = ProcessGroup(NetTransport(0, 1, {}, timeout=cfg.timeout), tuning=cfg.tuning)
    _open_groups.add(group)
    return group


def _rendezvous(cfg: Config, deadline: float) -> ProcessGroup:
    server = None
    if cfg.rank == 0:
        try:
            server = StoreServer(cfg.master_addr, cfg.master_port, cfg.secret, f"{cfg.job_id}/store")
        except OSError as exc:
            source = f", taken from {cfg.master_port_from}" if cfg.master_port_from else ""
            raise InvalidArgument(
                f"rank 0 cannot serve the rendezvous on {cfg.master_addr}:{cfg.master_port}{source}: {exc} "
                f"(is another job using this port? set SHMCOLL_MASTER_PORT to a free one)") from exc
    try:
        return join_over_store(cfg, _connect_store(cfg, deadline), deadline, server)
    finally:
        if server is not None:
            server.close()


def join_over_store(cfg: Config, client: RendezvousStore, deadline: float,
                    server: StoreServer | None = None) -> ProcessGroup:
    """Build this rank's transport through `client` (shmcoll's own store, or torch's through
    shmcoll.torch) and close start-up with one barrier over it. A failure is published to the
    other ranks first; rank 0's `server`, when it serves the store, lingers so they can read it."""
    try:
        transport = _build_transport(cfg, client, deadline)
    except BaseException as exc:
        _publish_failure(cfg, client, exc)
        client.close()
        if server is not None:
            server.linger(_LINGER_SECONDS)  # let the others read why before the store goes
        raise
    client.close()
    group = ProcessGroup(transport, tuning=cfg.tuning)
    try:
        group._startup_barrier()  # every rank is past the store now, so rank 0 may close it
    except BaseException:
        group.close()
        raise
    _open_groups.add(group)
    return group


def _publish_failure(cfg: Config, client: RendezvousStore, exc: BaseException) -> None:
    """Tell every rank still in the rendezvous why this one failed (unless it only relays another's)."""
    if isinstance(exc, CollectiveError) and exc.from_peer:
        return
    reason = json.dumps({"kind": type(exc).__name__, "rank": cfg.rank, "message": str(exc)})
    try:
        client.set(ABORT_KEY, reason, time.monotonic() + 2.0)
    except (OSError, EOFError, CollectiveError):
        pass  # the store is gone already: the others will see that instead


def _relayed(abort: StoreAbort) -> CollectiveError:
    """The error another rank published, as the same class, marked so it is not published again."""
    try:
        reason = json.loads(abort.args[0])
        kind, rank, message = reason["kind"], reason["rank"], reason["message"]
    except (ValueError, KeyError, TypeError):
        kind, rank, message = "CollectiveError", "?", abort.args[0]
    peer = int(rank) if str(rank).isdigit() else None
    error = error_of_kind(kind, f"rank {rank} failed during start-up: {message}", peer)
    error.from_peer = True
    return error


def _where(cfg: Config) -> str:
    return f"{cfg.master_addr}:{cfg.master_port}"


def _connect_store(cfg: Config, deadline: float) -> StoreClient:
    try:
        return StoreClient(cfg.master_addr, cfg.master_port, cfg.secret, f"{cfg.job_id}/store", cfg.rank, deadline)
    except Deadline as exc:
        raise CollectiveTimeout(f"rank {cfg.rank} could not reach the rendezvous at {_where(cfg)} within "
                                f"{cfg.timeout:g} s (is rank 0 running, and the address right?)") from exc
    except CollectiveError:
        raise  # e.g. the handshake's wrong-secret error, which says so itself
    except (EOFError, OSError) as exc:
        raise PeerLost(f"the rendezvous at {_where(cfg)} dropped rank {cfg.rank} ({exc})", 0) from exc


def _build_transport(cfg: Config, client: RendezvousStore, deadline: float) -> Transport:
    choice = cfg.transport
    try:
        mine = [cfg.host_id, os.getpid(), release(), kernel_id()]
        published = _gather(cfg, client, "host", json.dumps(mine), deadline)
        _check_same_release(published)
        hosts, pids, kernels = _hosts_pids_kernels(published)
        sharing = _sharing_cores(cfg, hosts, kernels)
        if _use_shm(choice, hosts):
            return _shm_transport(cfg, client, hosts, pids, deadline, sharing)
        if choice in ("auto", "hier"):
            return _hier_transport(cfg, client, hosts, pids, deadline, sharing)
        return _tcp_transport(cfg, client, deadline, spans_hosts=len(set(hosts.values())) > 1, sharing=sharing)
    except Deadline as exc:
        raise CollectiveTimeout(f"rendezvous at {_where(cfg)} did not finish within {cfg.timeout:g} s") from exc
    except StoreAbort as exc:
        raise _relayed(exc) from None
    except CollectiveError:
        raise
    except (EOFError, OSError) as exc:
        raise PeerLost(f"the rendezvous at {_where(cfg)} closed while rank {cfg.rank} was waiting "
                       f"(rank 0 gave up or died): {exc}", 0) from exc


def _gather(cfg: Config, client: RendezvousStore, kind: str, value: str, deadline: float,
            ranks: list[int] | None = None) -> dict[int, str]:
    """Publish value under kind/<rank> and wait for every rank's (or those of `ranks`);
    CollectiveTimeout names the missing."""
    ranks = list(range(cfg.world_size)) if ranks is None else ranks
    client.set(f"{kind}/{cfg.rank}", value, deadline)
    values, missing = client.wait([f"{kind}/{r}" for r in ranks], deadline)
    if missing:
        ranks = sorted(int(k.split("/")[1]) for k in missing)
        raise CollectiveTimeout(f"rendezvous at {_where(cfg)}: ranks {ranks} never arrived within {cfg.timeout:g} s")
    return {r: values[f"{kind}/{r}"] for r in ranks}


def release() -> str:
    """What every rank of a job must share: the library's version and the formats ranks exchange
    (the frames on every transport, the shared-memory layout, named by its magic)."""
    from . import __version__  # the package's; it is initialised by the time a rank meets the others

    return f"shmcoll {__version__} (frame format {frame.VERSION}, shm layout {MAGIC.to_bytes(8, 'big').decode()})"


def _check_same_release(published: dict[int, str]) -> None:
    """CollectiveMismatch on every rank, before any segment or connection exists, when ranks run
    different installs (hosts of one job may not have been upgraded together)."""
    ranks_of: dict[str, list[int]] = {}
    for r, value in sorted(published.items()):
        fields = json.loads(value)
        ranks_of.setdefault(fields[2] if len(fields) > 2 else "an older shmcoll (it sent no version)", []).append(r)
    if len(ranks_of) > 1:
        installs = "; ".join(f"ranks {ranks} run {what}" for what, ranks in ranks_of.items())
        raise CollectiveMismatch(f"the ranks of this job run different shmcoll installs: {installs}. Install the "
                                 f"same version on every host")


def _hosts_pids_kernels(published: dict[int, str]) -> tuple[dict[int, str], dict[int, int], dict[int, str]]:
    """Each rank's host id, process id and kernel id, as published: [host id, pid, release, kernel id]."""
    fields = {r: json.loads(v) for r, v in published.items()}
    return ({r: str(f[0]) for r, f in fields.items()}, {r: int(f[1]) for r, f in fields.items()},
            {r: str(f[3]) for r, f in fields.items()})


def _sharing_cores(cfg: Config, hosts: dict[int, str], kernels: dict[int, str]) -> int:
    """How many ranks of the job run on this rank's machine (its kernel), which the spin policy
    weighs against the cores (config.spin_seconds): the ranks of its host, and more where several
    "hosts" share one kernel (network namespaces, containers), or none says which kernel it is on."""
    here = sum(1 for h in hosts.values() if h == cfg.host_id)
    kernel = kernels[cfg.rank]
    return max(here, sum(1 for k in kernels.values() if k == kernel)) if kernel else here


def _use_shm(choice: str, hosts: dict[int, str]) -> bool:
    one_host = len(set(hosts.values())) == 1
    if choice == "shm" and not one_host:
        raise InvalidArgument(f"transport='shm' needs every rank on one host, but they span {len(set(hosts.values()))} "
                              f"(SHMCOLL_HOST_ID differs); use transport='auto' or 'tcp'")
    return choice == "shm" or (choice in ("auto", "hier") and one_host)


def _hier_transport(cfg: Config, client: RendezvousStore, hosts: dict[int, str], pids: dict[int, int],
                    deadline: float, sharing: int) -> HierarchicalTransport:
    """Shared memory among this host's ranks, TCP to the others, one mailbox between them."""
    topology = Topology.from_host_ids(hosts)
    mailbox = Mailbox(cfg.rank, cfg.world_size)
    shm = _shm_transport(cfg, client, hosts, pids, deadline, sharing, mailbox)
    try:
        overlap = overlaps_across_hosts(cfg.tuning, sharing)
        overlap_in_group = "1" in _gather(cfg, client, "overlap", str(int(overlap)), deadline).values()
        host = topology.local_ranks(cfg.rank)
        net = _tcp_transport(cfg, client, deadline, spans_hosts=True, sharing=sharing,
                             peers=set(range(cfg.world_size)) - set(host), mailbox=mailbox, local=shm)
    except BaseException:
        shm.close()
        raise
    return HierarchicalTransport(shm, net, topology, mailbox, overlap, overlap_in_group)


def _tcp_transport(cfg: Config, client: RendezvousStore, deadline: float, *, spans_hosts: bool, sharing: int,
                   peers: set[int] | None = None, mailbox: Mailbox | None = None,
                   local: ShmTransport | None = None) -> NetTransport:
    """TCP to `peers` (default every other rank); under a hierarchy, `local` is this host's
    shared-memory transport and the mailbox the one both share. sharing: _sharing_cores.

    Each rank listens where it reached the store from and publishes that address. A rank that
    reached it over loopback runs on rank 0's host; in a job across hosts (where the rendezvous
    name may resolve to loopback on rank 0's host only: Debian maps the hostname to 127.0.1.1) it
    listens on every interface and publishes no address, and each peer reaches it where the peer
    itself reached the store."""
    check_congestion(cfg.tuning.tcp_congestion)
    here = client.local_address
    unnamed = spans_hosts and ipaddress.ip_address(here).is_loopback
    listener = open_listener("" if unnamed else here)
    congestion = partial(set_congestion, choice=cfg.tuning.tcp_congestion)
    try:
        congestion(listener)  # before any connection: accepted ones are born with it
        me = json.dumps(["" if unnamed else here, listener.getsockname()[1]])
        addrs = {r: _reachable(json.loads(v), client) for r, v in _gather(cfg, client, "tcp", me, deadline).items()}
    except BaseException:
        listener.close()
        raise
    socks = connect_mesh(cfg.rank, cfg.world_size, listener, addrs, cfg.secret, cfg.job_id, deadline, peers,
                         check=lambda: _raise_if_aborted(client, deadline), prepare=congestion)
    return NetTransport(cfg.rank, cfg.world_size, socks, timeout=cfg.timeout, mailbox=mailbox, local=local,
                        spin_s=tcp_spin_seconds(cfg.tuning, sharing),
                        native_spin_s=native_spin_seconds(cfg.tuning))


def _reachable(published: list, client: RendezvousStore) -> tuple[str, int]:
    """Where to connect to a rank that published [address, port]: no address means rank 0's
    host, reached where this rank reached the store."""
    address, port = published
    return (address or client.store_address), int(port)


def _raise_if_aborted(client: RendezvousStore, deadline: float) -> None:
    """StoreAbort when a rank published a start-up failure (or its connection to the store dropped)."""
    reason = client.get(ABORT_KEY, deadline)
    if reason is not None:
        raise StoreAbort(reason)


def _shm_transport(cfg: Config, client: RendezvousStore, hosts: dict[int, str], pids: dict[int, int],
                   deadline: float, sharing: int, mailbox: Mailbox | None = None) -> ShmTransport:
    """The leader (lowest rank of the host) creates the segment; the host's ranks attach; the leader
    unlinks the names as soon as they all did (at once when it is alone), so nothing outlives the
    job even after kill -9. If start-up fails meanwhile, every local rank unlinks them: the leader
    may be the rank that died, and its pid tells the names without asking the store."""
    local = sorted(r for r, h in hosts.items() if h == cfg.host_id)
    is_leader, key = cfg.rank == local[0], f"shm/{cfg.host_id}"
    segment = None
    try:
        make = _create if is_leader else _attach
        segment = make(cfg, client, key, len(local), deadline)
        if len(local) == 1:
            segment.unlink()  # nobody else will attach
        transport = ShmTransport(segment, {r: i for i, r in enumerate(local)}, cfg.rank, cfg.world_size,
                                 timeout=cfg.timeout, spin_s=spin_seconds(cfg.tuning, sharing), mailbox=mailbox)
        _gather(cfg, client, f"shm-attached/{cfg.host_id}", "1", deadline, local)
    except BaseException:
        unlink_names(name_prefix(cfg.job_id, pids[local[0]]))
        if segment is not None:
            segment.close()
        raise
    finally:
        if is_leader and segment is not None:
            segment.unlink()
    return transport


def _create(cfg: Config, client: RendezvousStore, key: str, n_local: int, deadline: float) -> Segment:
    """The leader's side (a failure reaches the other ranks through the store's abort key)."""
    t = cfg.tuning
    try:
        board_bytes = board_bytes_for(n_local) if t.shm_board_bytes is None else t.shm_board_bytes
        layout = fit_layout(n_local, t.shm_slot_bytes, t.shm_slots, shm_budget(n_local, free_bytes()), board_bytes)
    except ValueError as exc:
        raise ShmSetupError(f"{exc}; /dev/shm is too small: give the container more (docker run "
                            f"--shm-size=1g) or use transport='tcp'") from exc
    segment = create_segment(cfg.job_id, layout)
    try:
        client.set(key, json.dumps([segment.prefix, layout.slot_bytes, layout.n_slots, layout.board_bytes,
                                    layout.blocks_per_rank]), deadline)
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    return segment


def _attach(cfg: Config, client: RendezvousStore, key: str, n_local: int, deadline: float) -> Segment:
    values, missing = client.wait([key], deadline)
    if missing:
        raise CollectiveTimeout(f"the local leader never published its shared memory within {cfg.timeout:g} s")
    prefix, *geometry = json.loads(values[key])
    try:
        return attach_segment(prefix, Layout(n_local, *(int(value) for value in geometry)))
    except ShmSetupError:
        _raise_if_aborted(client, deadline)  # the names are gone because start-up failed elsewhere: say why
        raise


@atexit.register
def _close_open_groups() -> None:
    """Say goodbye at interpreter exit, so peers see a clean departure rather than a crash."""
    for group in list(_open_groups):
        group.close()
