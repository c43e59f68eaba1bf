/* The shared-memory board's one-step calls, whole: publish, wait for every entry, fold (an
   all-reduce), copy one rank's payload (a broadcast) or every rank's into place (an all-gather),
   finish. */
#ifndef SHMCOLL_BOARD_H
#define SHMCOLL_BOARD_H

#include <stddef.h>
#include <stdint.h>

/* A board entry (transport/shm_layout.py): the published word (1 + sequence number), the frame
   header, a u32 count of sleepers waiting for the word, then the payload. */
enum { BOARD_HEADER_AT = 8, BOARD_HEADER_BYTES = 116, BOARD_SLEEPERS_AT = 124, BOARD_PAYLOAD_AT = 128 };
enum { SRC_FIELD_START = 12, SRC_FIELD_END = 16 }; /* header bytes naming the source rank: the one field ranks differ in */
enum { SEQ_AT = 28 };                              /* the header's sequence number (8 bytes, little-endian) */
#define BOARD_DONE (-1)                            /* else -(2 + r): rank r's entry describes another call */
#define BOARD_FOLD_ALL (-1)                        /* board_call.source of an all-reduce */
#define BOARD_GATHER_ALL (-2)                      /* ... of an all-gather */

/* What one call of the step works on. where[3 * r + k]: rank r's entry offset for even (k = 0) and
   odd (k = 1) sequence numbers, and the index of its "done" u64 word (k = 2). */
struct board_call {
    uint8_t *mem;
    const int64_t *where;
    int ranks, rank;
    uint32_t *done_sleepers;
    void *data; /* this rank's input, reduced in place; an all-gather's output, this rank's block in place */
    size_t nbytes;
    const uint8_t *header; /* our BOARD_HEADER_BYTES frame header; the step fills in the sequence number */
    uint64_t seq;
    int code, op;
    /* BOARD_FOLD_ALL: every entry is folded in (op); BOARD_GATHER_ALL: data holds one block of
       nbytes / ranks per board rank, in board order, each rank publishes its own and copies every
       other's into place; a rank r in [0, ranks): only r publishes its payload, which the others
       copy (a broadcast); any other: entries carry no payload (the ranks only meet: a broadcast's
       hosts other than the root's). Every entry is waited for and its call compared alike. */
    int source;
    /* Whether this rank goes on reading its peers after the step (their arrays, whose addresses
       the entries carry: algorithms/single_copy.py): then it does not mark its reading done,
       Board.finish does once the call is over. */
    int keeps_reading;
};

/* From `position` (0 at first): BOARD_DONE, -(2 + r), or a position to call again with after a
   wait slice (slice_ns) ran out. */
int64_t sc_board_step(const struct board_call *call, int64_t position, int64_t spin_ns, int64_t slice_ns);

#endif
