"""Kernels against numpy: exhaustive 16-bit conversions, rounding at every midpoint, every (code, op).

References: numpy's float16 casts (float64 -> float16 is direct and correctly rounded); for
bfloat16 a nearest-value table search (kernel_reference.py), itself checked with exact fractions,
so the reference depends on no third party's cast (some ml_dtypes releases rounded float64 ->
bfloat16 twice, through float32).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import os
import threading
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shmcoll import kernels
from shmcoll.types import WIRE_TYPES, ReduceKind

import kernel_reference as ref
from bounds import TEST_HANG_S

ALL_BITS = np.arange(1 << 16, dtype=np.uint16)
F16_QUIET, BF16_QUIET = 0x0200, 0x0040
FLOAT_CODES = (1, 2, 3, 4)
INT_CODES = (5, 6)


def widen(storage: np.ndarray, code: int) -> np.ndarray:
    """Reference widening of a storage array to float64 (numpy only)."""
    if code == 1:
        return ref.f16_bits_to_f64_np(storage)
    if code == 2:
        return ref.bf16_bits_to_f64_np(storage)
    with np.errstate(invalid="ignore"):
        return np.asarray(storage, dtype=np.float64)


def assert_same(actual: np.ndarray, expected: np.ndarray, code: int) -> None:
    """Bitwise equal, except that any NaN matches any NaN (payloads are not specified)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if code in INT_CODES:
        np.testing.assert_array_equal(actual, expected)
        return
    nan_actual, nan_expected = np.isnan(widen(actual, code)), np.isnan(widen(expected, code))
    np.testing.assert_array_equal(nan_actual, nan_expected, err_msg="NaN positions differ")
    unsigned = f"u{actual.itemsize}"
    got, want = actual[~nan_actual].view(unsigned), expected[~nan_expected].view(unsigned)
    mismatch = np.flatnonzero(got != want)
    assert mismatch.size == 0, (
        f"{mismatch.size} differ; first at {np.flatnonzero(~nan_actual)[mismatch[:5]]}: "
        f"got {[hex(v) for v in got[mismatch[:5]]]}, want {[hex(v) for v in want[mismatch[:5]]]}"
    )


def assert_nans_quiet(bits: np.ndarray, code: int) -> None:
    nans = bits[np.isnan(widen(bits, code))]
    quiet = F16_QUIET if code == 1 else BF16_QUIET
    assert np.all(nans & quiet), f"signalling NaN in result: {[hex(b) for b in nans[:5]]}"


# --- conversions ------------------------------------------------------------------------------


def test_f16_widening_matches_numpy_for_every_bit_pattern():
    assert_same(kernels.f16_bits_to_f64(ALL_BITS), ALL_BITS.view(np.float16).astype(np.float64), 4)


def test_bf16_widening_matches_ml_dtypes_for_every_bit_pattern():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with np.errstate(invalid="ignore"):
        expected = ALL_BITS.view(ml_dtypes.bfloat16).astype(np.float64)
    assert_same(kernels.bf16_bits_to_f64(ALL_BITS), expected, 4)


@pytest.mark.parametrize("code", [1, 2])
def test_every_pattern_survives_a_round_trip_and_nans_come_back_quiet(code):
    widened = kernels.f16_bits_to_f64(ALL_BITS) if code == 1 else kernels.bf16_bits_to_f64(ALL_BITS)
    back = kernels.f64_to_f16_bits(widened) if code == 1 else kernels.f64_to_bf16_bits(widened)
    nan = np.isnan(widened)
    np.testing.assert_array_equal(back[~nan], ALL_BITS[~nan])  # includes -0.0, subnormals, +-inf
    np.testing.assert_array_equal(back[nan] >> 15, ALL_BITS[nan] >> 15)  # sign kept
    assert_nans_quiet(back, code)


def midpoints_and_neighbours(values_of_patterns: np.ndarray, overflow_value: float) -> np.ndarray:
    """Every exact midpoint between adjacent non-negative values (and between the largest finite
    value and 2^(emax+1), the overflow boundary), one float64 ulp either side of each, the values
    themselves, all with both signs. One ulp off a midpoint is exactly where rounding via float32
    first would land on the midpoint and go the wrong way."""
    finite = np.append(values_of_patterns[np.isfinite(values_of_patterns)], overflow_value)
    mids = (finite[:-1] + finite[1:]) / 2  # exact: both are narrow floats
    points = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), finite[:-1]])
    return np.concatenate([points, -points])


