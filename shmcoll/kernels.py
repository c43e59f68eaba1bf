"""Reduction kernels: ``dst = op(dst, src)`` in place, one numba loop per (wire code, op).

Why numba: the loops run on every chunk a collective moves, so they must run near memory speed
and release the GIL (``nogil=True``) so a spawned all-reduce really overlaps the caller's work.
``cache=True`` keeps the machine code on disk, so the many processes of a job compile nothing after
the first one. Nothing compiles at import: a loop compiles (or loads from the cache) on its first
call, or when ``warm_up`` asks for it.

Every numba function of the library lives in this one file on purpose: numba's disk cache is
invalidated when the file of a jitted function changes, not when a file it calls into changes, so a
loop here calling a converter kept elsewhere could go on running a stale converter after an edit.

Numerics (API.md): each float16, bfloat16 and float32 step equals "compute in float64, round once
to nearest even". 16-bit floats travel as uint16 bit patterns. The hot loops widen them exactly to
float32, compute there and round once to 16 bits; that is bitwise the same as the float64 rule:
  * a product of two 16-bit floats is exact in float32 (at most 22 significant bits; for bfloat16 a
    product only loses bits below 2^-149, i.e. when it is under half the smallest subnormal, where
    every rounding gives zero), so one rounding to 16 bits follows;
  * a sum is rounded twice (float32, then 16 bits), which never differs from rounding once because
    float32 has 24 >= 2p + 2 bits for p = 11 (float16) and p = 8 (bfloat16) (Figueroa, "When is
    double rounding innocuous?", 1995); a bfloat16 sum below 2^-126 is exact in float32.
    The float64 rule itself is the same double rounding with 53 bits, so both equal rounding the
    exact result once.
``scale_into`` divides by an arbitrary integer, where that argument does not hold, so it really
computes in float64 and rounds straight from the float64 bits (``_round_f64_bits``), never via
float32. The float64 converters are also the exported array helpers.

MIN/MAX propagate NaN like ``np.minimum``/``np.maximum`` and order -0.0 below +0.0 (IEEE 754-2019
minimum/maximum), so a result never depends on which operand came first. NaN results are quiet.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from shmcoll.types import WIRE_TYPES, ReduceKind

_jit = numba.njit(nogil=True, cache=True)
_U32 = np.uint32  # numba widens int32 arithmetic to int64; casting each step back keeps 16 lanes


def _f64_bits(value: float) -> int:
    return int(np.float64(value).view(np.int64))


_F64_ONE_EXPONENT = 1 << 52  # one unit of the float64 biased exponent, in bit-pattern space
_F64_ABS_MASK = 0x7FFF_FFFF_FFFF_FFFF
_F64_INF_BITS = 0x7FF0_0000_0000_0000
# float16: bias 15, 10 mantissa bits (42 float64 mantissa bits dropped); bfloat16: bias 127, 7 (45).
_F16_FORMAT = (42, _f64_bits(2.0**-14), 2.0 ** (-24 + 52), _f64_bits(65504.0 + 16.0))
_BF16_FORMAT = (45, _f64_bits(2.0**-126), 2.0 ** (-133 + 52), _f64_bits(2.0**128 - 2.0**119))


# --- float64 -> 16-bit, rounded once, straight from the float64 bits ---------------------------


@_jit
def _round_f64_bits(x, drop, min_normal_bits, subnormal_magic, overflow_bits):
    """float64 -> 16-bit float bits, rounded once to nearest even, straight from the float64 bits.

    Normals: re-bias the exponent, add half-an-ulp-minus-one plus the lowest kept bit, drop the
    ``drop`` low bits (ties go to even; a carry bumps the exponent, up to inf). Subnormals: adding a
    float64 whose ulp is the subnormal step makes the FPU round. Overflow, infinity and NaN
    (payload kept, made quiet) are selected last. Every case is computed; selects, no branches.
    """
    u = np.float64(x).view(np.int64)
    sign = (u >> 48) & 0x8000
    mag = u & _F64_ABS_MASK
    mant_bits = 52 - drop
    inf = ((1 << (15 - mant_bits)) - 1) << mant_bits
    quiet_nan = inf | (1 << (mant_bits - 1)) | ((mag >> drop) & ((1 << mant_bits) - 1))
    rebias = min_normal_bits - _F64_ONE_EXPONENT
    normal = (mag - rebias + ((1 << (drop - 1)) - 1) + ((mag >> drop) & 1)) >> drop
    shifted = np.float64(np.int64(mag).view(np.float64) + subnormal_magic)
    subnormal = shifted.view(np.int64) - np.float64(subnormal_magic).view(np.int64)
    result = normal if mag >= min_normal_bits else subnormal
    result = inf if mag >= overflow_bits else result
    result = quiet_nan if mag > _F64_INF_BITS else result
    return np.uint16(result | sign)


@_jit
def _f64_to_f16(x):
    return _round_f64_bits(x, *_F16_FORMAT)


@_jit
def _f64_to_bf16(x):
    return _round_f64_bits(x, *_BF16_FORMAT)


# --- float16 <-> float32: conversion instructions where numba's target has them -------------


def _target_converts_half() -> bool:
    """True when LLVM lowers half<->float to instructions (F16C on x86-64, FCVT on aarch64).

    Elsewhere LLVM would emit calls to compiler-rt helpers that numba does not link (a segfault),
    so the software converters below are used instead. Follows NUMBA_CPU_FEATURES like numba does.
    """
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    features = getattr(numba.core.config, "CPU_FEATURES", None)  # set at numba's import, from the environment
    if features is None:
        from numba.core.codegen import get_host_cpu_features

        features = get_host_cpu_features()
    return "+f16c" in features.split(",")


@intrinsic
def _f16_to_f32_native(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_f16_native(typingctx, value):
    def codegen(context, builder, signature, args):  # round to nearest even, NaN stays (quiet) NaN
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@_jit
def _f16_to_f32_soft(h):
    """Exact widening with integer ops; subnormals via (2^-14 * 1.m) - 2^-14. No branches."""
    magnitude = _U32(_U32(_U32(h) & _U32(0x7FFF)) << _U32(13))
    exponent = _U32(magnitude & _U32(0x7C00 << 13))
    normal = _U32(magnitude + _U32((127 - 15) << 23))
    special = _U32(normal + _U32((128 - 16) << 23))  # inf/NaN: exponent all ones
    tiny = np.float32(_U32(normal + _U32(1 << 23)).view(np.float32) - np.float32(2.0**-14))
    widened = special if exponent == _U32(0x7C00 << 13) else normal
    widened = tiny.view(np.uint32) if exponent == _U32(0) else widened
    return _U32(widened | _U32(_U32(_U32(h) & _U32(0x8000)) << _U32(16))).view(np.float32)


@_jit
def _f32_to_f16_soft(x):
    """Round to nearest even; float32 -> float64 is exact, so this is one rounding."""
    return _f64_to_f16(np.float64(x))


_f16_to_f32: Any
_f32_to_f16: Any
if _target_converts_half():
    _f16_to_f32, _f32_to_f16 = _f16_to_f32_native, _f32_to_f16_native
else:  # pragma: no cover - exercised by a subprocess test with NUMBA_CPU_FEATURES lacking f16c
    _f16_to_f32, _f32_to_f16 = _f16_to_f32_soft, _f32_to_f16_soft


# --- bfloat16 <-> float32 -------------------------------------------------------------------


@_jit
def _bf16_to_f32(h):
    """bfloat16 is the top half of a float32."""
    return _U32(_U32(h) << _U32(16)).view(np.float32)


@_jit
def _f32_bits_to_bf16_high(u):
    """float32 bits rounded to nearest even at bit 16 (result in the high half; a carry bumps the
    exponent, up to inf; subnormals round alike). NaN needs no case of its own as long as its low
    half is zero, which holds for any NaN computed from bfloat16 operands (payload or default NaN)."""
    return _U32(_U32(u + _U32(0x7FFF)) + _U32(_U32(u >> _U32(16)) & _U32(1)))


@_jit
def _f32_to_bf16(x):
    return np.uint16(_f32_bits_to_bf16_high(np.float32(x).view(np.uint32)) >> _U32(16))


# --- array converters (exported) ----------------------------------------------------------


@_jit
def _f16_array_to_f64(bits, out):
    for i in range(bits.size):
        out[i] = np.float64(_f16_to_f32(bits[i]))


@_jit
def _bf16_array_to_f64(bits, out):
    for i in range(bits.size):
        out[i] = np.float64(_bf16_to_f32(bits[i]))


@_jit
def _f64_array_to_f16(values, out):
    for i in range(values.size):
        out[i] = _f64_to_f16(values[i])


@_jit
def _f64_array_to_bf16(values, out):
    for i in range(values.size):
        out[i] = _f64_to_bf16(values[i])


def _convert(loop, values, in_dtype, out_dtype) -> np.ndarray:
    flat = np.ascontiguousarray(values, dtype=in_dtype)
    out = np.empty(flat.shape, dtype=out_dtype)
    loop(flat.reshape(-1), out.reshape(-1))
    return out


def f16_bits_to_f64(bits) -> np.ndarray:
    """float16 bit patterns (uint16) -> float64 values, exactly."""
    return _convert(_f16_array_to_f64, bits, np.uint16, np.float64)


def bf16_bits_to_f64(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float64 values, exactly."""
    return _convert(_bf16_array_to_f64, bits, np.uint16, np.float64)


