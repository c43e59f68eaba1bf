"""The shared-memory transport in real processes: no leaks (not even after kill -9 of every rank),
set-up failures that say what to do, deadlock freedom with tiny rings, tag routing through the
mailbox, threads sharing a channel, and dead or departed peers.

Every rank is a forked process with a real ProcessGroup over transport="shm". Nothing here waits a
fixed time for something to happen: a test that needs a peer to be at some point waits (bounded) for
a sign that it is there (a slot it filled, a frame it sent, its process gone). Every wait is
bounded, by run_ranks' own deadline, by pytest-timeout, or by the bound passed to the wait.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import shmcoll
from shmcoll import ReduceKind
from shmcoll.config import derive_job_id
from shmcoll.runner import Plan
from shmcoll.transport import shm_segment
from shmcoll.transport.shm_board import entry_header
from shmcoll.transport.shm_layout import Layout
from shmcoll.transport.shm_segment import pid_alive
from shmcoll.types import I64, U8, Collective

from bounds import BROKEN_CALL_S, FAULT_NOTICE_S, NEVER_S, REAP_S, SETUP_FAILURE_S, WAIT_HANG_S
from faults import peers_inside
from harness import CTX, Died, WaitTimedOut, attempt, finish_together, run_ranks, wait_until
from params import BANDWIDTH_PATHS, reduced, small_ints

pytestmark = pytest.mark.multiprocess

SHM = {"SHMCOLL_TRANSPORT": "shm"}
TINY_RING = {**SHM, "SHMCOLL_SHM_SLOTS": "2", "SHMCOLL_SHM_SLOT_BYTES": "4096"}
TINIEST_RING = {**SHM, "SHMCOLL_SHM_SLOTS": "2", "SHMCOLL_SHM_SLOT_BYTES": "64", "SHMCOLL_CHUNK_BYTES": "4096"}
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _shm_entries() -> set[str]:
    return {n for n in os.listdir(shm_segment.SHM_DIR) if "shmcoll" in n}


def _creator(entry: str) -> int | None:
    """The creator pid in a shmcoll name ('[sem.]shmcoll-<pid>-<job>-...'), if it has one."""
    parts = entry.removeprefix("sem.").split("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _leftovers(before: set[str], ours: set[int] = frozenset()) -> set[str]:
    """shmcoll names that appeared since `before`, except those of live processes of other jobs
    (another test run on this machine may be between its create and its unlink right now)."""
    new = _shm_entries() - before
    return {e for e in new if _creator(e) in ours or _creator(e) is None or not pid_alive(_creator(e))}


def _init(rank: int, n: int, port: int, timeout: float = NEVER_S, **kwargs):
    return shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=timeout,
                        **kwargs)


def _warm_up(pg, ready) -> None:
    """Collective number 0, then an out-of-band barrier: nobody is still inside call 0 afterwards."""
    x = np.full(8, pg.rank + 1.0)
    pg.all_reduce(x)
    assert np.all(x == pg.world_size * (pg.world_size + 1) / 2)
    assert ready.wait(timeout=WAIT_HANG_S) is not None


def _wait_gone(pid: int) -> bool:
    """Until process pid no longer exists (or is a zombie); False if it is still there after REAP_S."""
    try:
        return wait_until(lambda: not pid_alive(pid), REAP_S, f"process {pid} to be gone", interval=0.002)
    except WaitTimedOut:
        return False


def _pattern(rank: int, nbytes: int, tag: int = 0) -> np.ndarray:
    """nbytes of data that differ by rank, tag and position (so a misplaced slot is caught)."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    return (words * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1000 * rank + tag)).reshape(-1, 4)


# ---------------------------------------------------------------------------------------------
# 1. nothing left in /dev/shm: after a normal job, while it runs, and after kill -9 of every rank
# ---------------------------------------------------------------------------------------------

def _normal_job(rank, n, port, pids):
    pids[rank] = os.getpid()
    with _init(rank, n, port) as pg:
        assert type(pg.transport).__name__ == "ShmTransport"
        job = derive_job_id("127.0.0.1", port, n)
        during = sorted(e for e in _shm_entries() if job in e)  # init returned: the names are gone already
        x = np.full(100_000, float(rank), dtype=np.float32)
        pg.all_reduce(x)
        assert np.all(x == n * (n - 1) / 2)
        gathered = pg.all_gather(np.array([rank], dtype=np.int64))
        pg.barrier()
        return during, gathered.tolist()


def test_no_names_left_after_a_normal_job():
    n = 3
    before = _shm_entries()
    pids = CTX.RawArray("q", n)
    results = run_ranks(n, _normal_job, pids, init=False, env=SHM)
    for during, gathered in results:
        assert during == [], f"names still in /dev/shm after init() returned: {during}"
        assert gathered == list(range(n))
    assert not _leftovers(before, set(pids)), "shared memory left behind by a normal job"


