/* float16 and bfloat16 <-> float32/float64, bit-exact, by integer operations.

   Numerics (API.md): each 16-bit step equals "compute in float64, round once to nearest even".
   The reduction loops widen exactly to float32, compute there and round once to 16 bits, which
   is bitwise the same (see reduce.c). Widening and rounding are written with selects, not
   branches, so the compiler vectorises the loops that call them. */
#ifndef SHMCOLL_HALF_H
#define SHMCOLL_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline int64_t f64_bits(double x) { int64_t u; memcpy(&u, &x, 8); return u; }
static inline double bits_f64(int64_t u) { double x; memcpy(&x, &u, 8); return x; }

#define F64_ONE_EXPONENT (INT64_C(1) << 52) /* one unit of the float64 biased exponent */
#define F64_ABS_MASK INT64_C(0x7FFFFFFFFFFFFFFF)
#define F64_INF_BITS INT64_C(0x7FF0000000000000)

/* float64 -> 16-bit float bits, rounded once to nearest even, straight from the float64 bits.
   Normals: re-bias the exponent, add half-an-ulp-minus-one plus the lowest kept bit, drop the
   `drop` low bits (ties go to even; a carry bumps the exponent, up to inf). Subnormals: adding a
   float64 whose ulp is the subnormal step makes the FPU round. Overflow, infinity and NaN
   (payload kept, made quiet) are selected last. */
static inline uint16_t round_f64_bits(double x, int drop, int64_t min_normal_bits, double subnormal_magic,
                                      int64_t overflow_bits) {
    int64_t u = f64_bits(x);
    int64_t sign = (u >> 48) & 0x8000;
    int64_t mag = u & F64_ABS_MASK;
    int mant_bits = 52 - drop;
    int64_t inf = ((INT64_C(1) << (15 - mant_bits)) - 1) << mant_bits;
    int64_t quiet_nan = inf | (INT64_C(1) << (mant_bits - 1)) | ((mag >> drop) & ((INT64_C(1) << mant_bits) - 1));
    int64_t rebias = min_normal_bits - F64_ONE_EXPONENT;
    int64_t normal = (mag - rebias + ((INT64_C(1) << (drop - 1)) - 1) + ((mag >> drop) & 1)) >> drop;
    int64_t subnormal = f64_bits(bits_f64(mag) + subnormal_magic) - f64_bits(subnormal_magic);
    int64_t result = mag >= min_normal_bits ? normal : subnormal;
    result = mag >= overflow_bits ? inf : result;
    result = mag > F64_INF_BITS ? quiet_nan : result;
    return (uint16_t)(result | sign);
}

/* float16: bias 15, 10 mantissa bits kept (42 float64 bits dropped); bfloat16: bias 127, 7 (45). */
#define F16_MIN_NORMAL_BITS INT64_C(0x3F10000000000000)   /* 2^-14 */
#define F16_SUBNORMAL_MAGIC 0x1p28                         /* ulp 2^-24, float16's subnormal step */
#define F16_OVERFLOW_BITS INT64_C(0x40EFFE0000000000)     /* 65504 + 16: rounds to inf from here */
#define BF16_MIN_NORMAL_BITS INT64_C(0x3810000000000000)  /* 2^-126 */
#define BF16_SUBNORMAL_MAGIC 0x1p-81                       /* ulp 2^-133 */
#define BF16_OVERFLOW_BITS INT64_C(0x47EFF00000000000)    /* 2^128 - 2^119 */

static inline uint16_t f64_to_f16(double x) {
    return round_f64_bits(x, 42, F16_MIN_NORMAL_BITS, F16_SUBNORMAL_MAGIC, F16_OVERFLOW_BITS);
}

static inline uint16_t f64_to_bf16(double x) {
    return round_f64_bits(x, 45, BF16_MIN_NORMAL_BITS, BF16_SUBNORMAL_MAGIC, BF16_OVERFLOW_BITS);
}

/* Exact widening; subnormals via (2^-14 * 1.m) - 2^-14. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t magnitude = (uint32_t)(h & 0x7FFF) << 13;
    uint32_t exponent = magnitude & (UINT32_C(0x7C00) << 13);
    uint32_t normal = magnitude + ((uint32_t)(127 - 15) << 23);
    uint32_t special = normal + ((uint32_t)(128 - 16) << 23); /* inf/NaN: exponent all ones */
    float tiny = bits_f32(normal + (UINT32_C(1) << 23)) - 0x1p-14f;
    uint32_t widened = exponent == (UINT32_C(0x7C00) << 13) ? special : normal;
    widened = exponent == 0 ? f32_bits(tiny) : widened;
    return bits_f32(widened | ((uint32_t)(h & 0x8000) << 16));
}

/* float32 -> float64 is exact, so this is one rounding. */
static inline uint16_t f32_to_f16(float x) { return f64_to_f16((double)x); }

/* bfloat16 is the top half of a float32. */
static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* float32 bits rounded to nearest even at bit 16, the result in the high half (a carry bumps the exponent, up to inf). NaN
   needs no case of its own while its low half is zero, which holds for any NaN computed from
   bfloat16 operands (a payload of theirs, or the default NaN). */
static inline uint32_t f32_bits_to_bf16_high(uint32_t u) { return u + UINT32_C(0x7FFF) + ((u >> 16) & 1); }

static inline uint16_t f32_to_bf16(float x) { return (uint16_t)(f32_bits_to_bf16_high(f32_bits(x)) >> 16); }

#endif
