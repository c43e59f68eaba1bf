"""Failure handling in real processes: dead, stopped and departed ranks, mismatched calls, rendezvous
problems and wrong secrets. Every rank is a real forked process with a real ProcessGroup; every
scenario that involves a transport runs over tcp, shm and hier (the `transport` fixture; "hier"
simulates two hosts, the first half of the ranks on one, the rest on the other).

Conventions of this file:

* Faults are injected from inside the victim at a precise point: `arm_signal` wraps the victim's
  `transport.send` so the victim signals itself (SIGKILL / SIGSTOP) just before its k-th frame of the
  collective, i.e. partway through a large, chunked call whose other ranks are already exchanging
  data with it. Where a test needs the victim to fail *before* its call while the others already wait,
  it first takes the others' first frames of that call (`peers_inside`), so nothing relies on sleep().
* Before the call under test every rank finishes a warm-up collective and meets the others at an
  out-of-band barrier (`check_group_works`), so no fault lands on frames of an earlier call.
* Ranks that raised stay alive (`finish_together`, a bounded multiprocessing barrier) until every
  other live rank is done, so what a rank sees comes from the library's own failure handling, never
  from a peer process that already exited and closed its sockets.
* Group timeouts are long (bounds.NEVER_S) wherever waiting them out must fail the test, and every
  wait in the test itself is bounded (run_ranks' timeout, pytest-timeout, bounded barrier waits).
* Every bound on a time (how soon a fault reaches every rank, ...) is harness's, scaled from one place.
* After every scenario (`Aftermath.check`): nothing its ranks created is left in /dev/shm, no
  process is left behind, and (checked in the ranks) every survivor's group refuses the next call at
  once saying it is broken, and close() leaves no shmcoll thread and no child process.
* Monotonic clocks are system wide on Linux, so `fault_s` (victim's fault to survivor's error) is
  measured across processes; `call_s` is from the survivor's call to its error. Each scenario prints
  a "[timing] <transport> | <scenario>: ..." line (run with -s); bench/fault_times.py tabulates them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest

import shmcoll
import shmcoll.bootstrap
from shmcoll import ReduceKind
from shmcoll.types import wire_type_of

from bounds import (
    BROKEN_CALL_S,
    CLOSE_S,
    FAULT_NOTICE_S,
    NEVER_S,
    NO_WAIT_S,
    SECRET_REFUSAL_S,
    TIMEOUT_LATE_S,
    WAIT_HANG_S,
)
from faults import (
    BIG,
    CHUNKS,
    arm_signal,
    assert_broken,
    assert_closed_cleanly,
    assert_nothing_running,
    assert_survivors,
    call_after_failure,
    check_group_works,
    close_group,
    init_group,
    leftovers,
    peers_inside,
    report_timing,
    run_tracked,
    tracked,
)
from harness import (
    CTX,
    Died,
    ShmCreations,
    attempt,
    finish_together,
    run_ranks,
    shm_names_of,
    simulated_host_id,
)

pytestmark = pytest.mark.multiprocess

STOP_TIMEOUT = 3.0  # group timeout for the SIGSTOP tests (above group.SILENT_AFTER, so the stopped rank is named)
SETUP_TIMEOUT = 2.0  # group timeout for the start-up tests
FORWARDER = "a rank that forwards the root's data"


# ---------------------------------------------------------------------------------------------
# kill -9 of one rank inside a collective
# ---------------------------------------------------------------------------------------------

def _call_all_reduce(pg, data):
    pg.all_reduce(data)


def _call_broadcast(pg, data):
    pg.broadcast(0, data)


def _call_spawn_all_reduce(pg, data):
    handle = pg.spawn_all_reduce(data)
    handle.join(timeout=WAIT_HANG_S)


def _call_barrier(pg, data):
    pg.barrier()


def _call_reduce_scatter(pg, data):
    pg.reduce_scatter(data)


def _call_all_to_all(pg, data):
    pg.all_to_all(data)


def _call_gather(pg, data):
    pg.gather(0, data)


def _call_scatter(pg, data):
    pg.scatter(0, data if pg.rank == 0 else None)


#: after how many of the victim's frames of the call it is killed: partway through the big calls,
#: at its first frame of a barrier (which sends only a few)
_AFTER_SENDS = {_call_all_reduce: 5, _call_broadcast: 5, _call_spawn_all_reduce: 5, _call_barrier: 1,
                _call_reduce_scatter: 5, _call_all_to_all: 5, _call_gather: 5, _call_scatter: 1}
#: calls whose count of frames starts at the data (`arm_signal`'s min_items): the root of a scatter sends each rank
#: its block as one frame, so it dies after the agreement step, before the first block, while every other
#: rank waits inside the call for its block (a later kill lets rank 1 legitimately return with its block)
_MIN_ITEMS = {_call_scatter: 1024}


def _killed_partway(rank, n, port, victim, call, stamps, ready, finish):
    pg = init_group(rank, n, port)
    check_group_works(pg, ready)
    data = np.full(BIG, float(rank), dtype=np.float32)
    if rank == victim:
        arm_signal(pg, _AFTER_SENDS[call], signal.SIGKILL, stamps, _MIN_ITEMS.get(call, 0))
        call(pg, data)
        return {"kind": "victim survived its own SIGKILL"}
    out = attempt(lambda: call(pg, data))
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = call_after_failure(pg)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


def _sigkill_partway(n: int, victim: int, call, aftermath, who: str | None = None) -> dict:
    stamps = CTX.RawArray("d", n)
    results, pids = run_tracked(n, _killed_partway, victim, call, stamps, CTX.Barrier(n), CTX.Barrier(n - 1),
                                env=CHUNKS, may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(f"SIGKILL {call.__name__[6:]} n={n} victim={who or victim}", outs)
    assert_survivors(outs, victim)
    aftermath.check(pids)
    return outs


@pytest.mark.parametrize("call, n, victim", [
    (_call_all_reduce, 2, 1),
    (_call_all_reduce, 3, 0),
    (_call_all_reduce, 4, 2),
    (_call_broadcast, 3, 0),  # the root dies while streaming
    (_call_broadcast, 4, FORWARDER),  # a forwarding rank dies
    (_call_spawn_all_reduce, 3, 1),  # dies on the victim's background worker thread
    (_call_barrier, 4, 3),
], ids=["all_reduce-n2", "all_reduce-n3-rank0", "all_reduce-n4", "broadcast-root", "broadcast-middle",
        "spawn_all_reduce-n3", "barrier-n4"])
def test_sigkill_partway_through_collective(call, n, victim, transport, aftermath):
    who = None
    if victim is FORWARDER:  # in a flat chain rank 1 forwards; over two hosts (0,1 + 2,3), rank 2 does
        victim = 2 if transport == "hier" else 1
        who = "forwarder"
    _sigkill_partway(n, victim, call, aftermath, who)


# the collectives that split or assemble per-rank blocks (BIG divides by 4: equal blocks for
# reduce_scatter, all_to_all and scatter)
BLOCKWISE_CALLS = [
    (_call_reduce_scatter, 4, 2),
    (_call_all_to_all, 4, 1),
    # a non-root dies while the root collects; n=2 because with more ranks another non-root has legitimately
    # finished its part (its block sent) and returns before anything is lost
    (_call_gather, 2, 1),
    (_call_scatter, 4, 0),  # the root dies while handing out blocks
]


@pytest.mark.parametrize("call, n, victim", BLOCKWISE_CALLS,
                         ids=["reduce_scatter-n4", "all_to_all-n4", "gather-n2-nonroot", "scatter-n4-root"])
def test_sigkill_partway_through_blockwise_collectives(call, n, victim, transport, aftermath):
    outs = _sigkill_partway(n, victim, call, aftermath)
    assert set(outs) == set(range(n)) - {victim}


# (host layout, call, world size, victim); every case has survivors on another host than the victim's
ACROSS_HOSTS = [
    ("first-alone", _call_all_reduce, 4, 0),  # the only rank of its host, and the rendezvous' rank 0
    ("first-alone", _call_all_reduce, 4, 2),  # rank 0 alone on the other host
    ("interleaved", _call_broadcast, 4, 1),  # host b's leader, forwarding the root's data to rank 3
    ("each", _call_all_reduce, 4, 3),  # one rank per host: every survivor learns over TCP
    ("halves", _call_spawn_all_reduce, 4, 3),  # not its host's leader
    ("halves", _call_barrier, 4, 2),  # its host's leader, inside the leaders' barrier
]


@pytest.mark.parametrize("layout, call, n, victim", ACROSS_HOSTS,
                         ids=[f"{m[0]}-{m[1].__name__[6:]}-victim{m[3]}" for m in ACROSS_HOSTS])
def test_sigkill_across_simulated_hosts(layout, call, n, victim, monkeypatch, aftermath):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    hosts = {r: simulated_host_id(layout, r, n) for r in range(n)}
    assert any(hosts[r] != hosts[victim] for r in range(n)), "the victim's host must not hold every survivor"
    _sigkill_partway(n, victim, call, aftermath)


def _killed_before_barrier(rank, n, port, victim, sender, stamps, ready, finish):
    pg = init_group(rank, n, port)
    check_group_works(pg, ready)
    if rank == victim:
        # die before calling barrier, once the rank that signals it first is waiting inside it
        inside = peers_inside(pg, [sender], seq=1)
        stamps[n] = float(inside)
        stamps[rank] = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
        return {"kind": f"victim survived its own SIGKILL (inside={inside})"}
    out = attempt(pg.barrier)
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = attempt(lambda: pg.all_reduce(np.ones(4, np.float32)))
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


def test_sigkill_while_others_wait_in_barrier(transport, aftermath):
    n, victim = 4, 2
    sender = 3  # rank 2 first hears from rank 3: its host's peer over hosts 0,1 + 2,3, its first pair (2 ^ 1) over TCP
    stamps = CTX.RawArray("d", n + 1)
    results, pids = run_tracked(n, _killed_before_barrier, victim, sender, stamps, CTX.Barrier(n), CTX.Barrier(n - 1),
                                may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    assert stamps[n] == 1.0, "the victim died before the others were inside the barrier"
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(f"SIGKILL before barrier n={n} victim={victim}", outs)
    assert_survivors(outs, victim)
    aftermath.check(pids)


#: small calls whose survivors wait inside a compiled board step over shared memory
SMALL_BOARD_CALLS = {"all_reduce": lambda pg, data: pg.all_reduce(data),
                     "all_gather": lambda pg, data: pg.all_gather(data)}


def _killed_before_small_call(rank, n, port, victim, name, stamps, ready, finish):
    """Over shared memory the survivors wait inside the compiled board step, asleep on a futex."""
    pg = init_group(rank, n, port)
    check_group_works(pg, ready)
    data = np.full(2, float(rank), dtype=np.float32)
    if rank == victim:
        inside = peers_inside(pg, [r for r in range(n) if r != victim], seq=1, nbytes=data.nbytes)
        stamps[n] = float(inside)
        stamps[rank] = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
        return {"kind": f"victim survived its own SIGKILL (inside={inside})"}
    out = attempt(lambda: SMALL_BOARD_CALLS[name](pg, data))
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = call_after_failure(pg)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


# (across hosts a small call never waits on the board; a Bruck all-gather over TCP sends to the
# victim only after it heard from it, so nobody would be seen inside before it dies)
@pytest.mark.parametrize("kind, name", [("shm", "all_reduce"), ("tcp", "all_reduce"), ("shm", "all_gather")])
def test_sigkill_while_others_wait_in_a_small_call(kind, name, monkeypatch, aftermath):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", kind)
    n, victim = 3, 1
    stamps = CTX.RawArray("d", n + 1)
    results, pids = run_tracked(n, _killed_before_small_call, victim, name, stamps, CTX.Barrier(n), CTX.Barrier(n - 1),
                                may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(f"SIGKILL before small {name} n={n} victim={victim}", outs)
    assert stamps[n] == 1.0, f"the victim died before the others were inside the {name}"
    assert_survivors(outs, victim)
    aftermath.check(pids)


# ---------------------------------------------------------------------------------------------
# SIGSTOP of one rank -> CollectiveTimeout within the group timeout, naming op, sequence, silent rank
# ---------------------------------------------------------------------------------------------

_OP_NAMES = {_call_all_reduce: "all_reduce", _call_broadcast: "broadcast", _call_spawn_all_reduce: "all_reduce",
             _call_barrier: "barrier", _call_all_to_all: "all_to_all"}


def _assert_timed_out(out: dict, op: str, seq: int, silent: int, first_start: float) -> None:
    """CollectiveTimeout within the group timeout plus a margin, naming op, sequence and silent rank.
    Not before the first survivor to call has waited the whole timeout: a survivor that called later
    may learn of it from that one's abort, before its own timeout."""
    assert out["kind"] == "CollectiveTimeout", out
    assert out["timeout_error"], out
    assert out["end"] >= first_start + STOP_TIMEOUT - 0.05, out
    assert out["call_s"] <= STOP_TIMEOUT + TIMEOUT_LATE_S, out
    assert f"{op} (sequence number {seq})" in out["msg"], out["msg"]
    named = re.search(r"(?:silent ranks|ranks not heard from[^:]*): \[([0-9, ]*)\]", out["msg"])
    assert named and silent in [int(r) for r in named.group(1).replace(" ", "").split(",") if r], out["msg"]


