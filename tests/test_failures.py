"""Failure handling in real processes: dead, stopped and departed ranks, mismatched calls, rendezvous
problems and wrong secrets. Every rank is a real forked process with a real ProcessGroup over TCP.

Conventions of this file:

* Faults are injected from inside the victim at a precise point: `_arm` wraps the victim's
  `transport.send` so the victim signals itself (SIGKILL / SIGSTOP) just before its k-th frame of the
  collective, i.e. partway through a large, chunked call whose other ranks are already exchanging
  data with it. Where a test needs the victim to fail *before* its call while the others already wait,
  it first takes the others' first frames of that call (`_inside`), so nothing relies on sleep().
* Before the call under test every rank finishes a warm-up collective and meets the others at an
  out-of-band barrier (`_check_group_works`), so no fault lands on frames of an earlier call.
* Ranks that raised stay alive (`_finish`, a bounded multiprocessing barrier) until every other live
  rank is done, so what a rank sees comes from the library's own failure handling, never from a peer
  process that already exited and closed its sockets.
* Group timeouts are long (LONG) wherever waiting them out must fail the test, and every wait in the
  test itself is bounded (run_ranks' timeout, pytest-timeout, bounded barrier waits).
* Monotonic clocks are system wide on Linux, so `fault_s` (victim's fault to survivor's error) is
  measured across processes; `call_s` is from the survivor's call to its error.
* Run with -s to see the measured timings.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

import shmcoll
from shmcoll import CollectiveError, ReduceKind

from harness import CTX, Died, attempt, finish_together, run_ranks


pytestmark = [pytest.mark.timeout(45), pytest.mark.usefixtures("transport")]  # over tcp and shm

LONG = 60.0  # group timeout where waiting it out must fail the test
PROMPT = 5.0  # a failure must reach every rank well within this many seconds
AT_ONCE = 0.5  # a call on a broken group must fail within this
STOP_TIMEOUT = 3.0  # group timeout for the SIGSTOP tests
BIG = 1 << 20  # float32 elements (4 MiB): many chunks per ring step with...
CHUNKS = {"SHMCOLL_CHUNK_BYTES": str(64 << 10)}  # ...64 KiB frames
RUN_TIMEOUT = 30.0  # run_ranks' own deadline (dumps the stacks of hung ranks)
FORWARDER = "a rank that forwards the root's data"


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ---------------------------------------------------------------------------------------------

def _init(rank: int, n: int, port: int, timeout: float = LONG):
    return shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=timeout)


def _broken(pg) -> dict:
    """The next call on a group that just failed: must raise at once, same class, saying 'broken'."""
    return attempt(lambda: pg.barrier())


def _shmcoll_threads() -> list[str]:
    """shmcoll threads alive in this process (the rendezvous store's included)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shmcoll-"))


def _close(pg) -> dict:
    start = time.monotonic()
    pg.close()
    return {"close_s": time.monotonic() - start, "threads": _shmcoll_threads()}


def _arm(pg, after_sends: int, sig: int, stamps) -> None:
    """Deliver `sig` to this rank just before its `after_sends`-th frame from now on; stamp the time."""
    transport = pg.transport
    real_send = transport.send
    count = itertools.count(1)

    def send(*args, **kwargs):
        if next(count) == after_sends:
            stamps[pg.rank] = time.monotonic()
            os.kill(os.getpid(), sig)
        return real_send(*args, **kwargs)

    transport.send = send


def _inside(pg, peers, seq: int, bound: float = 10.0, nbytes: int = 0) -> bool:
    """Wait (bounded) until each of `peers` is inside collective number `seq` (of `nbytes` of data):
    over shared memory a small call shows as the peer's board entry; otherwise take the first frame
    each peer sends in it. Only a rank about to fail or leave may do the latter, since it consumes
    the frames its own call would have needed."""
    deadline = time.monotonic() + bound
    tag = shmcoll.TAG_RESERVED_BASE + seq
    board = pg.transport.board
    if board is not None and nbytes <= board.capacity:
        while not all(board.published(p, seq) for p in peers):  # a bounded poll of shared memory
            if time.monotonic() > deadline:
                return False
        return True
    try:
        return all(pg.transport.recv(p, tag, deadline).header.meta.seq == seq for p in peers)
    except CollectiveError:
        return False


def _check_group_works(pg, ready) -> None:
    """Collective number 0, then an out-of-band barrier of every rank: nobody is still finishing call 0
    (frames of it still in flight) when the fault of call 1 happens."""
    x = np.full(8, pg.rank + 1.0, dtype=np.float64)
    pg.all_reduce(x)
    n = pg.world_size
    assert np.all(x == n * (n + 1) / 2), x
    ready.wait(timeout=RUN_TIMEOUT / 2)


# ---------------------------------------------------------------------------------------------
# helpers run in the test process
# ---------------------------------------------------------------------------------------------

def _report(name: str, outs: dict) -> None:
    parts = []
    for rank, out in sorted(outs.items()):
        text = f"rank {rank}: {out['kind']} call {out['call_s']:.3f}s"
        if "fault_s" in out:
            text += f" fault {out['fault_s']:.3f}s"
        parts.append(text)
    print(f"\n[timing] {name}: " + "; ".join(parts))


def _assert_lost(out: dict, victim: int) -> None:
    assert out["kind"] == "PeerLost" and out["connection_error"], out
    assert out["peer"] == victim, out
    assert out["call_s"] < PROMPT, out
    if "fault_s" in out:
        assert out["fault_s"] < PROMPT, out


def _assert_broken(out: dict, kind: str, peer: int | None = None) -> None:
    broken = out["broken"]
    assert broken["kind"] == kind, broken
    assert "broken" in broken["msg"], broken
    assert broken["call_s"] < AT_ONCE, broken
    if peer is not None:
        assert broken["peer"] == peer, broken


def _assert_closed_cleanly(out: dict) -> None:
    assert out["close_s"] < PROMPT, out
    assert out["threads"] == [], f"shmcoll threads still running after close(): {out['threads']}"


def _assert_no_children() -> None:
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------------------------------------
# 1, 2, 8: kill -9 of one rank inside a collective
# ---------------------------------------------------------------------------------------------

def _call_all_reduce(pg, data):
    pg.all_reduce(data)


def _call_broadcast(pg, data):
    pg.broadcast(0, data)


def _call_spawn_all_reduce(pg, data):
    handle = pg.spawn_all_reduce(data)
    handle.join(timeout=RUN_TIMEOUT)


def _killed_partway(rank, n, port, victim, call, stamps, ready, finish):
    pg = _init(rank, n, port)
    _check_group_works(pg, ready)
    data = np.full(BIG, float(rank), dtype=np.float32)
    if rank == victim:
        _arm(pg, 5, signal.SIGKILL, stamps)  # dies just before its 5th frame of the big call
        call(pg, data)
        return {"kind": "victim survived its own SIGKILL"}
    out = attempt(lambda: call(pg, data))
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = _broken(pg)
    out["finished_together"] = finish_together(finish)
    out.update(_close(pg))
    return out


@pytest.mark.parametrize("call, n, victim", [
    (_call_all_reduce, 2, 1),
    (_call_all_reduce, 3, 0),
    (_call_all_reduce, 4, 2),
    (_call_broadcast, 3, 0),  # the root dies while streaming
    (_call_broadcast, 4, FORWARDER),  # a forwarding rank dies
    (_call_spawn_all_reduce, 3, 1),  # dies on the victim's background worker thread
], ids=["all_reduce-n2", "all_reduce-n3-rank0", "all_reduce-n4", "broadcast-root", "broadcast-middle",
        "spawn_all_reduce-n3"])
def test_sigkill_partway_through_collective(call, n, victim, transport):
    if victim is FORWARDER:  # in a flat chain rank 1 forwards; over two hosts (0,1 + 2,3), rank 2 does
        victim = 2 if transport == "hier" else 1
    stamps = CTX.RawArray("d", n)
    results = run_ranks(n, _killed_partway, victim, call, stamps, CTX.Barrier(n), CTX.Barrier(n - 1), init=False,
                        env=CHUNKS, may_die={victim}, timeout=RUN_TIMEOUT)
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    _report(f"SIGKILL {call.__name__[6:]} n={n} victim={victim}", outs)
    for out in outs.values():
        _assert_lost(out, victim)
        _assert_broken(out, "PeerLost", victim)
        assert out["finished_together"], out
        _assert_closed_cleanly(out)
    _assert_no_children()


def _killed_before_barrier(rank, n, port, victim, sender, stamps, ready, finish):
    pg = _init(rank, n, port)
    _check_group_works(pg, ready)
    if rank == victim:
        # die before calling barrier, once the rank that signals it first is waiting inside it
        inside = _inside(pg, [sender], seq=1)
        stamps[rank] = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
        return {"kind": f"victim survived its own SIGKILL (inside={inside})"}
    out = attempt(pg.barrier)
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = attempt(lambda: pg.all_reduce(np.ones(4, np.float32)))
    out["finished_together"] = finish_together(finish)
    out.update(_close(pg))
    return out


def test_sigkill_while_others_wait_in_barrier(transport):
    n, victim = 4, 2
    sender = 3 if transport == "hier" else 1  # over hosts 0,1 + 2,3 rank 2 first hears from its host's rank 3
    stamps = CTX.RawArray("d", n)
    results = run_ranks(n, _killed_before_barrier, victim, sender, stamps, CTX.Barrier(n), CTX.Barrier(n - 1), init=False,
                        may_die={victim}, timeout=RUN_TIMEOUT)
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    _report("SIGKILL before barrier n=4", outs)
    for out in outs.values():
        _assert_lost(out, victim)
        _assert_broken(out, "PeerLost", victim)
        assert out["finished_together"], out
        _assert_closed_cleanly(out)
    _assert_no_children()


# ---------------------------------------------------------------------------------------------
# 3: SIGSTOP of one rank -> CollectiveTimeout within the group timeout
# ---------------------------------------------------------------------------------------------

def _assert_timed_out(out: dict, op: str, seq: int, silent: int) -> None:
    """CollectiveTimeout after the group timeout (plus a margin), naming op, sequence and silent rank."""
    assert out["kind"] == "CollectiveTimeout", out
    assert out["timeout_error"], out
    assert STOP_TIMEOUT - 0.05 <= out["call_s"] <= STOP_TIMEOUT + 5.5, out
    assert op in out["msg"] and f"sequence number {seq}" in out["msg"], out["msg"]
    named = re.search(r"(?:silent ranks|ranks not heard from[^:]*): \[([0-9, ]*)\]", out["msg"])
    assert named and silent in [int(r) for r in named.group(1).replace(" ", "").split(",") if r], out["msg"]


def _stopped_partway(rank, n, port, victim, pids, stamps, ready, finish):
    pids[rank] = os.getpid()
    pg = _init(rank, n, port, timeout=STOP_TIMEOUT)
    _check_group_works(pg, ready)  # sequence number 0
    data = np.full(BIG, float(rank), dtype=np.float32)
    if rank == victim:
        _arm(pg, 5, signal.SIGSTOP, stamps)  # stops inside all_reduce #1, resumed by the survivor
        out = attempt(lambda: pg.all_reduce(data))
        out["after_resume_s"] = out["end"] - stamps[n]
    else:
        try:
            out = attempt(lambda: pg.all_reduce(data))  # sequence number 1
            out["broken"] = _broken(pg)
        finally:
            stamps[n] = time.monotonic()
            os.kill(pids[victim], signal.SIGCONT)
    out["finished_together"] = finish_together(finish)
    out.update(_close(pg))
    return out


def test_sigstop_partway_through_all_reduce_times_out_then_resumed_rank_fails_too():
    n, victim = 2, 1
    pids, stamps = CTX.RawArray("q", n), CTX.RawArray("d", n + 1)
    results = run_ranks(n, _stopped_partway, victim, pids, stamps, CTX.Barrier(n), CTX.Barrier(n), init=False,
                        env=CHUNKS, timeout=RUN_TIMEOUT)
    survivor, resumed = results[0], results[victim]
    _report("SIGSTOP partway all_reduce n=2", {0: survivor})
    print(f"[timing] resumed rank raised {resumed['kind']} {resumed['after_resume_s']:.3f}s after SIGCONT")
    _assert_timed_out(survivor, "all_reduce", 1, silent=victim)
    _assert_broken(survivor, "CollectiveTimeout")
    # the stopped rank, once resumed, must fail too (its deadline passed), not hang or return
    assert resumed["collective_error"], resumed
    assert resumed["after_resume_s"] < PROMPT, resumed
    for out in results:
        assert out["finished_together"], out
        _assert_closed_cleanly(out)
    _assert_no_children()


def _stopped_before_barrier(rank, n, port, victim, pids, ready, finish):
    pids[rank] = os.getpid()
    pg = _init(rank, n, port, timeout=STOP_TIMEOUT)
    _check_group_works(pg, ready)  # sequence number 0
    if rank == victim:
        _inside(pg, [(rank - 1) % n], seq=1)  # the previous rank is waiting inside barrier #1
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"kind": "victim resumed; it should have been killed while stopped"}
    try:
        out = attempt(pg.barrier)  # sequence number 1
        out["broken"] = _broken(pg)
    finally:
        if rank == 0:
            os.kill(pids[victim], signal.SIGKILL)
    out["finished_together"] = finish_together(finish)
    out.update(_close(pg))
    return out


