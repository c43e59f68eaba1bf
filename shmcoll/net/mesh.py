"""Build the full mesh of authenticated TCP connections between ranks.

Rank i connects to every lower rank and accepts every higher one. From the start a Gate vets the
connections arriving on rank i's listener, all at once on one thread, while rank i connects out; so
the order cannot deadlock, and a stray or hostile connection (garbage, a wrong secret, a replayed
handshake, silence, a slowloris) is dropped without delaying the ranks that really connect. Each
connection opens with the job-secret handshake bound to the job id and the accepting rank.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from ..errors import CollectiveTimeout
from .gate import Gate
from .handshake import HandshakeDropped, client_handshake
from .sockets import Deadline, connect_with_retry

#: Listen backlog: room for a burst of hostile connections before the gate starts draining it.
_BACKLOG = 1024
#: Tries per peer when the listener hangs up mid-handshake (it sheds its oldest unproven
#: connections under a flood); a wrong secret is never retried.
_CONNECT_TRIES = 3
#: Seconds between looks at whether the job failed while waiting for a peer's connection.
_CHECK_EVERY = 0.2


def open_listener(addr: str) -> socket.socket:
    """A listening socket on an ephemeral port of `addr` (the interface that reaches the master)."""
    return socket.create_server((addr, 0), backlog=_BACKLOG)


def _purpose(job_id: str, acceptor: int) -> str:
    return f"{job_id}/mesh/{acceptor}"


def connect_mesh(rank: int, world_size: int, listener: socket.socket, addrs: dict[int, tuple[str, int]],
                 secret: bytes | None, job_id: str, deadline: float,
                 peers: set[int] | None = None, check: Callable[[], None] | None = None,
                 prepare: Callable[[socket.socket], object] | None = None) -> dict[int, socket.socket]:
    """Connections to `peers` (default: every other rank; a hierarchy passes the remote ones).
    The listener is closed on return, and with it every connection that was not a wanted rank.
    check() runs while waiting on a peer and raises when the job failed meanwhile (a rank died).
    prepare(sock) runs on each outgoing socket before it connects (accepted ones take the
    listener's settings)."""
    peers = set(range(world_size)) - {rank} if peers is None else set(peers)
    arrivals = _Arrivals({p for p in peers if p > rank})
    gate = None
    try:
        if arrivals.expected:
            gate = Gate(listener, secret, _purpose(job_id, rank), arrivals.admit, arrivals.deliver,
                        name=f"shmcoll-mesh-gate-{rank}")
    finally:
        if gate is None:
            listener.close()
    socks: dict[int, socket.socket] = {}
    done = False
    try:
        for peer in sorted(p for p in peers if p < rank):
            socks[peer] = _connect(peer, addrs[peer], rank, secret, job_id, deadline, check, prepare)
        socks.update(arrivals.wait(rank, deadline, check))
        done = True
    finally:
        if gate is not None:
            gate.close()  # no delivery after this
        if not done:
            for sock in [*socks.values(), *arrivals.received()]:
                sock.close()
    return socks


class _Arrivals:
    """The higher ranks' proven connections, handed from the gate's thread to connect_mesh."""

    def __init__(self, expected: set[int]):
        self.expected = set(expected)
        self._got: dict[int, socket.socket] = {}
        self._cond = threading.Condition()

    def admit(self, peer: int) -> bool:
        """A rank we wait for and do not have yet (any other proven id is refused)."""
        with self._cond:
            return peer in self.expected and peer not in self._got

    def deliver(self, peer: int, sock: socket.socket) -> None:
        with self._cond:
            self._got[peer] = sock
            self._cond.notify_all()

    def wait(self, rank: int, deadline: float, check: Callable[[], None] | None = None) -> dict[int, socket.socket]:
        """Every expected connection, or CollectiveTimeout naming the ranks that never came."""
        while True:
            with self._cond:
                missing = self.expected - set(self._got)
                if not missing:
                    return dict(self._got)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"ranks {sorted(missing)} never connected to rank {rank}")
                self._cond.wait(min(left, _CHECK_EVERY))
            if check is not None:
                check()

    def received(self) -> list[socket.socket]:
        with self._cond:
            return list(self._got.values())


def _connect(peer: int, addr: tuple[str, int], rank: int, secret, job_id: str, deadline: float,
             check: Callable[[], None] | None = None,
             prepare: Callable[[socket.socket], object] | None = None) -> socket.socket:
    """A proven connection to a lower rank; reconnects if its listener shed us under a flood."""
    for attempt in range(1, _CONNECT_TRIES + 1):
        try:
            sock = connect_with_retry(addr[0], addr[1], deadline, check, prepare)
        except Deadline as exc:
            raise CollectiveTimeout(f"could not connect to rank {peer} at {addr[0]}:{addr[1]} "
                                    f"before the deadline") from exc
        try:
            client_handshake(sock, secret, _purpose(job_id, peer), rank, deadline)
            return sock
        except BaseException as exc:
            sock.close()
            if isinstance(exc, Deadline):
                raise CollectiveTimeout(f"handshake with rank {peer} did not finish before the deadline") from exc
            if not isinstance(exc, HandshakeDropped) or attempt == _CONNECT_TRIES:
                raise
    raise AssertionError("unreachable")