def _stopped_partway(rank, n, port, victim, call, pids, stamps, ready, raised, finish):
    pg = init_group(rank, n, port, timeout=STOP_TIMEOUT)
    check_group_works(pg, ready)  # sequence number 0
    data = np.full(BIG, float(rank), dtype=np.float32)
    if rank == victim:
        arm_signal(pg, 5, signal.SIGSTOP, stamps)  # stops inside call #1, resumed by a survivor
        out = attempt(lambda: call(pg, data))
        out["after_resume_s"] = out["end"] - stamps[n]
    else:
        resumer = min(r for r in range(n) if r != victim)
        try:
            out = attempt(lambda: call(pg, data))  # sequence number 1
            out["fault_s"] = out["end"] - stamps[victim]
            out["broken"] = call_after_failure(pg)
            # resume the victim only once every survivor has raised: it must not change what they see
            out["all_raised"] = finish_together(raised, bound=STOP_TIMEOUT + 2 * TIMEOUT_LATE_S)
        finally:
            if rank == resumer:
                stamps[n] = time.monotonic()
                os.kill(pids[victim], signal.SIGCONT)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


@pytest.mark.parametrize("call, n, victim", [
    (_call_all_reduce, 4, 2),  # over hier: the victim on host b, two survivors on host a
    (_call_broadcast, 3, 0),  # the root stops while streaming
    (_call_spawn_all_reduce, 2, 1),  # stops on its background worker thread
    (_call_all_to_all, 2, 1),  # resumed, it may find all it needs already sent: it must fail anyway
], ids=["all_reduce-n4", "broadcast-root-n3", "spawn_all_reduce-n2", "all_to_all-n2"])
def test_sigstop_partway_times_out_then_resumed_rank_fails_too(call, n, victim, transport, aftermath):
    stamps = CTX.RawArray("d", n + 1)
    pids = CTX.RawArray("q", n)
    results = run_ranks(n, tracked, pids, _stopped_partway, victim, call, pids, stamps, CTX.Barrier(n),
                        CTX.Barrier(n - 1), CTX.Barrier(n), init=False, env=CHUNKS)
    resumed = results[victim]
    outs = {r: out for r, out in enumerate(results) if r != victim}
    name = f"SIGSTOP {call.__name__[6:]} n={n} victim={victim}"
    report_timing(name, outs)
    report_timing(f"{name} (resumed victim, from SIGCONT)", {victim: {**resumed, "fault_s": resumed["after_resume_s"]}})
    first_start = min(out["start"] for out in outs.values())
    for out in outs.values():
        _assert_timed_out(out, _OP_NAMES[call], 1, victim, first_start)
        assert_broken(out, "CollectiveTimeout")
        assert out["all_raised"], out
    # the stopped rank, once resumed, must fail too (its deadline passed), not hang or return
    assert resumed["collective_error"], resumed
    assert resumed["after_resume_s"] < FAULT_NOTICE_S, resumed
    for out in results:
        assert out["finished_together"], out
        assert_closed_cleanly(out)
    aftermath.check(list(pids))


