"""Mutual proof of the job secret on a fresh TCP connection (HMAC-SHA256 over two nonces).

Both sides prove knowledge of SHMCOLL_SECRET without sending it; the `purpose` string (job id and
what the connection is for) is bound into the MACs so a connection meant for another job or another
port is refused. Without a secret the key is empty: the exchange still checks the job id, but anyone
who can reach the port can join, which is why the launcher always sets a secret.

The server's side is a state machine without I/O (ServerHandshake), so gate.Gate can vet many
connections on one thread. Each connection gets a fresh server nonce, so a replayed transcript of a
genuine client's handshake fails its proof.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct

from ..errors import CollectiveError
from .sockets import recv_exact, send_all

_HELLO = struct.Struct("<4sB32sI16s")  # magic, version, purpose digest, client id, client nonce
_MAGIC = b"SHMH"
_VERSION = 1


class HandshakeError(CollectiveError, ConnectionError):
    """The peer failed to prove the secret, spoke another protocol, or belongs to another job."""


class HandshakeDropped(HandshakeError):
    """The server hung up before the client was accepted: the port serves another job or another
    purpose, or the server shed the connection (it drops the oldest unproven connections under a
    flood). Unlike a failed proof, worth one more try."""


#: The server's last byte: the client proved the secret and is admitted.
ACCEPT = b"\x01"


def _mac(secret: bytes | None, *parts: bytes) -> bytes:
    return hmac.new(secret or b"", b"".join(parts), hashlib.sha256).digest()


def _digest(purpose: str) -> bytes:
    return hashlib.sha256(purpose.encode()).digest()


def client_handshake(sock: socket.socket, secret: bytes | None, purpose: str, client_id: int, deadline: float) -> None:
    """Prove ourselves as `client_id` and check the server's proof; HandshakeError if anything is off
    (HandshakeDropped if the server hung up without saying why)."""
    nonce_c = os.urandom(16)
    digest = _digest(purpose)
    ident = struct.pack("<I", client_id) + digest
    with _dropped_as("server closed the connection during the handshake (wrong job or secret?)"):
        send_all(sock, _HELLO.pack(_MAGIC, _VERSION, digest, client_id, nonce_c), deadline)
        reply = recv_exact(sock, 48, deadline)
    nonce_s, mac_s = reply[:16], reply[16:]
    if not hmac.compare_digest(mac_s, _mac(secret, b"S", nonce_c, nonce_s, ident)):
        raise HandshakeError("server failed to prove the job secret (SHMCOLL_SECRET differs?)")
    with _dropped_as(f"server refused the handshake of client {client_id} (not expected there, or shed under load)"):
        send_all(sock, _mac(secret, b"C", nonce_s, nonce_c, ident), deadline)
        answer = recv_exact(sock, 1, deadline)
    if answer != ACCEPT:
        raise HandshakeError("server refused the handshake")


@contextlib.contextmanager
def _dropped_as(message: str):
    """The server ending the connection (EOF, reset, broken pipe) becomes HandshakeDropped(message)."""
    try:
        yield
    except HandshakeError:
        raise
    except (EOFError, ConnectionError) as exc:
        raise HandshakeDropped(message) from exc


class ServerHandshake:
    """The server's side as a state machine fed bytes as they arrive, with no I/O of its own, so
    one thread can vet many connections at once: a silent or slow client then holds a socket and a
    few bytes, never a thread. Feed it at most wanted() bytes at a time (never read past the
    handshake); send back what feed() returns; once `proved`, send ACCEPT if the client is admitted."""

    def __init__(self, secret: bytes | None, purpose: str):
        self._secret, self._digest = secret, _digest(purpose)
        self._buf = bytearray()
        self._need = _HELLO.size  # bytes of the current step: the hello, then the client's MAC
        self._expect_mac: bytes | None = None
        self.client_id: int | None = None
        self.proved = False

    @property
    def proven_id(self) -> int:
        """The id of a client that proved the secret."""
        if not self.proved or self.client_id is None:
            raise HandshakeError("the client has not proved the job secret")
        return self.client_id

    def wanted(self) -> int:
        """Bytes still missing for the current step (0 once proved)."""
        return 0 if self.proved else self._need - len(self._buf)

    def feed(self, data: bytes) -> bytes:
        """Take the next bytes from the client; returns what to send back now (b"" if nothing).
        HandshakeError: another protocol, another job or purpose, or a failed proof."""
        if len(data) > self.wanted():
            raise HandshakeError("client sent past the handshake")
        self._buf += data
        if self.wanted():
            return b""
        raw, self._buf = bytes(self._buf), bytearray()
        if self._expect_mac is None:
            return self._hello(raw)
        if not hmac.compare_digest(raw, self._expect_mac):
            raise HandshakeError(f"client claiming id {self.client_id} failed to prove the job secret")
        self.proved = True
        return b""

    def _hello(self, raw: bytes) -> bytes:
        magic, version, digest, client_id, nonce_c = _HELLO.unpack(raw)
        if magic != _MAGIC or version != _VERSION:
            raise HandshakeError(f"not a shmcoll handshake (magic {magic!r}, version {version})")
        if not hmac.compare_digest(digest, self._digest):
            raise HandshakeError("client belongs to another job or service")
        nonce_s = os.urandom(16)  # fresh per connection: a replayed client MAC never matches
        ident = struct.pack("<I", client_id) + digest
        self.client_id, self._need = client_id, 32
        self._expect_mac = _mac(self._secret, b"C", nonce_s, nonce_c, ident)
        return nonce_s + _mac(self._secret, b"S", nonce_c, nonce_s, ident)


def server_handshake(sock: socket.socket, secret: bytes | None, purpose: str, deadline: float) -> int:
    """Check a connecting client's proof and prove ourselves, blocking; returns the id the client
    claimed. (Listeners use gate.Gate, which vets many connections at once.)"""
    state = ServerHandshake(secret, purpose)
    while not state.proved:
        reply = state.feed(recv_exact(sock, state.wanted(), deadline))
        if reply:
            send_all(sock, reply, deadline)
    send_all(sock, ACCEPT, deadline)
    return state.proven_id