def wide_random_values(rng, n: int = 200_000) -> np.ndarray:
    """Random significands over every exponent that matters, plus special values."""
    values = rng.uniform(1, 2, n) * np.exp2(rng.integers(-150, 130, n).astype(np.float64))
    values *= rng.choice([-1.0, 1.0], n)
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e300, -1e300, 5e-324, 2.0**-1074,
                65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001,
                2.0**-133, 2.0**-134, 2.0**-134 * (1 + 2**-40), 2.0**128, 3.4e38, 2.0**128 - 2.0**119]
    return np.concatenate([values, specials])


def test_f64_to_f16_matches_numpy_at_every_midpoint_and_on_random_values():
    values = np.concatenate([
        midpoints_and_neighbours(ALL_BITS[:0x7C01].view(np.float16).astype(np.float64), 65536.0),
        wide_random_values(np.random.default_rng(1)),
    ])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    assert_same(kernels.f64_to_f16_bits(values), expected, 1)


def test_table_rounding_reference_agrees_with_numpy_for_f16():
    """The bfloat16 reference method, run on float16 where numpy is the judge."""
    values = midpoints_and_neighbours(ALL_BITS[:0x7C01].view(np.float16).astype(np.float64), 65536.0)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    assert_same(ref.f64_to_f16_bits_by_table(values), expected, 1)


@functools.cache
def exact_bf16_magnitudes() -> list[Fraction]:
    table = [Fraction(float(v)) for v in ref.bf16_bits_to_f64_np(np.arange(0x7F80, dtype=np.uint16))]
    return table + [Fraction(2) ** 128]  # inf sits where the next value would be


def exact_nearest_bf16(x: float) -> int:
    """Round-to-nearest-even by exact rational arithmetic (the definition, slowly)."""
    if x != x:
        return 0x7FC0
    sign = 0x8000 if np.signbit(x) else 0
    if abs(x) == np.inf:
        return sign | 0x7F80
    table = exact_bf16_magnitudes()
    target = abs(Fraction(x))
    hi = bisect.bisect_left(table, target) if target <= table[-1] else len(table) - 1
    lo = max(hi - 1, 0)
    below, above = target - table[lo], table[hi] - target
    return sign | (hi if above < below or (above == below and hi % 2 == 0) else lo)


@pytest.fixture(scope="module")
def bf16_midpoints():
    return midpoints_and_neighbours(ref.bf16_bits_to_f64_np(ALL_BITS[:0x7F81]), 2.0**128)


def test_bf16_table_reference_matches_exact_arithmetic(bf16_midpoints):
    rng = np.random.default_rng(2)
    edges = [2.0**128 - 2.0**119, 1 + 2.0**-8 + 2.0**-40, 2.0**-134, 2.0**-134 * (1 + 2**-40), -0.0]
    sample = np.concatenate([rng.choice(bf16_midpoints, 300), edges])
    table_bits = ref.f64_to_bf16_bits_np(sample)
    exact_bits = [exact_nearest_bf16(float(v)) for v in sample]
    assert table_bits.tolist() == exact_bits


def test_f64_to_bf16_is_correctly_rounded_at_every_midpoint_where_float32_first_is_not(bf16_midpoints):
    values = np.concatenate([bf16_midpoints, wide_random_values(np.random.default_rng(3))])
    expected = ref.f64_to_bf16_bits_np(values)
    assert_same(kernels.f64_to_bf16_bits(values), expected, 2)
    with np.errstate(over="ignore"):
        via_float32 = ref.f64_to_bf16_bits_np(values.astype(np.float32).astype(np.float64))
    assert np.count_nonzero(via_float32 != expected) > 1000, "these values would not catch double rounding"
    assert int(kernels.f64_to_bf16_bits(np.array([1 + 2.0**-8 + 2.0**-40]))[0]) == 0x3F81


# --- reductions -------------------------------------------------------------------------------


def special_values(code: int) -> np.ndarray:
    if code in INT_CODES:
        info = np.iinfo(WIRE_TYPES[code].storage)
        return np.array([info.max, info.min, -1, 0, 1, info.max // 2 + 1, 3], WIRE_TYPES[code].storage)
    f64 = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 65504.0, 3e38,
                    2.0**-24, 2.0**-25, 2.0**-133, 2.0**-140, 1e-300, 5e-324, 1.5, 2.5])
    return storage_of(f64, code)


