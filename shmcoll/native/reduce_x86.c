/* The 16-bit loops again, compiled for AVX2 and F16C and used where the CPU has both (most x86-64
   machines since 2013): eight elements per instruction, and float16 sums and products through the
   CPU's own conversions, which round to nearest even and quiet NaNs exactly as half.h does (the
   tests compare both paths on every pattern). */
#include "loops.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,f16c")
#include <immintrin.h>

SIXTEEN_BIT_LOOPS(_avx2)

#define F16C_LOOP(name, VECTOR_OP, tail)                                                              \
    static void name(void *restrict dst, const void *restrict src, size_t n) {                        \
        char *restrict d = dst;                                                                       \
        const char *restrict s = src;                                                                 \
        size_t i = 0;                                                                                 \
        for (; i + 8 <= n; i += 8) {                                                                  \
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 2 * i)));                \
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * i)));                \
            _mm_storeu_si128((__m128i *)(d + 2 * i), _mm256_cvtps_ph(VECTOR_OP(a, b), _MM_FROUND_TO_NEAREST_INT)); \
        }                                                                                             \
        tail(d + 2 * i, s + 2 * i, n - i);                                                            \
    }

F16C_LOOP(f16_sum_f16c, _mm256_add_ps, f16_sum_avx2)
F16C_LOOP(f16_prod_f16c, _mm256_mul_ps, f16_prod_avx2)

static const loop_fn LOOPS[2][4] = {
    {f16_sum_f16c, f16_prod_f16c, f16_min_avx2, f16_max_avx2},
    {bf16_sum_avx2, bf16_prod_avx2, bf16_min_avx2, bf16_max_avx2},
};

const loop_fn (*sc_x86_sixteen_bit_loops(void))[4] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") ? LOOPS : NULL;
}

#else

const loop_fn (*sc_x86_sixteen_bit_loops(void))[4] { return NULL; }

#endif
