"""torch's c10d store as shmcoll's rendezvous store, so `init_process_group("shmcoll")` meets
through whatever torch met through (env://, tcp://, file://, torchrun's agent store) and needs no
port or variable of its own.

Start-up (bootstrap.join_over_store) only sets, gets and waits on keys; this adapter maps those
onto the c10d calls, polls while it waits so a failure another rank publishes under ABORT_KEY
ends every wait at once, and keeps every key under one prefix. It never closes torch's store.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import torch.distributed as dist

from ..rendezvous.store import ABORT_KEY, StoreAbort

_PREFIX = "shmcoll/"
_JOB_KEY = "job-id"
# A wait polls (c10d's own blocking wait logs a warning each time it times out, and cannot be woken
# by ABORT_KEY): first after a millisecond, backing off to this many seconds between looks.
_FIRST_PAUSE, _LAST_PAUSE = 0.001, 0.05


class TorchStore:
    """bootstrap's RendezvousStore over a c10d Store."""

    def __init__(self, store: dist.Store):
        self._store = store
        self.store_address = _resolve(store_host(store))
        self.local_address = address_toward(self.store_address)

    def set(self, key: str, value: str, deadline: float) -> None:
        self._store.set(_PREFIX + key, value)

    def get(self, key: str, deadline: float) -> str | None:
        full = _PREFIX + key
        return self._store.get(full).decode() if self._store.check([full]) else None

    def wait(self, keys: list[str], deadline: float) -> tuple[dict[str, str], list[str]]:
        full, pause = [_PREFIX + k for k in keys], _FIRST_PAUSE
        while not self._store.check(full) and time.monotonic() < deadline:
            reason = self.get(ABORT_KEY, deadline)
            if reason is not None:
                raise StoreAbort(reason)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, _LAST_PAUSE)
        present = [k for k, f in zip(keys, full) if self._store.check([f])]
        values = {k: self._store.get(_PREFIX + k).decode() for k in present}
        return values, [k for k in keys if k not in values]

    def close(self) -> None:
        """torch owns the store and keeps using it; nothing to release."""


def agree_job_id(store: TorchStore, rank: int, deadline: float) -> str:
    """A name for this group's shared memory, fresh for every group: rank 0 draws it, the others
    read it. (Two groups never share names, even when torch reuses its store prefixes.)"""
    if rank == 0:
        store.set(_JOB_KEY, f"t{os.getpid():x}{secrets.token_hex(4)}", deadline)
    values, _ = store.wait([_JOB_KEY], deadline)
    return values.get(_JOB_KEY, "")


def store_host(store: dist.Store) -> str:
    """Where the store is served (a TCPStore's host), seen through PrefixStores; else MASTER_ADDR
    (a file:// or hash store has no host), else this machine."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def _resolve(host: str) -> str:
    """host's IPv4 address as this machine resolves it; loopback when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): the address other
    ranks can reach this one at, as shmcoll's own store tells from the connection it accepted."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((_resolve(host), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