def _big_all_reduces_until_killed(rank, n, port, pids, inside, bound):
    pids[rank] = os.getpid()
    pg = _init(rank, n, port)
    data = np.full(4 * MIB, float(rank), dtype=np.float32)  # 16 MiB: many slots per ring step
    pg.all_reduce(data, ReduceKind.MAX)
    inside.release()  # "I am in the loop"
    end = time.monotonic() + bound
    while time.monotonic() < end:
        pg.all_reduce(data, ReduceKind.MAX)
    return "not killed"


def test_no_names_left_after_kill_9_of_every_rank_mid_all_reduce():
    n = 3
    before = _shm_entries()
    pids, inside = CTX.RawArray("q", n), CTX.Semaphore(0)
    killed = []

    def killer():
        for _ in range(n):
            if not inside.acquire(timeout=WAIT_HANG_S):
                return
        for pid in list(pids):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    results = run_ranks(n, _big_all_reduces_until_killed, pids, inside, WAIT_HANG_S, init=False, env=SHM,
                        may_die=set(range(n)))
    thread.join(timeout=REAP_S)
    assert len(killed) == n, "the ranks never all reported being inside the loop"
    assert results == [Died(-signal.SIGKILL)] * n
    assert not _leftovers(before, set(pids)), "shared memory left behind after kill -9 of every rank"


# ---------------------------------------------------------------------------------------------
# 2. a crash between create and unlink: the stale sweep removes exactly those names
# ---------------------------------------------------------------------------------------------

def _names_of(prefix: str) -> set[str]:
    """The one name a segment has in /dev/shm: the segment itself (no semaphores)."""
    return {f"{prefix.lstrip('/')}-mem"}


def _create_and_crash(job, conn):
    seg = shm_segment.create_segment(job, Layout(2, 4096, 2))
    conn.send(seg.prefix)
    conn.close()
    os._exit(0)  # no unlink: a crash in the create-to-unlink window


def _crashed_creator(job: str) -> set[str]:
    """Names a child process created and never unlinked (it has exited and been reaped)."""
    parent_end, child_end = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=_create_and_crash, args=(job, child_end), daemon=True)
    proc.start()
    child_end.close()
    try:
        assert parent_end.poll(WAIT_HANG_S), "the creating child reported nothing"
        prefix = parent_end.recv()
    finally:
        proc.join(REAP_S)
    assert proc.exitcode == 0
    assert prefix.startswith(f"/shmcoll-{proc.pid}-{job}")
    names = _names_of(prefix)
    assert names <= _shm_entries(), f"the crashed creator's names are not in /dev/shm: {names - _shm_entries()}"
    return names


def test_stale_sweep_removes_exactly_a_crashed_creators_names():
    shm_segment.sweep_stale()  # whatever earlier crashes left, so what follows is exactly ours
    live = shm_segment.create_segment("leaktest-live", Layout(2, 4096, 2))  # this process: alive
    try:
        live_names = _names_of(live.prefix)
        assert live_names <= _shm_entries()
        stale = _crashed_creator("leaktest")
        removed = set(shm_segment.sweep_stale())
        assert removed == stale
        assert not stale & _shm_entries()
        assert live_names <= _shm_entries(), "the sweep removed names of a live process"
        assert shm_segment.sweep_stale() == []  # idempotent
    finally:
        live.unlink()
        live.close()
    assert not live_names & _shm_entries()


def _shm_job(pg):
    pg.barrier()
    return type(pg.transport).__name__


def test_a_new_jobs_init_sweeps_a_crashed_creators_names():
    stale = _crashed_creator("leaktest2")
    before = _shm_entries() - stale
    assert run_ranks(2, _shm_job, env=SHM) == ["ShmTransport"] * 2
    assert not stale & _shm_entries(), "init() did not sweep names of a creator that no longer exists"
    assert not _leftovers(before)


# ---------------------------------------------------------------------------------------------
# 3. too little /dev/shm: an actionable CollectiveError on every rank, promptly, nothing left
# ---------------------------------------------------------------------------------------------

def _signal_when_leader_published(rank, leader_failed) -> None:
    """On rank 0, set leader_failed right after it publishes its start-up failure in the store."""
    import shmcoll.bootstrap
    if rank != 0 or leader_failed is None:
        return
    real_publish = shmcoll.bootstrap._publish_failure

    def publish_then_signal(*args, **kwargs):
        real_publish(*args, **kwargs)
        leader_failed.set()

    shmcoll.bootstrap._publish_failure = publish_then_signal


