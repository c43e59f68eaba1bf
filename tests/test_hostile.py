"""Hostile network input against real jobs, and a fuzz of the TCP transport's frame reader.

While 4 real ranks start and compute, an attacker process hits rank 0's rendezvous port and every
rank's mesh listener with garbage, truncated and oversized headers, wrong-secret and replayed
handshakes, valid hellos that then go silent, many silent connections, connect-and-close and a
slowloris. The job must still form promptly (not one handshake timeout per hostile connection),
compute exact results, keep its threads and memory bounded, and close every hostile connection
itself, while it is still running.

How the attacker learns the ports: the ranks run with init=False, so each rank wraps
shmcoll.bootstrap.open_listener (and rank 0 the StoreServer class) before calling shmcoll.init. The
wrappers report the freshly opened port to the attacker over a pipe and then wait (bounded) until
the attacker says its connections are in place. So every hostile connection on a mesh listener
arrives before any rank's legitimate one (the worst case for a listener that vets connections one
at a time), and the rendezvous runs under attack from its start. Scanning for the ports would race
with the job. The wrappers only observe and delay; the transports are the real ones.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing.connection as mpc
import os
import selectors
import socket
import struct
import threading
import time
import traceback
import tracemalloc
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmcoll
from shmcoll.net.gate import Gate
from shmcoll.net.handshake import HandshakeDropped, client_handshake, server_handshake
from shmcoll.net.mesh import _purpose as mesh_purpose
from shmcoll.net.mesh import connect_mesh, open_listener
from shmcoll.transport import frame, tcp
from shmcoll.transport.mailbox import Mailbox
from shmcoll.transport.tcp import NetTransport
from shmcoll.types import WIRE_TYPES

from bounds import (
    DROP_LATE_S,
    FAULT_NOTICE_S,
    FORM_UNDER_ATTACK_S,
    HOSTILE_CLOSE_S,
    NO_WAIT_S,
    REAP_S,
    RUN_HANG_S,
    SHED_S,
    THROUGH_FLOOD_S,
    WAIT_HANG_S,
)
from harness import CTX, run_ranks, wait_until

N = 4
SECRET = "hostile-test-secret"
SILENT = 50  # silent connections per attacked port
CONNECT_CLOSE = 10  # connect-and-close per attacked port
THREAD_BOUND = 24  # threads in any rank at any time (a thread per hostile connection would be 60+)
RSS_BOUND = 50 << 20  # growth of a rank's anonymous memory during start-up and the collectives
HELLO = (b"SHMH", 1)  # the handshake hello's magic and version (see test_rendezvous.HELLO)


# ---------------------------------------------------------------- wiring between test, ranks and attacker

class Control:
    """Pipes and events made before any fork, shared by the ranks and the attacker process."""

    def __init__(self, n: int):
        pipes = [CTX.Pipe(duplex=False) for _ in range(n)]
        self.report_rx = [rx for rx, _ in pipes]  # rank r -> attacker: ("store" | "mesh", r, port)
        self.report_tx = [tx for _, tx in pipes]
        self.store_go = CTX.Event()  # attacker -> rank 0: the rendezvous port is under attack
        self.mesh_go = [CTX.Event() for _ in range(n)]  # attacker -> rank r: its mesh listener is
        self.checked = CTX.Event()  # attacker -> ranks: every hostile socket is settled; you may exit
        self.verdict_rx, self.verdict_tx = CTX.Pipe(duplex=False)  # attacker -> test: what it saw


def _report_and_wait(ctl: Control, rank: int, what: str, port: int, go, waited: list) -> None:
    """Tell the attacker where this rank listens, and hold until it is connected there."""
    ctl.report_tx[rank].send((what, rank, port))
    if not go.wait(WAIT_HANG_S):  # for the attacker to get in place
        raise AssertionError(f"the attacker never got in place on rank {rank}'s {what} port")
    waited.append(time.monotonic())


def _hook_ports(rank: int, ctl: Control, waited: list) -> None:
    """Wrap what init() opens so the attacker hears of each port before anyone else uses it."""
    import shmcoll.bootstrap as bootstrap

    real_listener, real_store = bootstrap.open_listener, bootstrap.StoreServer

    def open_listener(addr):
        sock = real_listener(addr)
        _report_and_wait(ctl, rank, "mesh", sock.getsockname()[1], ctl.mesh_go[rank], waited)
        return sock

    class StoreServer(real_store):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _report_and_wait(ctl, rank, "store", self.port, ctl.store_go, waited)

    bootstrap.open_listener = open_listener
    if rank == 0:
        bootstrap.StoreServer = StoreServer


class Sampler:
    """Samples this process's thread count and anonymous memory every few milliseconds."""

    def __init__(self):
        self.rss0 = _rss_anon()
        self.max_threads, self.max_rss = 0, self.rss0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-sampler", daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            self.max_threads = max(self.max_threads, threading.active_count())
            self.max_rss = max(self.max_rss, _rss_anon())
            if self._stop.wait(0.01):
                return

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(WAIT_HANG_S)
        return {"max_threads": self.max_threads, "rss_growth": self.max_rss - self.rss0}


def _rss_anon() -> int:
    """Private anonymous memory (what a flood would grow; shared memory segments do not count)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _rank_body(rank: int, n: int, port: int, ctl: Control, group_timeout: float) -> dict:
    """One rank: start the job under attack, compute, and stay up until the attacker has checked
    that the job closed every hostile connection (so closing is the job's doing, not our exit)."""
    sampler = Sampler()
    waited = [time.monotonic()]
    _hook_ports(rank, ctl, waited)
    with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port,
                      timeout=group_timeout) as pg:
        formed = time.monotonic()
        out = _compute(pg)
        checked = ctl.checked.wait(HOSTILE_CLOSE_S + WAIT_HANG_S)
    return {**out, **sampler.stop(), "formed": formed, "last_go": waited[-1], "checked": checked}