def test_sigstop_before_barrier_names_operation_sequence_and_silent_rank():
    n, victim = 3, 1
    pids = CTX.RawArray("q", n)
    results = run_ranks(n, _stopped_before_barrier, victim, pids, CTX.Barrier(n), CTX.Barrier(n - 1), init=False,
                        may_die={victim}, timeout=RUN_TIMEOUT)
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    _report("SIGSTOP before barrier n=3", outs)
    for out in outs.values():
        _assert_timed_out(out, "barrier", 1, silent=victim)
        _assert_broken(out, "CollectiveTimeout")
        assert out["finished_together"], out
        _assert_closed_cleanly(out)
    _assert_no_children()


# ---------------------------------------------------------------------------------------------
# 5: a rank that closes its group and exits while the others call a collective
# ---------------------------------------------------------------------------------------------

def _departs(rank, n, port, victim, count, ready, finish, senders):
    pg = _init(rank, n, port)
    _check_group_works(pg, ready)
    if rank == victim:
        # close once the ranks that send to us first are inside the all_reduce
        out = {"kind": "departed", "inside": _inside(pg, senders, seq=1, nbytes=4 * count)}
        out.update(_close(pg))
        return out
    out = attempt(lambda: pg.all_reduce(np.ones(count, dtype=np.float32)))
    out["broken"] = _broken(pg)
    out["finished_together"] = finish_together(finish, bound=1.5)
    out.update(_close(pg))
    return out