def storage_of(values: np.ndarray, code: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        if code == 1:
            return values.astype(np.float16).view(np.uint16)
        if code == 2:
            return ref.f64_to_bf16_bits_np(values)
        return values.astype(WIRE_TYPES[code].storage)


def random_operands(code: int, count: int, n: int, rng) -> list[np.ndarray]:
    """Mixed data: any bit pattern (16-bit codes), values of one scale (sums with ties and
    cancellation), values across the range (overflow, subnormals), and the special values."""
    specials = special_values(code)
    out = []
    for _ in range(count):
        if code in INT_CODES:
            info = np.iinfo(WIRE_TYPES[code].storage)
            data = rng.integers(info.min, info.max, n, dtype=WIRE_TYPES[code].storage, endpoint=True)
        else:
            third = n // 3
            scaled = rng.uniform(-4, 4, third) * np.exp2(rng.integers(-30, 30, third).astype(float))
            rest = n - 2 * third
            wide = rng.uniform(-2, 2, rest) * np.exp2(rng.integers(-160, 140, rest).astype(float))
            data = storage_of(np.concatenate([rng.uniform(-8, 8, third), scaled, wide]), code)
            if code in (1, 2):
                data[::4] = rng.integers(0, 1 << 16, data[::4].size, dtype=np.uint16)
        data[rng.integers(0, n, specials.size)] = rng.permutation(specials)
        out.append(data)
    return out


REDUCIBLE = [(code, op) for code in FLOAT_CODES + INT_CODES for op in ReduceKind
             if not (code in INT_CODES and op == ReduceKind.AVG)]


@pytest.fixture(params=["cpu-specific", "portable"])
def loops(request):
    """Each 16-bit loop twice: this CPU's (AVX2 and F16C where it has them) and the portable one,
    which a CPU without them runs."""
    from shmcoll import _native

    _native.use_cpu_specific_loops(request.param == "cpu-specific")
    yield request.param
    _native.use_cpu_specific_loops(True)


@pytest.mark.parametrize("code,op", REDUCIBLE, ids=[f"{WIRE_TYPES[c].name}-{o.name}" for c, o in REDUCIBLE])
def test_reduce_into_matches_reference(code, op, loops):
    rng = np.random.default_rng(code * 10 + op)
    arrays = random_operands(code, 4, 3001, rng)
    dst = arrays[0].copy()
    for other in arrays[1:]:
        kernels.reduce_into(dst, other, code, op)
    if op == ReduceKind.AVG:
        kernels.scale_into(dst, code, len(arrays))
    expected = ref.reference_reduce(arrays, code, op)
    assert_same(dst, expected, code)
    if code in (1, 2):
        assert_nans_quiet(dst, code)
    assert not np.array_equal(dst, arrays[0]), "the data did not exercise the reduction"


@pytest.mark.parametrize("code", [1, 2])
@pytest.mark.parametrize("op", [ReduceKind.SUM, ReduceKind.PROD])
def test_16bit_sum_and_prod_of_every_pattern_with_many_others(code, op, loops):
    """65,536 x 96 pairs: every pattern against special and random partners, ties included."""
    rng = np.random.default_rng(7)
    partners = np.concatenate([special_values(code), rng.integers(0, 1 << 16, 96 - special_values(code).size)])
    dst = np.tile(ALL_BITS, partners.size)
    src = np.repeat(partners.astype(np.uint16), ALL_BITS.size)
    expected = ref.reference_reduce([dst, src], code, op)
    kernels.reduce_into(dst, src, code, op)
    assert_same(dst, expected, code)


@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (1, 0), (0, 1)])
def test_bf16_sum_with_any_alignment_and_odd_length(offsets):
    """The two-per-lane bfloat16 path needs 4-byte alignment; other layouts use the plain loop."""
    code = 2
    a, b = random_operands(code, 2, 1001, np.random.default_rng(11))
    dst_buf, src_buf = np.zeros(1002, np.uint16), np.zeros(1002, np.uint16)
    dst, src = dst_buf[offsets[0]:offsets[0] + 1001], src_buf[offsets[1]:offsets[1] + 1001]
    dst[:], src[:] = a, b
    kernels.reduce_into(dst, src, code, ReduceKind.SUM)
    assert_same(dst, ref.reference_reduce([a, b], code, ReduceKind.SUM), code)