def _compute(pg) -> dict:
    """A few collectives whose exact results the test knows."""
    r, n = pg.rank, pg.world_size
    x = np.arange(1000, dtype=np.float64) * (r + 1)
    pg.all_reduce(x)
    b = np.full(257, r, dtype=np.int64)
    pg.broadcast(n - 1, b)
    g = pg.all_gather(np.array([10 * r, 10 * r + 1], dtype=np.int32))
    return {"all_reduce": x, "broadcast": b, "all_gather": g}


# ---------------------------------------------------------------- the attacker

def _hello(purpose: str, claim: int) -> bytes:
    """A well-formed hello for `purpose`, claiming to be client `claim` (nothing in it is secret)."""
    return struct.pack("<4sB32sI16s", *HELLO, hashlib.sha256(purpose.encode()).digest(), claim, os.urandom(16))


class _Recorder:
    """A socket stand-in for client_handshake that keeps every byte the client sends."""

    def __init__(self, sock):
        self.sock, self.sent = sock, bytearray()

    def settimeout(self, t):
        self.sock.settimeout(t)

    def sendall(self, data):
        self.sent += data
        self.sock.sendall(data)

    def recv_into(self, view, n):
        return self.sock.recv_into(view, n)


def _captured_transcript(purpose: str, claim: int) -> bytes:
    """What a genuine client with the secret sent in one past handshake, as an eavesdropper saw it."""
    a, b = socket.socketpair()
    with a, b:
        deadline = time.monotonic() + WAIT_HANG_S
        server = threading.Thread(target=server_handshake, args=(b, SECRET.encode(), purpose, deadline), daemon=True)
        server.start()
        rec = _Recorder(a)
        client_handshake(rec, SECRET.encode(), purpose, claim, time.monotonic() + WAIT_HANG_S)
        server.join(WAIT_HANG_S)
    return bytes(rec.sent)


def _frame_header(nbytes: int) -> bytes:
    """A transport frame header announcing an `nbytes` payload of uint8 (as if past the handshake)."""
    return frame.pack(frame.DATA, 1, 0, frame.Meta(), 8, (nbytes,), nbytes)


def _payloads(purpose: str, claim: int) -> dict[str, bytes]:
    """What each one-shot hostile connection sends before going quiet (the job must drop it)."""
    hello = _hello(purpose, claim)
    return {
        "garbage": os.urandom(4096),
        "truncated-hello": hello[:20],
        "truncated-frame-header": _frame_header(64)[:50],
        "frame-claiming-2**62": _frame_header(2**62) + os.urandom(64),
        "length-prefix-2**32-1": b"\xff\xff\xff\xff" + os.urandom(100),
        "http-request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "wrong-secret": hello + os.urandom(32),  # a MAC made up without the secret
        "replayed-handshake": _captured_transcript(purpose, claim),
        "valid-hello-then-silent": hello,
    }


class Watch:
    """Every hostile socket the attacker holds open, and when the job closed each (EOF or reset)."""

    def __init__(self):
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self.opened: dict[socket.socket, tuple[str, float]] = {}
        self.closed_after: dict[str, list[float]] = {}
        self.unclosed: list[str] = []

    def add(self, name: str, sock: socket.socket) -> None:
        sock.setblocking(False)
        with self._lock:
            self.opened[sock] = (name, time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ)

    def settle(self) -> None:
        """Read every socket until EOF or reset; one still open HOSTILE_CLOSE_S after its start is a failure."""
        while self.opened:
            now = time.monotonic()
            for sock, (_, t0) in list(self.opened.items()):
                if now - t0 > HOSTILE_CLOSE_S:
                    self._done(sock, None)
            for key, _ in self._sel.select(0.05):
                try:
                    if key.fileobj.recv(65536):
                        continue  # the handshake's reply, say: not the end yet
                except BlockingIOError:
                    continue
                except OSError:
                    pass  # reset by the job: closed
                self._done(key.fileobj, time.monotonic())

    def _done(self, sock: socket.socket, when: float | None) -> None:
        name, t0 = self.opened.pop(sock)
        self._sel.unregister(sock)
        sock.close()
        if when is None:
            self.unclosed.append(name)
        else:
            self.closed_after.setdefault(name.split("@")[0], []).append(when - t0)


class Dribbler:
    """Slowloris: sends a valid hello one byte every 100 ms on each of its sockets."""

    def __init__(self):
        self._socks: list[tuple[socket.socket, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, data: bytes) -> None:
        with self._lock:
            self._socks.append((sock, data))

    def _run(self):
        sent = 0
        while not self._stop.wait(0.1):
            with self._lock:
                socks = list(self._socks)
            for sock, data in socks:
                if sent < len(data):
                    try:
                        sock.send(data[sent:sent + 1])
                    except OSError:
                        pass  # dropped (or closed by the watch): nothing more to send
            sent += 1

    def stop(self):
        self._stop.set()
        self._thread.join(WAIT_HANG_S)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_HANG_S)