def test_rank_closing_early_is_reported_as_lost_peer(transport):
    """One-shot all_reduce: every rank waits on the departed one directly (over hosts 0,1 + 2,
    only the leader does, and rank 1 hears of it from rank 0's abort)."""
    n, victim = 3, 2
    senders = [0] if transport == "hier" else [0, 1]
    results = run_ranks(n, _departs, victim, 100, CTX.Barrier(n), CTX.Barrier(n - 1), senders, init=False,
                        timeout=RUN_TIMEOUT)
    assert results[victim]["inside"]
    _assert_closed_cleanly(results[victim])
    outs = {r: out for r, out in enumerate(results) if r != victim}
    _report("clean early exit n=3", outs)
    for out in outs.values():
        _assert_lost(out, victim)
        _assert_broken(out, "PeerLost", victim)
        assert out["finished_together"], out
        _assert_closed_cleanly(out)
    _assert_no_children()


def test_rank_closing_early_during_ring_all_reduce_reaches_every_rank():
    n, victim = 4, 3
    results = run_ranks(n, _departs, victim, BIG, CTX.Barrier(n), CTX.Barrier(n - 1), [2], init=False, env=CHUNKS,
                        timeout=RUN_TIMEOUT)
    for rank in range(n - 1):
        _assert_lost(results[rank], victim)


