"""Pure-numpy reference for the kernels: 16-bit float codecs and the reference reduction.

Deliberately a different method from the C bit tricks behind ``kernels.py`` (shmcoll/native/),
so the tests that compare the two can catch a mistake in either.

float16 uses numpy's own casts: numpy converts float64 -> float16 directly and correctly rounded.
bfloat16 relies on no third party's cast (some ml_dtypes releases rounded float64 -> bfloat16
twice, through float32): ``nearest_bits`` picks the nearest entry of the sorted table of every
non-negative 16-bit value, ties to the even pattern.
"""

from __future__ import annotations

import functools

import numpy as np

from shmcoll.types import ReduceKind

_F16_INF_BITS = 0x7C00
_BF16_INF_BITS = 0x7F80
_BF16_QUIET_NAN = 0x7FC0
_F16_QUIET_NAN = 0x7E00


def f16_bits_to_f64_np(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float64)


def bf16_bits_to_f64_np(bits) -> np.ndarray:
    """bfloat16 is the top half of a float32; both widenings are exact."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_f16_bits_np(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype(np.float16).view(np.uint16)


@functools.cache
def _magnitude_table(widen, inf_bits: int, overflow_value: float) -> np.ndarray:
    """Values of bit patterns 0..inf_bits, increasing; inf stands in as 2^(emax+1), where rounding
    with an unbounded exponent would land, so overflow falls out of the nearest-value search."""
    values = widen(np.arange(inf_bits + 1, dtype=np.uint16))
    values[-1] = overflow_value
    return values


def nearest_bits(values, table: np.ndarray, quiet_nan: int) -> np.ndarray:
    """Round float64 values to the nearest table entry (index = bit pattern), ties to even.

    The distances are exact in float64: within a bracket lo <= |x| <= hi with hi <= 2*lo,
    Sterbenz's lemma makes both subtractions exact; when lo == 0 a rounded hi - |x| still
    compares correctly against the exact |x|.
    """
    x = np.asarray(values, dtype=np.float64)
    mag = np.abs(x)
    hi = np.searchsorted(table, mag, side="left").clip(0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    with np.errstate(invalid="ignore"):
        below, above = mag - table[lo], table[hi] - mag
        take_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    magnitude_bits = np.where(np.isnan(x), quiet_nan, np.where(take_hi, hi, lo))
    return (magnitude_bits | (np.signbit(x).astype(np.int64) << 15)).astype(np.uint16)


def f64_to_bf16_bits_np(values) -> np.ndarray:
    """float64 -> bfloat16 bits, rounded once to nearest even (no float32 step)."""
    table = _magnitude_table(bf16_bits_to_f64_np, _BF16_INF_BITS, 2.0**128)
    return nearest_bits(values, table, _BF16_QUIET_NAN)


def f64_to_f16_bits_by_table(values) -> np.ndarray:
    """The bfloat16 method applied to float16, for tests to validate it against numpy's cast."""
    table = _magnitude_table(f16_bits_to_f64_np, _F16_INF_BITS, 2.0**16)
    return nearest_bits(values, table, _F16_QUIET_NAN)


def _identity(values):
    return np.asarray(values, dtype=np.float64)


#: wire code -> (storage -> float64, float64 -> storage) for the float codes.
_CODECS = {
    1: (f16_bits_to_f64_np, f64_to_f16_bits_np),
    2: (bf16_bits_to_f64_np, f64_to_bf16_bits_np),
    3: (lambda a: np.asarray(a, np.float32).astype(np.float64), lambda v: v.astype(np.float32)),
    4: (_identity, _identity),
}
_INT_DTYPES = {5: np.int32, 6: np.int64}


def _minimum(a, b):
    """np.minimum with -0.0 ordered below +0.0 (what the kernels do)."""
    return np.where(a == b, np.where(np.signbit(a), a, b), np.minimum(a, b))


def _maximum(a, b):
    return np.where(a == b, np.where(np.signbit(a), b, a), np.maximum(a, b))


_NP_OPS = {
    ReduceKind.SUM: np.add,
    ReduceKind.AVG: np.add,
    ReduceKind.PROD: np.multiply,
    ReduceKind.MIN: _minimum,
    ReduceKind.MAX: _maximum,
}


def _step(acc: np.ndarray, other: np.ndarray, code: int, op: ReduceKind) -> np.ndarray:
    if code in _INT_DTYPES:  # numpy integer arithmetic wraps around, like the kernels
        dtype = _INT_DTYPES[code]
        return _NP_OPS[op](np.asarray(acc, dtype), np.asarray(other, dtype)).astype(dtype)
    to_f64, from_f64 = _CODECS[code]
    with np.errstate(all="ignore"):
        return from_f64(_NP_OPS[op](to_f64(acc), to_f64(other)))


def reference_scale(storage: np.ndarray, code: int, divisor: int) -> np.ndarray:
    """storage / divisor computed in float64, rounded once to the element type."""
    to_f64, from_f64 = _CODECS[code]
    with np.errstate(all="ignore"):
        return from_f64(to_f64(storage) / divisor)


def reference_reduce(arrays: list[np.ndarray], code: int, op: ReduceKind) -> np.ndarray:
    """Left fold arrays[0] op arrays[1] op ..., each step in float64 rounded once to the element
    type; AVG is that SUM divided by len(arrays). Returns a storage array (uint16 for f16/bf16)."""
    if op == ReduceKind.AVG and code not in _CODECS:
        raise ValueError("AVG is defined for float codes only")
    acc = np.array(arrays[0], copy=True)
    for other in arrays[1:]:
        acc = _step(acc, other, code, op)
    if op == ReduceKind.AVG:
        acc = reference_scale(acc, code, len(arrays))
    return acc