def _probe_with_secret(sock: socket.socket, rank, purpose: str, claim: int, out: list) -> None:
    """A client that knows the secret. Claiming a rank the mesh listener does not expect it must
    never be accepted (the gate refuses it before the acceptance byte, or the listener closes
    first). On the store, any id is welcome: that it gets in shows the attacker's purposes are right."""
    try:
        client_handshake(sock, SECRET.encode(), purpose, claim, time.monotonic() + WAIT_HANG_S)
        out.append((rank, "accepted"))
    except Exception as exc:  # reported to the test
        out.append((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        sock.close()


def _attack(port: int, what: str, rank: int, n: int, job_id: str, watch: Watch, dribbler: Dribbler,
            probes: list) -> threading.Thread | None:
    """Open every kind of hostile connection to one port; each stays with the watch. Returns the
    thread probing a mesh listener with the secret but an unexpected rank."""
    purpose = f"{job_id}/store" if what == "store" else mesh_purpose(job_id, rank)  # as bootstrap, mesh build them
    claim = 1 if what == "store" else min(rank + 1, n - 1)  # a client the port does expect
    for name, data in _payloads(purpose, claim).items():
        sock = _connect(port)
        sock.sendall(data)
        watch.add(f"{name}@{what}{rank}", sock)
    for _ in range(CONNECT_CLOSE):
        _connect(port).close()
    slow = _connect(port)
    dribbler.add(slow, _hello(purpose, claim))
    watch.add(f"slowloris@{what}{rank}", slow)
    for _ in range(SILENT):
        watch.add(f"silent@{what}{rank}", _connect(port))
    if what == "store":  # the store's gate runs already: probe now
        _probe_with_secret(_connect(port), "store", purpose, 10_000, probes)
        return None
    probe = threading.Thread(target=_probe_with_secret, args=(_connect(port), rank, purpose, 10_000, probes),
                             daemon=True)
    probe.start()  # connected before the rank goes on; vetted only once it does
    return probe


def _attacker(ctl: Control, n: int, expected: set, job_id: str) -> None:
    """The attacker process: attack each port as it is reported, release that rank, then watch
    every hostile socket until the job closes it; the findings go to the test."""
    try:
        verdict = _run_attacks(ctl, n, expected, job_id)
    except BaseException:  # handed to the test
        verdict = {"error": traceback.format_exc()}
    ctl.verdict_tx.send(verdict)
    ctl.checked.set()


def _run_attacks(ctl: Control, n: int, expected: set, job_id: str) -> dict:
    watch, dribbler, probes, probe_threads = Watch(), Dribbler(), [], []
    waiting, deadline = set(expected), time.monotonic() + WAIT_HANG_S
    open_rx = list(ctl.report_rx)
    while waiting:
        if time.monotonic() > deadline:
            raise AssertionError(f"ports never reported: {sorted(waiting)}")
        for rx in mpc.wait(open_rx, timeout=0.5):
            try:
                what, rank, port = rx.recv()
            except EOFError:
                open_rx.remove(rx)
                continue
            probe_threads.append(_attack(port, what, rank, n, job_id, watch, dribbler, probes))
            (ctl.store_go if what == "store" else ctl.mesh_go[rank]).set()
            waiting.discard((what, rank))
    watch.settle()
    dribbler.stop()
    for t in filter(None, probe_threads):
        t.join(WAIT_HANG_S)
    store_probe = [o for r, o in probes if r == "store"]
    return {"unclosed": watch.unclosed, "closed_after": watch.closed_after, "store_probe": store_probe[0],
            "probes": [(r, o) for r, o in probes if r != "store"]}


# ---------------------------------------------------------------- the test

def _expected_ports(transport: str) -> set:
    """Which ports the ranks report: the store always; a mesh listener per rank unless all is shm."""
    return {("store", 0)} | ({("mesh", r) for r in range(N)} if transport != "shm" else set())


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["tcp", "hier", "shm"])
def test_job_survives_hostile_connections(transport):
    """The job forms promptly and computes exactly; threads and memory stay bounded; the job itself
    closes every hostile connection. (shm: only the rendezvous port exists to attack.)"""
    job_id = f"jhostile{uuid.uuid4().hex[:10]}"
    env = {"SHMCOLL_SECRET": SECRET, "SHMCOLL_JOB_ID": job_id, "SHMCOLL_TRANSPORT": transport}
    if transport == "hier":
        env["SHMCOLL_TEST_HOSTS"] = "halves"
    ctl = Control(N)
    attacker = CTX.Process(target=_attacker, args=(ctl, N, _expected_ports(transport), job_id), daemon=True)
    attacker.start()
    try:
        results = run_ranks(N, _rank_body, ctl, WAIT_HANG_S, init=False, env=env)
    finally:
        got_verdict = ctl.verdict_rx.poll(HOSTILE_CLOSE_S + WAIT_HANG_S)
        verdict = ctl.verdict_rx.recv() if got_verdict else {"error": "no verdict"}
        attacker.join(REAP_S)
        if attacker.is_alive():
            attacker.kill()
    assert "error" not in verdict, verdict.get("error")
    formed_s = max(r["formed"] for r in results) - max(r["last_go"] for r in results)
    print(f"\n{transport}: formed {formed_s:.2f} s after the attack; "
          f"threads <= {[r['max_threads'] for r in results]}; "
          f"RSS growth MiB {[round(r['rss_growth'] / 2**20, 1) for r in results]}; "
          f"closed within s {({k: round(max(v), 2) for k, v in verdict['closed_after'].items()})}")
    assert formed_s < FORM_UNDER_ATTACK_S
    _assert_exact(results)
    for rank, r in enumerate(results):
        assert r["checked"], f"rank {rank} never heard that the attacker had settled"
        assert r["max_threads"] <= THREAD_BOUND, (rank, r["max_threads"])
        assert r["rss_growth"] < RSS_BOUND, (rank, r["rss_growth"])
    assert verdict["unclosed"] == [], f"hostile connections the job left open: {verdict['unclosed']}"
    mesh_ports = len(_expected_ports(transport)) - 1
    per_port = len(_payloads("p", 1)) + 1 + SILENT  # the one-shot kinds, the slowloris, the silent ones
    assert sum(len(v) for v in verdict["closed_after"].values()) == (mesh_ports + 1) * per_port
    assert verdict["store_probe"] == "accepted"  # the store's purpose as the attacker built it is right
    mesh_probes = dict(verdict["probes"])
    assert sorted(mesh_probes) == [r for r in range(N) if ("mesh", r) in _expected_ports(transport)]
    for rank, outcome in mesh_probes.items():
        assert outcome.startswith("HandshakeDropped"), (rank, outcome)  # never "accepted"


def _assert_exact(results: list) -> None:
    total = N * (N + 1) // 2
    for r in results:
        np.testing.assert_array_equal(r["all_reduce"], np.arange(1000, dtype=np.float64) * total)
        np.testing.assert_array_equal(r["broadcast"], np.full(257, N - 1, dtype=np.int64))
        np.testing.assert_array_equal(r["all_gather"],
                                      np.array([v for k in range(N) for v in (10 * k, 10 * k + 1)], dtype=np.int32))


# ---------------------------------------------------------------- the mesh and the gate in one process

def _wait_closed(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the other side closed `sock` (EOF or reset), or None if it stayed open."""
    start = time.monotonic()
    end = start + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                return time.monotonic() - start
        except TimeoutError:
            return None
        except OSError:
            return time.monotonic() - start
    return None


def _mesh_threads(n: int, before_start) -> tuple[dict, float]:
    """connect_mesh on n threads (one per rank) after before_start(addrs) ran; returns each rank's
    sockets (or exception) and how long the mesh took to form."""
    listeners = [open_listener("127.0.0.1") for _ in range(n)]
    addrs = {r: ("127.0.0.1", lst.getsockname()[1]) for r, lst in enumerate(listeners)}
    before_start(addrs)
    out = {}

    def rank(r):
        try:
            out[r] = connect_mesh(r, n, listeners[r], addrs, SECRET.encode(), "jmesh", time.monotonic() + WAIT_HANG_S)
        except Exception as exc:  # inspected by the test
            out[r] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_HANG_S)
        assert not t.is_alive(), "connect_mesh hung"
    return out, time.monotonic() - start


def test_mesh_forms_at_once_behind_a_flood():
    """Hundreds of silent, half-sent and replayed connections queued on every listener before any
    rank connects: the mesh still forms at once (one at a time with a 5 s handshake timeout each,
    this took 10 s per silent connection), and every hostile one is closed when it is done."""
    hostile = []

    def flood(addrs):
        for r, addr in addrs.items():
            purpose = f"jmesh/mesh/{r}"
            for i in range(150):
                sock = socket.create_connection(addr, timeout=WAIT_HANG_S)
                if i % 3 == 1:
                    sock.sendall(_hello(purpose, (r + 1) % 3))  # a valid hello, then silence
                elif i % 3 == 2:
                    sock.sendall(_captured_transcript(purpose, (r + 1) % 3))  # replayed
                hostile.append(sock)

    gates_before = {t for t in threading.enumerate() if "mesh-gate" in t.name}
    out, took = _mesh_threads(3, flood)
    try:
        assert all(isinstance(v, dict) and sorted(v) == sorted({0, 1, 2} - {r}) for r, v in out.items()), out
        assert took < THROUGH_FLOOD_S, took
        closed = [_wait_closed(s, NO_WAIT_S) for s in hostile]  # the gates are closed already
        assert None not in closed, f"{closed.count(None)} hostile connections left open"
        assert {t for t in threading.enumerate() if "mesh-gate" in t.name} <= gates_before
    finally:
        for v in out.values():
            for s in (v.values() if isinstance(v, dict) else ()):
                s.close()
        for s in hostile:
            s.close()


def _delivered(rig, cid: int = 1) -> None:
    """The gate hands a client over just after sending it the acceptance byte: wait for that."""
    wait_until(lambda: cid in rig.delivered, NO_WAIT_S, f"the gate to deliver client {cid}")


class _GateRig:
    """A Gate on a fresh loopback listener that records what it delivers."""

    def __init__(self, expected=frozenset({1}), **kwargs):
        listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
        self.addr = listener.getsockname()
        self.delivered: dict[int, socket.socket] = {}
        self.gate = Gate(listener, SECRET.encode(), "jgate", lambda cid: cid in expected and cid not in self.delivered,
                         self.delivered.__setitem__, name="shmcoll-test-gate", **kwargs)

    def connect(self) -> socket.socket:
        return socket.create_connection(self.addr, timeout=WAIT_HANG_S)

    def genuine(self, cid: int = 1) -> socket.socket:
        sock = self.connect()
        client_handshake(sock, SECRET.encode(), "jgate", cid, time.monotonic() + WAIT_HANG_S)
        return sock

    def close(self):
        self.gate.close()
        for s in self.delivered.values():
            s.close()


def test_gate_holds_at_most_max_pending_and_sheds_the_oldest():
    rig = _GateRig(max_pending=16, budget=30.0)
    socks = []
    try:
        socks = [rig.connect() for _ in range(40)]
        early = [_wait_closed(s, SHED_S) for s in socks[:24]]
        assert None not in early, "the oldest unproven connections must go first"
        late = selectors.DefaultSelector()
        for s in socks[24:]:
            late.register(s, selectors.EVENT_READ)
        assert late.select(0.3) == [], "the 16 newest are held (within budget)"
        late.close()
        good = rig.genuine()  # one more: the oldest of the 16 goes, the genuine client is served
        _delivered(rig)
        good.close()
        assert _wait_closed(socks[24], SHED_S) is not None
        rig.gate.close()
        assert None not in [_wait_closed(s, SHED_S) for s in socks[25:]], "close() drops every unproven one"
    finally:
        rig.close()
        for s in socks:
            s.close()


def test_gate_drops_silent_and_slow_connections_after_the_budget():
    budget = 0.5
    rig = _GateRig(budget=budget)
    try:
        silent, slow = rig.connect(), rig.connect()
        hello = _hello("jgate", 1)
        slow.settimeout(1.0)
        start, closed_at = time.monotonic(), None
        for i in range(len(hello)):  # slowloris: a byte every 100 ms keeps it busy, not alive
            try:
                slow.send(hello[i:i + 1])
            except OSError:
                closed_at = time.monotonic() - start
                break
            if _wait_closed(slow, 0.1) is not None:
                closed_at = time.monotonic() - start
                break
        assert closed_at is not None and budget - 0.1 <= closed_at < budget + DROP_LATE_S, closed_at
        assert _wait_closed(silent, budget + DROP_LATE_S) is not None
        rig.genuine().close()  # and the gate still serves
        _delivered(rig)
    finally:
        rig.close()


def test_gate_serves_a_genuine_client_while_full_of_valid_hellos():
    """Unproven connections in the most advanced state (a valid, public hello) fill the gate: a
    genuine client still gets in, because the oldest goes, not the newest."""
    rig = _GateRig(max_pending=32, budget=30.0)
    squatters = []
    try:
        for _ in range(32):
            squatters.append(rig.connect())
            squatters[-1].sendall(_hello("jgate", 1))
        start = time.monotonic()
        rig.genuine().close()
        assert time.monotonic() - start < NO_WAIT_S
        _delivered(rig)
        assert _wait_closed(squatters[0], SHED_S) is not None
    finally:
        rig.close()
        for s in squatters:
            s.close()


def test_gate_refuses_a_proven_client_it_does_not_want_before_accepting_it():
    """Knowing the secret is not enough: an id the listener does not expect (or has already) is
    dropped before the acceptance byte, so that client never believes it is in."""
    rig = _GateRig()
    try:
        with pytest.raises(HandshakeDropped, match="refused the handshake of client 7"):
            rig.genuine(7)
        rig.genuine(1).close()
        _delivered(rig)
        with pytest.raises(HandshakeDropped):
            rig.genuine(1)  # a second rank 1
        assert list(rig.delivered) == [1]
    finally:
        rig.close()


def test_gate_survives_a_failing_receiver():
    calls = []

    def deliver(cid, sock):
        calls.append(cid)
        if len(calls) == 1:
            raise RuntimeError("receiver failed")
        sock.close()

    listener = socket.create_server(("127.0.0.1", 0))
    gate = Gate(listener, SECRET.encode(), "jgate", lambda cid: True, deliver, name="shmcoll-test-gate")
    try:
        for cid in (1, 2):
            sock = socket.create_connection(listener.getsockname(), timeout=WAIT_HANG_S)
            client_handshake(sock, SECRET.encode(), "jgate", cid, time.monotonic() + WAIT_HANG_S)
            assert _wait_closed(sock, SHED_S) is not None  # closed by the gate, or by the receiver
            sock.close()
        assert calls == [1, 2]
    finally:
        gate.close()


def _gate_with_few_descriptors(tx, stop) -> None:
    """Child process: a Gate allowed only 64 open files; reports its port and each client it delivers."""
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    gate = Gate(listener, SECRET.encode(), "jgate", lambda cid: True, lambda cid, sock: tx.send(cid),
                name="shmcoll-test-gate", budget=30.0)
    tx.send(listener.getsockname()[1])
    stop.wait(WAIT_HANG_S)
    gate.close()


@pytest.mark.multiprocess
def test_gate_out_of_descriptors_sheds_and_still_serves():
    """When accept() fails for want of descriptors (EMFILE), the gate drops its oldest unproven
    connection to make room instead of spinning or dying: a genuine client still gets in."""
    rx, tx = CTX.Pipe(duplex=False)
    stop = CTX.Event()
    child = CTX.Process(target=_gate_with_few_descriptors, args=(tx, stop), daemon=True)
    child.start()
    flood = []
    try:
        assert rx.poll(WAIT_HANG_S)
        port = rx.recv()
        flood = [_connect(port) for _ in range(150)]  # far more than the 64 descriptors
        assert None not in [_wait_closed(s, SHED_S) for s in flood[:80]], "the oldest must make room"
        start = time.monotonic()
        with _connect(port) as good:
            client_handshake(good, SECRET.encode(), "jgate", 5, time.monotonic() + WAIT_HANG_S)
        assert rx.poll(THROUGH_FLOOD_S) and rx.recv() == 5
        assert time.monotonic() - start < THROUGH_FLOOD_S
        assert child.is_alive()
    finally:
        stop.set()
        child.join(REAP_S)
        if child.is_alive():
            child.kill()
        for s in flood:
            s.close()


# ---------------------------------------------------------------- fuzz: a NetTransport reader on hostile streams

LIMIT = 64 << 10  # the max_payload of the transport under test
HUGE = [LIMIT + 1, 16 << 20, 2**40, 2**62, 2**64 - 1]  # announced payloads it must refuse
U8 = next(code for code, wire in WIRE_TYPES.items() if wire.itemsize == 1)


@st.composite
def _frames(draw) -> bytes:
    """One frame from rank 1: mostly valid (data, heartbeat, abort, goodbye), or one announcing a
    payload past the limit, or one claiming to come from another rank."""
    kind = draw(st.sampled_from(["data"] * 6 + ["heartbeat", "abort", "goodbye", "huge", "wrong-src"]))
    meta = frame.Meta(seq=draw(st.integers(0, 2**64 - 1)), coll=draw(st.integers(0, 5)))
    tag = draw(st.integers(0, 3))
    if kind == "data":
        code = draw(st.sampled_from(sorted(WIRE_TYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        nbytes = math.prod(shape) * WIRE_TYPES[code].itemsize
        payload = draw(st.binary(min_size=nbytes, max_size=nbytes))
        return frame.pack(frame.DATA, 1, tag, meta, code, shape, nbytes) + payload
    if kind in ("heartbeat", "goodbye"):
        return frame.pack(frame.HEARTBEAT if kind == "heartbeat" else frame.GOODBYE, 1, 0, frame.Meta(), 0, (), 0)
    if kind == "abort":
        text = draw(st.text(max_size=80)).encode()
        return frame.pack(frame.ABORT, 1, 0, frame.Meta(), 0, (), len(text)) + text
    if kind == "huge":
        n = draw(st.sampled_from(HUGE))
        return frame.pack(frame.DATA, 1, tag, meta, U8, (n,), n) + draw(st.binary(max_size=64))
    return frame.pack(frame.DATA, 0, tag, meta, U8, (1,), 1) + b"x"


@st.composite
def _streams(draw) -> bytes:
    """Random garbage, or a few frames, with at most one mutation (a flipped byte, a cut, an insertion)."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=600))
    raw = bytearray(b"".join(draw(st.lists(_frames(), max_size=6))))
    mutation = draw(st.sampled_from(["none", "none", "flip", "truncate", "insert"]))
    if raw and mutation != "none":
        at = draw(st.integers(0, len(raw) - 1))
        if mutation == "flip":
            raw[at] ^= draw(st.integers(1, 255))
        elif mutation == "truncate":
            del raw[at:]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=40))
    return bytes(raw)