def _init_with_tiny_shm(rank, n, port, patch_bootstrap, leader_failed=None):
    """init(transport='shm') with /dev/shm reported almost full. With leader_failed, the other ranks
    ask for the leader's shared-memory names only once the leader has failed and published why (it
    then keeps the store up a little while for them)."""
    import shmcoll.bootstrap
    shmcoll.transport.shm_segment.free_bytes = lambda: 4096  # forked: this process only
    if patch_bootstrap:
        shmcoll.bootstrap.free_bytes = lambda: 4096
    _signal_when_leader_published(rank, leader_failed)
    if leader_failed is not None and rank != 0:
        real_attach = shmcoll.bootstrap._attach

        def late_attach(*args, **kwargs):
            assert leader_failed.wait(WAIT_HANG_S), "rank 0 never published its failure"
            return real_attach(*args, **kwargs)

        shmcoll.bootstrap._attach = late_attach
    out = attempt(lambda: _init(rank, n, port, transport="shm").close())
    if rank == 0 and leader_failed is not None:
        leader_failed.set()
    return out


def _says_how_to_fix(msg: str, create_check: bool) -> bool:
    return "--shm-size" in msg and "transport='tcp'" in msg and (not create_check or "SHMCOLL_SHM_SLOT_BYTES" in msg)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("patch_bootstrap", [True, False], ids=["fit_layout-fails", "create-check-fails"])
def test_too_little_dev_shm_fails_every_rank_promptly(n, patch_bootstrap):
    before = _shm_entries()
    results = run_ranks(n, _init_with_tiny_shm, patch_bootstrap, init=False)
    for rank, out in enumerate(results):
        assert out["collective_error"], (rank, out)
        assert out["call_s"] < SETUP_FAILURE_S, (rank, out)  # far below the group timeout, NEVER_S
    assert _says_how_to_fix(results[0]["msg"], not patch_bootstrap), results[0]["msg"]
    for rank, out in enumerate(results[1:], 1):  # the leader's reason reaches every rank
        assert _says_how_to_fix(out["msg"], not patch_bootstrap), (rank, out["msg"])
    assert not _leftovers(before)


@pytest.mark.parametrize("n", [2, 3])
def test_too_little_dev_shm_every_rank_says_how_to_fix_it_even_when_late(n):
    results = run_ranks(n, _init_with_tiny_shm, True, CTX.Event(), init=False)
    for rank, out in enumerate(results):
        assert out["collective_error"] and out["call_s"] < SETUP_FAILURE_S, (rank, out)
        assert _says_how_to_fix(out["msg"], False), (rank, out["msg"])


# ---------------------------------------------------------------------------------------------
# 4. host ids: shm refuses several hosts; auto falls back to TCP, or picks shm on one host
# ---------------------------------------------------------------------------------------------

def _with_host_id(rank, n, port, host_ids, transport, leader_failed=None):
    """init() with this rank's SHMCOLL_HOST_ID. With leader_failed, ranks > 0 publish their host id
    but read everyone's only once rank 0 has failed and published why."""
    import shmcoll.bootstrap
    os.environ["SHMCOLL_HOST_ID"] = host_ids[rank]
    _signal_when_leader_published(rank, leader_failed)
    if leader_failed is not None and rank != 0:
        real_gather = shmcoll.bootstrap._gather

        def late_gather(cfg, client, kind, value, deadline, *rest):
            if kind == "host":
                client.set(f"host/{cfg.rank}", value, deadline)
                assert leader_failed.wait(WAIT_HANG_S), "rank 0 never published its failure"
            return real_gather(cfg, client, kind, value, deadline, *rest)

        shmcoll.bootstrap._gather = late_gather
    holder = {}

    def run():
        with _init(rank, n, port, transport=transport) as pg:
            holder["transport"] = type(pg.transport).__name__
            x = np.full(3, rank + 1.0)
            pg.all_reduce(x)
            holder["sum"] = x.tolist()
    out = attempt(run)
    if rank == 0 and leader_failed is not None:
        leader_failed.set()
    out.update(holder)
    return out


def _says_several_hosts(out: dict) -> bool:
    return out["kind"] == "InvalidArgument" and out["invalid"] and "span" in out["msg"] and "HOST_ID" in out["msg"]


@pytest.mark.parametrize("n", [2, 3])
def test_shm_refuses_ranks_on_several_hosts(n):
    results = run_ranks(n, _with_host_id, [f"host{r}" for r in range(n)], "shm", init=False)
    for rank, out in enumerate(results):
        assert out["collective_error"] and out["call_s"] < SETUP_FAILURE_S, (rank, out)
    assert _says_several_hosts(results[0]), results[0]
    for rank, out in enumerate(results):
        assert _says_several_hosts(out), (rank, out)


@pytest.mark.parametrize("n", [2, 3])
def test_shm_refuses_several_hosts_on_every_rank_even_when_late(n):
    results = run_ranks(n, _with_host_id, [f"host{r}" for r in range(n)], "shm", CTX.Event(), init=False)
    for rank, out in enumerate(results):
        assert _says_several_hosts(out), (rank, out)


