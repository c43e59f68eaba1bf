"""Every public collective on one job, with exact expected results; prints one OK line per rank.

Run under any launcher (`shmcoll-run --hostfile ... tests/programs/api_check.py`). Inputs are small
integers, halves and powers of two, so every sum, product and average below is exact in every
dtype whatever order the ranks reduce in: any difference is a bug, not rounding. Uses the public
API only, so it holds for whichever transport init() picks.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter

import numpy as np

import shmcoll
from shmcoll import DType, ReduceKind

BASE_FLOATS = [np.float16, np.float32, np.float64]
INTS = [np.int32, np.int64]
SIZES = [0, 1, 7, 4099]
BIG = [(np.float32, ReduceKind.SUM, 3 << 20), (np.float16, ReduceKind.MAX, 2 << 20),
       (np.float64, ReduceKind.AVG, 4 << 20)]  # (dtype, op, bytes)
#: Largest job whose ranks also reduce numpy bfloat16 arrays (ml_dtypes): importing ml_dtypes takes
#: about 1.5 s of processor per rank, most of a 64-rank job's time on 2 cores. Larger jobs check
#: bfloat16 through all_reduce_typed only.
ML_DTYPES_UP_TO = 16


def numpy_bfloat16(world: int) -> list[np.dtype]:
    """[ml_dtypes' bfloat16] where this job reduces numpy bfloat16 arrays and ml_dtypes is installed, else []."""
    if world > ML_DTYPES_UP_TO:
        return []
    try:
        import ml_dtypes
    except ImportError:  # bfloat16 is still checked through all_reduce_typed
        return []
    return [np.dtype(ml_dtypes.bfloat16)]


def values(rank: int, n: int, op: ReduceKind, is_float: bool) -> np.ndarray:
    """Rank `rank`'s input, as float64: products stay powers of two, sums small integers or halves."""
    i = np.arange(n)
    if op is ReduceKind.PROD:
        choices = np.array([-2.0, -1.0, 0.5, 1.0, 2.0] if is_float else [-2.0, -1.0, 1.0, 2.0])
        if rank >= 8:  # only signs beyond 8 ranks: products stay inside int32 and float16 at any size
            choices = np.array([-1.0, 1.0])
        return choices[(i * 3 + rank) % len(choices)]
    step = 0.5 if is_float else 1.0
    return (((i * 7 + rank * 3) % 11) - 5) * step


def same_input_as(rank: int, op: ReduceKind) -> int:
    """The lowest rank whose values() input equals rank's: inputs repeat every 11 ranks (every 2
    for products beyond 8 ranks), so expected() computes each distinct one once."""
    if op is ReduceKind.PROD:
        return rank if rank < 8 else 8 + rank % 2
    return rank % 11


def expected(world: int, n: int, op: ReduceKind, dtype) -> np.ndarray:
    """The reduction over every rank's input, in float64 (exact here), rounded once to dtype. Each
    distinct input is folded once with its number of ranks, so the cost does not grow with the world."""
    is_float = np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16"
    counts = Counter(same_input_as(r, op) for r in range(world))
    inputs = [(values(r, n, op, is_float), k) for r, k in sorted(counts.items())]
    if op is ReduceKind.PROD:
        out = functools.reduce(np.multiply, [v ** k for v, k in inputs])
    elif op in (ReduceKind.MIN, ReduceKind.MAX):
        out = functools.reduce(np.minimum if op is ReduceKind.MIN else np.maximum, [v for v, _ in inputs])
    else:
        out = functools.reduce(np.add, [v * k for v, k in inputs])
    if op is ReduceKind.AVG:
        out = out / world
    return out.astype(dtype)


def check_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    assert got.tobytes() == want.tobytes(), f"{what}: got {got[:8]} ... want {want[:8]} ..."


def check_all_reduce(pg) -> None:
    floats = BASE_FLOATS + numpy_bfloat16(pg.world_size)
    for dtype in floats + INTS:
        is_float = dtype in floats
        for op in ReduceKind:
            if op is ReduceKind.AVG and not is_float:
                continue
            for n in SIZES:
                data = values(pg.rank, n, op, is_float).astype(dtype)
                pg.all_reduce(data, op)
                check_equal(data, expected(pg.world_size, n, op, dtype), f"all_reduce {np.dtype(dtype)} {op} n={n}")
    for dtype, op, nbytes in BIG:
        nbytes //= max(1, pg.world_size // 8)  # every rank computes the expected result: keep it cheap
        n = nbytes // np.dtype(dtype).itemsize + 1  # not divisible by the world size
        data = values(pg.rank, n, op, True).astype(dtype)
        pg.all_reduce(data, op)
        check_equal(data, expected(pg.world_size, n, op, dtype), f"all_reduce {np.dtype(dtype)} {op} {nbytes} B")


def bf16_bytes(x: np.ndarray) -> bytearray:
    """float64 values exact in bfloat16 as raw little-endian bfloat16 (the top half of float32)."""
    return bytearray((x.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes())


def check_all_reduce_typed(pg) -> None:
    for op in (ReduceKind.SUM, ReduceKind.MAX, ReduceKind.PROD):
        n = 1001
        mine, want = values(pg.rank, n, op, True), expected(pg.world_size, n, op, np.float64)
        buf = bytearray(mine.astype("<f2").tobytes())
        pg.all_reduce_typed(buf, DType.F16, op)
        assert bytes(buf) == want.astype("<f2").tobytes(), f"all_reduce_typed F16 {op}"
        buf = bf16_bytes(mine)
        pg.all_reduce_typed(memoryview(buf), DType.BF16, op)
        assert buf == bf16_bytes(want), f"all_reduce_typed BF16 {op}"


def check_spawn(pg) -> None:
    a = values(pg.rank, 50_000, ReduceKind.SUM, True).astype(np.float32)
    b = values(pg.rank, 333, ReduceKind.MIN, False).astype(np.int64)
    ha, hb = pg.spawn_all_reduce(a), pg.spawn_all_reduce(b, ReduceKind.MIN)
    check_equal(hb.join(timeout=60), expected(pg.world_size, 333, ReduceKind.MIN, np.int64), "spawn MIN")
    check_equal(ha.join(timeout=60), expected(pg.world_size, 50_000, ReduceKind.SUM, np.float32), "spawn SUM")
    assert ha.done() and hb.done()


def check_p2p(pg) -> None:
    """A ring of sends; the second tag is read first, which must not wait behind the first."""
    right, left = (pg.rank + 1) % pg.world_size, (pg.rank - 1) % pg.world_size
    pg.send(right, 5, np.full(pg.rank + 1, pg.rank, dtype=np.int64))
    pg.send(right, 6, np.arange(6, dtype=np.float32).reshape(2, 3) + pg.rank)
    check_equal(pg.recv(left, 6), np.arange(6, dtype=np.float32).reshape(2, 3) + left, "recv tag 6")
    check_equal(pg.recv(left, 5), np.full(left + 1, left, dtype=np.int64), "recv tag 5")


def check_gather_broadcast(pg) -> None:
    got = pg.all_gather(np.arange(3, dtype=np.int32) + 10 * pg.rank)
    check_equal(got, np.concatenate([np.arange(3, dtype=np.int32) + 10 * r for r in range(pg.world_size)]),
                "all_gather")
    for root in range(pg.world_size):
        large = root in {0, 1, pg.world_size // 2, pg.world_size - 1}  # a large one from a few roots
        for dtype, n in ((np.int32, 5),) + (((np.float32, 1 << 18),) if large else ()):
            want = (np.arange(n) % 1000 + root).astype(dtype)
            data = want.copy() if pg.rank == root else np.zeros(n, dtype=dtype)
            pg.broadcast(root, data)
            check_equal(data, want, f"broadcast root={root} {np.dtype(dtype)}")


def check_federated(pg) -> None:
    data = np.full(1000, 2.0 * pg.rank, dtype=np.float32)
    count = pg.federated_average(data, 30.0)
    assert count == (pg.world_size if pg.rank == 0 else 0), f"federated_average returned {count}"
    check_equal(data, np.full(1000, pg.world_size - 1.0, dtype=np.float32), "federated_average")


def netns_id() -> str:
    """This process's network namespace (inode), so a test can see the ranks really ran apart."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "-"


def main() -> int:
    with shmcoll.init(timeout=60.0) as pg:
        pg.barrier()
        check_p2p(pg)
        check_all_reduce(pg)
        check_all_reduce_typed(pg)
        check_spawn(pg)
        check_gather_broadcast(pg)
        check_federated(pg)
        pg.barrier()
        line = (f"OK rank={pg.rank} world={pg.world_size} host={os.environ.get('SHMCOLL_HOST_ID', '-')} "
                f"transport={type(pg.transport).__name__} netns={netns_id()}\n")
        sys.stdout.flush()
        os.write(1, line.encode())  # one write: whole even when ranks share an untagged pipe
    return 0


if __name__ == "__main__":
    sys.exit(main())
