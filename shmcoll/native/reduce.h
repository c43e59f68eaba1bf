/* dst = op(dst, src) over n elements of one wire type, in place; and AVG's final division. */
#ifndef SHMCOLL_REDUCE_H
#define SHMCOLL_REDUCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Wire codes (types.py) and reduction kinds (ReduceKind). AVG reduces as SUM; the caller divides. */
enum { CODE_F16 = 1, CODE_BF16 = 2, CODE_F32 = 3, CODE_F64 = 4, CODE_I32 = 5, CODE_I64 = 6 };
enum { OP_SUM = 0, OP_PROD = 1, OP_MIN = 2, OP_MAX = 3, OP_AVG = 4 };

/* Use this CPU's faster 16-bit loops (use != 0; the default once the module loads) or the portable
   ones, which give the same bits; returns whether faster loops are in use now. */
int sc_use_cpu_specific_loops(int use);

/* Bytes per element of a reducible code, 0 for any other code. */
size_t sc_element_size(int code);

/* Whether (code, op) has a loop: a reducible code, and AVG only for the float codes. */
bool sc_has_loop(int64_t code, int64_t op);

/* 0 on success, -1 for a (code, op) with no loop. dst and src may have any alignment. */
int sc_reduce(void *dst, const void *src, size_t n, int code, int op);

/* dst[i] = dst[i] / divisor in float64, rounded once; 0, or -1 for a code that is not a float. */
int sc_scale(void *dst, size_t n, int code, int64_t divisor);

void sc_f16_to_f64(const uint16_t *bits, double *out, size_t n);
void sc_bf16_to_f64(const uint16_t *bits, double *out, size_t n);
void sc_f64_to_f16(const double *values, uint16_t *out, size_t n);
void sc_f64_to_bf16(const double *values, uint16_t *out, size_t n);

#endif
