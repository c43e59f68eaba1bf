"""The rendezvous store (StoreServer / StoreClient on 127.0.0.1, threads) and the job-secret
handshake (over socket pairs): normal use, refusals, and hostile or broken peers."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmcoll.net import gate
from shmcoll.net.handshake import (
    ACCEPT,
    HandshakeDropped,
    HandshakeError,
    ServerHandshake,
    client_handshake,
    server_handshake,
)
from shmcoll.rendezvous.store import StoreClient, StoreServer, listen_address

from bounds import CALL_DEADLINE_S, DROP_LATE_S, LATE_S, NEVER_S, NO_WAIT_S, THROUGH_FLOOD_S, WAIT_HANG_S

SECRET = b"job-secret"
PURPOSE = "jtest/store"
HELLO = struct.Struct("<4sB32sI16s")  # the documented hello: magic, version, purpose digest, id, nonce


def dl(seconds: float = CALL_DEADLINE_S) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, SECRET, PURPOSE)
    yield server
    server.close()


#: The handshake budget of quick_store's gate: the real one's behaviour, for less of the tests' time.
SHORT_BUDGET_S = 1.0


@pytest.fixture
def quick_store(monkeypatch):
    """A store whose gate drops unproven connections after SHORT_BUDGET_S (gate.HANDSHAKE_SECONDS)."""
    monkeypatch.setattr(gate, "HANDSHAKE_SECONDS", SHORT_BUDGET_S)
    server = StoreServer("127.0.0.1", 0, SECRET, PURPOSE)
    yield server
    server.close()


def client(store, secret=SECRET, purpose=PURPOSE, cid=1) -> StoreClient:
    return StoreClient("127.0.0.1", store.port, secret, purpose, cid, dl())


_probe = iter(range(10**9))


def assert_store_serves(store) -> None:
    """A good client can still set, get and wait."""
    key, value = f"probe/{next(_probe)}", os.urandom(6).hex()
    c = client(store, cid=77)
    try:
        c.set(key, value, dl())
        assert c.get(key, dl()) == value
        assert c.wait([key], dl()) == ({key: value}, [])
    finally:
        c.close()


def raw_conn(store) -> socket.socket:
    return socket.create_connection(("127.0.0.1", store.port), timeout=CALL_DEADLINE_S)


def authed_conn(store) -> socket.socket:
    sock = raw_conn(store)
    client_handshake(sock, SECRET, PURPOSE, 5, dl())
    return sock


def assert_dropped(sock: socket.socket, seconds: float = gate.HANDSHAKE_SECONDS + DROP_LATE_S) -> None:
    """The server closes this connection (EOF or reset) within `seconds`; anything it sent first is ignored."""
    end = dl(seconds)
    while True:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            if sock.recv(4096) == b"":
                return
        except (ConnectionResetError, BrokenPipeError):
            return
        except TimeoutError:
            pytest.fail("the store kept a hostile connection open")


# ---------------------------------------------------------------- normal use
def test_a_rank_that_vanishes_mid_rendezvous_aborts_the_waiters_at_once(store):
    """A client that joined (set a key) and whose connection drops without a goodbye is a dead
    rank: the others' wait ends with its name, not with their timeout."""
    import json

    from shmcoll.rendezvous.store import StoreAbort

    a, b = client(store, cid=0), client(store, cid=2)
    try:
        b.set("host/2", "h", dl())
        b._sock.close()  # what kill -9 does to its socket: no goodbye
        start = time.monotonic()
        with pytest.raises(StoreAbort) as err:
            a.wait(["host/0", "host/1"], dl(WAIT_HANG_S))
        assert time.monotonic() - start < NO_WAIT_S
        reason = json.loads(err.value.args[0])
        assert reason["kind"] == "PeerLost" and reason["rank"] == 2 and "closed" in reason["message"], reason
    finally:
        a.close()


def test_a_rank_that_says_goodbye_or_never_joined_aborts_nothing(store):
    a, b, c = client(store, cid=0), client(store, cid=1), client(store, cid=7)
    try:
        b.set("host/1", "h", dl())
        b.close()  # a finished rank says goodbye
        c.close()  # a connection that never set anything (a probe) is no rank
        values, missing = a.wait(["host/1", "host/3"], dl(0.5))
        assert values == {"host/1": "h"} and missing == ["host/3"]  # no abort: the deadline ended it
    finally:
        a.close()