# ---------------------------------------------------------------------------------------------
# 4: mismatched calls at the same sequence number
# ---------------------------------------------------------------------------------------------

def _ar(count=1000, dtype=np.float32, op=ReduceKind.SUM):
    return lambda pg: pg.all_reduce(np.ones(count, dtype=dtype), op)


def _bc(root=0, count=1000, dtype=np.float32):
    return lambda pg: pg.broadcast(root, np.ones(count, dtype=dtype))


def _ag(count=1000, dtype=np.float32):
    return lambda pg: pg.all_gather(np.ones(count, dtype=dtype))


def _barrier():
    return lambda pg: pg.barrier()


def _spawn(count=1000):
    return lambda pg: pg.spawn_all_reduce(np.ones(count, dtype=np.float32)).join(timeout=RUN_TIMEOUT)


def _mismatched(pg, normal, odd_call, odd, ready, finish, bound):
    _check_group_works(pg, ready)  # sequence number 0; the mismatch is at sequence number 1
    out = attempt(lambda: (odd_call if pg.rank == odd else normal)(pg))
    out["broken"] = _broken(pg)
    out["finished_together"] = finish_together(finish, bound)
    return out


def _run_mismatch(n, normal, odd_call, odd, bound=5.0, group_timeout=LONG):
    return run_ranks(n, _mismatched, normal, odd_call, odd, CTX.Barrier(n), CTX.Barrier(n), bound, env=CHUNKS,
                     group_timeout=group_timeout, timeout=RUN_TIMEOUT)


