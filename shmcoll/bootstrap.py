"""init(): read the configuration, meet the other ranks through the rendezvous store, and return a
ProcessGroup over the chosen transport.

Rank 0 serves the store; every rank publishes the address it listens on (the interface it used to
reach rank 0, so multi-homed hosts pick a routable one), waits for all the others, and builds the
TCP mesh. Rank 0 shuts the store down as soon as the mesh is up: by then every rank is done with it.
"""

from __future__ import annotations

import atexit
import json
import time
import weakref

from .config import load_config
from .errors import CollectiveError, CollectiveTimeout, InvalidArgument, PeerLost
from .group import ProcessGroup
from .netio import Deadline
from .rendezvous.store import StoreClient, StoreServer
from .transport.mesh import connect_mesh, open_listener
from .transport.tcp import NetTransport

TRANSPORTS = ("auto", "hier", "tcp", "shm")
_open_groups: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


def init(rank: int | None = None, world_size: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, timeout: float | None = None, *, transport: str = "auto") -> ProcessGroup:
    """Join the job and return its ProcessGroup (see API.md, "Getting a group")."""
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    if transport == "shm":
        raise InvalidArgument("transport='shm' is not available in this version yet; use 'tcp' or 'auto'")
    cfg = load_config(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
                      timeout=timeout)
    deadline = time.monotonic() + cfg.timeout
    socks = _rendezvous(cfg, deadline) if cfg.world_size > 1 else {}
    group = ProcessGroup(NetTransport(cfg.rank, cfg.world_size, socks, timeout=cfg.timeout), tuning=cfg.tuning)
    _open_groups.add(group)
    return group


def _rendezvous(cfg, deadline: float) -> dict:
    server = None
    if cfg.rank == 0:
        try:
            server = StoreServer(cfg.master_addr, cfg.master_port, cfg.secret, f"{cfg.job_id}/store")
        except OSError as exc:
            raise InvalidArgument(
                f"rank 0 cannot serve the rendezvous on {cfg.master_addr}:{cfg.master_port}: {exc} "
                f"(is another job using this port? set SHMCOLL_MASTER_PORT / MASTER_PORT)") from exc
    try:
        return _meet(cfg, deadline)
    finally:
        if server is not None:
            server.close()


def _meet(cfg, deadline: float) -> dict:
    where = f"{cfg.master_addr}:{cfg.master_port}"
    try:
        client = StoreClient(cfg.master_addr, cfg.master_port, cfg.secret, f"{cfg.job_id}/store", cfg.rank, deadline)
    except Deadline as exc:
        raise CollectiveTimeout(f"rank {cfg.rank} could not reach the rendezvous at {where} within "
                                f"{cfg.timeout:g} s (is rank 0 running, and the address right?)") from exc
    except CollectiveError:
        raise  # e.g. the handshake's wrong-secret error, which says so itself
    except (EOFError, OSError) as exc:
        raise PeerLost(f"the rendezvous at {where} dropped rank {cfg.rank} ({exc})", 0) from exc
    try:
        listener = open_listener(client.local_address)
        me = json.dumps([client.local_address, listener.getsockname()[1], cfg.host_id])
        client.set(f"peer/{cfg.rank}", me, deadline)
        keys = [f"peer/{r}" for r in range(cfg.world_size)]
        values, missing = client.wait(keys, deadline)
        if missing:
            listener.close()
            ranks = sorted(int(k.split("/")[1]) for k in missing)
            raise CollectiveTimeout(f"rendezvous at {where}: ranks {ranks} never arrived within {cfg.timeout:g} s")
        addrs = {r: tuple(json.loads(values[f"peer/{r}"])[:2]) for r in range(cfg.world_size)}
        return connect_mesh(cfg.rank, cfg.world_size, listener, addrs, cfg.secret, cfg.job_id, deadline)
    except Deadline as exc:
        raise CollectiveTimeout(f"rendezvous at {where} did not finish within {cfg.timeout:g} s") from exc
    except CollectiveError:
        raise
    except (EOFError, OSError) as exc:
        raise PeerLost(f"the rendezvous at {where} closed while rank {cfg.rank} was waiting "
                       f"(rank 0 gave up or died): {exc}", 0) from exc
    finally:
        client.close()


@atexit.register
def _close_open_groups() -> None:
    """Say goodbye at interpreter exit, so peers see a clean departure rather than a crash."""
    for group in list(_open_groups):
        group.close()
