"""all_reduce (typed and spawned too), all_gather and broadcast in real processes at world sizes 1-4,
over every transport and simulated host layout: results checked against a float64 reference, and
bitwise identical on every rank. reduce_scatter, reduce, gather, scatter, all_to_all and all_gather_v
are in test_reduce_gather_scatter_all_to_all.py."""

from __future__ import annotations

import numpy as np
import pytest

from shmcoll import DType, ReduceKind
from shmcoll.types import bfloat16

from bounds import WAIT_HANG_S
from harness import run_ranks
from params import (
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

# 0, 1, odd, one-shot sized, ring sized, and (with 4 KiB chunks) many chunks per ring segment
COUNTS = [0, 1, 7, 1001, 5003, 70001]


def _reduce_all(pg, dtype):
    out = []
    for count in COUNTS:
        for op in ops_for(dtype):
            data = small_ints(pg.rank, count, dtype, op)
            assert pg.all_reduce(data, op) is data
            out.append(data.tobytes())
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_all_reduce_every_op_and_count(n, dtype):
    results = run_ranks(n, _reduce_all, dtype, env=SMALL_CHUNKS)
    cases = [(count, op) for count in COUNTS for op in ops_for(dtype)]
    for rank_result in results:
        assert rank_result == results[0], "ranks disagree bitwise"
    for got, (count, op) in zip(results[0], cases):
        assert got == reduced(n, count, dtype, op).tobytes(), f"count={count} op={op.name}"


def _random_float_reduce(pg, dtype, count):
    data = np.random.default_rng(pg.rank).standard_normal(count).astype(dtype)
    pg.all_reduce(data)
    return data


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("dtype", RANDOM_FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_random_floats_identical_on_every_rank(n, dtype):
    count = 40001
    results = run_ranks(n, _random_float_reduce, dtype, count, env=SMALL_CHUNKS)
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    exact = sum(np.random.default_rng(r).standard_normal(count).astype(dtype).astype(np.float64) for r in range(n))
    tol = RANDOM_FLOAT_TOL[dtype]
    np.testing.assert_allclose(results[0].astype(np.float64), exact, rtol=tol, atol=tol * n)


def _typed(pg, dtype: DType):
    wire = dtype.wire
    values = np.arange(257, dtype=np.float64) % 17 - 8 + pg.rank
    if wire is not DType.BF16.wire or bfloat16() is not None:
        raw = bytearray(values.astype(wire.array_dtype).tobytes())
    else:  # bf16 without ml_dtypes: numpy has no bfloat16 to cast through
        from shmcoll.kernels import f64_to_bf16_bits
        raw = bytearray(f64_to_bf16_bits(values).tobytes())
    assert pg.all_reduce_typed(raw, dtype, ReduceKind.MAX) is raw
    view = np.frombuffer(memoryview(raw), dtype=np.uint8)  # a uint8 array works too
    pg.all_reduce_typed(view, dtype, ReduceKind.SUM)
    return bytes(raw)


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_all_reduce_typed_over_raw_bytes(dtype):
    n = 3
    results = run_ranks(n, _typed, dtype)
    values = [np.arange(257, dtype=np.float64) % 17 - 8 + r for r in range(n)]
    want = n * np.maximum.reduce(values)  # MAX then SUM of n equal vectors
    from shmcoll.kernels import bf16_bits_to_f64, f16_bits_to_f64
    storage = np.frombuffer(results[0], dtype=dtype.wire.storage)
    got = {DType.F16: f16_bits_to_f64, DType.BF16: bf16_bits_to_f64}.get(dtype, lambda a: a.astype(np.float64))(storage)
    np.testing.assert_array_equal(got, want)
    assert all(r == results[0] for r in results)


def _spawned(pg, count):
    arrays = [np.full(count, float(pg.rank + i), dtype=np.float32) for i in range(4)]
    handles = [pg.spawn_all_reduce(a) for a in arrays]
    after = np.full(3, float(pg.rank), dtype=np.float64)
    pg.all_reduce(after, ReduceKind.MAX)  # a blocking call issued after the spawned ones runs after them
    joined = [handles[i].join(timeout=WAIT_HANG_S) for i in (2, 0, 3, 1)]  # any order
    assert all(h.done() for h in handles)
    assert all(j is a for j, a in zip(joined, [arrays[i] for i in (2, 0, 3, 1)]))
    return [a.copy() for a in arrays], after


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_spawn_all_reduce_in_flight_and_ordered(n):
    for arrays, after in run_ranks(n, _spawned, 30001, env=SMALL_CHUNKS):
        for i, a in enumerate(arrays):
            assert np.all(a == sum(r + i for r in range(n)))
        assert np.all(after == n - 1)


GATHER_DTYPES = [np.float32, np.int8, np.bool_, np.complex64, np.uint64, np.float16]


def _gather_every_dtype(pg, count, shape_tail):
    """One all_gather per dtype, in one group (a launch per dtype would cost more than the calls)."""
    base = np.arange(count * int(np.prod(shape_tail)), dtype=np.int64).reshape(count, *shape_tail)
    return [pg.all_gather((base + 100 * pg.rank).astype(dtype)) for dtype in GATHER_DTYPES]


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("count,tail", [(0, ()), (1, ()), (7, (3,)), (3001, ())])
def test_all_gather(n, count, tail):
    results = run_ranks(n, _gather_every_dtype, count, tail, env=SMALL_CHUNKS)
    base = np.arange(count * int(np.prod(tail)), dtype=np.int64).reshape(count, *tail)
    for i, dtype in enumerate(GATHER_DTYPES):
        want = np.concatenate([(base + 100 * r).astype(dtype) for r in range(n)])
        for per_rank in results:
            got = per_rank[i]
            assert got.dtype == np.dtype(dtype) and got.shape == (n * count, *tail)
            np.testing.assert_array_equal(got, want)


def _broadcast_all_roots(pg, count):
    out = []
    for root in range(pg.world_size):
        for dtype in (np.float32, np.uint16, bfloat16()):
            data = np.zeros(count, dtype=dtype)
            if pg.rank == root:
                data[:] = (np.arange(count) % 97 + root).astype(dtype)
            assert pg.broadcast(root, data) is data
            out.append((root, dtype, data))
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("count", [0, 1, 7, 50001])
def test_broadcast_from_every_root(n, count):
    for per_rank in run_ranks(n, _broadcast_all_roots, count, env=SMALL_CHUNKS):
        assert len(per_rank) == 3 * n
        for root, dtype, got in per_rank:
            np.testing.assert_array_equal(got, (np.arange(count) % 97 + root).astype(dtype))