def _expected(stream: bytes) -> tuple[list, bool, str]:
    """What the reader must make of a stream: the data frames delivered (queue tag, payload) in order,
    whether an abort arrived, and how it ends: "protocol" (a bad header), "goodbye", or "closed"
    (the stream ran out, perhaps mid-frame)."""
    pos, delivered, aborted = 0, [], False
    while len(stream) - pos >= frame.HEADER_SIZE:
        try:
            h = frame.unpack(stream[pos:pos + frame.HEADER_SIZE], 1, LIMIT)
        except frame.FrameError:
            return delivered, aborted, "protocol"
        pos += frame.HEADER_SIZE
        if len(stream) - pos < h.nbytes:
            break
        payload, pos = stream[pos:pos + h.nbytes], pos + h.nbytes
        if h.kind == frame.DATA:  # queued under its tag plus any sub-group context (frame.queue_tag)
            delivered.append((frame.queue_tag(h), payload))
        elif h.kind == frame.ABORT:
            aborted = True
        elif h.kind == frame.GOODBYE:
            return delivered, aborted, "goodbye"
    return delivered, aborted, "closed"


def _shmcoll_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("shmcoll-")}


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected TCP sockets over loopback (NetTransport sets TCP options a Unix socket lacks)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=WAIT_HANG_S)
        listener.settimeout(WAIT_HANG_S)
        b, _ = listener.accept()
    return a, b