def test_set_get_wait(store):
    a, b = client(store, cid=0), client(store, cid=1)
    try:
        assert a.get("missing", dl()) is None
        a.set("peer/0", '["127.0.0.1", 1234]', dl())
        b.set("peer/1", "ünïcødé ✓", dl())
        assert b.get("peer/0", dl()) == '["127.0.0.1", 1234]'
        assert a.get("peer/1", dl()) == "ünïcødé ✓"
        b.set("peer/1", "second", dl())  # last write wins
        assert a.wait(["peer/0", "peer/1"], dl()) == ({"peer/0": '["127.0.0.1", 1234]', "peer/1": "second"}, [])
        assert a.wait([], dl()) == ({}, [])
        assert isinstance(a.local_address, str) and a.local_address.startswith("127.")
        assert a.store_address == "127.0.0.1"
    finally:
        a.close()
        b.close()


def test_the_store_listens_on_every_interface_unless_told_loopback_literally():
    """A name may resolve to loopback on rank 0's host only, so the store takes every interface for
    it; 127.0.0.1 written out means one machine and stays private; another host's address is an
    error, since rank 0 serves the store."""
    assert listen_address("127.0.0.1") == "127.0.0.1"
    assert listen_address("localhost") == ""
    with pytest.raises(OSError):
        listen_address("192.0.2.1")  # TEST-NET-1: no host's address


def test_wait_blocks_until_another_client_sets(store):
    waiter_client, setter = client(store, cid=0), client(store, cid=1)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=waiter_client.wait(["x", "y"], dl(WAIT_HANG_S))), daemon=True)
    start = time.monotonic()
    t.start()
    setter.set("x", "1", dl())
    setter.set("y", "2", dl())
    t.join(WAIT_HANG_S)
    assert not t.is_alive()
    assert out["r"] == ({"x": "1", "y": "2"}, [])
    assert time.monotonic() - start < NO_WAIT_S  # released by the set, not by the deadline
    waiter_client.close()
    setter.close()


@pytest.mark.parametrize("seconds", [0.4, 1.6])  # within one server wait slice, and across several
def test_wait_returns_the_missing_keys_at_the_deadline(store, seconds):
    c = client(store)
    try:
        c.set("present", "yes", dl())
        start = time.monotonic()
        values, missing = c.wait(["absent", "present", "also-absent"], start + seconds)
        took = time.monotonic() - start
        assert values == {"present": "yes"}
        assert sorted(missing) == ["absent", "also-absent"]
        assert seconds - 0.05 <= took < seconds + LATE_S
    finally:
        c.close()


def test_wait_with_a_deadline_already_past(store):
    c = client(store)
    start = time.monotonic()
    assert c.wait(["nope"], start - 1) == ({}, ["nope"])
    assert time.monotonic() - start < NO_WAIT_S
    c.close()


def test_close_releases_waiting_clients(store):
    c = client(store)
    out = {}

    def wait():
        try:
            out["r"] = c.wait(["never"], dl(NEVER_S))
        except (EOFError, OSError) as exc:
            out["e"] = exc

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    store.close()
    t.join(WAIT_HANG_S)
    assert not t.is_alive(), "a client waiting on a closed store must not hang until its deadline"
    assert "e" in out or out["r"][1] == ["never"]
    with pytest.raises((EOFError, OSError)):  # the store is gone for good
        StoreClient("127.0.0.1", store.port, SECRET, PURPOSE, 3, dl(1))
    c.close()


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("secret,purpose", [(b"wrong", PURPOSE), (None, PURPOSE), (SECRET, "jother/store"),
                                            (SECRET + b"x", PURPOSE)],
                         ids=["wrong-secret", "no-secret", "other-job", "longer-secret"])
def test_client_without_the_secret_is_refused(store, secret, purpose):
    start = time.monotonic()
    with pytest.raises((HandshakeError, EOFError)):
        StoreClient("127.0.0.1", store.port, secret, purpose, 1, dl())
    assert time.monotonic() - start < NO_WAIT_S
    assert_store_serves(store)