# (name, world size, odd rank, what the others call, what the odd rank calls)
MISMATCHES = [
    ("all_reduce-dtype", 2, 1, _ar(), _ar(dtype=np.float64)),
    ("all_reduce-dtype", 3, 2, _ar(), _ar(dtype=np.float64)),
    ("all_reduce-dtype", 4, 0, _ar(), _ar(dtype=np.float64)),
    ("all_reduce-int-vs-float", 3, 1, _ar(dtype=np.int32), _ar(dtype=np.float32)),
    ("all_reduce-length", 2, 0, _ar(), _ar(count=1001)),
    ("all_reduce-length", 4, 3, _ar(), _ar(count=1001)),
    ("all_reduce-op", 3, 0, _ar(), _ar(op=ReduceKind.MAX)),
    ("all_reduce-op", 4, 2, _ar(), _ar(op=ReduceKind.MIN)),
    ("spawn_all_reduce-length", 3, 2, _spawn(), _spawn(1001)),
    ("all_reduce-vs-barrier", 2, 1, _ar(), _barrier()),
    ("all_reduce-vs-all_gather", 2, 0, _ar(), _ag()),
    ("all_gather-vs-barrier", 2, 1, _ag(), _barrier()),
    ("spawn_all_reduce-vs-barrier", 2, 0, _spawn(), _barrier()),
    ("all_gather-length", 2, 1, _ag(), _ag(count=999)),
    ("all_gather-dtype", 2, 0, _ag(), _ag(dtype=np.float64)),
    ("broadcast-both-ranks-claim-root", 2, 1, _bc(root=0), _bc(root=1)),
]


@pytest.mark.parametrize("name, n, odd, normal, odd_call", MISMATCHES,
                         ids=[f"{m[0]}-n{m[1]}-odd{m[2]}" for m in MISMATCHES])
def test_mismatch_raises_on_every_rank(name, n, odd, normal, odd_call):
    results = _run_mismatch(n, normal, odd_call, odd)
    _report(f"mismatch {name} n={n}", dict(enumerate(results)))
    for out in results:
        assert out["kind"] == "CollectiveMismatch", out
        assert out["call_s"] < PROMPT, out
        assert "sequence number 1" in out["msg"], out["msg"]
        _assert_broken(out, "CollectiveMismatch")
        assert out["finished_together"], out