def _feed(stream: bytes) -> tuple[Mailbox, int]:
    """Run a real NetTransport whose peer (rank 1) sends `stream` then closes; returns its mailbox
    once the reader has given up on the peer, and the peak of traced allocations meanwhile."""
    a, b = _tcp_pair()
    mailbox = Mailbox(0, 2)
    tracemalloc.start()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, max_payload=LIMIT,
                             mailbox=mailbox)
    try:
        b.settimeout(WAIT_HANG_S)
        b.sendall(stream)  # a few KiB: fits the socket buffers, never waits on the reader
        b.shutdown(socket.SHUT_WR)
        wait_until(lambda: 1 in mailbox.unreachable(), FAULT_NOTICE_S, "the reader to finish with the stream",
                   interval=0.001)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        transport.close()
        b.close()
    return mailbox, peak


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_streams())
def test_net_transport_reader_on_hostile_streams(stream):
    """Whatever arrives, the reader delivers the valid frames, ends the peer with "protocol error"
    at the first bad header (else as closed or gone), never lets an exception escape, never
    allocates what a header merely announces, and the transport closes without leftover threads."""
    escaped, hook = [], threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    before = _shmcoll_threads()
    try:
        mailbox, peak = _feed(stream)
    finally:
        threading.excepthook = hook
    delivered, aborted, end = _expected(stream)
    assert escaped == []
    assert peak < 8 << 20, f"{peak} bytes allocated while reading {len(stream)}"
    lost = mailbox.lost_peers().get(1)
    if end == "goodbye":
        assert lost is None
    else:
        assert lost is not None and ("protocol error" in lost) == (end == "protocol"), lost
    assert (mailbox.aborted is not None) == aborted
    for tag, payload in delivered:
        msg = mailbox.pop(1, tag)
        assert msg is not None and msg.payload.tobytes() == payload
    assert all(mailbox.pop(1, tag) is None for tag in range(4))
    assert _shmcoll_threads() <= before