def test_server_without_secret_refuses_a_client_that_has_one():
    server = StoreServer("127.0.0.1", 0, None, PURPOSE)
    try:
        with pytest.raises(HandshakeError):
            StoreClient("127.0.0.1", server.port, SECRET, PURPOSE, 1, dl())
        c = StoreClient("127.0.0.1", server.port, None, PURPOSE, 1, dl())
        c.set("k", "v", dl())
        assert c.get("k", dl()) == "v"
        c.close()
    finally:
        server.close()


# ---------------------------------------------------------------- hostile and broken peers

def _garbage(store):
    sock = raw_conn(store)
    sock.sendall(os.urandom(4096))
    return sock, True


def _garbage_with_hello_magic(store):
    sock = raw_conn(store)
    sock.sendall(b"SHMH\x01" + os.urandom(HELLO.size + 100))
    return sock, True


def _short_garbage_then_close(store):
    sock = raw_conn(store)
    sock.sendall(b"GET / HTTP/1.0\r\n")
    sock.shutdown(socket.SHUT_WR)
    return sock, True


def _hello_then_close(store):
    sock = raw_conn(store)
    sock.sendall(HELLO.pack(b"SHMH", 1, hashlib.sha256(PURPOSE.encode()).digest(), 1, os.urandom(16)))
    sock.shutdown(socket.SHUT_WR)
    return sock, True


def _wrong_mac(store):
    sock = raw_conn(store)
    sock.sendall(HELLO.pack(b"SHMH", 1, hashlib.sha256(PURPOSE.encode()).digest(), 1, os.urandom(16)))
    sock.recv(48)
    sock.sendall(os.urandom(32))
    return sock, True


def _prefixed(body: bytes):
    def hostile(store):
        sock = authed_conn(store)
        sock.sendall(struct.pack("<I", len(body)) + body)
        return sock, True
    return hostile


def _huge_length(n: int):
    def hostile(store):
        sock = authed_conn(store)
        sock.sendall(struct.pack("<I", n) + b"{}")
        return sock, True
    return hostile


def _truncated_request(close: bool):
    def hostile(store):
        sock = authed_conn(store)
        sock.sendall(struct.pack("<I", 100) + b'{"op": "ge')
        if close:
            sock.shutdown(socket.SHUT_WR)
        return sock, close  # left open: the store waits on it, but serves everybody else meanwhile
    return hostile


def _truncated_length(store):
    sock = authed_conn(store)
    sock.sendall(b"\x05\x00")
    sock.shutdown(socket.SHUT_WR)
    return sock, True


def _silent(store):
    return raw_conn(store), False


def _silent_after_handshake(store):
    return authed_conn(store), False


