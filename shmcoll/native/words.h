/* Ordered loads and stores of shared 64-bit words, and waiting for a word: spin, then a futex. */
#ifndef SHMCOLL_WORDS_H
#define SHMCOLL_WORDS_H

#include <stdbool.h>
#include <stdint.h>

int64_t sc_now_ns(void);

/* The word at p with acquire ordering: reads after it see what its writer stored before publishing. */
static inline uint64_t sc_load_acquire(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* *word = value after every store before it; then wake the futex sleepers counted in *sleepers. */
void sc_store_and_wake(uint64_t *word, uint64_t value, uint32_t *sleepers);

/* Until *word equals target (or, at_least, passes it), with acquire ordering. Spins for spin_ns,
   then sleeps counted in *sleepers; false once slice_ns have passed without it. */
bool sc_wait_word(uint64_t *word, uint64_t target, bool at_least, uint32_t *sleepers, int64_t spin_ns,
                  int64_t slice_ns);

#endif
