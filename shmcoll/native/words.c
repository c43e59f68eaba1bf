/* Shared memory's ordered loads and stores, waiting and waking.

   The board (transport/shm_board.py) and the channels (shm_channel.py) are memory that other
   processes read while this one writes. A reader whose acquire load sees a published word also
   sees every store the writer made before its release (here sequentially consistent) store, on
   every CPU, not by x86's store order.

   Waiting spins on the word with the CPU's pause hint, then sleeps on a futex of the word's low
   half (plain FUTEX_WAIT, not the private variant: the word lives in a segment several processes
   map). A sleeper counts itself in a counter next to the word first, so a writer knows whether to
   make the wake-up system call. Store, then look at the counter (writer); count, then look at the
   word (sleeper): both sequentially consistent, so at least one of the two sees the other, and
   FUTEX_WAIT itself refuses to sleep once the word has changed. Words are little-endian. */
#define _GNU_SOURCE
#include "words.h"

#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum {
    PAUSES_PER_LOOK = 4,  /* pause hints between two looks at a word while spinning (a few hundred ns) */
    LOOKS_PER_YIELD = 16, /* every so many looks, give the core away: ranks may outnumber cores */
};

int64_t sc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* x86's pause or arm's yield: the spinning core lets its sibling run and saves power. */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline bool reached(uint64_t seen, uint64_t target, bool at_least) {
    return seen == target || (at_least && seen > target);
}

/* The futex is the word's low half: its address on a little-endian machine. */
static inline uint32_t *low_half(uint64_t *word) { return (uint32_t *)word; }

void sc_store_and_wake(uint64_t *word, uint64_t value, uint32_t *sleepers) {
    __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST) != 0)
        syscall(SYS_futex, low_half(word), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static bool sleep_on_word(uint64_t *word, uint64_t target, bool at_least, uint32_t *sleepers, int64_t end_ns) {
    uint64_t seen;
    __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
        if (reached(seen, target, at_least))
            break;
        int64_t left = end_ns - sc_now_ns();
        if (left <= 0)
            break;
        struct timespec timeout = {left / 1000000000, left % 1000000000};
        syscall(SYS_futex, low_half(word), FUTEX_WAIT, (uint32_t)seen, &timeout, NULL, 0);
    }
    __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
    return reached(seen, target, at_least);
}

bool sc_wait_word(uint64_t *word, uint64_t target, bool at_least, uint32_t *sleepers, int64_t spin_ns,
                  int64_t slice_ns) {
    int64_t start = sc_now_ns();
    for (unsigned looks = 1; !reached(sc_load_acquire(word), target, at_least); looks++) {
        if (sc_now_ns() - start >= spin_ns)
            return sleep_on_word(word, target, at_least, sleepers, start + slice_ns);
        if (looks % LOOKS_PER_YIELD == 0) {
            sched_yield();
        } else {
            for (int k = 0; k < PAUSES_PER_LOOK; k++)
                cpu_relax();
        }
    }
    return true;
}