def _stopped_before_barrier(rank, n, port, victim, pids, stamps, ready, raised, finish):
    pg = init_group(rank, n, port, timeout=STOP_TIMEOUT)
    check_group_works(pg, ready)  # sequence number 0
    if rank == victim:
        stamps[n] = float(peers_inside(pg, [(rank - 1) % n], seq=1))  # the previous rank waits inside barrier #1
        stamps[rank] = time.monotonic()
        os.kill(os.getpid(), signal.SIGSTOP)
        return {"kind": "victim resumed; it should have been killed while stopped"}
    try:
        out = attempt(pg.barrier)  # sequence number 1
        out["fault_s"] = out["end"] - stamps[victim]
        out["broken"] = call_after_failure(pg)
        out["all_raised"] = finish_together(raised, bound=STOP_TIMEOUT + 2 * TIMEOUT_LATE_S)
    finally:
        if rank == 0:
            os.kill(pids[victim], signal.SIGKILL)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


def test_sigstop_before_barrier_names_operation_sequence_and_silent_rank(transport, aftermath):
    n, victim = 3, 1  # over hier: hosts 0,1 + 2, so one survivor shares the victim's host and one does not
    pids, stamps = CTX.RawArray("q", n), CTX.RawArray("d", n + 1)
    results = run_ranks(n, tracked, pids, _stopped_before_barrier, victim, pids, stamps, CTX.Barrier(n),
                        CTX.Barrier(n - 1), CTX.Barrier(n - 1), init=False, may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    assert stamps[n] == 1.0, "the victim stopped before the previous rank was inside the barrier"
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing("SIGSTOP before barrier n=3 victim=1", outs)
    first_start = min(out["start"] for out in outs.values())
    for out in outs.values():
        _assert_timed_out(out, "barrier", 1, victim, first_start)
        assert_broken(out, "CollectiveTimeout")
        assert out["all_raised"] and out["finished_together"], out
        assert_closed_cleanly(out)
    aftermath.check(list(pids))


# ---------------------------------------------------------------------------------------------
# a rank that closes its group and exits while the others call a collective
# ---------------------------------------------------------------------------------------------

def _departs(rank, n, port, victim, count, stamps, ready, finish, senders):
    pg = init_group(rank, n, port)
    check_group_works(pg, ready)
    if rank == victim:
        # close once the ranks that send to us first are inside the all_reduce
        out = {"kind": "departed", "inside": peers_inside(pg, senders, seq=1, nbytes=4 * count)}
        stamps[rank] = time.monotonic()
        out.update(close_group(pg))
        out["after_close"] = attempt(pg.barrier)
        return out
    out = attempt(lambda: pg.all_reduce(np.ones(count, dtype=np.float32)))
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = call_after_failure(pg)
    out["finished_together"] = finish_together(finish, bound=FAULT_NOTICE_S + BROKEN_CALL_S)
    out.update(close_group(pg))
    return out


def _departure(n: int, victim: int, count: int, senders: list[int], name: str, aftermath) -> None:
    stamps = CTX.RawArray("d", n)
    results, pids = run_tracked(n, _departs, victim, count, stamps, CTX.Barrier(n), CTX.Barrier(n - 1), senders,
                                env=CHUNKS)
    departed = results[victim]
    assert departed["inside"], departed
    assert_closed_cleanly(departed)
    after = departed["after_close"]  # its own group, closed, refuses calls too
    assert after["kind"] == "InvalidArgument" and "closed" in after["msg"], after
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(name, outs)
    assert_survivors(outs, victim)
    aftermath.check(pids)


def test_rank_closing_early_is_reported_as_lost_peer(transport, aftermath):
    """One-shot all_reduce: every rank waits on the departed one directly (over hosts 0,1 + 2,
    only the leader does, and rank 1 hears of it from rank 0's abort)."""
    senders = [0] if transport == "hier" else [0, 1]
    _departure(3, 2, 100, senders, "clean early exit, small all_reduce n=3 victim=2", aftermath)


def test_rank_closing_early_during_ring_all_reduce_reaches_every_rank(transport, aftermath):
    _departure(4, 3, BIG, [2], "clean early exit, large all_reduce n=4 victim=3", aftermath)


# ---------------------------------------------------------------------------------------------
# mismatched calls at the same sequence number
# ---------------------------------------------------------------------------------------------

class _Call:
    """One side of a mismatch: what a rank calls, and the fields a message must give to describe it."""

    def __init__(self, name: str, run, **fields):
        self.name, self.run = name, run
        self.fields = {k: str(v) for k, v in fields.items()}

    def __call__(self, pg):
        return self.run(pg)

    def described_in(self, msg: str) -> bool:
        """The message describes this call: `name(... key=value ...)` with every field of it."""
        for found in re.finditer(rf"\b{self.name}\(([^)]*)\)", msg):
            given = dict(kv.split("=", 1) for kv in found.group(1).split(", ") if "=" in kv)
            if all(given.get(k) == v for k, v in self.fields.items()):
                return True
        return False

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.fields.items())})"