@pytest.mark.parametrize("code", FLOAT_CODES + INT_CODES)
@pytest.mark.parametrize("offset", [1, 3])
def test_operands_may_start_at_any_byte(code, offset):
    """A view may start at any byte (np.frombuffer at an offset): the loops and AVG's division
    load and store each element whatever the alignment."""
    a, b = random_operands(code, 2, 301, np.random.default_rng(17 + offset))
    dst = np.frombuffer(bytearray(a.nbytes + offset), a.dtype, a.size, offset)
    src = np.frombuffer(bytearray(b.nbytes + offset), b.dtype, b.size, offset)
    dst[:], src[:] = a, b
    assert not (dst.flags.aligned or src.flags.aligned)
    kernels.reduce_into(dst, src, code, ReduceKind.SUM)
    summed = ref.reference_reduce([a, b], code, ReduceKind.SUM)
    assert_same(dst.copy(), summed, code)
    if code in FLOAT_CODES:
        kernels.scale_into(dst, code, 3)
        assert_same(dst.copy(), ref.reference_scale(summed, code, 3), code)


@pytest.mark.parametrize("code", FLOAT_CODES + INT_CODES)
def test_read_only_src_works(code):
    """Received messages and shared-memory slots may be read-only views."""
    a, b = random_operands(code, 2, 301, np.random.default_rng(13))
    src = np.frombuffer(b.tobytes(), b.dtype)
    assert not src.flags.writeable
    dst = a.copy()
    kernels.reduce_into(dst, src, code, ReduceKind.SUM)
    assert_same(dst, ref.reference_reduce([a, b], code, ReduceKind.SUM), code)


@pytest.mark.parametrize("code", INT_CODES)
def test_integer_sum_and_prod_wrap_around(code):
    dtype = WIRE_TYPES[code].storage
    bits = dtype.itemsize * 8
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max, 3, -7], dtype)
    b = np.array([1, -1, info.max, info.max, info.min + 5], dtype)

    def wrap(v):
        v %= 1 << bits
        return v - (1 << bits) if v > info.max else v

    for op, exact in [(ReduceKind.SUM, lambda x, y: x + y), (ReduceKind.PROD, lambda x, y: x * y)]:
        dst = a.copy()
        kernels.reduce_into(dst, b, code, op)
        assert dst.tolist() == [wrap(exact(int(x), int(y))) for x, y in zip(a, b)]


@pytest.mark.parametrize("code", FLOAT_CODES)
def test_min_max_order_signed_zeros_and_propagate_nan_in_both_orders(code):
    zero, neg_zero, nan, one = (storage_of(np.array([v]), code) for v in (0.0, -0.0, np.nan, 1.0))
    for op, want in [(ReduceKind.MIN, neg_zero), (ReduceKind.MAX, zero)]:
        for first, second in [(zero, neg_zero), (neg_zero, zero)]:
            dst = first.copy()
            kernels.reduce_into(dst, second, code, op)
            assert dst.tobytes() == want.tobytes(), (op, first, second)
        for first, second in [(nan, one), (one, nan)]:
            dst = first.copy()
            kernels.reduce_into(dst, second, code, op)
            assert np.isnan(widen(dst, code)[0])


@pytest.mark.parametrize("code", [1, 2])
def test_signalling_nan_input_gives_a_quiet_nan(code):
    signalling = np.uint16(0x7C01 if code == 1 else 0x7F81)
    for op in (ReduceKind.SUM, ReduceKind.PROD, ReduceKind.MIN, ReduceKind.MAX):
        dst = np.array([signalling] * 3, np.uint16)
        kernels.reduce_into(dst, storage_of(np.array([1.0, -2.0, 0.0]), code), code, op)
        assert np.isnan(widen(dst, code)).all()
        assert_nans_quiet(dst, code)


@pytest.mark.parametrize("code", FLOAT_CODES)
@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 7, 8, 1000, 1024, 2**24 + 1, 3**30, 2**40])
def test_scale_into_matches_float64_divided_and_rounded_once(code, divisor):
    """Powers of two (1, 2, 4, 8, 1024, 2**40) take a multiplication by the exact inverse, the
    others a division: both round the same real number once."""
    data = random_operands(code, 1, 5000, np.random.default_rng(divisor % 1000 + code))[0]
    dst = data.copy()
    kernels.scale_into(dst, code, divisor)
    assert_same(dst, ref.reference_scale(data, code, divisor), code)
    if divisor > 1:
        assert not np.array_equal(dst, data)


