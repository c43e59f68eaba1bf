/* The board's one-step calls: publish our entry, wait for every peer's, fold them all in rank
   order (an all-reduce: every rank computes bitwise the same result), copy the source's payload
   (a broadcast) or every rank's block into place (an all-gather), mark our reading done.

   Ordering: an entry's header and payload are written before its published word is stored
   (sequentially consistent, words.c); a reader loads the word with acquire ordering before it
   reads the entry. An entry is overwritten (two calls later: entries alternate by parity) only
   once every peer's "done" word says it finished the call the entry last held, and "done" is
   stored after the reader's last read of it. */
#include "board.h"

#include <string.h>

#include "reduce.h"
#include "words.h"

static inline uint64_t *word_at(uint8_t *mem, int64_t offset) { return (uint64_t *)(mem + offset); }
static inline uint32_t *sleepers_of(uint8_t *mem, int64_t entry) { return (uint32_t *)(mem + entry + BOARD_SLEEPERS_AT); }
static inline uint64_t *done_word(const struct board_call *c, int r) { return (uint64_t *)c->mem + c->where[3 * r + 2]; }

/* Whether every peer has finished the call our entry last held (1 + its number is still in the
   published word), so that overwriting it cannot change what a peer is reading. */
static bool entry_free(const struct board_call *c, int64_t mine, int64_t spin_ns, int64_t slice_ns) {
    uint64_t previous = sc_load_acquire(word_at(c->mem, mine));
    if (previous == 0)
        return true;
    for (int r = 0; r < c->ranks; r++)
        if (r != c->rank && !sc_wait_word(done_word(c, r), previous, true, c->done_sleepers, spin_ns, slice_ns))
            return false;
    return true;
}

/* An all-gather's block of board rank r in data. */
static uint8_t *block_of(const struct board_call *c, int r) {
    return (uint8_t *)c->data + (size_t)r * (c->nbytes / (size_t)c->ranks);
}

static void write_entry(const struct board_call *c, int64_t at) {
    uint8_t *head = c->mem + at + BOARD_HEADER_AT;
    memcpy(head, c->header, BOARD_HEADER_BYTES);
    for (int k = 0; k < 8; k++)
        head[SEQ_AT + k] = (uint8_t)(c->seq >> (8 * k));
    if (c->source == BOARD_GATHER_ALL)
        memcpy(c->mem + at + BOARD_PAYLOAD_AT, block_of(c, c->rank), c->nbytes / (size_t)c->ranks);
    else if (c->source == BOARD_FOLD_ALL || c->source == c->rank)
        memcpy(c->mem + at + BOARD_PAYLOAD_AT, c->data, c->nbytes);
    sc_store_and_wake(word_at(c->mem, at), c->seq + 1, sleepers_of(c->mem, at));
}

/* Whether two published entries describe the same call (headers equal but for the source rank). */
static bool same_call(const uint8_t *mem, int64_t theirs, int64_t mine) {
    const uint8_t *a = mem + theirs + BOARD_HEADER_AT, *b = mem + mine + BOARD_HEADER_AT;
    return memcmp(a, b, SRC_FIELD_START) == 0 &&
           memcmp(a + SRC_FIELD_END, b + SRC_FIELD_END, BOARD_HEADER_BYTES - SRC_FIELD_END) == 0;
}

/* Entry r's payload into data, as the call's source says: kept (r = 0), copied or folded in (an
   all-reduce), copied into r's block (an all-gather), or copied from the source alone (a
   broadcast). */
static void take_entry(const struct board_call *c, int r, const uint8_t *payload, size_t size) {
    if (c->source == BOARD_GATHER_ALL) {
        if (r != c->rank)
            memcpy(block_of(c, r), payload, c->nbytes / (size_t)c->ranks);
    } else if (c->source != BOARD_FOLD_ALL) {
        if (r == c->source && r != c->rank)
            memcpy(c->data, payload, c->nbytes);
    } else if (r == 0) {
        if (c->rank != 0)
            memcpy(c->data, payload, c->nbytes);
    } else if (c->nbytes > 0) {
        sc_reduce(c->data, payload, c->nbytes / size, c->code, c->op);
    }
}

int64_t sc_board_step(const struct board_call *c, int64_t position, int64_t spin_ns, int64_t slice_ns) {
    int parity = (int)(c->seq % 2);
    int64_t mine = c->where[3 * c->rank + parity];
    size_t size = sc_element_size(c->code);
    if (position == 0) {
        if (!entry_free(c, mine, spin_ns, slice_ns))
            return 0;
        write_entry(c, mine);
        position = 1;
    }
    for (int r = (int)position - 1; r < c->ranks; r++) {
        int64_t at = c->where[3 * r + parity];
        const uint8_t *payload = c->mem + at + BOARD_PAYLOAD_AT;
        if (r != c->rank) {
            if (!sc_wait_word(word_at(c->mem, at), c->seq + 1, false, sleepers_of(c->mem, at), spin_ns, slice_ns))
                return r + 1;
            if (!same_call(c->mem, at, mine))
                return -2 - r;
        }
        take_entry(c, r, payload, size);
    }
    if (!c->keeps_reading)
        sc_store_and_wake(done_word(c, c->rank), c->seq + 1, c->done_sleepers);
    return BOARD_DONE;
}