@pytest.mark.parametrize("announced", HUGE)
def test_net_transport_refuses_a_header_announcing_too_much(announced):
    """The plain case of the property: one header claiming a huge payload, nothing allocated."""
    header = frame.pack(frame.DATA, 1, 0, frame.Meta(), U8, (announced,), announced)
    mailbox, peak = _feed(header + os.urandom(1000))
    assert "protocol error" in mailbox.lost_peers()[1]
    assert "exceeds the limit" in mailbox.lost_peers()[1]
    assert peak < 8 << 20


def test_a_frame_too_large_to_allocate_drops_the_peer_as_a_protocol_error():
    """A peer that knows the secret but announces a payload this process cannot hold (under the
    frame limit) is dropped with a protocol error, not a crash of the reader thread."""
    import socket

    from shmcoll.transport import frame
    from shmcoll.transport.frame import Meta
    from shmcoll.transport.tcp import NetTransport

    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    mine, _ = server.accept()
    server.close()
    t = NetTransport(0, 2, {1: mine})
    try:
        peer.sendall(frame.pack(frame.DATA, 1, 5, Meta(), 3, (1 << 38,), frame.MAX_PAYLOAD))
        wait_until(lambda: 1 in t._mailbox.lost_peers(), FAULT_NOTICE_S, "the reader thread to drop the peer")
        reason = t._mailbox.lost_peers().get(1, "")
        assert "protocol error" in reason and "more than this process can allocate" in reason, reason
    finally:
        t.close()
        peer.close()