def f64_to_f16_bits(values) -> np.ndarray:
    """float64 values -> float16 bit patterns, rounded once to nearest even."""
    return _convert(_f64_array_to_f16, values, np.float64, np.uint16)


def f64_to_bf16_bits(values) -> np.ndarray:
    """float64 values -> bfloat16 bit patterns, rounded once to nearest even (no float32 step)."""
    return _convert(_f64_array_to_bf16, values, np.float64, np.uint16)


# --- reduction loops ------------------------------------------------------------------------


@_jit
def _min(a, b):
    """np.minimum's NaN propagation (the first NaN wins) with -0.0 < +0.0; selects, no branches."""
    negative = math.copysign(1.0, a) < 0.0
    return a if (a < b) | ((a == b) & negative) | (a != a) else b


@_jit
def _max(a, b):
    """np.maximum's NaN propagation (the first NaN wins) with +0.0 > -0.0."""
    positive = math.copysign(1.0, a) > 0.0
    return a if (a > b) | ((a == b) & positive) | (a != a) else b


@_jit
def _quiet_f16(bits):
    """MIN/MAX only select, and LLVM may fold the widen-narrow pair, so a signalling NaN operand
    could pass through untouched; set the quiet bit on the integer result instead."""
    return np.uint16(bits | 0x0200) if (bits & 0x7FFF) > 0x7C00 else bits


