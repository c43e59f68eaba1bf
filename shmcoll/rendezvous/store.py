"""A tiny key-value store served by rank 0 over TCP, used once at start-up for ranks to meet.

Ranks publish where they listen (and later shared-memory names) with `set`, and block in `wait`
until every rank has published. Requests are length-prefixed JSON on a connection that first passes
the job-secret handshake; sizes are bounded, nothing is unpickled.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

from ..handshake import HandshakeError, client_handshake, server_handshake
from ..netio import Deadline, connect_with_retry, recv_exact, send_all

_LEN = struct.Struct("<I")
MAX_REQUEST = 1 << 20
MAX_CONNECTIONS = 1024
_HANDSHAKE_SECONDS = 10.0
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


class StoreAbort(Exception):
    """Another rank failed during start-up; the argument is what it published under ABORT_KEY."""


class StoreServer:
    """Serves the store on (addr, port) from daemon threads until close()."""

    def __init__(self, addr: str, port: int, secret: bytes | None, purpose: str):
        self._secret, self._purpose = secret, purpose
        self._data: dict[str, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._handlers: list[threading.Thread] = []  # joined by close(), even those already done serving
        self._listener = socket.create_server((addr, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="shmcoll-store", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        self._listener.settimeout(_WAIT_SLICE)  # so close() is seen even if shutdown cannot wake accept
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._cond:
                if len(self._conns) >= MAX_CONNECTIONS or self._closed:
                    conn.close()
                    continue
                handler = self._conns[conn] = threading.Thread(target=self._serve, args=(conn,),
                                                               name="shmcoll-store-conn", daemon=True)
                self._handlers = [h for h in self._handlers if h.is_alive()] + [handler]
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            server_handshake(conn, self._secret, self._purpose, time.monotonic() + _HANDSHAKE_SECONDS)
            while not self._closed:
                request = _recv_msg(conn, time.monotonic() + 3600.0)
                _send_msg(conn, self._answer(request), time.monotonic() + 60.0)
        except (OSError, EOFError, ValueError, HandshakeError, Deadline, struct.error, KeyError, TypeError,
                RecursionError):
            pass  # a broken, hostile or finished client: drop it, the store goes on
        finally:
            conn.close()
            with self._cond:
                self._conns.pop(conn, None)
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
        """Wait (bounded) until every client has hung up, so they can read an abort before close()."""
        end = time.monotonic() + seconds
        with self._cond:
            while self._conns and time.monotonic() < end:
                self._cond.wait(min(0.05, max(0.0, end - time.monotonic())))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conns, handlers = dict(self._conns), list(self._handlers)
            self._cond.notify_all()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=2 * _WAIT_SLICE)
        for handler in handlers:  # woken by the shutdown above; a waiter within one wait slice
            handler.join(timeout=2 * _WAIT_SLICE)


class StoreClient:
    """One rank's connection to the store; every call takes an absolute monotonic deadline."""

    def __init__(self, addr: str, port: int, secret: bytes | None, purpose: str, client_id: int, deadline: float):
        self._sock = connect_with_retry(addr, port, deadline)
        try:
            client_handshake(self._sock, secret, purpose, client_id, deadline)
        except BaseException:
            self._sock.close()
            raise
        self.local_address = self._sock.getsockname()[0]

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
        self._sock.close()
