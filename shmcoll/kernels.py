"""Reduction kernels: ``dst = op(dst, src)`` in place, one numba loop per (wire code, op); and,
at the end, the shared-memory board's atomics, waits and compiled all-reduce step, which call them.

Why numba: the loops run on every chunk a collective moves, so they must run near memory speed
and release the GIL (``nogil=True``) so a spawned all-reduce really overlaps the caller's work.
``cache=True`` keeps the machine code on disk, so the many processes of a job compile nothing after
the first one. Nothing compiles at import: a loop compiles (or loads from the cache) on its first
call, or when ``warm_up`` (``warm_board`` for the board's step) asks for it.

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
from numba.core import cgutils, types
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array

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


# --- shared memory: ordered loads and stores, waiting and waking ----------------------------
#
# The board (transport/shm_board.py) is memory that other processes read while this one writes.
# These give it real ordering on every CPU, not x86's store order by luck: a reader whose acquire
# load sees a published word also sees every store the writer made before its release store.
# Waiting spins on the word with the CPU's pause hint, then sleeps on a futex of the word's low
# half (plain FUTEX_WAIT, not the private variant: the word lives in a segment several processes
# map). A sleeper counts itself in a counter next to the word first, so a writer knows whether to
# make the wake-up system call. Store, then look at the counter (writer); count, then look at the
# word (sleeper): both sequentially consistent, so at least one of the two sees the other, and
# FUTEX_WAIT itself refuses to sleep once the word has changed. Words are little-endian.

_ARM = platform.machine().lower() in ("aarch64", "arm64")
_SYS_FUTEX, _SYS_SCHED_YIELD = (98, 124) if _ARM else (202, 24)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_CLOCK_MONOTONIC = 1
_I32, _I64 = ir.IntType(32), ir.IntType(64)
_PAUSES_PER_LOOK = 4  # pause hints between two looks at a word while spinning (a few hundred ns)
_LOOKS_PER_YIELD = 16  # every so many looks, give the core away: ranks may outnumber cores


def _element_pointer(context, builder, sig, args):
    """The address of arr[index] for an intrinsic called as f(arr, index, ...)."""
    ary = make_array(sig.args[0])(context, builder, args[0])
    index = context.cast(builder, args[1], sig.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [index], wraparound=False)


def _atomic_load(ordering: str):
    @intrinsic
    def load(typingctx, arr, index):
        def codegen(context, builder, sig, args):
            return builder.load_atomic(_element_pointer(context, builder, sig, args), ordering,
                                       arr.dtype.bitwidth // 8)

        return arr.dtype(arr, index), codegen

    return load


_load_acquire = _atomic_load("acquire")
_load_seq_cst = _atomic_load("seq_cst")


@intrinsic
def _store_seq_cst(typingctx, arr, index, value):
    def codegen(context, builder, sig, args):
        stored = context.cast(builder, args[2], sig.args[2], arr.dtype)
        builder.store_atomic(stored, _element_pointer(context, builder, sig, args), "seq_cst", arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def _add_seq_cst(typingctx, arr, index, value):
    def codegen(context, builder, sig, args):
        added = context.cast(builder, args[2], sig.args[2], arr.dtype)
        builder.atomic_rmw("add", _element_pointer(context, builder, sig, args), added, "seq_cst")
        return context.get_dummy_value()

    return types.void(arr, index, value), codegen


@intrinsic
def _cpu_relax(typingctx):
    """x86's pause or arm's yield: the spinning core lets its sibling run and saves power."""
    def codegen(context, builder, sig, args):
        if _ARM:
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I32]),
                                                  "llvm.aarch64.hint")
            builder.call(hint, [ir.Constant(_I32, 1)])
        else:
            pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                   "llvm.x86.sse2.pause")
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _syscall(typingctx, number, a1, a2, a3, a4, a5):
    """libc's syscall(2), found by name when the code is loaded (so it can live in numba's cache)."""
    sig = types.int64(number, a1, a2, a3, a4, a5)

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
        return builder.call(fn, [context.cast(builder, a, t, types.int64) for a, t in zip(args, sig.args)])

    return sig, codegen


@intrinsic
def _now_ns(typingctx):
    """CLOCK_MONOTONIC in nanoseconds (clock_gettime: the vDSO, no system call)."""
    def codegen(context, builder, sig, args):
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32, ts.type]), "clock_gettime")
        builder.call(fn, [ir.Constant(_I32, _CLOCK_MONOTONIC), ts])
        zero = ir.Constant(_I32, 0)
        sec = builder.load(builder.gep(ts, [zero, zero]))
        nsec = builder.load(builder.gep(ts, [zero, ir.Constant(_I32, 1)]))
        return builder.add(builder.mul(sec, ir.Constant(_I64, 1_000_000_000)), nsec)

    return types.int64(), codegen


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """libc's memcpy between two addresses (array.ctypes.data + offset): numba's own slice copy
    moves one element at a time, a third of memory speed for bytes."""
    sig = types.void(dst, src, nbytes)

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8p, [i8p, i8p, _I64]), "memcpy")
        dst, src, n = (context.cast(builder, a, t, types.int64) for a, t in zip(args, sig.args))
        builder.call(fn, [builder.inttoptr(dst, i8p), builder.inttoptr(src, i8p), n])
        return context.get_dummy_value()

    return sig, codegen


@_jit
def _reached(seen, target, at_least):
    return seen == target or (at_least and seen > target)


@_jit
def wait_word(mem, word, target, at_least, sleepers, spin_ns, slice_ns):
    """Until u64 word `word` of mem equals target (or, at_least, passes it); acquire ordering.
    Spins for spin_ns, then sleeps counted in u32 counter `sleepers`; False once slice_ns have
    passed without it (the caller then looks for failures and waits again)."""
    words = mem.view(np.uint64)
    start = _now_ns()
    looks = 0
    while not _reached(_load_acquire(words, word), target, at_least):
        if _now_ns() - start >= spin_ns:
            return _sleep_on_word(mem, word, target, at_least, sleepers, start + slice_ns)
        looks += 1
        if looks % _LOOKS_PER_YIELD == 0:
            _syscall(_SYS_SCHED_YIELD, 0, 0, 0, 0, 0)
        else:
            for _ in range(_PAUSES_PER_LOOK):
                _cpu_relax()
    return True


@_jit
def _sleep_on_word(mem, word, target, at_least, sleepers, end_ns):
    words, counters = mem.view(np.uint64), mem.view(np.uint32)
    timeout = np.empty(2, np.int64)  # struct timespec
    _add_seq_cst(counters, sleepers, 1)
    while True:
        seen = _load_seq_cst(words, word)
        if _reached(seen, target, at_least):
            break
        left = end_ns - _now_ns()
        if left <= 0:
            break
        timeout[0], timeout[1] = left // 1_000_000_000, left % 1_000_000_000
        _syscall(_SYS_FUTEX, words.ctypes.data + 8 * word, _FUTEX_WAIT, seen & 0xFFFFFFFF, timeout.ctypes.data, 0)
    _add_seq_cst(counters, sleepers, -1)
    return _reached(seen, target, at_least)


@_jit
def store_and_wake(mem, word, value, sleepers):
    """Set u64 word `word` of mem to value, ordered after every store before it; wake its sleepers."""
    words, counters = mem.view(np.uint64), mem.view(np.uint32)
    _store_seq_cst(words, word, value)
    if _load_seq_cst(counters, sleepers) != 0:
        _syscall(_SYS_FUTEX, words.ctypes.data + 8 * word, _FUTEX_WAKE, 0x7FFFFFFF, 0, 0)


@_jit
def load_word(mem, word):
    """u64 word `word` of mem, with acquire ordering (reads after it see what its writer published)."""
    return _load_acquire(mem.view(np.uint64), word)


# --- the board's all-reduce step, compiled whole ---------------------------------------------
#
# A board entry (transport/shm_layout.py): the published word (1 + sequence number), the frame
# header, a u32 count of sleepers waiting for the word, then the payload.

BOARD_HEADER_AT, BOARD_HEADER_BYTES, BOARD_SLEEPERS_AT, BOARD_PAYLOAD_AT = 8, 116, 124, 128
_SRC_FIELD = (12, 16)  # bytes of the header that name the source rank: the one field ranks differ in
_SEQ_AT = 28  # where the header holds the sequence number (8 bytes, little-endian)
#: board_all_reduce's results besides a position to resume at (>= 0): done, or -(2 + r) when
#: rank r's entry describes another call.
BOARD_DONE = -1


def _reduce_entry(dst, src, code, op):
    """dst = op(dst, src) inside a compiled step: the loop family by dtype, then code and op."""


def _by_op(loops):
    """A compiled (dst, src, op) running the loop for op of one family (SUM, PROD, MIN, MAX as in
    _PER_OP); AVG reduces as SUM, the caller divides."""
    sum_, prod, min_, max_ = loops

    def by_op(dst, src, op):
        if op == 1:
            prod(dst, src)
        elif op == 2:
            min_(dst, src)
        elif op == 3:
            max_(dst, src)
        else:
            sum_(dst, src)

    return numba.njit(nogil=True, inline="always")(by_op)


_F16_BY_OP, _BF16_BY_OP, _NATIVE_BY_OP = (_by_op(_PER_OP[code]) for code in (1, 2, 3))


@overload(_reduce_entry)
def _reduce_entry_overload(dst, src, code, op):
    if dst.dtype == types.uint16:
        def half(dst, src, code, op):
            if code == 1:
                _F16_BY_OP(dst, src, op)
            else:
                _BF16_BY_OP(dst, src, op)

        return half
    return lambda dst, src, code, op: _NATIVE_BY_OP(dst, src, op)


@_jit
def board_all_reduce(mem, data, header, where, rank, seq, code, op, position, spin_ns, slice_ns, done_sleepers):
    """One all-reduce on the board, from publishing our entry to marking it read, in one call.

    data: this rank's 1-D input (storage dtype), reduced in place. header: our 116-byte frame
    header (its sequence number is filled in here). where[r]: rank r's entry offsets for even and
    odd sequence numbers and the index of its "done" word. Folds every entry in rank order, so
    every rank computes bitwise the same result. Returns BOARD_DONE, -(2 + r) when rank r made
    another call, or a position to call again with after a wait slice ran out.
    """
    parity, nbytes = seq % 2, data.nbytes
    mine = where[rank, parity]
    if position == 0:
        if not _entry_free(mem, where, rank, mine, spin_ns, slice_ns, done_sleepers):
            return 0
        _write_entry(mem, mine, header, seq, data)
        position = 1
    for r in range(position - 1, where.shape[0]):
        at = where[r, parity]
        if r != rank:
            if not wait_word(mem, at // 8, seq + 1, False, (at + BOARD_SLEEPERS_AT) // 4, spin_ns, slice_ns):
                return r + 1
            if not _same_call(mem, at, mine):
                return -2 - r
        if r == 0:
            if rank != 0:
                _memcpy(data.ctypes.data, mem.ctypes.data + at + BOARD_PAYLOAD_AT, nbytes)
        else:
            _reduce_entry(data, mem[at + BOARD_PAYLOAD_AT:at + BOARD_PAYLOAD_AT + nbytes].view(data.dtype), code, op)
    store_and_wake(mem, where[rank, 2], seq + 1, done_sleepers)
    return BOARD_DONE


@_jit
def _entry_free(mem, where, rank, mine, spin_ns, slice_ns, done_sleepers):
    """Whether every peer has finished the call our entry last held (1 + its number is still in
    the published word), so that overwriting it cannot change what a peer is reading."""
    previous = _load_acquire(mem.view(np.uint64), mine // 8)
    if previous == 0:
        return True
    for r in range(where.shape[0]):
        if r != rank and not wait_word(mem, where[r, 2], previous, True, done_sleepers, spin_ns, slice_ns):
            return False
    return True


@_jit
def _write_entry(mem, at, header, seq, data):
    head = at + BOARD_HEADER_AT
    _memcpy(mem.ctypes.data + head, header.ctypes.data, BOARD_HEADER_BYTES)
    for k in range(8):
        mem[head + _SEQ_AT + k] = (seq >> (8 * k)) & 0xFF
    _memcpy(mem.ctypes.data + at + BOARD_PAYLOAD_AT, data.ctypes.data, data.nbytes)
    store_and_wake(mem, at // 8, seq + 1, (at + BOARD_SLEEPERS_AT) // 4)


@_jit
def _same_call(mem, theirs, mine):
    """Whether two published entries describe the same call (headers equal but for the source rank)."""
    for k in range(BOARD_HEADER_BYTES):
        if (k < _SRC_FIELD[0] or k >= _SRC_FIELD[1]) and \
                mem[theirs + BOARD_HEADER_AT + k] != mem[mine + BOARD_HEADER_AT + k]:
            return False
    return True


def warm_board() -> None:
    """Compile (or load from numba's disk cache) the board's compiled step, for every reducible
    wire type and the barrier's bytes, and its waits, as warm_up does for the loops: a rank alone
    publishes into a scratch entry."""
    mem = np.zeros(4 * BOARD_PAYLOAD_AT, np.uint8)
    where = np.array([[BOARD_PAYLOAD_AT, 2 * BOARD_PAYLOAD_AT, 1]], np.int64)  # entries, done word 1
    header = np.zeros(BOARD_HEADER_BYTES, np.uint8)
    for code, wire in WIRE_TYPES.items():
        if wire.reducible or wire.storage == np.uint8:
            board_all_reduce(mem, np.zeros(2, wire.storage), header, where, 0, 0, code, 0, 0, 0, 0, 0)
    wait_word(mem, 1, 1, True, 0, 0, 0)
    store_and_wake(mem, 1, 1, 0)
    load_word(mem, 1)