@_jit
def _quiet_bf16(bits):
    return np.uint16(bits | 0x0040) if (bits & 0x7FFF) > 0x7F80 else bits


@_jit
def _common_length(dst, src):
    """Checked inside the jitted loop (no Python cost): unequal lengths would run out of bounds."""
    if dst.size != src.size:
        raise ValueError("reduce_into: dst and src differ in length")
    return dst.size


@_jit
def _f16_sum(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _f32_to_f16(_f16_to_f32(dst[i]) + _f16_to_f32(src[i]))


@_jit
def _f16_prod(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _f32_to_f16(_f16_to_f32(dst[i]) * _f16_to_f32(src[i]))


@_jit
def _f16_min(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _quiet_f16(_f32_to_f16(_min(_f16_to_f32(dst[i]), _f16_to_f32(src[i]))))


@_jit
def _f16_max(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _quiet_f16(_f32_to_f16(_max(_f16_to_f32(dst[i]), _f16_to_f32(src[i]))))


@_jit
def _bf16_sum_pairs(dst, src):
    """Two bfloat16 per uint32 lane: widening is one shift or mask, narrowing one mask or shift;
    half the instructions of one value per lane (which half holds which element is irrelevant)."""
    high = _U32(0xFFFF0000)
    for i in range(dst.size):
        d, s = dst[i], src[i]
        low_sum = _U32(d << _U32(16)).view(np.float32) + _U32(s << _U32(16)).view(np.float32)
        high_sum = _U32(d & high).view(np.float32) + _U32(s & high).view(np.float32)
        low_rounded = _f32_bits_to_bf16_high(np.float32(low_sum).view(np.uint32))
        high_rounded = _f32_bits_to_bf16_high(np.float32(high_sum).view(np.uint32))
        dst[i] = _U32(low_rounded >> _U32(16)) | _U32(high_rounded & high)


@_jit
def _bf16_sum(dst, src):
    n = _common_length(dst, src)
    pairs = n // 2 if (dst.ctypes.data | src.ctypes.data) % 4 == 0 else 0
    if pairs:
        _bf16_sum_pairs(dst[: 2 * pairs].view(np.uint32), src[: 2 * pairs].view(np.uint32))
    for i in range(2 * pairs, n):
        dst[i] = _f32_to_bf16(_bf16_to_f32(dst[i]) + _bf16_to_f32(src[i]))


@_jit
def _bf16_prod(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _f32_to_bf16(_bf16_to_f32(dst[i]) * _bf16_to_f32(src[i]))


@_jit
def _bf16_min(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _quiet_bf16(_f32_to_bf16(_min(_bf16_to_f32(dst[i]), _bf16_to_f32(src[i]))))


@_jit
def _bf16_max(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _quiet_bf16(_f32_to_bf16(_max(_bf16_to_f32(dst[i]), _bf16_to_f32(src[i]))))


# Native loops serve float32, float64, int32 and int64 (one compiled specialisation per dtype).
# float32 SUM/PROD in native float32 equal "float64, then round once": 53 >= 2*24 + 2, the same
# double-rounding argument as above. Integer SUM/PROD wrap around: numba widens int32 to int64 and
# the store truncates to the low 32 bits; int64 arithmetic wraps in LLVM.


@_jit
def _native_sum(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] += src[i]


@_jit
def _native_prod(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] *= src[i]


@_jit
def _native_min(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _min(dst[i], src[i])


@_jit
def _native_max(dst, src):
    for i in range(_common_length(dst, src)):
        dst[i] = _max(dst[i], src[i])


@_jit
def _f16_scale(dst, divisor):
    d = np.float64(divisor)
    for i in range(dst.size):
        dst[i] = _f64_to_f16(np.float64(_f16_to_f32(dst[i])) / d)


@_jit
def _bf16_scale(dst, divisor):
    d = np.float64(divisor)
    for i in range(dst.size):
        dst[i] = _f64_to_bf16(np.float64(_bf16_to_f32(dst[i])) / d)


@_jit
def _native_scale(dst, divisor):
    """float64 quotient, then one rounding on the store for float32."""
    d = np.float64(divisor)
    for i in range(dst.size):
        dst[i] = np.float64(dst[i]) / d


# --- dispatch -------------------------------------------------------------------------------

_PER_OP = {
    1: (_f16_sum, _f16_prod, _f16_min, _f16_max),
    2: (_bf16_sum, _bf16_prod, _bf16_min, _bf16_max),
    **{code: (_native_sum, _native_prod, _native_min, _native_max) for code in (3, 4, 5, 6)},
}
#: (code, op) -> jitted loop. AVG reduces as SUM; the caller divides at the end with scale_into.
_REDUCERS = {
    (code, op): loops[ReduceKind.SUM if op == ReduceKind.AVG else op]
    for code, loops in _PER_OP.items()
    for op in ReduceKind
}
_SCALERS = {1: _f16_scale, 2: _bf16_scale, 3: _native_scale, 4: _native_scale}


def reduce_into(dst: np.ndarray, src: np.ndarray, code: int, op: ReduceKind) -> None:
    """dst[i] = op(dst[i], src[i]) in place over storage arrays (uint16 bits for f16/bf16).

    Kept to a dict lookup and one call: this runs once per chunk of every collective.
    """
    try:
        loop = _REDUCERS[code, op]
    except KeyError:
        raise ValueError(f"no reduction for wire code {code!r} and op {op!r}") from None
    loop(dst, src)


def scale_into(dst: np.ndarray, code: int, divisor: int) -> None:
    """dst[i] = dst[i] / divisor in float64, rounded once (float codes only; AVG's last step)."""
    try:
        loop = _SCALERS[code]
    except KeyError:
        raise ValueError(f"scale_into needs a float wire code, got {code!r}") from None
    loop(dst, divisor)


def warm_up(code: int, op: ReduceKind) -> None:
    """Compile (or load from numba's disk cache) the loop for (code, op) now, off the hot path.

    Covers writable C-contiguous operands; a read-only src is a second specialisation (compiled
    and cached on its first use).
    """
    storage = WIRE_TYPES[code].storage
    reduce_into(np.zeros(2, storage), np.zeros(2, storage), code, op)
    if op == ReduceKind.AVG:
        scale_into(np.zeros(1, storage), code, 1)