HOSTILE = {
    "garbage": _garbage,
    "garbage-with-hello-magic": _garbage_with_hello_magic,
    "http-request-then-close": _short_garbage_then_close,
    "hello-then-close": _hello_then_close,
    "wrong-mac": _wrong_mac,
    "length-2**31": _huge_length(2**31),
    "length-2**32-1": _huge_length(2**32 - 1),
    "length-just-over-limit": _huge_length((1 << 20) + 1),
    "truncated-request-then-close": _truncated_request(True),
    "truncated-request-then-silent": _truncated_request(False),
    "truncated-length-prefix": _truncated_length,
    "invalid-json": _prefixed(b"{not json"),
    "invalid-utf8": _prefixed(b"\xff\xfe\xfd"),
    "json-list": _prefixed(b"[1, 2, 3]"),
    "json-string": _prefixed(b'"set"'),
    "unknown-op": _prefixed(b'{"op": "delete", "key": "a"}'),
    "no-op": _prefixed(b'{"key": "a"}'),
    "set-without-value": _prefixed(b'{"op": "set", "key": "a"}'),
    "op-unhashable": _prefixed(b'{"op": [1]}'),
    "wait-keys-not-a-list": _prefixed(b'{"op": "wait", "keys": 5, "timeout": 1}'),
    "wait-timeout-not-a-number": _prefixed(b'{"op": "wait", "keys": ["a"], "timeout": "soon"}'),
    "wait-timeout-null": _prefixed(b'{"op": "wait", "keys": ["a"], "timeout": null}'),
    "silent": _silent,
    "silent-after-handshake": _silent_after_handshake,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_connection_does_not_disturb_the_store(store, name):
    a = client(store, cid=0)
    a.set("before", "1", dl())
    sock, dropped = HOSTILE[name](store)
    try:
        if dropped:
            assert_dropped(sock)
        assert_store_serves(store)  # with the hostile connection still open where it stays open
        assert a.get("before", dl()) == "1"  # an existing client and the data are untouched
        assert a.wait(["before"], dl()) == ({"before": "1"}, [])
    finally:
        sock.close()
        a.close()


def test_many_silent_connections_do_not_block_good_clients(store):
    silent = [raw_conn(store) for _ in range(30)]
    try:
        start = time.monotonic()
        assert_store_serves(store)
        assert time.monotonic() - start < THROUGH_FLOOD_S  # not after the silent ones' handshake timeouts
    finally:
        for s in silent:
            s.close()


def _store_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shmcoll-store")]


def test_flood_of_silent_connections_costs_no_threads_and_is_dropped(quick_store):
    """200 silent connections (more than the gate holds): good clients are served at once, the store
    runs no thread per connection, and every silent one is closed within the handshake budget."""
    store = quick_store
    silent = [raw_conn(store) for _ in range(200)]
    try:
        start = time.monotonic()
        assert_store_serves(store)
        assert time.monotonic() - start < NO_WAIT_S
        assert len(_store_threads()) <= 2  # the gate, and at most the good client's handler
        for sock in silent:
            assert_dropped(sock, seconds=gate.HANDSHAKE_SECONDS + LATE_S - (time.monotonic() - start))
        assert time.monotonic() - start < gate.HANDSHAKE_SECONDS + LATE_S
        assert_store_serves(store)
    finally:
        for s in silent:
            s.close()


def test_slowloris_is_dropped_within_the_handshake_budget(quick_store):
    """A client that sends its hello one byte every 100 ms keeps nothing alive past the budget."""
    store = quick_store
    sock = raw_conn(store)
    hello = HELLO.pack(b"SHMH", 1, hashlib.sha256(PURPOSE.encode()).digest(), 1, os.urandom(16))
    start, closed = time.monotonic(), None
    try:
        for i in range(len(hello)):
            try:
                sock.sendall(hello[i:i + 1])
                sock.settimeout(0.1)
                if sock.recv(64) == b"":
                    closed = time.monotonic() - start
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = time.monotonic() - start
                break
        assert closed is not None and closed < gate.HANDSHAKE_SECONDS + DROP_LATE_S, closed
        assert_store_serves(store)
    finally:
        sock.close()


def test_client_reconnects_when_the_server_hangs_up_mid_handshake():
    """A client shed by a flooded gate (the server hangs up after its hello) tries again; a server
    that fails its proof is not retried."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(WAIT_HANG_S)
    port = listener.getsockname()[1]

    seen = []

    def serve(first_hangs_up: bool):
        conn, _ = listener.accept()
        with conn:
            if first_hangs_up:
                conn.recv(HELLO.size)
                conn.close()
                conn, _ = listener.accept()
            with conn:
                try:
                    seen.append(server_handshake(conn, SECRET, PURPOSE, dl()))
                except (HandshakeError, EOFError) as exc:
                    seen.append(type(exc).__name__)

    t = threading.Thread(target=serve, args=(True,), daemon=True)
    t.start()
    StoreClient("127.0.0.1", port, SECRET, PURPOSE, 1, dl()).close()
    t.join(WAIT_HANG_S)
    assert not t.is_alive() and seen == [1]
    t = threading.Thread(target=serve, args=(False,), daemon=True)
    t.start()
    with pytest.raises(HandshakeError) as err:
        StoreClient("127.0.0.1", port, b"other-secret", PURPOSE, 1, dl())
    assert not isinstance(err.value, HandshakeDropped)
    t.join(WAIT_HANG_S)
    assert not t.is_alive() and seen == [1, "EOFError"]  # one connection only: no retry
    listener.close()


def _hang_up_after_hello(sock):
    sock.recv(HELLO.size, socket.MSG_WAITALL)


def _hang_up_after_proofs(sock):
    """Both proofs go through, but the acceptance byte never comes (the id is not wanted)."""
    state = ServerHandshake(SECRET, "p")
    sock.sendall(state.feed(sock.recv(HELLO.size, socket.MSG_WAITALL)))
    state.feed(sock.recv(32, socket.MSG_WAITALL))
    assert state.proved


@pytest.mark.parametrize("server", [_hang_up_after_hello, _hang_up_after_proofs], ids=["after-hello", "after-proofs"])
def test_client_handshake_reports_a_hang_up_as_dropped(server):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(CALL_DEADLINE_S)
        t = threading.Thread(target=lambda: (server(b), b.shutdown(socket.SHUT_RDWR)), daemon=True)
        t.start()
        with pytest.raises(HandshakeDropped):
            client_handshake(a, SECRET, "p", 1, dl())
        t.join(CALL_DEADLINE_S)
        assert not t.is_alive()


def _send_deeply_nested(store):
    """Send a deeply nested JSON request; return once the store dropped it and its thread ended."""
    before = set(threading.enumerate())
    body = b"[" * 100_000 + b"]" * 100_000
    sock = authed_conn(store)
    try:
        sock.sendall(struct.pack("<I", len(body)) + body)
        assert_dropped(sock)
    finally:
        sock.close()
    for t in set(threading.enumerate()) - before:
        if t.name.startswith("shmcoll-store"):
            t.join(WAIT_HANG_S)  # the thread's end (and any exception it let escape) is behind us
            assert not t.is_alive()


def test_deeply_nested_json_does_not_disturb_the_store(store):
    _send_deeply_nested(store)
    assert_store_serves(store)


def test_deeply_nested_json_is_dropped_quietly(store, monkeypatch):
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_type))
    _send_deeply_nested(store)
    assert_store_serves(store)
    assert escaped == []


# ---------------------------------------------------------------- handshake over a socket pair

def run_pair(client_args, server_args, seconds: float = CALL_DEADLINE_S):
    """client_handshake and server_handshake on the two ends of a socket pair, like real callers:
    each side closes its end when it fails. Returns ((client result, error), (server result, error))."""
    a, b = socket.socketpair()
    out = {}

    def side(name, fn, sock, args):
        try:
            out[name] = (fn(sock, *args, dl(seconds)), None)
        except Exception as exc:  # inspected by the test
            out[name] = (None, exc)
            sock.close()

    threads = [threading.Thread(target=side, args=("c", client_handshake, a, client_args), daemon=True),
               threading.Thread(target=side, args=("s", server_handshake, b, server_args), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + CALL_DEADLINE_S)
        assert not t.is_alive(), "handshake hung past its deadline"
    a.close()
    b.close()
    return out["c"], out["s"]


@pytest.mark.parametrize("secret", [b"k", b"\x00" * 64, None], ids=["short", "binary", "none"])
@pytest.mark.parametrize("cid", [0, 3, 2**32 - 1])
def test_handshake_same_secret(secret, cid):
    (c_res, c_err), (s_res, s_err) = run_pair((secret, "job/mesh/0", cid), (secret, "job/mesh/0"))
    assert c_err is None and s_err is None
    assert s_res == cid


@pytest.mark.parametrize("client_secret,server_secret", [(b"a", b"b"), (None, b"b"), (b"a", None), (b"a", b"A")])
def test_handshake_different_secret_fails_on_both_sides(client_secret, server_secret):
    (_, c_err), (s_res, s_err) = run_pair((client_secret, "job/store", 1), (server_secret, "job/store"))
    assert isinstance(c_err, HandshakeError), repr(c_err)
    # the client sees the server's bad proof first and hangs up without sending its own, so the
    # server sees the connection end (EOFError) -- never a success
    assert s_res is None and isinstance(s_err, (HandshakeError, EOFError)), repr(s_err)


@pytest.mark.parametrize("client_purpose,server_purpose", [("job/store", "job/mesh/0"), ("a/store", "b/store"),
                                                           ("", "job/store")])
def test_handshake_different_purpose_fails_on_both_sides(client_purpose, server_purpose):
    (_, c_err), (s_res, s_err) = run_pair((SECRET, client_purpose, 1), (SECRET, server_purpose))
    assert isinstance(s_err, HandshakeError), repr(s_err)
    assert isinstance(c_err, HandshakeError), repr(c_err)


def test_server_refuses_a_client_that_cannot_prove_the_secret():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(HELLO.pack(b"SHMH", 1, hashlib.sha256(b"p").digest(), 9, os.urandom(16)))
        a.sendall(os.urandom(32))  # a MAC made up without the secret
        with pytest.raises(HandshakeError, match="9"):
            server_handshake(b, SECRET, "p", dl())
        a.settimeout(CALL_DEADLINE_S)
        assert len(a.recv(48, socket.MSG_WAITALL)) == 48  # the server's nonce and proof ...
        a.setblocking(False)
        with pytest.raises(BlockingIOError):  # ... but no acceptance byte
            a.recv(1)


def test_client_refuses_a_server_that_cannot_prove_the_secret():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(os.urandom(48))  # a nonce and a made-up MAC
        with pytest.raises(HandshakeError):
            client_handshake(a, SECRET, "p", 1, dl())
        b.settimeout(CALL_DEADLINE_S)
        assert len(b.recv(HELLO.size)) > 0  # it did say hello first, but never sent its proof
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            b.recv(1)


@pytest.mark.parametrize("side", ["server", "client"])
def test_silent_peer_times_out(side):
    a, b = socket.socketpair()
    with a, b:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            if side == "server":
                server_handshake(b, SECRET, "p", start + 0.3)
            else:
                client_handshake(a, SECRET, "p", 1, start + 0.3)
        assert 0.25 <= time.monotonic() - start < 0.3 + LATE_S


@st.composite
def hostile_hellos(draw):
    """Random bytes; or a well-formed hello (right or wrong purpose) followed by random bytes."""
    tail = draw(st.binary(max_size=200))
    kind = draw(st.sampled_from(["random", "hello", "hello-other-purpose", "magic-only"]))
    if kind == "random":
        return tail
    if kind == "magic-only":
        return b"SHMH" + bytes([draw(st.integers(0, 255))]) + tail
    purpose = "p" if kind == "hello" else draw(st.text(max_size=10))
    hello = HELLO.pack(b"SHMH", 1, hashlib.sha256(purpose.encode()).digest(), draw(st.integers(0, 2**32 - 1)),
                       draw(st.binary(min_size=16, max_size=16)))
    return hello + tail


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_hellos(), st.sampled_from([SECRET, None]))
def test_server_handshake_on_random_bytes(raw, secret):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        with pytest.raises((HandshakeError, EOFError, OSError)):
            server_handshake(b, secret, "p", start + 2.0)
        assert time.monotonic() - start < NO_WAIT_S  # the input ended: it fails at once, not at the deadline


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=120), st.sampled_from([SECRET, None]))
def test_client_handshake_on_random_bytes(raw, secret):
    a, b = socket.socketpair()
    with a, b:
        b.sendall(raw)
        b.shutdown(socket.SHUT_WR)
        start = time.monotonic()
        with pytest.raises(HandshakeError):  # the client turns every early end into a HandshakeError
            client_handshake(a, secret, "p", 1, start + 2.0)
        assert time.monotonic() - start < NO_WAIT_S


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_hellos(), st.lists(st.integers(1, 80), min_size=1, max_size=20), st.sampled_from([SECRET, None]))
def test_server_handshake_state_machine_on_random_chunks(raw, cuts, secret):
    """The state machine the gate drives, fed arbitrary bytes in arbitrary pieces: it only ever
    asks for what the current step lacks, answers the hello with 48 bytes, fails only with
    HandshakeError, and never counts anyone as proven without a MAC over its fresh nonce."""
    state, pos, i = ServerHandshake(secret, "p"), 0, 0
    try:
        while pos < len(raw):
            n = min(cuts[i % len(cuts)], state.wanted(), len(raw) - pos)
            assert n > 0
            reply, pos, i = state.feed(raw[pos:pos + n]), pos + n, i + 1
            assert reply == b"" or len(reply) == 48
    except HandshakeError:
        pass
    else:
        assert len(raw) < HELLO.size + 32, "a whole hello and MAC went through without failing"
    assert not state.proved


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=10))
def test_server_handshake_state_machine_with_a_genuine_client_in_pieces(cuts):
    """However the genuine client's bytes are split on the way, the state machine proves it."""
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=client_handshake, args=(a, SECRET, "p", 42, dl()), daemon=True)
        t.start()
        state, i = ServerHandshake(SECRET, "p"), 0
        b.settimeout(CALL_DEADLINE_S)
        while not state.proved:
            reply = state.feed(b.recv(min(cuts[i % len(cuts)], state.wanted())))
            i += 1
            if reply:
                b.sendall(reply)
        b.sendall(ACCEPT)
        t.join(CALL_DEADLINE_S)
        assert not t.is_alive() and state.client_id == 42