def _wire(dtype) -> str:
    """The name messages give a dtype (shmcoll's wire type names: f32, f64, i32, ...)."""
    wire = wire_type_of(np.dtype(dtype))
    assert wire is not None, dtype
    return wire.name


def _ar(count=1000, dtype=np.float32, op=ReduceKind.SUM):
    return _Call("all_reduce", lambda pg: pg.all_reduce(np.ones(count, dtype=dtype), op),
                 dtype=_wire(dtype), count=count, op=op.name)


def _bc(root=0, count=1000, dtype=np.float32):
    return _Call("broadcast", lambda pg: pg.broadcast(root, np.ones(count, dtype=dtype)),
                 dtype=_wire(dtype), count=count, root=root)


def _ag(count=1000, dtype=np.float32):
    return _Call("all_gather", lambda pg: pg.all_gather(np.ones(count, dtype=dtype)), dtype=_wire(dtype), count=count)


def _rs(count=1000, dtype=np.float32):
    return _Call("reduce_scatter", lambda pg: pg.reduce_scatter(np.ones(count, dtype=dtype)),
                 dtype=_wire(dtype), count=count, op="SUM")


def _barrier():
    return _Call("barrier", lambda pg: pg.barrier())


def _spawn(count=1000):
    def run(pg):
        return pg.spawn_all_reduce(np.ones(count, dtype=np.float32)).join(timeout=WAIT_HANG_S)
    return _Call("all_reduce", run, dtype="f32", count=count, op="SUM")