@pytest.mark.parametrize("host_ids, choice, want", [
    (["a", "b", "c"], "auto", "HierarchicalTransport"),
    (["a", "a", "b"], "auto", "HierarchicalTransport"),
    (["a", "a", "b"], "hier", "HierarchicalTransport"),
    (["a", "a", "b"], "tcp", "NetTransport"),
    (["same", "same", "same"], "auto", "ShmTransport"),
    (["same", "same", "same"], "hier", "ShmTransport"),
    (["same", "same", "same"], "tcp", "NetTransport"),
], ids=["all-differ", "two-hosts", "two-hosts-hier", "two-hosts-tcp", "one-host", "one-host-hier", "one-host-tcp"])
def test_auto_picks_the_hierarchy_across_hosts_and_shm_on_one(host_ids, choice, want):
    n = len(host_ids)
    for rank, out in enumerate(run_ranks(n, _with_host_id, host_ids, choice, init=False)):
        assert out["kind"] == "returned" and out["transport"] == want, (rank, out)
        assert out["sum"] == [n * (n + 1) / 2] * 3


# ---------------------------------------------------------------------------------------------
# 5. deadlock freedom: everyone sends a message many times the ring before anyone receives
# ---------------------------------------------------------------------------------------------

def _send_then_recv(pg, nbytes):
    n, r = pg.world_size, pg.rank
    right, left = (r + 1) % n, (r - 1) % n
    start = time.monotonic()
    pg.send(right, 5, _pattern(r, nbytes, 5))
    got = pg.recv(left, 5)
    took = time.monotonic() - start
    want = _pattern(left, nbytes, 5)
    return got.dtype == want.dtype and got.shape == want.shape and bool(np.array_equal(got, want)), took


@pytest.mark.parametrize("n, nbytes", [(2, 32 * MIB), (3, 16 * MIB)], ids=["pair-32MiB", "ring3-16MiB"])
def test_simultaneous_large_sends_do_not_deadlock(n, nbytes):
    results = run_ranks(n, _send_then_recv, nbytes, env=TINY_RING)
    print(f"\n[timing] n={n} {nbytes >> 20} MiB through 2 x 4 KiB slots: "
          + ", ".join(f"{took:.2f}s" for _, took in results))
    assert [ok for ok, _ in results] == [True] * n


# ---------------------------------------------------------------------------------------------
# 6. tags: a message on another tag moves out of the ring; one (src, tag) keeps send order
# ---------------------------------------------------------------------------------------------

def _small_overtakes_large(pg):
    if pg.rank == 0:
        pg.send(1, 1, _pattern(0, 4 * MIB, 1))  # 1024 slots: returns only once rank 1 drained it
        pg.send(1, 2, np.array([7, 8, 9], dtype=np.int16))
        return None
    small = pg.recv(0, 2)
    large = pg.recv(0, 1)
    return small.tolist(), small.dtype.name, bool(np.array_equal(large, _pattern(0, 4 * MIB, 1)))


def test_receiving_another_tag_first_moves_the_large_message_to_the_mailbox():
    _, (small, dtype, large_ok) = run_ranks(2, _small_overtakes_large, env=TINY_RING)
    assert small == [7, 8, 9] and dtype == "int16"
    assert large_ok


MESSAGE_BYTES = [8, 4096, 4097, 3 * 4096 + 5, 40_000, 0, 1]  # within one slot, exactly one, several