# ---- a waiting caller reads its peer's socket itself (NetTransport spin_s) ----

def _data_frame(tag: int, payload: bytes) -> bytes:
    return frame.pack(frame.DATA, 1, tag, frame.Meta(), 8, (len(payload),), len(payload)) + payload


def test_a_waiting_caller_reads_whole_frames_and_leaves_partial_ones_to_the_reader():
    """With spin_s, recv reads frames already whole in the socket on the caller's thread; a frame
    still arriving is left to the reader thread (a caller must never block mid-frame past its
    deadline), and either way every frame arrives once, whole, in order."""
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=WAIT_HANG_S)
    try:
        b.sendall(_data_frame(5, b"first") + _data_frame(5, b"second"))
        got = [transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes() for _ in range(2)]
        assert got == [b"first", b"second"]

        late = _data_frame(6, bytes(range(200)))
        b.sendall(late[:frame.HEADER_SIZE + 50])  # the header and part of the payload
        received: list[bytes] = []
        waiter = threading.Thread(target=lambda: received.append(
            transport.recv(1, 6, time.monotonic() + WAIT_HANG_S).payload.tobytes()))
        waiter.start()
        b.sendall(late[frame.HEADER_SIZE + 50:])
        waiter.join(WAIT_HANG_S)
        assert received == [bytes(range(200))]
    finally:
        transport.close()
        b.close()


def _send_once_the_caller_reads(inbox, sock: socket.socket, data: bytes) -> threading.Thread:
    """Send `data` from a thread once a caller holds `inbox` (polling it, the reader thread kept
    out), so that the caller, not the reader thread, is the one that reads it."""
    def send():
        wait_until(inbox.lock.locked, FAULT_NOTICE_S, "the caller to hold the socket", interval=0.001)
        sock.sendall(data)
    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_a_caller_past_its_spin_sleeps_on_the_socket_and_reads_the_frame_itself(monkeypatch):
    """With no spin at all (ranks outnumber cores), a waiting caller still reads its peer's socket
    itself: asleep in poll on it, the reader thread kept out, so a frame that comes meanwhile
    reaches the caller with one wake-up and no hand-off between threads."""
    monkeypatch.setattr(tcp, "CALLER_SLEEP_SECONDS", WAIT_HANG_S)
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=0.0)
    inbox = transport._inboxes[1]
    read_by_reader_thread: list[int] = []
    take_frame = transport._take_frame
    monkeypatch.setattr(transport, "_take_frame",
                        lambda peer, box: (read_by_reader_thread.append(peer), take_frame(peer, box)))
    try:
        sender = _send_once_the_caller_reads(inbox, b, _data_frame(5, b"late"))
        t0 = time.monotonic()
        got = transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes()
        sender.join(WAIT_HANG_S)
        assert got == b"late" and read_by_reader_thread == []
        assert time.monotonic() - t0 < FAULT_NOTICE_S
    finally:
        transport.close()
        b.close()


def test_a_message_the_reader_thread_queued_comes_before_a_later_one_still_in_the_socket():
    """A caller takes what the reader thread already queued for it before it reads its peer's
    socket itself: messages of one (source, tag) arrive in the order they were sent."""
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=WAIT_HANG_S)
    inbox = transport._inboxes[1]
    try:
        b.sendall(_data_frame(5, b"first"))
        wait_until(lambda: transport._mailbox.has(1, 5), FAULT_NOTICE_S, "the reader thread to queue it")
        inbox.mute_reader(True)  # the next frame stays in the socket for the caller
        b.sendall(_data_frame(5, b"second"))
        wait_until(lambda: inbox._bytes_waiting() > 0, FAULT_NOTICE_S, "the second frame to arrive")
        got = [transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes() for _ in range(2)]
        assert got == [b"first", b"second"]
    finally:
        transport.close()
        b.close()


