"""broadcast_object / all_gather_object, split (sub-groups, nested, concurrent with the parent and
with each other) and the spawn_* variants, in real processes over tcp, shm and the simulated host
layouts. Results are exact (integer-valued data), mismatches must fail on every rank."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shmcoll import ReduceKind

from bounds import WAIT_HANG_S
from harness import attempt, run_ranks
from params import BANDWIDTH_PATHS, WORLD_SIZES

pytestmark = pytest.mark.multiprocess


def _thread(target, *args):
    """Run target on a thread; returns a function that joins it (bounded) and returns its result
    or re-raises its error."""
    box = {}

    def run():
        try:
            box["result"] = target(*args)
        except BaseException as exc:  # re-raised on the main thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(WAIT_HANG_S)
        assert not thread.is_alive(), "worker thread did not finish in time"
        if "error" in box:
            raise box["error"]
        return box["result"]

    return join


# ---------------------------------------------------------------- object collectives

def _payload(r: int, i: int):
    return {"from": r, "i": i, "arr": np.arange(5, dtype=np.int64) * (r + 1), "nested": [r, (i, "x" * r)]}


def _objects(pg):
    n, rank = pg.world_size, pg.rank
    for root in range(n):
        mine = _payload(rank, root)
        got = pg.broadcast_object(root, mine)
        want = _payload(root, root)
        assert got["from"] == root and got["nested"] == want["nested"] and np.array_equal(got["arr"], want["arr"])
        if rank == root:
            assert got is mine
    for empty in ({}, [], None, "", b""):
        assert pg.broadcast_object(n - 1, empty if rank == n - 1 else "ignored") == empty
    big = np.random.default_rng(7).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()  # 1 MB
    assert pg.broadcast_object(0, big if rank == 0 else None) == big
    everyone = pg.all_gather_object(_payload(rank, 9))
    assert [o["from"] for o in everyone] == list(range(n))
    assert all(np.array_equal(o["arr"], np.arange(5) * (r + 1)) for r, o in enumerate(everyone))
    mixed = pg.all_gather_object(big if rank == n - 1 else ({} if rank % 2 else []))
    assert mixed == [big if r == n - 1 else ({} if r % 2 else []) for r in range(n)]
    return True


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("n", [1, 4])
def test_object_collectives(n):
    assert run_ranks(n, _objects) == [True] * n


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("n", [2, 3])
def test_object_collectives_odd_sizes(n):
    assert run_ranks(n, _objects) == [True] * n


# ---------------------------------------------------------------- split: every collective

def _members(n: int) -> list[int]:
    """Reversed order and a gap: renumbering must follow the list, not the parent ranks."""
    return [n - 1] + list(range(0, n - 2)) if n > 2 else list(range(n))[::-1]


def _every_collective(g, parent_rank: int, members: list[int]):
    """Run every collective on sub-group g; checks against values derived from the sub ranks."""
    m, r = g.world_size, g.rank
    assert members[r] == parent_rank
    for count in (5, 40_000):  # one-shot and ring
        x = np.full(count, float(r + 1), dtype=np.float32)
        assert np.all(g.all_reduce(x) == m * (m + 1) / 2)
    assert np.array_equal(g.all_gather(np.array([r, 10 * r], dtype=np.int64)),
                          np.array([v for q in range(m) for v in (q, 10 * q)]))
    for root in range(m):
        b = np.full(3, r, dtype=np.int32)
        assert np.all(g.broadcast(root, b) == root)
        d = np.full(2, r + 1, dtype=np.int64)
        g.reduce(root, d, ReduceKind.MAX)
        if r == root:
            assert np.all(d == m)
        gathered = g.gather(root, np.array([r], dtype=np.int64))
        assert (gathered is None) == (r != root) and (gathered is None or list(gathered) == list(range(m)))
        s = g.scatter(root, np.arange(2 * m, dtype=np.float64) if r == root else None)
        assert list(s) == [2 * r, 2 * r + 1]
        assert g.broadcast_object(root, {"root": root} if r == root else None) == {"root": root}
    rs = g.reduce_scatter(np.arange(2 * m, dtype=np.int64) * (r + 1))
    assert list(rs) == [2 * r * m * (m + 1) // 2, (2 * r + 1) * m * (m + 1) // 2]
    a2a = g.all_to_all(np.array([100 * r + j for j in range(m)], dtype=np.int64))
    assert list(a2a) == [100 * j + r for j in range(m)]
    out, lengths = g.all_gather_v(np.full(r, r, dtype=np.int32))
    assert lengths == list(range(m)) and list(out) == [q for q in range(m) for _ in range(q)]
    assert g.all_gather_object(parent_rank) == members
    g.barrier()
    f = np.full(4, float(r), dtype=np.float64)
    g.federated_average(f, WAIT_HANG_S)
    assert np.all(f == (m - 1) / 2)
    if m > 1:  # point to point, renumbered
        g.send((r + 1) % m, 3, np.array([r], dtype=np.int64))
        assert g.recv((r - 1) % m, 3)[0] == (r - 1) % m
    h = g.spawn_all_reduce(np.ones(7, dtype=np.float64))
    assert np.all(h.join(WAIT_HANG_S) == m)


def _split_all(pg, members):
    g = pg.split(members)
    if pg.rank not in members:
        assert g is None
        pg.barrier()
        return None
    with g:
        assert (g.rank, g.world_size) == (members.index(pg.rank), len(members))
        _every_collective(g, pg.rank, members)
        pg.barrier()  # the parent still works after (and alongside) its sub-group
        return g.rank


#: "large": the bandwidth algorithms (rings, two-level across hosts) even for these small arrays.
LARGE_PATHS = {**BANDWIDTH_PATHS, "SHMCOLL_CHUNK_BYTES": "64"}


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("path", ["sized", "large"])
def test_split_every_collective_n4(path):
    members = _members(4)
    got = run_ranks(4, _split_all, members, env=LARGE_PATHS if path == "large" else None)
    assert got == [members.index(r) if r in members else None for r in range(4)]


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_split_every_collective_small(n):
    members = _members(n)
    got = run_ranks(n, _split_all, members)
    assert got == [members.index(r) if r in members else None for r in range(n)]


# ---------------------------------------------------------------- concurrency

ROUNDS = 150


def _sub_all_reduces(g):
    for i in range(ROUNDS):
        x = np.full(33 + i % 5, float(g.rank + i), dtype=np.float64)
        g.all_reduce(x)
        assert np.all(x == sum(q + i for q in range(g.world_size))), f"sub all_reduce {i}"
    return ROUNDS


def _concurrent_with_parent(pg):
    """The issue's done-when: 2 of 4 ranks all-reduce in their sub-group (a thread) while the
    parent broadcasts."""
    g = pg.split([1, 3])
    join = _thread(_sub_all_reduces, g) if g is not None else (lambda: 0)
    for i in range(ROUNDS // 2):
        root = i % pg.world_size
        b = np.full(17, pg.rank * 1000 + i, dtype=np.int64)
        pg.broadcast(root, b)
        assert np.all(b == root * 1000 + i), f"parent broadcast {i}"
    done = join()
    if g is not None:
        g.close()
    return done


@pytest.mark.usefixtures("layout")
def test_subgroup_all_reduces_while_parent_broadcasts():
    assert run_ranks(4, _concurrent_with_parent) == [0, ROUNDS, 0, ROUNDS]


def _two_groups(pg, a, b):
    """Every rank makes both groups; members of both run both at once, one per thread, while
    the parent all-reduces on the main thread."""
    ga, gb = pg.split(a), pg.split(b)
    joins = [_thread(_sub_all_reduces, g) for g in (ga, gb) if g is not None]
    for _ in range(40):
        x = np.full(9, float(pg.rank), dtype=np.float32)
        pg.all_reduce(x)
        assert np.all(x == pg.world_size * (pg.world_size - 1) / 2)
    done = [join() for join in joins]
    for g in (ga, gb):
        if g is not None:
            g.close()
    return done


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("a,b", [([0, 1], [2, 3]), ([0, 1, 2], [3, 2, 1])], ids=["disjoint", "overlapping"])
def test_two_subgroups_concurrently(a, b):
    got = run_ranks(4, _two_groups, a, b)
    for rank, done in enumerate(got):
        assert done == [ROUNDS] * ((rank in a) + (rank in b))


def _spawned_gather_beside_subgroup_calls(pg):
    """A world gather spawned (the worker thread) while the main thread runs a sub-group's small
    broadcast and all-gather with the same peers; rank 0 finishes the gather before its own
    sub-group calls every other round, so the others' sub-group steps wait on a rank that waits
    on their gathers. Each thread must leave the connections it shares to the other while it
    waits (else the two wait on each other until the deadline)."""
    sub = pg.split(list(reversed(range(pg.world_size))))
    root = pg.world_size - 1  # sub-group rank 0
    for i in range(30):
        handle = pg.spawn_gather(0, np.array([pg.rank, i], np.int64))
        if pg.rank == 0 and i % 2:
            gathered = handle.join(WAIT_HANG_S)
        y = np.arange(5, dtype=np.float32) + i if pg.rank == root else np.zeros(5, np.float32)
        sub.broadcast(0, y)
        assert y.tolist() == (np.arange(5) + i).tolist(), f"broadcast {i}"
        assert sub.all_gather(np.array([sub.rank, i])).tolist() == [x for r in range(pg.world_size) for x in (r, i)]
        if not (pg.rank == 0 and i % 2):
            gathered = handle.join(WAIT_HANG_S)
        if pg.rank == 0:
            assert gathered.tolist() == [x for r in range(pg.world_size) for x in (r, i)], f"gather {i}"
    sub.close()
    return True


@pytest.mark.usefixtures("layout")
def test_a_spawned_call_and_a_subgroups_calls_share_peers_without_waiting_on_each_other(monkeypatch):
    monkeypatch.setenv("SHMCOLL_TIMEOUT", "30")  # a deadlock fails within the run, as CollectiveTimeout
    assert run_ranks(4, _spawned_gather_beside_subgroup_calls) == [True] * 4


def _nested(pg):
    g = pg.split([3, 1, 2])  # parent ranks 3,1,2 -> sub ranks 0,1,2
    inner = g.split([2, 0]) if g is not None else None  # sub ranks 2,0 = parent ranks 2,3
    if g is not None and g.rank in (2, 0):
        assert inner is not None and inner.world_size == 2
    join = _thread(_sub_all_reduces, inner) if inner is not None else (lambda: 0)
    if g is not None:
        y = np.full(5, float(pg.rank), dtype=np.float64)
        g.all_reduce(y)
        assert np.all(y == 3 + 1 + 2)
    z = np.arange(4, dtype=np.int64) + pg.rank
    pg.all_reduce(z)
    assert list(z) == [4 * k + 6 for k in range(4)]
    done = join()
    ident = (inner.rank, inner.world_size) if inner is not None else None
    for grp in (inner, g):
        if grp is not None:
            grp.close()
    return ident, done


def _same_tag_in_parent_and_subgroups(pg):
    """Ranks 1 and 3 talk on user tag 5 in the parent, in sub-group [1, 3] and in sub-group [3, 1]
    (each sent before the parent's, which is received first): each recv must get its own group's."""
    a, b = pg.split([1, 3]), pg.split([3, 1])
    if pg.rank not in (1, 3):
        pg.barrier()
        return None
    peer = 4 - pg.rank
    a.send(1 - a.rank, 5, np.array([10 + pg.rank]))
    b.send(1 - b.rank, 5, np.array([20 + pg.rank]))
    pg.send(peer, 5, np.array([30 + pg.rank]))
    got = [int(pg.recv(peer, 5)[0]), int(b.recv(1 - b.rank, 5)[0]), int(a.recv(1 - a.rank, 5)[0])]
    a.close(), b.close()
    pg.barrier()
    return got


@pytest.mark.usefixtures("transport")
def test_point_to_point_tags_are_per_group():
    """A sub-group's send/recv have their own tag space, as MPI communicators do."""
    results = run_ranks(4, _same_tag_in_parent_and_subgroups)
    assert results[1] == [33, 23, 13]
    assert results[3] == [31, 21, 11]


@pytest.mark.usefixtures("transport")
def test_nested_split():
    got = run_ranks(4, _nested)
    assert got == [(None, 0), (None, 0), ((0, 2), ROUNDS), ((1, 2), ROUNDS)]


# ---------------------------------------------------------------- mismatches

def _split_disagree(pg):
    mine = [0, 1] if pg.rank == 0 else [1, 0]
    return attempt(lambda: pg.split(mine))


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("n", [2, 4])
def test_split_with_disagreeing_lists_raises_everywhere(n):
    for res in run_ranks(n, _split_disagree):
        assert res["kind"] == "CollectiveMismatch", res


def _sub_mismatch(pg):
    box = {}
    made = attempt(lambda: box.setdefault("g", pg.split([2, 0, 1])))
    g = box.get("g")
    if g is None:  # rank 3, or a member still finishing the split when the others' failure aborted the transport
        return made
    count = 4 if g.rank == 0 else 5
    return attempt(lambda: g.all_reduce(np.ones(count, dtype=np.float32)))


@pytest.mark.usefixtures("transport")
def test_subgroup_mismatch_raises_collective_mismatch():
    got = run_ranks(4, _sub_mismatch)
    assert got[3]["kind"] in ("returned", "CollectiveMismatch")
    for res in got[:3]:  # from its own call, or relayed into its split
        assert res["kind"] == "CollectiveMismatch", res
        assert "sub-group over parent ranks [2, 0, 1]" in res["msg"] and "2305843009213693952" not in res["msg"]


# ---------------------------------------------------------------- spawn variants

def _spawned(pg):
    n, r = pg.world_size, pg.rank
    local = np.array([r, r + 100], dtype=np.int32)
    bdata = np.full(1000, r, dtype=np.float64)
    rdata = np.arange(3 * n, dtype=np.int64) * (r + 1)
    h_gather = pg.spawn_all_gather(local)
    h_cast = pg.spawn_broadcast(n - 1, bdata)
    h_rs = pg.spawn_reduce_scatter(rdata, ReduceKind.SUM)
    rdata[:] = -1  # spawn_reduce_scatter copied its input
    red = np.full(5, r + 1, dtype=np.int64)
    h_red = pg.spawn_reduce(0, red, ReduceKind.SUM)
    h_gat = pg.spawn_gather(n - 1, local)
    h_sca = pg.spawn_scatter(0, np.arange(2 * n, dtype=np.int16) if r == 0 else None)
    h_a2a = pg.spawn_all_to_all(np.array([10 * r + j for j in range(n)], dtype=np.int64))
    h_agv = pg.spawn_all_gather_v(np.full(r, r, dtype=np.uint8))
    handles = (h_gather, h_cast, h_rs, h_red, h_gat, h_sca, h_a2a, h_agv)
    after = np.full(4, float(r), dtype=np.float32)
    pg.all_reduce(after, ReduceKind.MAX)  # issued after the spawned ones: runs after them
    assert all(h.done() for h in handles)
    assert np.all(after == n - 1)
    assert h_red.join(WAIT_HANG_S) is red and (r != 0 or np.all(red == n * (n + 1) // 2))
    gathered = h_gat.join(WAIT_HANG_S)
    assert (gathered is None) == (r != n - 1)
    assert gathered is None or list(gathered) == [v for q in range(n) for v in (q, q + 100)]
    assert h_sca.join(WAIT_HANG_S).tolist() == [2 * r, 2 * r + 1]
    assert h_a2a.join(WAIT_HANG_S).tolist() == [10 * q + r for q in range(n)]
    out, lengths = h_agv.join(WAIT_HANG_S)
    assert lengths == list(range(n)) and out.tolist() == [q for q in range(n) for _ in range(q)]
    assert h_cast.join(WAIT_HANG_S) is bdata and np.all(bdata == n - 1)
    assert list(h_rs.join(WAIT_HANG_S)) == [(3 * r + k) * n * (n + 1) // 2 for k in range(3)]
    assert list(h_gather.join(WAIT_HANG_S)) == [v for q in range(n) for v in (q, q + 100)]
    return True


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_spawn_variants(n):
    assert run_ranks(n, _spawned) == [True] * n


def _spawn_error(pg, which):
    """A mismatch inside a spawned collective is re-raised by join (on every rank)."""
    dtype = np.float32 if pg.rank == 0 else np.float64
    data = np.ones(3 * pg.world_size, dtype=dtype)
    spawn = {"all_gather": lambda: pg.spawn_all_gather(data), "broadcast": lambda: pg.spawn_broadcast(0, data),
             "reduce_scatter": lambda: pg.spawn_reduce_scatter(data), "reduce": lambda: pg.spawn_reduce(0, data),
             "gather": lambda: pg.spawn_gather(0, data), "all_to_all": lambda: pg.spawn_all_to_all(data),
             "all_gather_v": lambda: pg.spawn_all_gather_v(data.reshape(-1, 1) if pg.rank else data)}[which]
    handle = spawn()
    return attempt(lambda: handle.join(WAIT_HANG_S))


@pytest.mark.usefixtures("transport")
@pytest.mark.parametrize("which", ["all_gather", "broadcast", "reduce_scatter", "reduce", "gather", "all_to_all",
                                   "all_gather_v"])
def test_spawn_errors_reraised_by_join(which):
    for res in run_ranks(3, _spawn_error, which):
        assert res["kind"] == "CollectiveMismatch", res


# ---------------------------------------------------------------- bad input

def _bad_inputs(pg):
    n = pg.world_size
    calls = {
        "split empty": lambda: pg.split([]),
        "split duplicate": lambda: pg.split([0, 0]),
        "split out of range": lambda: pg.split([n]),
        "split negative": lambda: pg.split([-1]),
        "split str": lambda: pg.split("01"),
        "split bool": lambda: pg.split([True]),
        "split float": lambda: pg.split([0.0]),
        "split int": lambda: pg.split(0),
        "broadcast_object root": lambda: pg.broadcast_object(n, 1),
        "spawn_broadcast root": lambda: pg.spawn_broadcast(-1, np.zeros(2)),
        "spawn_broadcast dtype": lambda: pg.spawn_broadcast(0, np.array([object()])),
        "spawn_all_gather dtype": lambda: pg.spawn_all_gather(np.array(["text"])),
        "spawn_reduce_scatter blocks": lambda: pg.spawn_reduce_scatter(np.zeros(2 * n + 1) if n > 1 else np.zeros(())),
        "spawn_reduce_scatter op": lambda: pg.spawn_reduce_scatter(np.zeros(n, dtype=np.int32), ReduceKind.AVG),
        "broadcast_object unpicklable": lambda: pg.broadcast_object(0, lambda: 0),  # every rank learns of it
        "all_gather_object unpicklable": lambda: pg.all_gather_object((lambda: 0) if pg.rank == n - 1 else 1),
    }
    got = {name: attempt(call)["kind"] for name, call in calls.items()}
    x = np.ones(3, dtype=np.float32)
    pg.all_reduce(x)  # the group still works: bad calls were refused before they were numbered
    assert np.all(x == n)
    return got


@pytest.mark.parametrize("n", [1, 3])
def test_bad_inputs_raise_invalid_argument(n):
    for got in run_ranks(n, _bad_inputs):
        bad = {name: kind for name, kind in got.items() if kind != "InvalidArgument"}
        assert not bad, bad

