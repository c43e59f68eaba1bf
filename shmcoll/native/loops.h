/* The reduction loops' shape, shared by reduce.c (portable) and reduce_x86.c (AVX2 and F16C). */
#ifndef SHMCOLL_LOOPS_H
#define SHMCOLL_LOOPS_H

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "half.h"

typedef void (*loop_fn)(void *restrict, const void *restrict, size_t);

/* One loop over n elements of type T: d[i] = EXPR, where EXPR reads d[i] as `a` and s[i] as `b`.
   Elements are loaded and stored with memcpy, so operands need no alignment (a view may start at
   any byte); the compiler turns each into one unaligned load or store, vectorised. */
#define LOOP(name, T, EXPR)                                                              \
    static void name(void *restrict dst, const void *restrict src, size_t n) {           \
        char *restrict d = dst;                                                          \
        const char *restrict s = src;                                                    \
        for (size_t i = 0; i < n; i++) {                                                 \
            T a, b;                                                                      \
            memcpy(&a, d + i * sizeof(T), sizeof(T));                                    \
            memcpy(&b, s + i * sizeof(T), sizeof(T));                                    \
            a = (EXPR);                                                                  \
            memcpy(d + i * sizeof(T), &a, sizeof(T));                                    \
        }                                                                                \
    }

/* Whether MIN (MAX) keeps its first operand: the first NaN wins; -0.0 < +0.0. Selects, no branches. */
#define MIN_KEEPS_FIRST(a, b) (((a) < (b)) | (((a) == (b)) & (signbit(a) != 0)) | ((a) != (a)))
#define MAX_KEEPS_FIRST(a, b) (((a) > (b)) | (((a) == (b)) & (signbit(a) == 0)) | ((a) != (a)))

static inline uint16_t quiet_f16(uint16_t bits) { return (bits & 0x7FFF) > 0x7C00 ? (uint16_t)(bits | 0x0200) : bits; }
static inline uint16_t quiet_bf16(uint16_t bits) { return (bits & 0x7FFF) > 0x7F80 ? (uint16_t)(bits | 0x0040) : bits; }

/* Two bfloat16 sums in one uint32 lane: widening is one shift or mask, narrowing one mask or
   shift; half the instructions of one value per lane (which half holds which element is irrelevant). */
static inline uint32_t bf16_pair_sum(uint32_t d, uint32_t s) {
    const uint32_t high = 0xFFFF0000u;
    uint32_t low_sum = f32_bits(bits_f32(d << 16) + bits_f32(s << 16));
    uint32_t high_sum = f32_bits(bits_f32(d & high) + bits_f32(s & high));
    return (f32_bits_to_bf16_high(low_sum) >> 16) | (f32_bits_to_bf16_high(high_sum) & high);
}

/* The 16-bit loops, named with `suffix`. MIN and MAX pick one operand's bits (widening is exact,
   so narrowing the picked value back gives those bits) and quiet a NaN. */
#define SIXTEEN_BIT_LOOPS(suffix)                                                                              \
    LOOP(f16_sum##suffix, uint16_t, f32_to_f16(f16_to_f32(a) + f16_to_f32(b)))                                 \
    LOOP(f16_prod##suffix, uint16_t, f32_to_f16(f16_to_f32(a) * f16_to_f32(b)))                                \
    LOOP(f16_min##suffix, uint16_t, quiet_f16(MIN_KEEPS_FIRST(f16_to_f32(a), f16_to_f32(b)) ? a : b))          \
    LOOP(f16_max##suffix, uint16_t, quiet_f16(MAX_KEEPS_FIRST(f16_to_f32(a), f16_to_f32(b)) ? a : b))          \
    LOOP(bf16_sum_pairs##suffix, uint32_t, bf16_pair_sum(a, b))                                                \
    LOOP(bf16_sum_one_by_one##suffix, uint16_t, f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b)))                  \
    static void bf16_sum##suffix(void *restrict dst, const void *restrict src, size_t n) {                     \
        bf16_sum_pairs##suffix(dst, src, n / 2);                                                               \
        bf16_sum_one_by_one##suffix((char *)dst + 4 * (n / 2), (const char *)src + 4 * (n / 2), n % 2);        \
    }                                                                                                          \
    LOOP(bf16_prod##suffix, uint16_t, f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b)))                            \
    LOOP(bf16_min##suffix, uint16_t, quiet_bf16(MIN_KEEPS_FIRST(bf16_to_f32(a), bf16_to_f32(b)) ? a : b))      \
    LOOP(bf16_max##suffix, uint16_t, quiet_bf16(MAX_KEEPS_FIRST(bf16_to_f32(a), bf16_to_f32(b)) ? a : b))

/* Loops for float16 and bfloat16 ([0] and [1]) in SUM, PROD, MIN, MAX order, that use this CPU's
   AVX2 and F16C; NULL where it lacks them or is no x86-64 (reduce_x86.c). */
const loop_fn (*sc_x86_sixteen_bit_loops(void))[4];

#endif
