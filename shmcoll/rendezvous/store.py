"""A tiny key-value store served by rank 0 over TCP, used once at start-up for ranks to meet.

Ranks publish where they listen (and later shared-memory names) with `set`, and block in `wait`
until every rank has published. Requests are length-prefixed JSON on a connection that first passes
the job-secret handshake; sizes are bounded, nothing is unpickled.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
import threading
import time
from typing import Protocol

from ..net.gate import Gate
from ..net.handshake import HandshakeDropped, HandshakeError, client_handshake
from ..net.sockets import Deadline, connect_with_retry, recv_exact, send_all

_LEN = struct.Struct("<I")
MAX_REQUEST = 1 << 20
#: Clients that proved the secret, served at once (each has a thread); more are refused.
MAX_CONNECTIONS = 1024
_BACKLOG = 1024
_CONNECT_TRIES = 3  # a client the gate shed under a flood (HandshakeDropped) reconnects
_WAIT_SLICE = 1.0  # the server answers a wait at least this often, so clients see their own deadline
#: A rank that fails during start-up sets this key: every other rank's wait ends with its reason.
ABORT_KEY = "__abort__"


def _send_msg(sock: socket.socket, obj: dict, deadline: float) -> None:
    body = json.dumps(obj).encode()
    send_all(sock, _LEN.pack(len(body)) + body, deadline)


def _recv_msg(sock: socket.socket, deadline: float) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, 4, deadline))
    if n > MAX_REQUEST:
        raise ValueError(f"store message of {n} bytes exceeds {MAX_REQUEST}")
    msg = json.loads(recv_exact(sock, n, deadline))
    if not isinstance(msg, dict):
        raise ValueError("store message is not an object")
    return msg


def listen_address(addr: str) -> str:
    """Where rank 0 serves the store for the rendezvous address `addr`: every interface, as torch's
    TCPStore does, so that a name that resolves to loopback on rank 0's host (Debian maps the
    hostname to 127.0.1.1) still reaches it from the others; but a loopback address written as such
    stays private to this host. OSError when `addr` is not this host's: rank 0 must run there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((addr, 0))
    try:
        return addr if ipaddress.ip_address(addr).is_loopback else ""
    except ValueError:  # a name, not an address
        return ""


class RendezvousStore(Protocol):
    """What start-up needs of a store (bootstrap.py): shmcoll's StoreClient, or torch's store seen
    through shmcoll.torch. Every call takes an absolute monotonic deadline; `wait` raises
    StoreAbort once a rank has published a start-up failure under ABORT_KEY."""

    local_address: str  # the address this rank reached the store from: where it listens
    store_address: str  # the address this rank reached the store at: rank 0's host, as seen from here

    def set(self, key: str, value: str, deadline: float) -> None: ...

    def get(self, key: str, deadline: float) -> str | None: ...

    def wait(self, keys: list[str], deadline: float) -> tuple[dict[str, str], list[str]]: ...

    def close(self) -> None: ...


class StoreAbort(Exception):
    """Another rank failed during start-up; the argument is what it published under ABORT_KEY."""


