"""Build the full mesh of authenticated TCP connections between ranks.

Rank i connects to every lower rank and accepts every higher one. Rank 0 only accepts, rank 1
accepts once it reached rank 0, and so on, so the order cannot deadlock. Each connection opens
with the job-secret handshake, bound to the job id and the accepting rank, so a stray or hostile
connection is dropped and the accept loop goes on.
"""

from __future__ import annotations

import socket
import time

from ..errors import CollectiveTimeout
from ..handshake import HandshakeError, client_handshake, server_handshake
from ..netio import Deadline, connect_with_retry

_HANDSHAKE_SECONDS = 5.0


def open_listener(addr: str) -> socket.socket:
    """A listening socket on an ephemeral port of `addr` (the interface that reaches the master)."""
    sock = socket.create_server((addr, 0), backlog=128)
    return sock


def _purpose(job_id: str, acceptor: int) -> str:
    return f"{job_id}/mesh/{acceptor}"


def connect_mesh(rank: int, world_size: int, listener: socket.socket, addrs: dict[int, tuple[str, int]],
                 secret: bytes | None, job_id: str, deadline: float,
                 peers: set[int] | None = None) -> dict[int, socket.socket]:
    """Connections to `peers` (default: every other rank; a hierarchy passes the remote ones)."""
    peers = set(range(world_size)) - {rank} if peers is None else set(peers)
    socks: dict[int, socket.socket] = {}
    try:
        for peer in sorted(p for p in peers if p < rank):
            socks[peer] = _connect(peer, addrs[peer], rank, secret, job_id, deadline)
        _accept_higher(rank, {p for p in peers if p > rank}, listener, socks, secret, job_id, deadline)
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    finally:
        listener.close()
    return socks


def _connect(peer: int, addr: tuple[str, int], rank: int, secret, job_id: str, deadline: float) -> socket.socket:
    try:
        sock = connect_with_retry(addr[0], addr[1], deadline)
    except Deadline as exc:
        raise CollectiveTimeout(f"could not connect to rank {peer} at {addr[0]}:{addr[1]} before the deadline") from exc
    try:
        client_handshake(sock, secret, _purpose(job_id, peer), rank, deadline)
    except BaseException as exc:
        sock.close()
        if isinstance(exc, Deadline):
            raise CollectiveTimeout(f"handshake with rank {peer} did not finish before the deadline") from exc
        raise
    return sock


def _accept_higher(rank: int, expected: set[int], listener: socket.socket, socks: dict[int, socket.socket],
                   secret, job_id: str, deadline: float) -> None:
    expected = set(expected)
    while expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"ranks {sorted(expected)} never connected to rank {rank}")
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        peer = _vet(conn, expected, secret, job_id, rank, deadline)
        if peer is not None:
            expected.discard(peer)
            socks[peer] = conn


def _vet(conn: socket.socket, expected: set[int], secret, job_id: str, rank: int, deadline: float) -> int | None:
    """The rank of a connection that proved itself and was expected, else None (connection closed)."""
    try:
        peer = server_handshake(conn, secret, _purpose(job_id, rank),
                                min(deadline, time.monotonic() + _HANDSHAKE_SECONDS))
        if peer in expected:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return peer
    except (HandshakeError, Deadline, EOFError, OSError, ValueError):
        pass
    conn.close()
    return None