@pytest.mark.parametrize("x,divisor", [(3.5104310282335025e-29, 764493069963),
                                       (7.951717924627799e-28, 558623007822)])
def test_bf16_scale_rounds_once_from_float64_where_float32_first_would_not(x, divisor):
    """Witnesses found by search: x / divisor rounded to float32 lands on a bfloat16 midpoint."""
    bits = ref.f64_to_bf16_bits_np(np.array([x]))
    assert ref.bf16_bits_to_f64_np(bits)[0] == x
    quotient = np.array([x / divisor])
    correct = ref.f64_to_bf16_bits_np(quotient)
    via_float32 = ref.f64_to_bf16_bits_np(quotient.astype(np.float32).astype(np.float64))
    assert correct[0] != via_float32[0]
    dst = bits.copy()
    kernels.scale_into(dst, 2, divisor)
    assert dst[0] == correct[0]


def test_avg_reduces_like_sum():
    rng = np.random.default_rng(9)
    for code in FLOAT_CODES:
        a, b = random_operands(code, 2, 500, rng)
        via_sum, via_avg = a.copy(), a.copy()
        kernels.reduce_into(via_sum, b, code, ReduceKind.SUM)
        kernels.reduce_into(via_avg, b, code, ReduceKind.AVG)
        assert via_sum.tobytes() == via_avg.tobytes()


def test_empty_arrays_and_bad_arguments():
    for code, op in REDUCIBLE:
        empty = np.zeros(0, WIRE_TYPES[code].storage)
        kernels.reduce_into(empty, empty.copy(), code, op)
    with pytest.raises(ValueError):
        kernels.reduce_into(np.zeros(3, np.float32), np.zeros(2, np.float32), 3, ReduceKind.SUM)
    with pytest.raises(ValueError):
        kernels.reduce_into(np.zeros(3, np.uint8), np.zeros(3, np.uint8), 8, ReduceKind.SUM)
    with pytest.raises(ValueError):
        kernels.scale_into(np.zeros(3, np.int32), 5, 2)


#: rows of the (a, b) square checked at once by the exhaustive test: big enough that numpy's
#: per-call cost vanishes, small enough for a few MiB per thread
PAIR_ROWS = 16


def _pair_mismatches(code: int, op: ReduceKind, widened: np.ndarray, rows: range) -> int:
    """For every a in rows and b >= rows.start: the kernel's a op b against float64 (a op b)
    rounded once (if that is a NaN: any NaN), and its b op a against its a op b (equal unless both
    are NaNs). widened: every 16-bit pattern as float64. The rounding is kernels' float64 -> 16-bit
    converter, checked at every midpoint above."""
    round16 = kernels.f64_to_f16_bits if code == 1 else kernels.f64_to_bf16_bits
    exponent_mask = 0x7C00 if code == 1 else 0x7F80
    a = np.arange(rows.start, rows.stop, dtype=np.uint16)
    b = ALL_BITS[rows.start:]
    ab = np.repeat(a, b.size)  # a op b, row by row
    bs = np.tile(b, a.size)
    ba = bs.copy()  # b op a
    kernels.reduce_into(ba, ab, code, op)
    kernels.reduce_into(ab, bs, code, op)
    wa, wb = widened[rows.start:rows.stop, None], widened[None, rows.start:]
    with np.errstate(invalid="ignore", over="ignore"):
        exact = (wa + wb if op == ReduceKind.SUM else wa * wb).reshape(-1)
        want = round16(exact)
    nan_ab, nan_ba = (ab & 0x7FFF) > exponent_mask, (ba & 0x7FFF) > exponent_mask
    wrong = np.where(np.isnan(exact), ~nan_ab, ab != want)
    return int(np.count_nonzero(wrong) + np.count_nonzero((ab != ba) & ~(nan_ab & nan_ba)))


