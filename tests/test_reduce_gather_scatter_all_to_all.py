"""reduce_scatter, reduce, gather, scatter, all_to_all and all_gather_v in real processes, over tcp,
shm and every simulated host layout: exact expected results (integer-valued inputs, so reduction
order cannot matter), every dtype at one world size, every root and size at world sizes 1-4, and
mismatched calls failing with CollectiveMismatch on every rank, promptly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shmcoll import ReduceKind

from bounds import MISMATCH_NOTICE_S, WAIT_HANG_S
from harness import CTX, run_ranks
from params import (
    BANDWIDTH_PATHS,
    MOVE_DTYPES,
    RANDOM_FLOAT_DTYPES,
    RANDOM_FLOAT_TOL,
    REDUCE_DTYPES,
    SMALL_CHUNKS,
    WORLD_SIZES,
    ops_for,
    reduced,
    small_ints,
)

# over tcp, shm and every simulated multi-host layout
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("layout")]

BLOCKS = [0, 1, 7, 1001]  # rows per rank: empty, one, odd, several 4 KiB chunks
#: Sizes pick the algorithm (board, one-shot, ring, two-level); "large" forces the bandwidth paths at
#: every size; "overflow": a board entry of 128 bytes, so all_gather_v starts on the board and
#: mostly finds a piece too large for it (it goes on over the rings), sometimes not.
PATHS = {"sized": SMALL_CHUNKS,
         "large": {**SMALL_CHUNKS, **BANDWIDTH_PATHS},
         "overflow": {**SMALL_CHUNKS, "SHMCOLL_SHM_BOARD_BYTES": "128"}}


def storage(a: np.ndarray) -> bytes:
    return a.tobytes()


# ---------------------------------------------------------------- reductions, every dtype and op

def _reductions(pg, dtype):
    n, out = pg.world_size, []
    for i, (b, op) in enumerate((b, op) for b in BLOCKS for op in ops_for(dtype)):
        data = small_ints(pg.rank, n * b, dtype, op)
        before = data.copy()
        got = pg.reduce_scatter(data, op)
        assert got.dtype == data.dtype and got.shape == (b,) and not np.shares_memory(got, data)
        assert storage(data) == storage(before), "reduce_scatter must not write its input"
        root = i % n
        assert pg.reduce(root, data, op) is data
        out.append((storage(got), storage(data) if pg.rank == root else None))
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_reductions_every_dtype_and_op(dtype, path):
    n = 3
    results = run_ranks(n, _reductions, dtype, env=PATHS[path])
    cases = [(b, op) for b in BLOCKS for op in ops_for(dtype)]
    for rank, per_case in enumerate(results):
        assert len(per_case) == len(cases)
        for i, ((scattered, whole), (b, op)) in enumerate(zip(per_case, cases)):
            want = reduced(n, n * b, dtype, op)
            assert scattered == storage(want[rank * b:(rank + 1) * b]), f"reduce_scatter b={b} {op.name} rank {rank}"
            if rank == i % n:
                assert whole == storage(want), f"reduce b={b} {op.name} root {rank}"


# ---------------------------------------------------------------- float32: every size and root

def _rows(rank: int, rows: int, tail=(), dtype=np.float32, salt: int = 0) -> np.ndarray:
    values = (np.arange(rows * int(np.prod(tail)), dtype=np.int64) + 7 * rank + salt) % 61
    return values.reshape(rows, *tail).astype(dtype)


def _varying(rank: int, b: int) -> int:
    """all_gather_v lengths: differ per rank, some zero."""
    return (b + 3 * rank) % 5 if b < 1001 else b + rank


def _every_root(pg, b):
    n, r, got = pg.world_size, pg.rank, {}
    tail = (3,)
    rs = pg.reduce_scatter(_rows(r, n * b, tail), ReduceKind.SUM)
    got["reduce_scatter"] = rs
    for root in range(n):
        data = _rows(r, b, tail, salt=root)
        pg.reduce(root, data, ReduceKind.MAX)
        if r == root:
            got[("reduce", root)] = data
        got[("gather", root)] = pg.gather(root, _rows(r, b, tail, salt=root))
        got[("scatter", root)] = pg.scatter(root, _rows(r, n * b, tail, salt=root) if r == root else None)
    got["all_to_all"] = pg.all_to_all(_rows(r, n * b, tail))
    got["all_gather_v"] = pg.all_gather_v(_rows(r, _varying(r, b), tail))
    return got


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("b", BLOCKS)
def test_every_size_and_root_float32(n, b, path):
    tail = (3,)
    results = run_ranks(n, _every_root, b, env=PATHS[path])
    for r, got in enumerate(results):
        total = sum(_rows(k, n * b, tail).astype(np.float64) for k in range(n))
        np.testing.assert_array_equal(got["reduce_scatter"], total[r * b:(r + 1) * b])
        assert got["reduce_scatter"].shape == (b, 3)
        for root in range(n):
            if r == root:
                want = np.maximum.reduce([_rows(k, b, tail, salt=root) for k in range(n)])
                np.testing.assert_array_equal(got[("reduce", root)], want)
                gathered = np.concatenate([_rows(k, b, tail, salt=root) for k in range(n)])
                assert got[("gather", root)].shape == (n * b, 3)
                np.testing.assert_array_equal(got[("gather", root)], gathered)
            else:
                assert got[("gather", root)] is None
            block = _rows(root, n * b, tail, salt=root)[r * b:(r + 1) * b]
            assert got[("scatter", root)].dtype == np.float32
            np.testing.assert_array_equal(got[("scatter", root)], block)
        want = np.concatenate([_rows(k, n * b, tail)[r * b:(r + 1) * b] for k in range(n)])
        np.testing.assert_array_equal(got["all_to_all"], want)
        out, lengths = got["all_gather_v"]
        assert lengths == [_varying(k, b) for k in range(n)]
        np.testing.assert_array_equal(out, np.concatenate([_rows(k, _varying(k, b), tail) for k in range(n)]))


# ---------------------------------------------------------------- random floats: accurate, repeatable

def _random_reductions(pg, dtype, rows):
    """reduce_scatter and reduce (root 1) of random normal floats, twice each."""
    data = np.random.default_rng(pg.rank).standard_normal(pg.world_size * rows).astype(dtype)
    got = [pg.reduce_scatter(data) for _ in range(2)]
    for _ in range(2):
        scratch = data.copy()
        pg.reduce(1, scratch)
        got.append(scratch if pg.rank == 1 else None)
    return got


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", RANDOM_FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_random_floats_accurate_and_repeatable(n, dtype):
    """Within rounding of the exact sum, and bitwise the same when the call is repeated (the
    reduction order is fixed by the algorithm, never by timing). 3001 rows: the large paths."""
    rows = 3001
    results = run_ranks(n, _random_reductions, dtype, rows, env=SMALL_CHUNKS)
    exact = sum(np.random.default_rng(r).standard_normal(n * rows).astype(dtype).astype(np.float64) for r in range(n))
    tol = RANDOM_FLOAT_TOL[dtype]
    for r, (first, again, whole, whole_again) in enumerate(results):
        assert first.tobytes() == again.tobytes()
        np.testing.assert_allclose(first.astype(np.float64), exact[r * rows:(r + 1) * rows], rtol=tol, atol=tol * n)
        if r == 1:
            assert whole.tobytes() == whole_again.tobytes()
            np.testing.assert_allclose(whole.astype(np.float64), exact, rtol=tol, atol=tol * n)


# ---------------------------------------------------------------- data movement, every dtype

def _movement(pg, dtypes):
    n, r, out = pg.world_size, pg.rank, []
    for i, dtype in enumerate(dtypes):
        root = i % n
        for b in (0, 5):
            out.append(pg.gather(root, _rows(r, b, (2,), dtype)))
            out.append(pg.scatter(root, _rows(r, n * b, (), dtype) if r == root else None))
            out.append(pg.all_to_all(_rows(r, n * b, (), dtype)))
            out.append(pg.all_gather_v(_rows(r, _varying(r, b), (2,), dtype))[0])
    out.append(pg.gather(0, np.array(r + 1, dtype=np.int16)))  # 0-d, as all_gather: one row each
    out.append(pg.all_gather_v(np.array(r + 1, dtype=np.int16)))
    return out


def test_data_movement_every_dtype():
    n = 3
    results = run_ranks(n, _movement, MOVE_DTYPES, env=SMALL_CHUNKS)
    for r, got in enumerate(results):
        it = iter(got)
        for i, dtype in enumerate(MOVE_DTYPES):
            root = i % n
            for b in (0, 5):
                gathered, scattered, exchanged, gathered_v = (next(it) for _ in range(4))
                if r == root:
                    want = np.concatenate([_rows(k, b, (2,), dtype) for k in range(n)])
                    assert gathered.dtype == want.dtype and gathered.tobytes() == want.tobytes()
                else:
                    assert gathered is None
                want = _rows(root, n * b, (), dtype)[r * b:(r + 1) * b]
                assert scattered.dtype == want.dtype and scattered.shape == want.shape
                assert scattered.tobytes() == want.tobytes()
                want = np.concatenate([_rows(k, n * b, (), dtype)[r * b:(r + 1) * b] for k in range(n)])
                assert exchanged.dtype == want.dtype and exchanged.tobytes() == want.tobytes()
                want = np.concatenate([_rows(k, _varying(k, b), (2,), dtype) for k in range(n)])
                assert gathered_v.dtype == want.dtype and gathered_v.shape == want.shape
                assert gathered_v.tobytes() == want.tobytes()
        zero_d, (zero_d_v, lengths) = next(it), next(it)
        assert (zero_d.tolist() if r == 0 else zero_d) == ([1, 2, 3] if r == 0 else None)
        assert zero_d_v.tolist() == [1, 2, 3] and lengths == [1, 1, 1]


# ---------------------------------------------------------------- mismatches

def _call(pg, name, root=0, rows=12, dtype="float32", op=ReduceKind.SUM, tail=()):
    data = np.ones((rows, *tail), dtype=dtype)
    calls = {
        "gather": lambda: pg.gather(root, data),
        "scatter": lambda: pg.scatter(root, data if pg.rank == root else None),
        "reduce": lambda: pg.reduce(root, data, op),
        "reduce_scatter": lambda: pg.reduce_scatter(data, op),
        "all_to_all": lambda: pg.all_to_all(data),
        "all_gather_v": lambda: pg.all_gather_v(data),
        "all_gather": lambda: pg.all_gather(data),
        "all_reduce": lambda: pg.all_reduce(data, op),
        "barrier": lambda: pg.barrier(),
        "broadcast": lambda: pg.broadcast(root, data),
    }
    calls[name]()


def _mismatched(pg, normal, odd_call, odd, finish, ready):
    pg.all_reduce(np.ones(8))  # sequence number 0: every rank connected and in step
    ready.wait(WAIT_HANG_S)  # nobody is still finishing call 0 when call 1's mismatch aborts the group
    name, kw = odd_call if pg.rank in odd else normal
    start = time.monotonic()
    try:
        _call(pg, name, **kw)
        out = {"kind": None}
    except Exception as exc:  # reported to the parent
        out = {"kind": type(exc).__name__, "msg": str(exc)}
    out["s"] = time.monotonic() - start
    try:  # stay up until every rank has its outcome: a rank leaving early would read as a lost peer
        finish.wait(MISMATCH_NOTICE_S)
        out["together"] = True
    except threading.BrokenBarrierError:
        out["together"] = False
    return out


def C(name, **kw):
    return (name, kw)


# (id, world size, odd ranks, what the others call, what the odd ranks call)
MISMATCHES = [
    ("gather-vs-all_gather", 3, {1}, C("gather"), C("all_gather")),
    ("gather-both-claim-root", 2, {1}, C("gather", root=0), C("gather", root=1)),
    ("gather-roots-swapped", 2, {0}, C("gather", root=1), C("gather", root=0)),  # both only send
    ("gather-root-of-three", 3, {2}, C("gather", root=0), C("gather", root=1)),
    ("gather-length", 3, {1}, C("gather"), C("gather", rows=13)),
    ("gather-dtype", 4, {3}, C("gather", root=2), C("gather", root=2, dtype="float64")),
    ("scatter-root", 3, {2}, C("scatter", root=0), C("scatter", root=1)),
    ("scatter-vs-gather", 2, {1}, C("scatter", root=1), C("gather", root=1)),
    ("scatter-vs-barrier", 3, {1}, C("scatter"), C("barrier")),
    ("scatter-vs-broadcast", 2, {1}, C("scatter"), C("broadcast")),
    ("reduce-root", 3, {1}, C("reduce", root=0), C("reduce", root=2)),
    ("reduce-op", 4, {2}, C("reduce", root=1), C("reduce", root=1, op=ReduceKind.MAX)),
    ("reduce-dtype", 2, {0}, C("reduce"), C("reduce", dtype="float64")),
    ("reduce-vs-all_reduce", 3, {2}, C("reduce"), C("all_reduce")),  # one board step, told apart by header
    ("reduce_scatter-vs-all_reduce", 3, {0}, C("reduce_scatter"), C("all_reduce")),
    ("reduce_scatter-length", 4, {3}, C("reduce_scatter"), C("reduce_scatter", rows=24)),
    ("reduce_scatter-op", 3, {1}, C("reduce_scatter"), C("reduce_scatter", op=ReduceKind.PROD)),
    ("all_to_all-length", 3, {2}, C("all_to_all"), C("all_to_all", rows=24)),
    ("all_to_all-vs-reduce_scatter", 2, {1}, C("all_to_all"), C("reduce_scatter")),
    ("all_gather_v-dtype", 3, {1}, C("all_gather_v"), C("all_gather_v", dtype="int32")),
    ("all_gather_v-trailing", 3, {2}, C("all_gather_v", tail=(2, 3)), C("all_gather_v", tail=(3, 2))),
    ("all_gather_v-ndim", 2, {1}, C("all_gather_v", tail=(1,)), C("all_gather_v")),
    ("all_gather_v-vs-all_gather", 4, {0}, C("all_gather_v"), C("all_gather")),
]


@pytest.mark.parametrize("name, n, odd, normal, odd_call", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatch_raises_on_every_rank(name, n, odd, normal, odd_call):
    # the group timeout (WAIT_HANG_S) is far longer than MISMATCH_NOTICE_S: only real detection is this quick
    results = run_ranks(n, _mismatched, normal, odd_call, odd, CTX.Barrier(n), CTX.Barrier(n))
    for rank, out in enumerate(results):
        assert out["kind"] == "CollectiveMismatch", f"rank {rank}: {out}"
        assert out["s"] < MISMATCH_NOTICE_S, f"rank {rank} took {out['s']:.1f} s: {out}"
        assert "sequence number 1" in out["msg"] or "shape" in out["msg"], out["msg"]
        assert out["together"], f"rank {rank} did not finish within {MISMATCH_NOTICE_S} s of the others"


# ---------------------------------------------------------------- unusual but valid inputs

def _unusual(pg):
    n, r, got = pg.world_size, pg.rank, {}
    ro = np.arange(2 * n, dtype=np.int32) + r
    ro.flags.writeable = False  # calls that only read their input accept read-only arrays
    got["reduce_scatter"] = pg.reduce_scatter(ro, "max").tolist()  # op given by name, as all_reduce
    got["all_to_all"] = pg.all_to_all(ro).tolist()
    got["gather"] = pg.gather(n - 1, ro)
    got["all_gather_v"] = pg.all_gather_v(ro[:r])[1]
    got["scatter"] = pg.scatter(0, ro if r == 0 else np.full(99, -1.0)).tolist()  # non-root data is ignored
    return got


@pytest.mark.parametrize("n", [2, 3])
def test_read_only_inputs_and_ignored_non_root_data(n):
    for r, got in enumerate(run_ranks(n, _unusual)):
        base = np.arange(2 * n)
        assert got["reduce_scatter"] == (base + n - 1)[2 * r:2 * r + 2].tolist()
        assert got["all_to_all"] == [int(v) + k for k in range(n) for v in base[2 * r:2 * r + 2]]
        assert (got["gather"] is None) == (r != n - 1)
        assert got["all_gather_v"] == list(range(n))
        assert got["scatter"] == base[2 * r:2 * r + 2].tolist()
