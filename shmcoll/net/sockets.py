"""Blocking socket helpers that honour a deadline (time.monotonic() seconds); no protocol knowledge."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


class Deadline(TimeoutError):
    """The deadline passed while waiting on a socket."""


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise Deadline("deadline passed")
    return left


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Read exactly n bytes; EOFError if the peer closes first, Deadline if time runs out."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill `view` from the socket; EOFError if the peer closes first, Deadline if time runs out."""
    got, n = 0, len(view)
    while got < n:
        sock.settimeout(remaining(deadline))
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            continue  # remaining() raises once the deadline has passed
        if k == 0:
            raise EOFError("connection closed by peer")
        got += k


def send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(remaining(deadline))
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise Deadline("deadline passed while sending") from exc


def connect_with_retry(addr: str, port: int, deadline: float, check: Callable[[], None] | None = None,
                       prepare: Callable[[socket.socket], object] | None = None) -> socket.socket:
    """Connect, retrying with backoff while the listener is not up yet (ranks start in any order);
    check() runs between tries and raises when waiting is pointless (the job already failed);
    prepare(sock) sets what must be set before the connection exists. An OSError from prepare
    (an option the kernel refuses) is raised at once: no later try would go otherwise."""
    delay = 0.01
    while True:
        timeout = min(5.0, remaining(deadline))
        try:
            sock = _connect(addr, port, timeout, prepare)
        except _PrepareFailed as failed:
            raise failed.error from None
        except OSError:
            if check is not None:
                check()
            time.sleep(min(delay, remaining(deadline)))
            delay = min(delay * 2, 0.5)
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class _PrepareFailed(Exception):
    """What _connect raises where prepare(sock) raised `error`: not a connection to try again."""

    def __init__(self, error: OSError):
        super().__init__(error)
        self.error = error


def _connect(addr: str, port: int, timeout: float, prepare: Callable[[socket.socket], object] | None) -> socket.socket:
    """socket.create_connection, with prepare(sock) before each try to connect."""
    error: OSError = OSError(f"no address for {addr}")
    for family, kind, proto, _, where in socket.getaddrinfo(addr, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if prepare is not None:
                prepare(sock)
        except OSError as exc:
            sock.close()
            raise _PrepareFailed(exc) from exc
        try:
            sock.settimeout(timeout)
            sock.connect(where)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error
