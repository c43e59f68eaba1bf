"""Mutual proof of the job secret on a fresh TCP connection (HMAC-SHA256 over two nonces).

Both sides prove knowledge of SHMCOLL_SECRET without sending it; the `purpose` string (job id and
what the connection is for) is bound into the MACs so a connection meant for another job or another
port is refused. Without a secret the key is empty: the exchange still checks the job id, but anyone
who can reach the port can join, which is why the launcher always sets a secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from .errors import CollectiveError
from .netio import recv_exact, send_all

_HELLO = struct.Struct("<4sB32sI16s")  # magic, version, purpose digest, client id, client nonce
_MAGIC = b"SHMH"
_VERSION = 1
_OK = b"\x01"


class HandshakeError(CollectiveError, ConnectionError):
    """The peer failed to prove the secret, spoke another protocol, or belongs to another job."""


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    return hmac.new(secret or b"", b"".join(parts), hashlib.sha256).digest()


def _digest(purpose: str) -> bytes:
    return hashlib.sha256(purpose.encode()).digest()


def client_handshake(sock: socket.socket, secret: bytes | None, purpose: str, client_id: int, deadline: float) -> None:
    """Prove ourselves as `client_id` and check the server's proof; HandshakeError if anything is off."""
    nonce_c = os.urandom(16)
    digest = _digest(purpose)
    send_all(sock, _HELLO.pack(_MAGIC, _VERSION, digest, client_id, nonce_c), deadline)
    try:
        reply = recv_exact(sock, 48, deadline)
    except EOFError as exc:
        raise HandshakeError("server closed the connection during the handshake (wrong job or secret?)") from exc
    nonce_s, mac_s = reply[:16], reply[16:]
    ident = struct.pack("<I", client_id) + digest
    if not hmac.compare_digest(mac_s, _mac(secret, b"S", nonce_c, nonce_s, ident)):
        raise HandshakeError("server failed to prove the job secret (SHMCOLL_SECRET differs?)")
    send_all(sock, _mac(secret, b"C", nonce_s, nonce_c, ident), deadline)
    try:
        if recv_exact(sock, 1, deadline) != _OK:
            raise HandshakeError("server refused the handshake")
    except EOFError as exc:
        raise HandshakeError("server refused the handshake (SHMCOLL_SECRET differs?)") from exc


def server_handshake(sock: socket.socket, secret: bytes | None, purpose: str, deadline: float) -> int:
    """Check a connecting client's proof and prove ourselves; returns the id the client claimed."""
    magic, version, digest, client_id, nonce_c = _HELLO.unpack(recv_exact(sock, _HELLO.size, deadline))
    if magic != _MAGIC or version != _VERSION:
        raise HandshakeError(f"not a shmcoll handshake (magic {magic!r}, version {version})")
    if not hmac.compare_digest(digest, _digest(purpose)):
        raise HandshakeError("client belongs to another job or service")
    nonce_s = os.urandom(16)
    ident = struct.pack("<I", client_id) + digest
    send_all(sock, nonce_s + _mac(secret, b"S", nonce_c, nonce_s, ident), deadline)
    mac_c = recv_exact(sock, 32, deadline)
    if not hmac.compare_digest(mac_c, _mac(secret, b"C", nonce_s, nonce_c, ident)):
        raise HandshakeError(f"client claiming id {client_id} failed to prove the job secret")
    send_all(sock, _OK, deadline)
    return client_id