def _mismatched(pg, pids, normal, odd_call, odd, ready, finish):
    pids[pg.rank] = os.getpid()
    check_group_works(pg, ready)  # sequence number 0; the mismatch is at sequence number 1
    out = attempt(lambda: (odd_call if pg.rank == odd else normal)(pg))
    out["broken"] = call_after_failure(pg)
    # long enough for a rank that learns within FAULT_NOTICE_S to be measured, short enough that a rank
    # waiting in vain fails the test quickly (the others leave, it then sees a lost peer)
    out["finished_together"] = finish_together(finish, bound=FAULT_NOTICE_S + BROKEN_CALL_S)
    return out


_SUM, _MAX, _MIN, _PROD = ReduceKind.SUM, ReduceKind.MAX, ReduceKind.MIN, ReduceKind.PROD

# (kind:name, world size, odd rank, what the others call, what the odd rank calls). Every rank's
# message must describe both calls (neither can be the warm-up: all_reduce of 8 float64).
MISMATCHES = [
    ("collective:all_reduce-vs-barrier", 2, 1, _ar(), _barrier()),
    ("collective:all_reduce-vs-all_gather", 3, 0, _ar(), _ag()),
    ("collective:all_gather-vs-barrier", 2, 1, _ag(), _barrier()),
    ("collective:all_reduce-vs-reduce_scatter", 4, 3, _ar(), _rs()),  # both one step of the board's all-reduce
    ("collective:spawn_all_reduce-vs-barrier", 2, 0, _spawn(), _barrier()),
    ("collective:all_reduce-vs-broadcast", 2, 1, _ar(), _bc(root=0)),  # rank 0 waits for a frame never sent
    ("collective:broadcast-vs-all_gather-big", 4, 2, _bc(count=BIG), _ag(count=BIG // 4)),
    ("dtype:all_reduce", 2, 1, _ar(), _ar(dtype=np.float64)),
    ("dtype:all_reduce", 3, 2, _ar(), _ar(dtype=np.float64)),
    ("dtype:all_reduce", 4, 0, _ar(), _ar(dtype=np.float64)),
    ("dtype:all_reduce-int-vs-float", 3, 1, _ar(dtype=np.int32), _ar(dtype=np.float32)),
    ("dtype:all_reduce-big", 4, 1, _ar(BIG), _ar(BIG, dtype=np.float64)),
    ("dtype:all_gather", 2, 0, _ag(), _ag(dtype=np.float64)),
    ("dtype:broadcast-downstream", 3, 2, _bc(), _bc(dtype=np.int32)),
    ("length:all_reduce", 2, 0, _ar(), _ar(count=1001)),
    ("length:all_reduce", 4, 3, _ar(), _ar(count=1001)),
    ("length:all_reduce-big", 4, 2, _ar(BIG), _ar(BIG + 1)),
    ("length:all_reduce-small-vs-big", 3, 1, _ar(), _ar(BIG)),  # the two sides pick different algorithms
    ("length:spawn_all_reduce", 3, 2, _spawn(), _spawn(1001)),
    ("length:all_gather", 2, 1, _ag(), _ag(count=999)),
    ("length:all_gather-ring", 4, 3, _ag(), _ag(count=999)),  # ranks 1, 2 only hear from ranks that match
    ("length:broadcast-root", 2, 0, _bc(), _bc(count=1001)),  # the root waits for the last rank's ack
    ("length:broadcast-downstream", 3, 2, _bc(), _bc(count=1001)),
    ("op:all_reduce", 3, 0, _ar(), _ar(op=_MAX)),
    ("op:all_reduce", 4, 2, _ar(), _ar(op=_MIN)),
    ("op:all_reduce-big", 4, 1, _ar(BIG), _ar(BIG, op=_PROD)),
    ("root:broadcast-both-claim-root", 2, 1, _bc(root=0), _bc(root=1)),
    ("root:broadcast-roots-swapped", 2, 1, _bc(root=1), _bc(root=0)),  # both wait to receive: nobody sends
    ("root:broadcast-downstream", 3, 2, _bc(root=0), _bc(root=1)),
    ("root:broadcast-big", 4, 3, _bc(root=0, count=BIG), _bc(root=2, count=BIG)),
]


def _run_mismatch(n, normal, odd_call, odd):
    pids = CTX.RawArray("q", n)
    results = run_ranks(n, _mismatched, pids, normal, odd_call, odd, CTX.Barrier(n), CTX.Barrier(n), env=CHUNKS,
                        group_timeout=NEVER_S)
    last_call = max(out["start"] for out in results)  # the mismatch exists once every rank has called
    for out in results:
        out["fault_s"] = out["end"] - last_call
    return results, list(pids)


@pytest.mark.parametrize("name, n, odd, normal, odd_call", MISMATCHES,
                         ids=[f"{m[0].replace(':', '-')}-n{m[1]}-odd{m[2]}" for m in MISMATCHES])
def test_mismatch_raises_on_every_rank(name, n, odd, normal, odd_call, transport, aftermath):
    results, pids = _run_mismatch(n, normal, odd_call, odd)
    report_timing(f"mismatch {name} n={n} odd={odd}", dict(enumerate(results)))
    for out in results:
        assert out["kind"] == "CollectiveMismatch", out
        assert out["call_s"] < FAULT_NOTICE_S and out["fault_s"] < FAULT_NOTICE_S, out
        assert "sequence number 1" in out["msg"], out["msg"]
        for call in (normal, odd_call):
            assert call.described_in(out["msg"]), f"{call} is not described in: {out['msg']}"
        assert_broken(out, "CollectiveMismatch")
        assert out["finished_together"], out
    aftermath.check(pids)


# ---------------------------------------------------------------------------------------------
# start-up: ranks that never arrive, die while the transport is built, or hold the wrong secret
# ---------------------------------------------------------------------------------------------
# The rendezvous (rank 0's store, the host ids every rank publishes) comes before any transport is
# chosen: a rank missing there, a missing rank 0 and a wrong secret play out the same whatever the
# transport, so those tests run once ("any" in the timing table). A rank that dies after the
# rendezvous, while its transport is being built, is transport-specific and runs over every one.

def _rendezvous(rank, n, port, timeouts, secrets):
    """Rank r calls init with timeouts[r] (None: never arrives) and SHMCOLL_SECRET secrets[r]."""
    if timeouts[rank] is None:
        return {"kind": "absent"}
    if secrets is not None:
        os.environ["SHMCOLL_SECRET"] = secrets[rank]
    groups = []
    out = attempt(lambda: groups.append(init_group(rank, n, port, timeout=timeouts[rank])))
    if groups:
        pg = groups[0]
        x = np.full(5, rank + 1, dtype=np.int64)
        pg.all_reduce(x)
        out["sum"] = int(x[0])
        out.update(close_group(pg))
    else:
        out.update(leftovers())
    return out


def test_rendezvous_names_the_rank_that_never_arrives(aftermath):
    # Rank 0 waits longest: with equal timeouts rank 0 may stop serving the store first, and then the
    # others see a raw EOFError (test_rendezvous_error_is_collective_error_when_rank0_gives_up_first).
    timeouts = [3.0, 2.0, None]
    results, pids = run_tracked(3, _rendezvous, timeouts, None)
    report_timing("rendezvous, rank 2 never arrives", {r: results[r] for r in (0, 1)}, label="any")
    for rank in (0, 1):
        out = results[rank]
        assert out["kind"] == "CollectiveTimeout" and out["timeout_error"], out
        assert "ranks [2] never arrived" in out["msg"], out["msg"]
        # the first rank to give up tells the others why, so nobody waits longer than its own timeout
        assert min(t for t in timeouts if t) - 0.1 <= out["call_s"] < timeouts[rank] + TIMEOUT_LATE_S, out
        assert_nothing_running(out)
    aftermath.check(pids)


def test_rendezvous_without_rank_0_says_so(aftermath):
    results, pids = run_tracked(3, _rendezvous, [None, 2.0, 2.0], None)
    report_timing("rendezvous, rank 0 never arrives", {r: results[r] for r in (1, 2)}, label="any")
    for out in results[1:]:
        assert out["kind"] == "CollectiveTimeout" and out["timeout_error"], out
        assert "rank 0" in out["msg"], out["msg"]
        assert 1.9 <= out["call_s"] < 2.0 + TIMEOUT_LATE_S, out
        assert_nothing_running(out)
    aftermath.check(pids)


def test_rendezvous_error_is_collective_error_when_rank0_gives_up_first(aftermath):
    results, pids = run_tracked(3, _rendezvous, [1.0, 4.0, None], None)
    assert results[0]["kind"] == "CollectiveTimeout", results[0]
    assert results[1]["collective_error"], results[1]
    for out in results[:2]:
        assert_nothing_running(out)
    aftermath.check(pids)


def _dies_building_transport(rank, n, port, victim, stamps, segments_ready):
    """The victim kills itself at the first rendezvous step after the host ids: the transport is
    being built (its shared memory created or attached, its TCP listener published or not). Over
    shared memory it first waits (bounded) until every host's leader has published its segment in
    the store (bootstrap's "host/<rank>" and "shm/<host id>" keys), so no create_segment of this job,
    which sweeps the names of dead creators, comes after its death: what is left in /dev/shm then
    depends on the library's handling of the death alone."""
    if rank == victim:
        real_gather = shmcoll.bootstrap._gather

        def gather(cfg, client, kind, value, deadline, *rest):
            if kind != "host":
                if cfg.transport != "tcp":
                    bound = time.monotonic() + SETUP_TIMEOUT / 2
                    hosts, _ = client.wait([f"host/{r}" for r in range(n)], bound)  # [host id, pid, ...] each
                    host_ids = {json.loads(v)[0] for v in hosts.values()}
                    _, missing = client.wait([f"shm/{h}" for h in host_ids], bound)
                    segments_ready.value = not missing and len(hosts) == n
                stamps[rank] = time.monotonic()
                os.kill(os.getpid(), signal.SIGKILL)
            return real_gather(cfg, client, kind, value, deadline, *rest)

        shmcoll.bootstrap._gather = gather
    out = attempt(lambda: init_group(rank, n, port, timeout=SETUP_TIMEOUT).close())
    out["fault_s"] = out["end"] - stamps[victim]
    out.update(leftovers())
    return out


@pytest.mark.parametrize("transport, victim, leader", [
    ("tcp", 0, False), ("tcp", 2, False),
    ("shm", 0, True),  # rank 0 serves the store and leads the host
    ("shm", 2, False),
    ("hier", 0, True),  # host a's leader (with rank 1) and the store
    ("hier", 2, True),  # host b's only rank, so its leader
], indirect=["transport"])
def test_rank_killed_while_transport_is_built(transport, victim, leader, aftermath):
    """leader: the victim created its host's segment (and dies before the others attached)."""
    n = 3
    stamps, segments_ready = CTX.RawArray("d", n), CTX.RawValue("b", transport == "tcp")
    watch = ShmCreations()
    try:
        results, pids = run_tracked(n, _dies_building_transport, victim, stamps, segments_ready, may_die={victim})
        others = watch.shmcoll_by_others(pids)
    finally:
        watch.close()
    assert results[victim] == Died(-signal.SIGKILL)
    assert segments_ready.value, "the victim died before every host's segment existed"
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(f"killed while the transport is built n={n} victim={victim}", outs)
    for out in outs.values():
        assert out["kind"] in ("CollectiveTimeout", "PeerLost") and out["collective_error"], out
        # rank 0 serves the store: its death is seen at once; any other is missed at the deadline
        assert re.search(rf"\branks? \[?{victim}\b", out["msg"]), out["msg"]
        assert out["call_s"] <= SETUP_TIMEOUT + TIMEOUT_LATE_S, out
        assert_nothing_running(out)
    if leader and others and not shm_names_of(pids):
        pytest.skip(f"another shmcoll job on this machine created {others[:3]} meanwhile, and with it swept "
                    f"the names of dead creators: whether this job left its segment cannot be told")
    aftermath.check(pids)


def _dies_in_mesh(rank, n, port, victim, stamps):
    """The victim published its TCP address and dies as it starts connecting its mesh, so the
    others wait for a connection (or a listener) that never comes."""
    if rank == victim:
        import shmcoll.bootstrap

        def connect_mesh(*args, **kwargs):
            stamps[rank] = time.monotonic()
            os.kill(os.getpid(), signal.SIGKILL)

        shmcoll.bootstrap.connect_mesh = connect_mesh
    out = attempt(lambda: init_group(rank, n, port, timeout=NEVER_S).close())
    out["fault_s"] = out["end"] - stamps[victim]
    out.update(leftovers())
    return out


@pytest.mark.parametrize("victim", [1, 3])
def test_rank_killed_while_the_mesh_connects_is_named_promptly(victim, aftermath, monkeypatch):
    """With a long timeout: the store sees the victim's connection drop and every rank's mesh wait
    looks at the store, so nobody waits out the timeout."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "tcp")
    n = 4
    stamps = CTX.RawArray("d", n)
    results, pids = run_tracked(n, _dies_in_mesh, victim, stamps, may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    outs = {r: out for r, out in enumerate(results) if r != victim}
    report_timing(f"killed while the mesh connects n={n} victim={victim}", outs)
    for out in outs.values():
        assert out["kind"] == "PeerLost" and out["peer"] == victim, out
        assert out["fault_s"] < FAULT_NOTICE_S and out["call_s"] < NEVER_S / 2, out
        assert_nothing_running(out)
    aftermath.check(pids)


def _ordered_start(rank, n, port, started):
    """Ranks call init from the highest to the lowest, rank 0 last: each first waits for the rank above
    it to have started its own init, and checks the rendezvous port still refuses connections (rank 0
    is not serving yet), so the others really start, and retry, before rank 0 exists."""
    if rank < n - 1 and not started[rank + 1].wait(WAIT_HANG_S):
        return {"kind": "rank above never started"}
    refused = True
    if rank > 0:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=NO_WAIT_S).close()
            refused = False
        except ConnectionRefusedError:
            pass
    started[rank].set()
    with init_group(rank, n, port, timeout=WAIT_HANG_S) as pg:
        x = np.full(7, rank + 1.0, dtype=np.float32)
        pg.all_reduce(x)
        pg.barrier()
        return {"kind": "formed", "refused": refused, "sum": float(x[0])}


def test_ranks_starting_before_rank_0_still_meet(aftermath):
    n = 4
    results, pids = run_tracked(n, _ordered_start, [CTX.Event() for _ in range(n)])
    for out in results:
        assert out["kind"] == "formed", out
        assert out["refused"], "rank 0 was already serving: the late start was not tested"
        assert out["sum"] == n * (n + 1) / 2
    aftermath.check(pids)


# ---------------------------------------------------------------------------------------------
# the job secret (checked at the rendezvous, before any transport: run once)
# ---------------------------------------------------------------------------------------------

def test_wrong_secret_keeps_that_rank_out(aftermath):
    # rank 0 waits longest, as above
    results, pids = run_tracked(3, _rendezvous, [3.0, 2.0, 2.0], ["s3cret", "s3cret", "wrong"])
    report_timing("wrong secret on rank 2", dict(enumerate(results)), label="any")
    for out in results[:2]:
        assert out["kind"] == "CollectiveTimeout", out
        assert "ranks [2] never arrived" in out["msg"], out["msg"]
    intruder = results[2]
    assert intruder["kind"] not in ("returned", "absent"), intruder
    assert "SHMCOLL_SECRET" in intruder["msg"], intruder
    assert intruder["call_s"] < SECRET_REFUSAL_S, intruder
    for out in results:
        assert_nothing_running(out)
    aftermath.check(pids)


def test_wrong_secret_error_is_a_collective_error(aftermath):
    results, pids = run_tracked(2, _rendezvous, [1.0, 1.0], ["s3cret", "wrong"])
    assert results[1]["collective_error"], results[1]
    aftermath.check(pids)


def test_same_secret_forms_the_job(transport, aftermath):
    results, pids = run_tracked(3, _rendezvous, [WAIT_HANG_S] * 3, ["s3cret"] * 3)
    for out in results:
        assert out["kind"] == "returned", out
        assert out["sum"] == 6
        assert_closed_cleanly(out)
    aftermath.check(pids)


# ---------------------------------------------------------------------------------------------
# nothing of shmcoll keeps running after close()
# ---------------------------------------------------------------------------------------------

def _store_after_close(rank, n, port):
    pg = init_group(rank, n, port, timeout=WAIT_HANG_S)
    pg.barrier()
    pg.close()
    if rank != 0:
        return None
    for thread in threading.enumerate():  # a generous grace period, in case close() only signals them
        if thread.name.startswith("shmcoll-"):
            thread.join(CLOSE_S)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("shmcoll-"))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=NO_WAIT_S).close()
        listening = True
    except OSError:
        listening = False
    return {"threads": left, "still_listening": listening}


def test_store_thread_and_port_released_after_close(transport, aftermath):
    results, pids = run_tracked(2, _store_after_close)
    out = results[0]
    assert out["threads"] == [], out
    assert not out["still_listening"], out
    aftermath.check(pids)
