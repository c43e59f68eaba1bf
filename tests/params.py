"""What the tests run over: world sizes, dtypes, ops, environments that force a path, and the
exact integer inputs whose reductions every dtype holds exactly."""

from __future__ import annotations

import numpy as np

from shmcoll.types import WIRE_TYPES, ReduceKind, bfloat16, wire_type_of

from kernel_reference import reference_reduce

#: World sizes of the collective tests.
WORLD_SIZES = [1, 2, 3, 4]
#: Floating-point dtypes, bfloat16 included.
FLOAT_DTYPES = [np.float16, bfloat16(), np.float32, np.float64]
#: Every dtype a reduction accepts.
REDUCE_DTYPES = [*FLOAT_DTYPES, np.int32, np.int64]
#: Every dtype that can travel (gather, scatter, all_to_all, ...): each wire type's array dtype, bf16's
#: only with ml_dtypes (without it bf16 arrays are uint16, which is u16's).
MOVE_DTYPES = [w.array_dtype for w in WIRE_TYPES.values() if wire_type_of(w.array_dtype) is w]
#: Random normal floats: the dtypes, and the tolerance of a sum of them against float64.
RANDOM_FLOAT_DTYPES = [np.float16, np.float32, np.float64]
RANDOM_FLOAT_TOL = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-12}
#: The ops of integer reductions (AVG is for floats only).
INT_OPS = [ReduceKind.SUM, ReduceKind.PROD, ReduceKind.MIN, ReduceKind.MAX]
#: 4 KiB chunks: many chunks per message even for small test arrays.
SMALL_CHUNKS = {"SHMCOLL_CHUNK_BYTES": "4096"}
#: The bandwidth algorithms (rings, two levels across hosts) even for small arrays: no one-step path,
#: no shared-memory board.
BANDWIDTH_PATHS = {"SHMCOLL_ONE_SHOT_BYTES": "0", "SHMCOLL_SHM_BOARD_BYTES": "0"}


def ops_for(dtype) -> list[ReduceKind]:
    """Every op a reduction of `dtype` accepts."""
    return list(ReduceKind) if wire_type_of(np.dtype(dtype)).is_float else INT_OPS


def small_ints(rank: int, count: int, dtype, op: ReduceKind) -> np.ndarray:
    """Integer-valued inputs whose sums and products are exact in every dtype, so the reduction
    order cannot matter and results must equal the reference bit for bit."""
    rng = np.random.default_rng(1000 * rank + count + int(op))
    high = 3 if op is ReduceKind.PROD else 9
    return rng.integers(-high, high + 1, size=count).astype(np.float64).astype(dtype)


def reduced(n: int, count: int, dtype, op: ReduceKind) -> np.ndarray:
    """op over the small_ints of ranks 0..n-1, as storage (uint16 for the 16-bit floats)."""
    wire = wire_type_of(np.dtype(dtype))
    return reference_reduce([small_ints(r, count, dtype, op).view(wire.storage) for r in range(n)], wire.code, op)