# Only some ranks receive a frame of the mismatched call; the others can only learn of the mismatch
# from the group's abort. The bound keeps the ranks that raised alive for 1.5 s: long enough for any
# abort to arrive, short enough that the ranks waiting in vain fail the test quickly.
NEED_ABORT = [
    ("all_reduce-vs-broadcast", 2, 1, _ar(), _bc(root=0)),  # rank 0 waits for a frame rank 1 never sends
    ("broadcast-root-length", 2, 0, _bc(), _bc(count=1001)),  # the root waits for the last rank's ack
    ("all_gather-length-ring", 4, 3, _ag(), _ag(count=999)),  # ranks 1, 2 only hear from ranks that match
]


@pytest.mark.parametrize("name, n, odd, normal, odd_call", NEED_ABORT,
                         ids=[f"{m[0]}-n{m[1]}-odd{m[2]}" for m in NEED_ABORT])
def test_mismatch_reaches_ranks_that_saw_no_mismatched_frame(name, n, odd, normal, odd_call):
    results = _run_mismatch(n, normal, odd_call, odd, bound=1.5)
    for out in results:
        assert out["kind"] == "CollectiveMismatch", out
        assert out["call_s"] < 1.0, out


BROADCAST_DOWNSTREAM = [
    ("length", _bc(count=1000), _bc(count=1001)),
    ("dtype", _bc(dtype=np.float32), _bc(dtype=np.int32)),
    ("root", _bc(root=0), _bc(root=1)),
]


@pytest.mark.parametrize("name, normal, odd_call", BROADCAST_DOWNSTREAM, ids=[m[0] for m in BROADCAST_DOWNSTREAM])
def test_broadcast_mismatch_after_forwarding_rank_raises_there_too(name, normal, odd_call):
    n, odd = 3, 2
    results = _run_mismatch(n, normal, odd_call, odd, bound=1.5)
    for out in results:  # the forwarding rank 1 too: it waits for the tail's "done" before returning
        assert out["kind"] == "CollectiveMismatch", out


def test_broadcast_ranks_naming_each_other_root_mismatch_promptly():
    results = _run_mismatch(2, _bc(root=1), _bc(root=0), odd=1, bound=1.5, group_timeout=2.0)
    for out in results:
        assert out["kind"] == "CollectiveMismatch", out
        assert out["call_s"] < 1.5, out


# ---------------------------------------------------------------------------------------------
# 6: rendezvous
# ---------------------------------------------------------------------------------------------

def _rendezvous(rank, n, port, timeouts, secrets):
    """Rank r calls init with timeouts[r] (None: never arrives) and SHMCOLL_SECRET secrets[r]."""
    if timeouts[rank] is None:
        return {"kind": "absent"}
    if secrets is not None:
        os.environ["SHMCOLL_SECRET"] = secrets[rank]
    groups = []
    out = attempt(lambda: groups.append(_init(rank, n, port, timeout=timeouts[rank])))
    if groups:
        pg = groups[0]
        x = np.full(5, rank + 1, dtype=np.int64)
        pg.all_reduce(x)
        out["sum"] = int(x[0])
        out.update(_close(pg))
    else:
        out["threads"] = _shmcoll_threads()
    return out


def test_rendezvous_names_the_rank_that_never_arrives():
    # Rank 0 waits longest: with equal timeouts rank 0 may stop serving the store first, and then the
    # others see a raw EOFError (test_rendezvous_error_is_collective_error_when_rank0_gives_up_first).
    timeouts = [3.0, 2.0, None]
    results = run_ranks(3, _rendezvous, timeouts, None, init=False, timeout=RUN_TIMEOUT)
    _report("rendezvous, rank 2 missing", {r: results[r] for r in (0, 1)})
    for rank in (0, 1):
        out = results[rank]
        assert out["kind"] == "CollectiveTimeout" and out["timeout_error"], out
        assert "ranks [2] never arrived" in out["msg"], out["msg"]
        # the first rank to give up tells the others why, so nobody waits longer than its own timeout
        assert min(t for t in timeouts if t) - 0.1 <= out["call_s"] < timeouts[rank] + PROMPT, out
        assert out["threads"] == [], out