def test_a_caller_drops_a_retired_frame_it_reads_and_waits_on_for_its_message():
    """A collective frame older than the mailbox's retired sequence number (a round already over)
    is dropped by the caller that reads it, as the reader thread drops it; the caller's message is
    the next one."""
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=WAIT_HANG_S)
    transport.retire_below(10)

    def collective(seq: int, payload: bytes) -> bytes:
        return frame.pack(frame.DATA, 1, 5, frame.Meta(seq=seq, coll=1), 8, (len(payload),), len(payload)) + payload
    try:
        sender = _send_once_the_caller_reads(transport._inboxes[1], b, collective(3, b"stale") + collective(12, b"now"))
        msg = transport.recv(1, 5, time.monotonic() + WAIT_HANG_S)
        sender.join(WAIT_HANG_S)
        assert (msg.header.meta.seq, msg.payload.tobytes()) == (12, b"now")
        assert not transport._mailbox.has(1, 5)
    finally:
        transport.close()
        b.close()


def test_a_sleeping_caller_hands_the_wait_over_after_its_time(monkeypatch):
    """Past CALLER_SLEEP_SECONDS (none here) the caller leaves the socket to the reader thread and
    waits on the mailbox: the frame still arrives, through the reader thread."""
    monkeypatch.setattr(tcp, "CALLER_SLEEP_SECONDS", 0.0)
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=0.0)
    read_by_reader_thread: list[int] = []
    take_frame = transport._take_frame
    monkeypatch.setattr(transport, "_take_frame",
                        lambda peer, box: (read_by_reader_thread.append(peer), take_frame(peer, box)))
    try:
        received: list[bytes] = []
        waiter = threading.Thread(target=lambda: received.append(
            transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes()))
        waiter.start()
        b.sendall(_data_frame(5, b"later"))
        waiter.join(WAIT_HANG_S)
        assert received == [b"later"] and read_by_reader_thread == [1]
    finally:
        transport.close()
        b.close()


def test_a_waiting_caller_sees_its_peer_leave():
    """The caller reads the goodbye (or the reader thread does): the wait ends as PeerLost, at once."""
    a, b = _tcp_pair()
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=WAIT_HANG_S)
    try:
        b.sendall(frame.pack(frame.GOODBYE, 1, 0, frame.Meta(), 0, (), 0))
        b.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        with pytest.raises(shmcoll.PeerLost):
            transport.recv(1, 5, time.monotonic() + WAIT_HANG_S)
        assert time.monotonic() - t0 < FAULT_NOTICE_S
    finally:
        transport.close()
        b.close()


def test_a_frame_nobody_waits_for_arrives_after_the_callers_quiet_time(monkeypatch):
    """Once callers find their messages on the socket, the reader thread naps with the socket muted
    (tcp.QUIET_SECONDS, made long enough here that the steps below fall inside it), but no longer:
    an abort that arrives while no caller waits still reaches the mailbox, soon after."""
    monkeypatch.setattr(tcp, "QUIET_SECONDS", 0.5)
    a, b = _tcp_pair()
    mailbox = Mailbox(0, 2)
    transport = NetTransport(rank=0, world_size=2, socks={1: a}, timeout=WAIT_HANG_S, spin_s=WAIT_HANG_S,
                             mailbox=mailbox)
    inbox = transport._inboxes[1]
    try:
        sender = _send_once_the_caller_reads(inbox, b, _data_frame(5, b"found"))
        assert transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes() == b"found"
        sender.join(WAIT_HANG_S)
        b.sendall(frame.pack(frame.HEARTBEAT, 1, 0, frame.Meta(), 0, (), 0))  # read by the reader thread...
        wait_until(lambda: inbox._napping, FAULT_NOTICE_S, "the reader thread to nap", interval=0.001)  # ...asleep
        b.sendall(_data_frame(5, b"again"))
        assert transport.recv(1, 5, time.monotonic() + WAIT_HANG_S).payload.tobytes() == b"again"
        text = b"CollectiveError\n\nstop"
        b.sendall(frame.pack(frame.ABORT, 1, 0, frame.Meta(), 0, (), len(text)) + text)
        wait_until(lambda: mailbox.aborted is not None, FAULT_NOTICE_S, "the reader thread to deliver the abort",
                   interval=0.001)
        assert "stop" in mailbox.aborted.message
    finally:
        transport.close()
        b.close()


def test_whole_frame_waiting_finds_small_frames_in_one_peek_and_large_ones_by_the_bytes_waiting():
    """_Inbox.whole_frame_waiting: a header only for a frame whose every byte is in the socket, be it
    empty, small enough for one peek (PEEK_BYTES), or larger; None for part of one."""
    from shmcoll.transport.tcp import PEEK_BYTES, _Inbox

    a, b = _tcp_pair()
    inbox = _Inbox(a)
    try:
        def sent_in_part(data: bytes, part: int):
            b.sendall(data[:part])
            wait_until(lambda: inbox._bytes_waiting() == part, FAULT_NOTICE_S, "the bytes to arrive")
            assert inbox.whole_frame_waiting(1, frame.MAX_PAYLOAD) is None
            b.sendall(data[part:])
            wait_until(lambda: inbox._bytes_waiting() == len(data), FAULT_NOTICE_S, "the bytes to arrive")
            header = inbox.whole_frame_waiting(1, frame.MAX_PAYLOAD)
            assert header is not None and header.nbytes == len(data) - frame.HEADER_SIZE
            a.recv(len(data), socket.MSG_WAITALL)  # taken: the next case starts from an empty socket

        assert not inbox.readable()
        sent_in_part(_data_frame(5, b""), frame.HEADER_SIZE - 1)
        sent_in_part(_data_frame(5, bytes(100)), frame.HEADER_SIZE + 50)
        sent_in_part(_data_frame(5, bytes(PEEK_BYTES - frame.HEADER_SIZE)), PEEK_BYTES - 1)
        sent_in_part(_data_frame(5, bytes(4 * PEEK_BYTES)), 3 * PEEK_BYTES)
    finally:
        inbox.close()
        a.close()
        b.close()