def _fifo_two_tags(pg, count):
    if pg.rank == 0:
        for i in range(count):
            tag = 5 + i % 2
            pg.send(1, tag, np.full(MESSAGE_BYTES[i % len(MESSAGE_BYTES)], i % 251, dtype=np.uint8))
        return None
    got = {}
    for tag in (6, 5):  # everything of tag 6 first: all of tag 5 moves through the mailbox
        got[tag] = [pg.recv(0, tag) for _ in range(count // 2)]
    return {tag: [(len(a), int(a[0]) if len(a) else None, bool(np.all(a == a[:1]))) for a in arrays]
            for tag, arrays in got.items()}


def test_one_source_and_tag_keeps_send_order_across_many_slots():
    count = 60
    _, got = run_ranks(2, _fifo_two_tags, count, env=TINY_RING)
    for tag in (5, 6):
        sizes = [MESSAGE_BYTES[i % len(MESSAGE_BYTES)] for i in range(count)]
        want = [(sizes[i], i % 251 if sizes[i] else None, True) for i in range(count) if 5 + i % 2 == tag]
        assert got[tag] == want, tag


def _threads_share_a_channel(pg, per_thread):
    if pg.rank == 0:
        errors = []

        def sender(tag):
            try:
                for i in range(per_thread):
                    pg.send(1, tag, _pattern(tag, 4096 * (1 + i % 4) + 32 * i, i))
            except BaseException as exc:  # reported to the parent
                errors.append(repr(exc))

        threads = [threading.Thread(target=sender, args=(tag,)) for tag in (10, 11, 12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=WAIT_HANG_S)
        return errors, [t.is_alive() for t in threads]
    ok = {}
    for tag in (12, 10, 11):
        ok[tag] = [bool(np.array_equal(pg.recv(0, tag), _pattern(tag, 4096 * (1 + i % 4) + 32 * i, i)))
                   for i in range(per_thread)]
    return ok


def test_threads_sending_on_one_channel_keep_messages_whole_and_ordered():
    per_thread = 25
    (errors, alive), ok = run_ranks(2, _threads_share_a_channel, per_thread, env=TINY_RING)
    assert errors == [] and not any(alive)
    assert ok == {tag: [True] * per_thread for tag in (10, 11, 12)}


def _frame_ahead_of_a_board_step(pg, sent, looked):
    """One call, as a two-level call runs (a board barrier, then frames on the call's own tag):
    rank 1 sends its frame of the call before it takes the board step; rank 0 waits on the board,
    its guard drains the ring meanwhile (looked is set once it has), then receives the frame."""
    got, nothing = np.zeros(4, dtype=np.int64), np.zeros(0, dtype=np.uint8)

    def body(c):
        board = pg.transport.board
        if c.rank == 1:
            c.t.send(0, c.tag, np.arange(4, dtype=np.int64), I64.code, c.meta, c.deadline)
            sent.set()
            assert looked.wait(WAIT_HANG_S)  # rank 0's guard ran with the frame in its ring
        else:
            assert sent.wait(WAIT_HANG_S)

        def guard():
            check = c.board_guard()

            def looking(src=None):
                try:
                    check(src)
                finally:
                    looked.set()
            return looking
        board.all_reduce(c.meta.seq, nothing, entry_header(c.rank, c.meta, c.code, nothing), c.code,
                         int(ReduceKind.SUM), c.deadline, guard, c.meta)
        if c.rank == 0:
            c.t.recv_into(1, c.tag, got, I64.code, c.deadline, c.meta)

    pg._runner.run(Plan(Collective.BARRIER, U8.code, 0, body))
    return got.tolist()


def test_a_board_step_leaves_a_frame_of_its_own_call_for_the_receive_after_it():
    """The guard of a board wait used to take such a frame for a mismatch and drop it (the failure
    it reported was dropped too once the step completed), so the receive after it never came."""
    got, _ = run_ranks(2, _frame_ahead_of_a_board_step, CTX.Event(), CTX.Event(), env=SHM)
    assert got == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# 7. a spawned all-reduce on the worker thread while the main thread talks to the same peer
# ---------------------------------------------------------------------------------------------

def _spawn_and_p2p(pg, count, rounds):
    r, peer = pg.rank, 1 - pg.rank
    data = np.full(count, float(r + 1), dtype=np.float32)
    in_flight = None
    if r == 0:
        handle = pg.spawn_all_reduce(data)
    for i in range(rounds):
        if r == 0 and i == rounds - 1:
            in_flight = not handle.done()  # rank 1 spawns only after this round: cannot be done yet
        pg.send(peer, 3, _pattern(r, 8 * 1024 + 64 * i, i))
        got = pg.recv(peer, 3)
        assert np.array_equal(got, _pattern(peer, 8 * 1024 + 64 * i, i)), f"p2p round {i} corrupted"
    if r == 1:
        handle = pg.spawn_all_reduce(data)
    for i in range(rounds):  # both workers stream the all-reduce while the main threads exchange
        pg.send(peer, 4, _pattern(r, 4096 * (i % 3 + 1), i))
        assert np.array_equal(pg.recv(peer, 4), _pattern(peer, 4096 * (i % 3 + 1), i)), f"round {i}"
    result = handle.join(timeout=WAIT_HANG_S)
    wrong = np.flatnonzero(result != 3.0)
    return in_flight, (len(wrong), wrong[:5].tolist(), result[wrong[:5]].tolist()), result is data


# Two threads of one rank receiving from the same peer: one may move the other's message from the
# ring into the mailbox while that one waits for the ring's lock (ShmTransport._pump looks again).


def test_spawned_all_reduce_and_main_thread_p2p_share_the_peer():
    out = run_ranks(2, _spawn_and_p2p, 2 * MIB, 20, env=TINY_RING, group_timeout=WAIT_HANG_S)
    assert out[0][0] is True, "rank 0's spawned all-reduce was not in flight during the exchange"
    for rank, (_, wrong, same) in enumerate(out):
        assert wrong[0] == 0, f"rank {rank}: {wrong[0]} wrong elements, e.g. at {wrong[1]}: {wrong[2]}"
        assert same, rank


def _overtake_through_the_mailbox(pg, count, fired):
    """Rank 1's main thread waits for a p2p message (tag 9) that rank 0 sends only at the very end, so
    it moves rank 0's all-reduce frames out of the ring into the mailbox while rank 1's worker runs the
    all-reduce. Once, the interleaving is forced: the main thread's first such move waits until the
    worker has looked in the mailbox (and missed) and gone for the channel lock, then lets it have the
    lock first. The worker must still take its frames in order."""
    data = np.arange(count, dtype=np.float32) * (pg.rank + 1)  # exact sums; pieces out of order show
    if pg.rank == 0:
        pg.spawn_all_reduce(data).join(timeout=WAIT_HANG_S)
        pg.send(1, 9, np.arange(3))
    else:
        t = pg.transport
        entered, pumped = threading.Event(), threading.Event()
        state = {"armed": True, "yield": False}
        real_pump, real_put = t._pump, t._mailbox.put

        def pump(*args, **kwargs):
            if threading.current_thread().name == "shmcoll-worker":
                entered.set()
                try:
                    return real_pump(*args, **kwargs)
                finally:
                    pumped.set()
            if state["yield"]:
                state["yield"] = False
                pumped.wait(WAIT_HANG_S)  # the worker's attempt comes first
            return real_pump(*args, **kwargs)

        def put(msg):
            if (state["armed"] and threading.current_thread() is threading.main_thread()
                    and msg.header.tag >= shmcoll.TAG_RESERVED_BASE):
                state["armed"] = False
                entered.clear()
                fired.value = entered.wait(WAIT_HANG_S)  # the worker missed in the mailbox and goes for the lock
                pumped.clear()
                state["yield"] = True
            real_put(msg)

        t._pump, t._mailbox.put = pump, put
        handle = pg.spawn_all_reduce(data)
        assert pg.recv(0, 9).tolist() == [0, 1, 2]
        handle.join(timeout=WAIT_HANG_S)
    wrong = np.flatnonzero(data != np.arange(count, dtype=np.float32) * 3)
    return len(wrong), wrong[:3].tolist(), data[wrong[:3]].tolist()


def test_frames_moved_to_the_mailbox_by_another_thread_keep_their_order():
    fired = CTX.Value("b", 0)
    out = run_ranks(2, _overtake_through_the_mailbox, MIB, fired, group_timeout=WAIT_HANG_S,
                    env={**SHM, **BANDWIDTH_PATHS, "SHMCOLL_CHUNK_BYTES": str(64 << 10)})
    assert fired.value, "the interleaving was not forced"
    for rank, (wrong, where, values) in enumerate(out):
        assert wrong == 0, f"rank {rank}: {wrong} wrong sums, e.g. at {where}: {values}"


# ---------------------------------------------------------------------------------------------
# 8. rings of two 64-byte slots: every collective streams a message through many slots
# ---------------------------------------------------------------------------------------------

TINY_COUNTS = [0, 1, 7, 9001]  # 9001 f16 = 18 KB: the ring algorithm, not the one-shot


def _everything(pg):
    n, r = pg.world_size, pg.rank
    layout = getattr(pg.transport, "_layout", None)  # private: only to prove the geometry took effect
    if layout is not None:
        assert (layout.slot_bytes, layout.n_slots) == (64, 2), layout
    out = {}
    for dtype in (np.float32, np.float16):
        for count in TINY_COUNTS:
            for op in ReduceKind:
                data = small_ints(r, count, dtype, op)
                pg.all_reduce(data, op)
                out["all_reduce", np.dtype(dtype).name, count, op.name] = data.tobytes()
    out["all_gather"] = pg.all_gather((np.arange(3001, dtype=np.int32) + 10_000 * r).reshape(-1, 1)).tobytes()
    for root in range(n):
        data = np.zeros(5003, dtype=np.float64)
        if r == root:
            data[:] = np.arange(5003) + root
        pg.broadcast(root, data)
        out["broadcast", root] = data.tobytes()
    fed = np.full(3001, float(r + 1), dtype=np.float32)
    out["federated_count"] = pg.federated_average(fed, WAIT_HANG_S)
    out["federated"] = fed.tobytes()
    return out


@pytest.mark.parametrize("board", ["0", "64"], ids=["no-board", "64-byte-board"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_collective_through_rings_of_two_64_byte_slots(n, board):
    """Board off: every all-reduce goes through the rings. A 64-byte board: the smallest ones use it."""
    results = run_ranks(n, _everything, env={**TINIEST_RING, "SHMCOLL_SHM_BOARD_BYTES": board})
    for rank, out in enumerate(results):
        for dtype in (np.float32, np.float16):
            for count in TINY_COUNTS:
                for op in ReduceKind:
                    key = ("all_reduce", np.dtype(dtype).name, count, op.name)
                    assert out[key] == reduced(n, count, dtype, op).tobytes(), (rank, key)
        want = np.concatenate([np.arange(3001, dtype=np.int32) + 10_000 * q for q in range(n)])
        assert out["all_gather"] == want.tobytes(), rank
        for root in range(n):
            assert out["broadcast", root] == (np.arange(5003, dtype=np.float64) + root).tobytes(), (rank, root)
        assert out["federated_count"] == (n if rank == 0 else 0)
        assert out["federated"] == np.full(3001, (n + 1) / 2, dtype=np.float32).tobytes(), rank


# ---------------------------------------------------------------------------------------------
# 9. dead and departed peers
# ---------------------------------------------------------------------------------------------

def _all_reduce_big(pg):
    pg.all_reduce(np.ones(MIB, dtype=np.float32))


_all_reduce_big.nbytes = 4 * MIB
_all_reduce_big.coll = Collective.ALL_REDUCE


#: A board small enough that _all_reduce_fits_the_ring's frames fit in the default ring at once
#: (with SHMCOLL_SINGLE_COPY=0, so that it takes the ring).
RING_FITS_BOARD = 256 << 10


def _all_reduce_fits_the_ring(pg):
    """A ring all-reduce (above the board's size) whose frames all fit in the default ring at once."""
    x = np.full(pg.transport.board.capacity // 4 + 32 * 1024, pg.rank + 1.0, dtype=np.float32)
    pg.all_reduce(x)
    assert np.all(x == pg.world_size * (pg.world_size + 1) / 2)


def _barrier(pg):
    pg.barrier()


_barrier.nbytes = 0
_barrier.coll = Collective.BARRIER


def _broadcast_big(pg):
    pg.broadcast(0, np.ones(MIB, dtype=np.float32))


_broadcast_big.nbytes = 4 * MIB
_broadcast_big.coll = Collective.BROADCAST


def _killed_while_waited_on(rank, n, port, victim, call, stamps, ready, finish):
    pg = _init(rank, n, port)
    _warm_up(pg, ready)
    if rank == victim:
        # the rank sending to us first is waiting inside call 1
        stamps[n] = float(peers_inside(pg, [(rank - 1) % n], seq=1, nbytes=call.nbytes, coll=call.coll))
        stamps[rank] = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
    out = attempt(lambda: call(pg))
    out["fault_s"] = out["end"] - stamps[victim]
    out["then"] = attempt(pg.barrier)  # the group is broken: fails at once
    out["finished_together"] = finish_together(finish)
    pg.close()
    return out


@pytest.mark.parametrize("call, n, victim", [
    (_all_reduce_big, 2, 1), (_all_reduce_big, 3, 0), (_all_reduce_big, 4, 2),
    (_barrier, 4, 3), (_broadcast_big, 3, 1),
], ids=["all_reduce-n2", "all_reduce-n3-rank0", "all_reduce-n4", "barrier-n4", "broadcast-n3-middle"])
def test_rank_killed_while_others_wait_on_it(call, n, victim):
    stamps = CTX.RawArray("d", n + 1)  # the kill's time per victim, then whether its peer was inside
    results = run_ranks(n, _killed_while_waited_on, victim, call, stamps, CTX.Barrier(n), CTX.Barrier(n - 1),
                        init=False, env=SHM, may_die={victim})
    assert results[victim] == Died(-signal.SIGKILL)
    assert stamps[n] == 1.0, "the victim died before the rank sending to it was inside the call"
    for rank, out in enumerate(results):
        if rank == victim:
            continue
        print(f"\n[timing] {call.__name__} n={n}: rank {rank} {out['kind']} {out['fault_s']:.3f}s after the kill")
        assert out["kind"] == "PeerLost" and out["peer"] == victim, (rank, out)
        assert out["fault_s"] < FAULT_NOTICE_S, (rank, out)
        assert out["then"]["kind"] == "PeerLost" and out["then"]["call_s"] < BROKEN_CALL_S, (rank, out["then"])
        assert out["finished_together"], rank


def _p2p_to_killed(rank, n, port, direction, stamps, ready):
    pg = _init(rank, n, port)
    _warm_up(pg, ready)
    if rank == 1:
        if direction == "send":
            _wait_for_slot_traffic(pg)  # rank 0 is blocked: its ring to us is full
        stamps[1] = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)
    if direction == "send":
        out = attempt(lambda: pg.send(1, 1, _pattern(0, 32 * MIB)))
    else:
        out = attempt(lambda: pg.recv(1, 1))
    out["fault_s"] = out["end"] - stamps[1]
    pg.close()
    return out


def _wait_for_slot_traffic(pg) -> None:
    """Until rank 0's ring to this rank is full (rank 0 is then waiting on us)."""
    ring = pg.transport._in[0]  # the channel from rank 0
    wait_until(lambda: ring.filled() >= pg.transport._layout.n_slots, WAIT_HANG_S, "rank 0's ring to this rank to fill",
               interval=0.001)


@pytest.mark.parametrize("direction", ["send", "recv"])
def test_p2p_with_a_killed_peer_raises_peer_lost_promptly(direction):
    stamps = CTX.RawArray("d", 2)
    results = run_ranks(2, _p2p_to_killed, direction, stamps, CTX.Barrier(2), init=False, env=TINY_RING,
                        may_die={1})
    assert results[1] == Died(-signal.SIGKILL)
    out = results[0]
    print(f"\n[timing] p2p {direction}: {out['kind']} {out['fault_s']:.3f}s after the kill")
    assert out["kind"] == "PeerLost" and out["peer"] == 1, out
    assert out["fault_s"] < FAULT_NOTICE_S, out


def _closes_early(rank, n, port, leaver, ready, finish):
    pg = _init(rank, n, port)
    _warm_up(pg, ready)
    if rank == leaver:
        inside = peers_inside(pg, [r for r in range(n) if r != leaver], seq=1, nbytes=400)  # one-shot: all send to us
        pg.close()
        return {"kind": "left", "inside": inside, "end": time.monotonic()}
    out = attempt(lambda: pg.all_reduce(np.ones(100, dtype=np.float32)))
    out["finished_together"] = finish_together(finish)
    pg.close()
    return out


def test_rank_that_closes_while_others_wait_on_it_is_peer_lost():
    n, leaver = 3, 2
    results = run_ranks(n, _closes_early, leaver, CTX.Barrier(n), CTX.Barrier(n - 1), init=False, env=SHM)
    assert results[leaver]["inside"]
    for rank in range(n - 1):
        out = results[rank]
        assert out["kind"] == "PeerLost" and out["peer"] == leaver, (rank, out)
        assert out["end"] - results[leaver]["end"] < FAULT_NOTICE_S, (rank, out)
        assert out["finished_together"], rank


def _leaves_after_final(rank, n, port, leaver, final, gates, pids, left, ready):
    """Everyone's last collective is `final`; the leaver closes and exits the moment it returns. Rank r
    makes its gates[r]-th receive from the leaver in that call (its last one) only once the leaver is
    gone, so it really reads the frames of a rank that has exited."""
    pids[rank] = os.getpid()
    pg = _init(rank, n, port)
    _warm_up(pg, ready)
    gated, calls = [], []
    if rank != leaver and rank in gates:
        transport = pg.transport
        real = transport.recv_into

        def recv_into(src, tag, *args, **kwargs):
            if src == leaver:
                calls.append(src)
                if len(calls) == gates[rank]:
                    gated.append(left.wait(WAIT_HANG_S) and _wait_gone(pids[leaver]))
            return real(src, tag, *args, **kwargs)

        transport.recv_into = recv_into
    out = attempt(lambda: final(pg))
    if rank == leaver:
        pg.close()
        left.set()
        return out  # the harness exits this process right away
    out["gated"] = gated
    out["board"] = getattr(pg.transport, "board", None) is not None
    pg.close()
    return out


@pytest.mark.parametrize("final, n, leaver, gates", [
    (_barrier, 4, 0, {1: 1, 2: 1}),  # dissemination: r+1 hears from r in round 1, r+2 in round 2
    (_barrier, 4, 1, {2: 1, 3: 1}),
    (_barrier, 4, 3, {0: 1, 1: 1}),
    (_broadcast_big, 3, 2, {0: 2, 1: 1}),  # the tail returns once it has signalled "done" to everyone
    (_all_reduce_fits_the_ring, 2, 1, {0: 2}),  # the right neighbour's last of 2(n-1) ring steps
    (_all_reduce_fits_the_ring, 3, 0, {1: 4}),
], ids=["barrier-n4-rank0", "barrier-n4-rank1", "barrier-n4-rank3", "broadcast-tail", "all_reduce-n2", "all_reduce-n3"])
def test_rank_that_finished_and_exited_does_not_disturb_the_others(final, n, leaver, gates):
    pids, left = CTX.RawArray("q", n), CTX.Event()
    results = run_ranks(n, _leaves_after_final, leaver, final, gates, pids, left, CTX.Barrier(n), init=False,
                        env={**SHM, "SHMCOLL_SHM_BOARD_BYTES": str(RING_FITS_BOARD), "SHMCOLL_SINGLE_COPY": "0"})
    for rank, out in enumerate(results):
        assert out["kind"] == "returned", (rank, out)
        if rank != leaver:
            assert out["gated"] in ([], [True]), (rank, out)
    if final is _barrier and results[(leaver + 1) % n]["board"]:
        return  # a barrier over the shared-memory board has no frames to gate; it ran ungated
    # every gated rank read the leaver's last frames after the leaver's process was gone
    assert all(results[r]["gated"] == [True] for r in gates), results