def test_rendezvous_without_rank_0_says_so():
    results = run_ranks(3, _rendezvous, [None, 2.0, 2.0], None, init=False, timeout=RUN_TIMEOUT)
    _report("rendezvous, rank 0 missing", {r: results[r] for r in (1, 2)})
    for out in results[1:]:
        assert out["kind"] == "CollectiveTimeout" and out["timeout_error"], out
        assert "rank 0" in out["msg"], out["msg"]
        assert 1.9 <= out["call_s"] < 2.0 + PROMPT, out


def test_rendezvous_error_is_collective_error_when_rank0_gives_up_first():
    results = run_ranks(3, _rendezvous, [1.0, 4.0, None], None, init=False, timeout=RUN_TIMEOUT)
    assert results[0]["kind"] == "CollectiveTimeout", results[0]
    assert results[1]["collective_error"], results[1]


def _ordered_start(rank, n, port, started):
    """Ranks call init from the highest to the lowest, rank 0 last: each first waits for the rank above
    it to have started its own init, and checks the rendezvous port still refuses connections (rank 0
    is not serving yet), so the others really start, and retry, before rank 0 exists."""
    if rank < n - 1 and not started[rank + 1].wait(RUN_TIMEOUT / 2):
        return {"kind": "rank above never started"}
    refused = True
    if rank > 0:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            refused = False
        except ConnectionRefusedError:
            pass
    started[rank].set()
    with _init(rank, n, port, timeout=20.0) as pg:
        x = np.full(7, rank + 1.0, dtype=np.float32)
        pg.all_reduce(x)
        pg.barrier()
        return {"kind": "formed", "refused": refused, "sum": float(x[0])}


def test_ranks_starting_before_rank_0_still_meet():
    n = 4
    results = run_ranks(n, _ordered_start, [CTX.Event() for _ in range(n)], init=False, timeout=RUN_TIMEOUT)
    for out in results:
        assert out["kind"] == "formed", out
        assert out["refused"], "rank 0 was already serving: the late start was not tested"
        assert out["sum"] == n * (n + 1) / 2


# ---------------------------------------------------------------------------------------------
# 7: the job secret
# ---------------------------------------------------------------------------------------------

def test_wrong_secret_keeps_that_rank_out():
    results = run_ranks(3, _rendezvous, [3.0, 2.0, 2.0], ["s3cret", "s3cret", "wrong"], init=False,
                        timeout=RUN_TIMEOUT)  # rank 0 waits longest, as above
    _report("wrong secret on rank 2", dict(enumerate(results)))
    for out in results[:2]:
        assert out["kind"] == "CollectiveTimeout", out
        assert "ranks [2] never arrived" in out["msg"], out["msg"]
    intruder = results[2]
    assert intruder["kind"] not in ("returned", "absent"), intruder
    assert "SHMCOLL_SECRET" in intruder["msg"], intruder
    assert intruder["call_s"] < 1.0, intruder


def test_wrong_secret_error_is_a_collective_error():
    results = run_ranks(2, _rendezvous, [1.0, 1.0], ["s3cret", "wrong"], init=False, timeout=RUN_TIMEOUT)
    assert results[1]["collective_error"], results[1]


def test_same_secret_forms_the_job():
    results = run_ranks(3, _rendezvous, [10.0, 10.0, 10.0], ["s3cret"] * 3, init=False, timeout=RUN_TIMEOUT)
    for out in results:
        assert out["kind"] == "returned", out
        assert out["sum"] == 6
        _assert_closed_cleanly(out)


# ---------------------------------------------------------------------------------------------
# 8: nothing of shmcoll keeps running after close()
# ---------------------------------------------------------------------------------------------

def _store_after_close(rank, n, port):
    pg = _init(rank, n, port, timeout=10.0)
    pg.barrier()
    pg.close()
    if rank != 0:
        return None
    for thread in threading.enumerate():  # a generous grace period, in case close() only signals them
        if thread.name.startswith("shmcoll-"):
            thread.join(2.0)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("shmcoll-"))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
        listening = True
    except OSError:
        listening = False
    return {"threads": left, "still_listening": listening}


def test_store_thread_and_port_released_after_close():
    out = run_ranks(2, _store_after_close, init=False, timeout=RUN_TIMEOUT)[0]
    assert out["threads"] == [], out
    assert not out["still_listening"], out
