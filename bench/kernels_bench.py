"""Throughput of shmcoll.kernels.reduce_into (SUM) against numpy, and its per-call overhead.

GB/s here = bytes of the two operands read per call (2 * n * itemsize, dst and src) / seconds;
the write-back of dst (another n * itemsize) is not counted. Sizes are per array. Each figure is the
best of several timed rounds, after a warm-up call, so it excludes first-touch faults.

    python bench/kernels_bench.py
"""

from __future__ import annotations

import time

import numpy as np

from shmcoll import kernels
from shmcoll.types import ReduceKind

SIZES = {"1 MiB": 1 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20}
CODES = {"f32": (3, np.float32), "f16": (1, np.uint16), "bf16": (2, np.uint16), "f64": (4, np.float64)}


def best_seconds(call, nbytes: int) -> float:
    """Best per-call time over a few rounds sized to take ~0.1 s each."""
    call()
    reps = max(1, int(0.1 / max(nbytes / 5e9, 1e-7)))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def operands(code: int, storage, nbytes: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random values of moderate size, so a repeated SUM stays finite and normal for a while."""
    n = nbytes // np.dtype(storage).itemsize
    first, second = (rng.uniform(-1.0, 1.0, n) for _ in range(2))
    if code == 1:
        return kernels.f64_to_f16_bits(first), kernels.f64_to_f16_bits(second)
    if code == 2:
        return kernels.f64_to_bf16_bits(first), kernels.f64_to_bf16_bits(second)
    return first.astype(storage), second.astype(storage)


def gbps(seconds: float, nbytes: int) -> float:
    return 2 * nbytes / seconds / 1e9


def kernel_gbps(code: int, storage, nbytes: int, rng) -> float:
    dst, src = operands(code, storage, nbytes, rng)
    return gbps(best_seconds(lambda: kernels.reduce_into(dst, src, code, ReduceKind.SUM), nbytes), nbytes)


def numpy_gbps(dtype, nbytes: int, rng) -> float:
    a, b = (rng.uniform(-1, 1, nbytes // np.dtype(dtype).itemsize).astype(dtype) for _ in range(2))
    return gbps(best_seconds(lambda: np.add(a, b, out=a), nbytes), nbytes)


def throughput_table(rng) -> None:
    print("reduce_into SUM, GB/s = 2 * n * itemsize / time (both operands read; per-array size)")
    columns = [*CODES, "np f32", "np f16", "f16/f32", "bf16/f32"]
    print(f"{'size':>8} " + " ".join(f"{name:>8}" for name in columns))
    for label, nbytes in SIZES.items():
        ours = {name: kernel_gbps(code, storage, nbytes, rng) for name, (code, storage) in CODES.items()}
        row = [*ours.values(), numpy_gbps(np.float32, nbytes, rng), numpy_gbps(np.float16, nbytes, rng),
               ours["f16"] / ours["f32"], ours["bf16"] / ours["f32"]]
        print(f"{label:>8} " + " ".join(f"{v:8.2f}" for v in row))


def per_call_overhead(code: int, storage, calls: int = 200_000) -> float:
    """Microseconds per reduce_into call on 8-byte arrays (best of 3 loops)."""
    dst = np.zeros(8 // np.dtype(storage).itemsize, storage)
    src = np.zeros_like(dst)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            kernels.reduce_into(dst, src, code, ReduceKind.SUM)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    throughput_table(rng)
    print()
    print("per-call overhead of kernels.reduce_into at 8 bytes (us)")
    for name in ("f32", "f16"):
        code, storage = CODES[name]
        print(f"{name:>8} {per_call_overhead(code, storage):8.3f}")


if __name__ == "__main__":
    main()