@pytest.mark.slow  # every pair of 16-bit patterns: tens of seconds, so outside the quick tier
@pytest.mark.parametrize("code", [1, 2])
@pytest.mark.parametrize("op", [ReduceKind.SUM, ReduceKind.PROD])
def test_16bit_sum_and_prod_of_all_two_to_the_32_pairs(code, op):
    """The float32 route of the hot loops against float64 + direct rounding, for every pair (a, b):
    for each a, the kernel's a op b and b op a for every b >= a. Blocks of rows are shared out to
    a thread per core: the kernels and numpy's loops release the GIL."""
    blocks = [range(first, min(first + PAIR_ROWS, 1 << 16)) for first in range(0, 1 << 16, PAIR_ROWS)]
    with np.errstate(invalid="ignore"):
        widened = widen(ALL_BITS, code)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        total = sum(pool.map(functools.partial(_pair_mismatches, code, op, widened), blocks))
    assert total == 0


@pytest.mark.parametrize("code", [1, 2])
@pytest.mark.parametrize("op", list(ReduceKind))
def test_cpu_specific_and_portable_16bit_loops_give_the_same_bits(code, op):
    """A CPU without AVX2 or F16C computes what this one does (NaN payloads aside, which API.md
    leaves unspecified: the CPUs pick which operand's payload a sum of two NaNs keeps)."""
    from shmcoll import _native

    rng = np.random.default_rng(int(op) * 2 + code)
    a = np.tile(ALL_BITS, 8)
    b = rng.integers(0, 1 << 16, a.size, dtype=np.uint16)
    results = []
    for cpu_specific in (True, False):
        dst = a.copy()
        _native.use_cpu_specific_loops(cpu_specific)
        try:
            kernels.reduce_into(dst, b, code, op)
        finally:
            _native.use_cpu_specific_loops(True)
        results.append(dst)
    assert_same(results[0], results[1], code)
    assert_nans_quiet(results[0], code)
    assert_nans_quiet(results[1], code)


# --- the GIL ----------------------------------------------------------------------------------


def test_a_long_reduction_releases_the_gil():
    """A spawned collective reduces in a worker thread: the caller's Python must go on meanwhile.
    While one long call runs in a thread, the main thread counts; were the GIL held, it could
    count only before the call began or after it ended."""
    a, b = (np.full(32 << 20, 0x3C00, np.uint16) for _ in range(2))  # 1.0 in float16
    started, finished = threading.Event(), threading.Event()
    count, counted_when_done = [0], []

    def reduce() -> None:
        started.set()
        kernels.reduce_into(a, b, 1, ReduceKind.PROD)
        counted_when_done.append(count[0])
        finished.set()

    worker = threading.Thread(target=reduce)
    worker.start()
    assert started.wait(TEST_HANG_S)
    before = count[0]
    while not finished.is_set():
        count[0] += 1
    worker.join(TEST_HANG_S)
    assert counted_when_done[0] - before > 1000, "the main thread did not run during the reduction"


# --- properties -------------------------------------------------------------------------------

bits16 = hnp.arrays(np.uint16, st.integers(0, 64), elements=st.integers(0, 0xFFFF))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2]), st.sampled_from(list(ReduceKind)), st.data())
def test_16bit_reduction_is_commutative_and_matches_reference(code, op, data):
    a = data.draw(bits16)
    b = data.draw(hnp.arrays(np.uint16, a.size, elements=st.integers(0, 0xFFFF)))
    ab, ba = a.copy(), b.copy()
    kernels.reduce_into(ab, b, code, op)
    kernels.reduce_into(ba, a, code, op)
    reference_op = ReduceKind.SUM if op == ReduceKind.AVG else op  # reduce_into leaves AVG's division out
    assert_same(ab, ref.reference_reduce([a, b], code, reference_op), code)
    assert_same(ab, ba, code)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_16bit_rounding_picks_a_nearest_value(x):
    values = np.array([x])
    assert_same(kernels.f64_to_bf16_bits(values), ref.f64_to_bf16_bits_np(values), 2)
    with np.errstate(over="ignore"):
        assert_same(kernels.f64_to_f16_bits(values), values.astype(np.float16).view(np.uint16), 1)
    if np.isfinite(x) and abs(x) < 3e38:
        got = float(kernels.bf16_bits_to_f64(kernels.f64_to_bf16_bits(values))[0])
        bits = int(kernels.f64_to_bf16_bits(values)[0])
        for neighbour in (bits - 1, bits + 1):
            if 0 <= neighbour & 0x7FFF < 0x7F80 and (neighbour ^ bits) >> 15 == 0:
                other = float(kernels.bf16_bits_to_f64(np.array([neighbour], np.uint16))[0])
                assert abs(Fraction(x) - Fraction(got)) <= abs(Fraction(x) - Fraction(other))
