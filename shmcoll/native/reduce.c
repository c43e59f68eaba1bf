/* The reduction loops: one per (wire type, op), each a plain loop the compiler vectorises.

   Numerics (API.md): every float16, bfloat16 and float32 step equals "compute in float64, round
   once to nearest even". The 16-bit loops widen exactly to float32, compute there and round once
   to 16 bits; that is bitwise the same as the float64 rule:
     - a product of two 16-bit floats is exact in float32 (at most 22 significant bits; for
       bfloat16 a product only loses bits below 2^-149, under half the smallest subnormal, where
       every rounding gives zero), so one rounding to 16 bits follows;
     - a sum is rounded twice (float32, then 16 bits), which never differs from rounding once
       because float32 has 24 >= 2p + 2 bits for p = 11 (float16) and p = 8 (bfloat16)
       (Figueroa, "When is double rounding innocuous?", 1995); a bfloat16 sum below 2^-126 is
       exact in float32.
   float32 SUM and PROD computed in float32 equal "float64, then round once" by the same argument
   (53 >= 2*24 + 2). The build turns off floating-point contraction (no fused multiply-add), so
   each operation rounds as written. Integer SUM and PROD wrap around (computed unsigned).
   sc_scale divides by an arbitrary integer, where the double-rounding argument does not hold, so
   it computes in float64 and rounds straight from the float64 bits.

   MIN/MAX propagate NaN like numpy's minimum/maximum and order -0.0 below +0.0 (IEEE 754-2019
   minimum/maximum), so a result never depends on which operand came first. 16-bit NaN results
   are quiet. */
#include "reduce.h"

#include "loops.h"

#define INT_MIN_OF(a, b) ((a) < (b) ? (a) : (b))
#define INT_MAX_OF(a, b) ((a) > (b) ? (a) : (b))

SIXTEEN_BIT_LOOPS(_portable)
LOOP(f32_sum, float, a + b)
LOOP(f32_prod, float, a * b)
LOOP(f32_min, float, MIN_KEEPS_FIRST(a, b) ? a : b)
LOOP(f32_max, float, MAX_KEEPS_FIRST(a, b) ? a : b)
LOOP(f64_sum, double, a + b)
LOOP(f64_prod, double, a * b)
LOOP(f64_min, double, MIN_KEEPS_FIRST(a, b) ? a : b)
LOOP(f64_max, double, MAX_KEEPS_FIRST(a, b) ? a : b)
LOOP(i32_sum, uint32_t, a + b)
LOOP(i32_prod, uint32_t, a * b)
LOOP(i32_min, int32_t, INT_MIN_OF(a, b))
LOOP(i32_max, int32_t, INT_MAX_OF(a, b))
LOOP(i64_sum, uint64_t, a + b)
LOOP(i64_prod, uint64_t, a * b)
LOOP(i64_min, int64_t, INT_MIN_OF(a, b))
LOOP(i64_max, int64_t, INT_MAX_OF(a, b))

#define PORTABLE_SIXTEEN_BIT_ROWS                                             \
    {f16_sum_portable, f16_prod_portable, f16_min_portable, f16_max_portable}, \
    {bf16_sum_portable, bf16_prod_portable, bf16_min_portable, bf16_max_portable}

/* [code - 1][op], op in SUM, PROD, MIN, MAX order; the 16-bit rows are replaced by faster ones
   where the CPU has them (sc_use_cpu_specific_loops). */
static loop_fn LOOPS[6][4] = {
    PORTABLE_SIXTEEN_BIT_ROWS,
    {f32_sum, f32_prod, f32_min, f32_max},
    {f64_sum, f64_prod, f64_min, f64_max},
    {i32_sum, i32_prod, i32_min, i32_max},
    {i64_sum, i64_prod, i64_min, i64_max},
};

int sc_use_cpu_specific_loops(int use) {
    static const loop_fn portable[2][4] = {PORTABLE_SIXTEEN_BIT_ROWS};
    const loop_fn (*faster)[4] = use ? sc_x86_sixteen_bit_loops() : NULL;
    memcpy(LOOPS, faster ? faster : portable, sizeof portable);
    return faster != NULL;
}

size_t sc_element_size(int code) {
    static const size_t sizes[7] = {0, 2, 2, 4, 8, 4, 8};
    return code >= 1 && code <= 6 ? sizes[code] : 0;
}

bool sc_has_loop(int64_t code, int64_t op) {
    return code >= CODE_F16 && code <= CODE_I64 && op >= OP_SUM && op <= OP_AVG && !(op == OP_AVG && code >= CODE_I32);
}

int sc_reduce(void *dst, const void *src, size_t n, int code, int op) {
    if (!sc_has_loop(code, op))
        return -1;
    LOOPS[code - 1][op == OP_AVG ? OP_SUM : op](dst, src, n);
    return 0;
}

/* d[i] = EXPR over the n elements of type T at d, where EXPR reads d[i] as `a`; loaded and stored
   with memcpy like LOOP's, so d needs no alignment. */
#define MAP_IN_PLACE(T, EXPR)                                 \
    for (size_t i = 0; i < n; i++) {                          \
        T a;                                                  \
        memcpy(&a, d + i * sizeof(T), sizeof(T));             \
        a = (EXPR);                                           \
        memcpy(d + i * sizeof(T), &a, sizeof(T));             \
    }

/* Where divisor is a power of two, 1 / divisor is exact and a * (1 / divisor) is the same real
   number as a / divisor, so both round alike (subnormal results included): the same bits, from a
   multiplication that runs several times faster than a division (AVG over 2, 4, 8 ... ranks). */
#define SCALE_IN_PLACE(T, WIDEN, NARROW)                                          \
    if (inverse_is_exact)                                                         \
        MAP_IN_PLACE(T, NARROW((double)WIDEN(a) * inverse))                       \
    else                                                                          \
        MAP_IN_PLACE(T, NARROW((double)WIDEN(a) / by))

#define AS_IS(x) (x)

int sc_scale(void *dst, size_t n, int code, int64_t divisor) {
    char *d = dst;
    double by = (double)divisor, inverse = 1.0 / by;
    int inverse_is_exact = divisor > 0 && (divisor & (divisor - 1)) == 0;
    switch (code) {
    case CODE_F16:
        SCALE_IN_PLACE(uint16_t, f16_to_f32, f64_to_f16)
        return 0;
    case CODE_BF16:
        SCALE_IN_PLACE(uint16_t, bf16_to_f32, f64_to_bf16)
        return 0;
    case CODE_F32:
        SCALE_IN_PLACE(float, AS_IS, (float))
        return 0;
    case CODE_F64:
        SCALE_IN_PLACE(double, AS_IS, AS_IS)
        return 0;
    default:
        return -1;
    }
}

void sc_f16_to_f64(const uint16_t *bits, double *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = (double)f16_to_f32(bits[i]);
}

void sc_bf16_to_f64(const uint16_t *bits, double *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = (double)bf16_to_f32(bits[i]);
}

void sc_f64_to_f16(const double *values, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = f64_to_f16(values[i]);
}

void sc_f64_to_bf16(const double *values, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = f64_to_bf16(values[i]);
}