class StoreServer:
    """Serves the store on (addr, port) until close().

    A Gate vets every connection on one thread (a flood of silent or hostile connections costs no
    threads and is dropped within the handshake budget); each client that proved the secret gets a
    daemon thread, at most MAX_CONNECTIONS of them.
    """

    def __init__(self, addr: str, port: int, secret: bytes | None, purpose: str):
        self._data: dict[str, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._claimed: set[int] = set()  # the ids of the clients connected now
        self._contested = False  # a second process claimed a connected id: two jobs meet here
        self._handlers: list[threading.Thread] = []  # joined by close(), even those already done serving
        listener = socket.create_server((listen_address(addr), port), reuse_port=False, backlog=_BACKLOG)
        self.port = listener.getsockname()[1]
        self._where = f"{addr}:{self.port}"
        self._gate = Gate(listener, secret, purpose, self._admit, self._start_serving, name="shmcoll-store")

    def _admit(self, client_id: int) -> bool:
        """A client whose id is connected already is refused (it sees the handshake dropped), and the
        rendezvous is aborted: two processes claiming one rank means two jobs meet here (the same
        port, and nothing else to tell them apart), and which of them is the intruder cannot be
        told, so every rank waiting here fails saying so instead of forming a group of both jobs."""
        with self._cond:
            if client_id in self._claimed and not self._closed:
                self._contested = True
                self._data.setdefault(ABORT_KEY, _claimed_twice(client_id, self._where))
                self._cond.notify_all()
                return False
            return not self._closed and len(self._conns) < MAX_CONNECTIONS

    def _start_serving(self, client_id: int, conn: socket.socket) -> None:
        """Called by the gate with a proven client's socket: serve it on a thread of its own."""
        with self._cond:
            self._claimed.add(client_id)
            handler = self._conns[conn] = threading.Thread(target=self._serve, args=(conn, client_id),
                                                           name="shmcoll-store-conn", daemon=True)
            self._handlers = [h for h in self._handlers if h.is_alive()] + [handler]
        handler.start()

    def _serve(self, conn: socket.socket, client_id: int) -> None:
        joined = said_bye = False
        try:
            while not self._closed:
                request = _recv_msg(conn, time.monotonic() + 3600.0)
                op = request.get("op") if isinstance(request, dict) else None
                if op == "bye":
                    said_bye = True
                    return
                joined = joined or op == "set"
                _send_msg(conn, self._answer(request), time.monotonic() + 60.0)
        except (OSError, EOFError, ValueError, Deadline, struct.error, KeyError, TypeError, RecursionError):
            pass  # a broken or finished client: drop it, the store goes on
        finally:
            conn.close()
            with self._cond:
                self._conns.pop(conn, None)
                self._claimed.discard(client_id)
                if joined and not said_bye and not self._closed:
                    self._data.setdefault(ABORT_KEY, _vanished(client_id))
                self._cond.notify_all()

    def _answer(self, req: dict) -> dict:
        op = req["op"]
        if op == "set":
            with self._cond:
                self._data[str(req["key"])] = str(req["value"])
                self._cond.notify_all()
            return {"ok": True}
        if op == "get":
            with self._cond:
                return {"ok": True, "value": self._data.get(str(req["key"]))}
        if op == "wait":
            return self._wait([str(k) for k in req["keys"]], float(req["timeout"]))
        raise ValueError(f"unknown store op {op!r}")

    def _wait(self, keys: list[str], timeout: float) -> dict:
        end = time.monotonic() + max(0.0, min(timeout, _WAIT_SLICE))
        with self._cond:
            while True:
                missing = [k for k in keys if k not in self._data]
                left = end - time.monotonic()
                if not missing or left <= 0 or self._closed or ABORT_KEY in self._data:
                    return {"ok": not missing, "missing": missing, "abort": self._data.get(ABORT_KEY),
                            "values": {k: self._data[k] for k in keys if k in self._data}}
                self._cond.wait(left)

    def linger(self, seconds: float) -> None:
        """Wait (bounded) until every client has hung up, so they can read an abort before close().
        When two jobs met here, wait the whole time: the other job's ranks still arriving (started
        with the rank refused) then read why, instead of waiting out their timeout for a rank 0."""
        end = time.monotonic() + seconds
        with self._cond:
            while (self._conns or self._contested) and time.monotonic() < end:
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._gate.close()  # closes the listener and every connection not yet proven; no more arrive
        with self._cond:
            conns, handlers = dict(self._conns), list(self._handlers)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for handler in handlers:  # woken by the shutdown above; a waiter within one wait slice
            handler.join(timeout=2 * _WAIT_SLICE)


def _vanished(client_id: int) -> str:
    """The abort a rank's dropped connection publishes: the others stop waiting for it at once."""
    return json.dumps({"kind": "PeerLost", "rank": client_id,
                       "message": "its connection to the rendezvous closed before start-up finished (process died?)"})


def _claimed_twice(client_id: int, where: str) -> str:
    """The abort published when a second process claims a rank that is connected already."""
    return json.dumps({"kind": "CollectiveError", "rank": client_id,
                       "message": f"a second process claimed rank {client_id} at the rendezvous on {where}: "
                                  f"another job is using this port (give each job its own SHMCOLL_MASTER_PORT), "
                                  f"or two processes were given the same rank"})


class StoreClient:
    """One rank's connection to the store; every call takes an absolute monotonic deadline."""

    def __init__(self, addr: str, port: int, secret: bytes | None, purpose: str, client_id: int, deadline: float):
        where, refused = f"{addr}:{port}", None
        for attempt in range(1, _CONNECT_TRIES + 1):
            # a retry after a dropped handshake finds the store gone: that store was not ours, say so now
            self._sock = connect_with_retry(addr, port, deadline, None if refused is None else refused.again)
            try:
                client_handshake(self._sock, secret, purpose, client_id, deadline)
                break
            except HandshakeError as exc:
                self._sock.close()
                refused = _Refusal(exc, where, client_id)
                if not isinstance(exc, HandshakeDropped) or attempt == _CONNECT_TRIES:
                    refused.again()
            except BaseException:
                self._sock.close()
                raise
        self.local_address = self._sock.getsockname()[0]
        self.store_address = self._sock.getpeername()[0]

    def _call(self, request: dict, deadline: float) -> dict:
        _send_msg(self._sock, request, deadline)
        return _recv_msg(self._sock, deadline)

    def set(self, key: str, value: str, deadline: float) -> None:
        self._call({"op": "set", "key": key, "value": value}, deadline)

    def get(self, key: str, deadline: float) -> str | None:
        return self._call({"op": "get", "key": key}, deadline)["value"]

    def wait(self, keys: list[str], deadline: float) -> tuple[dict[str, str], list[str]]:
        """Block until every key is set or the deadline passes; returns (values, missing keys).
        StoreAbort when a rank has published a start-up failure (ABORT_KEY) meanwhile."""
        while True:
            left = deadline - time.monotonic()
            reply = self._call({"op": "wait", "keys": keys, "timeout": max(0.0, left)}, deadline + 5.0)
            if reply["ok"] or left <= 0:
                return reply["values"], reply["missing"]
            if reply.get("abort") is not None:
                raise StoreAbort(str(reply["abort"]))

    def close(self) -> None:
        """Say goodbye first, so the store can tell a rank that is done from one that died."""
        try:
            _send_msg(self._sock, {"op": "bye"}, time.monotonic() + 1.0)
        except (OSError, Deadline):
            pass
        self._sock.close()


class _Refusal:
    """The store's refusal of a handshake, raised (same class) saying where and the likely causes:
    the handshake alone cannot tell another job's store from a wrong secret or rank."""

    def __init__(self, exc: HandshakeError, where: str, client_id: int):
        self.exc, self.where, self.client_id = exc, where, client_id

    def again(self) -> None:
        raise type(self.exc)(
            f"the rendezvous at {self.where} refused rank {self.client_id}: {self.exc}; is another job using this "
            f"port (give each job its own SHMCOLL_MASTER_PORT), or do this rank's SHMCOLL_SECRET, job id or rank "
            f"differ from what rank 0 expects?") from self.exc
