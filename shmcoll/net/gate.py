"""Gate: accept connections on a listening socket and vet them all at once, on one thread.

Every connection runs the job-secret handshake (handshake.ServerHandshake) without blocking; one
that proves the secret and is admitted is handed over, one that fails or speaks another protocol is
closed at once, and one still unproven after a short budget is closed too. At most `max_pending`
unproven connections are held; past that the oldest is dropped. So a flood of silent, slow or
garbage connections costs one thread per listener, bounded memory and descriptors, and never
delays a legitimate client, which completes its handshake within a round trip (one shed by a
flood sees HandshakeDropped and reconnects).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable

from .handshake import ACCEPT, HandshakeError, ServerHandshake

#: Seconds a connection may take to prove the secret (a genuine client needs one round trip).
HANDSHAKE_SECONDS = 3.0
#: Unproven connections held at once; past this the oldest is dropped.
MAX_PENDING = 128
_ACCEPT_BATCH = 64  # accepts per wake-up, so a flood cannot starve the connections already in
_PAUSE_SECONDS = 0.1  # when accept() fails for want of descriptors, stop listening this long
_CLOSE_SECONDS = 5.0


class Gate:
    """Vets connections to `listener` (which it owns and closes) until close().

    admit(client_id) -> bool decides, before the client hears ACCEPT, whether a proven client is
    wanted; deliver(client_id, sock) then takes the blocking socket. Both run on the gate's thread.
    budget: seconds a connection may take to prove the secret (None: HANDSHAKE_SECONDS as it is
    when the gate starts).
    """

    def __init__(self, listener: socket.socket, secret: bytes | None, purpose: str,
                 admit: Callable[[int], bool], deliver: Callable[[int, socket.socket], None], *,
                 name: str, budget: float | None = None, max_pending: int = MAX_PENDING):
        self._listener, self._secret, self._purpose = listener, secret, purpose
        self._admit, self._deliver = admit, deliver
        self._budget, self._max_pending = HANDSHAKE_SECONDS if budget is None else budget, max_pending
        self._pending: dict[socket.socket, tuple[ServerHandshake, float]] = {}  # oldest first
        self._paused_until = 0.0
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop: the listener and every unproven connection are closed (their clients see EOF or a
        reset); connections already delivered are the receiver's. Idempotent."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # already closed: the thread is gone
        if threading.current_thread() is not self._thread:
            self._thread.join(_CLOSE_SECONDS)

    # ---- the gate's thread ----
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, _ in self._sel.select(self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept_batch()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif key.fileobj in self._pending:
                        self._advance(key.fileobj)
                self._expire()
        finally:
            self._shut()

    def _next_timeout(self) -> float:
        """Until the oldest connection's budget runs out (or listening resumes); at most 1 s."""
        now = time.monotonic()
        wake = min((since + self._budget for _, since in self._pending.values()), default=now + 1.0)
        if self._paused_until:
            wake = min(wake, self._paused_until)
        return min(1.0, max(0.0, wake - now))

    def _accept_batch(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up before we got to it
            except OSError:  # out of descriptors (EMFILE, ENFILE, ENOBUFS): shed, else pause
                if not self._shed():
                    self._pause()
                return
            conn.setblocking(False)
            self._pending[conn] = (ServerHandshake(self._secret, self._purpose), time.monotonic())
            self._sel.register(conn, selectors.EVENT_READ)
            if len(self._pending) > self._max_pending:
                self._shed()

    def _advance(self, conn: socket.socket) -> None:
        """Feed what the connection sent into its handshake; drop it on EOF or any failure."""
        state = self._pending[conn][0]
        try:
            data = conn.recv(state.wanted())
            if not data:
                raise EOFError("closed by the client")
            reply = state.feed(data)
            if reply:
                _send_now(conn, reply)
        except (BlockingIOError, InterruptedError):
            return
        except Exception:  # EOF, reset, a failed proof: whatever it is, only this one goes
            self._drop(conn)
            return
        if state.proved:
            self._forget(conn)
            self._hand_over(conn, state.proven_id)

    def _hand_over(self, conn: socket.socket, client_id: int) -> None:
        try:
            if not self._admit(client_id):
                conn.close()  # a duplicate or unexpected id: the client sees HandshakeDropped
                return
            _send_now(conn, ACCEPT)
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._deliver(client_id, conn)
        except Exception:  # the gate must outlive any one connection
            conn.close()

    def _expire(self) -> None:
        end = time.monotonic() - self._budget
        for conn in [c for c, (_, since) in self._pending.items() if since <= end]:
            self._drop(conn)
        if self._paused_until and time.monotonic() >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ)

    def _shed(self) -> bool:
        """Drop the oldest unproven connection; False if there is none."""
        oldest = next(iter(self._pending), None)
        if oldest is None:
            return False
        self._drop(oldest)
        return True

    def _pause(self) -> None:
        """Stop watching the listener briefly (it stays readable while accept() cannot succeed)."""
        self._sel.unregister(self._listener)
        self._paused_until = time.monotonic() + _PAUSE_SECONDS

    def _forget(self, conn: socket.socket) -> None:
        del self._pending[conn]
        self._sel.unregister(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()

    def _shut(self) -> None:
        for conn in list(self._pending):
            self._drop(conn)
        self._sel.close()
        self._listener.close()  # connections still in the backlog are reset by the kernel
        self._wake_r.close()
        self._wake_w.close()


def _send_now(conn: socket.socket, data: bytes) -> None:
    """A handshake reply is a few dozen bytes on a fresh socket: it always fits, so a short send
    means something is wrong with the connection."""
    if conn.send(data) != len(data):
        raise HandshakeError("the client does not take the handshake's reply")
