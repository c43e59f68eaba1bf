/* Small frames each way with TCP peers, a row of pairwise steps in one call: the small all-reduce's
   steps across hosts, without Python between the sends, the waits and the folds. */
#ifndef SHMCOLL_SWAP_H
#define SHMCOLL_SWAP_H

#include <stddef.h>
#include <stdint.h>

/* sc_swap_row's results; below 0: -errno of a send that failed. SWAP_SENT and SWAP_PARTIAL are
   the step's that stopped the row. */
enum {
    SWAP_DONE = 0,    /* every step: sent, and the peer's frame read and folded into data */
    SWAP_SENT = 1,    /* sent; the peer's frame is not (whole) in the socket yet, or another frame is first */
    SWAP_PARTIAL = 2, /* the socket took only *sent bytes within the wait: the caller sends the rest */
};

enum {                   /* a frame header's fields the row writes or compares (little-endian; transport/frame.py) */
    SWAP_NDIM_AT = 7,    /* the payload's dimensions (1 byte) */
    SWAP_SRC_AT = 12,    /* the source rank (4 bytes) */
    SWAP_TAG_AT = 16,    /* the tag (4 bytes) */
    SWAP_SEQ_AT = 28,    /* the call's sequence number (8 bytes) */
    SWAP_NBYTES_AT = 44, /* the payload's bytes (8 bytes) */
    SWAP_DIM0_AT = 52,   /* the payload's first dimension (8 bytes) */
    SWAP_MAX_STEPS = 64, /* steps in one row */
};

/* What step i of a row does with its peer (ways[i]). An exchange sends and folds the peer's frame
   in; among a number of ranks that is not a power of two, a rank past the largest power of two
   gives its array to a partner (which folds it in) and takes the result back from it. A
   broadcast's step sends the array one way and an empty frame, which only describes the call, the
   other (WAY_SWAP with WAY_OURS_EMPTY or WAY_THEIRS_EMPTY): the low bits say what the step does,
   the two flags which of its frames carry no payload. An empty frame's header is the array's with
   no bytes and a first dimension of 0, as transport/frame.py packs a 1-D array of none. */
enum {
    WAY_THEIRS_FIRST = 0, /* send; data = theirs op data */
    WAY_OWN_FIRST = 1,    /* send; data = data op theirs */
    WAY_GIVE = 2,         /* send only */
    WAY_TAKE = 3,         /* receive only: the peer's payload replaces into's */
    WAY_FOLD_IN = 4,      /* receive only: data = data op theirs */
    WAY_SWAP = 5,         /* send; the peer's payload replaces into's */
    WAY_COUNT = 6,
    WAY_KIND_MASK = 7,
    WAY_OURS_EMPTY = 8,    /* the frame this step sends is empty */
    WAY_THEIRS_EMPTY = 16, /* the frame this step receives is empty: nothing is placed */
};

/* Pairwise steps with TCP peers in a row (recursive doubling's), step i with the peer on connected
   socket fds[i] (non-blocking), as ways[i] says. A step that sends sends our frame, `header` (at
   most MAX_HEADER_BYTES, duplex.h) with tag and seq written in, then data; a caller may keep one
   header per kind of call and pass each call's numbers. A step that receives waits for the peer's
   frame: its header must equal ours with srcs[i] as the source, byte for byte (the same call, from
   that peer), and its payload be data's length (or, as the way's flags say, either frame empty:
   `header` then describes a 1-D array).
   Once the whole frame waits in the socket it is read into `inbound` (header then payload) and
   folded (data op theirs or theirs op data: float operations in one order on both ends, so both
   hold bitwise the same result) or copied into `into` (data itself, or, for a row that only
   copies, another array of its length: an all-gather's step sends its own range and takes the
   peer's); empty frames only meet. Each wait polls for spin_ns, yielding the core between looks,
   then sleeps in ppoll, for at most wait_ns and within left_ns of the row's start. Nothing but
   those frames is ever read. *done: the steps finished; the row stops at the first step that does
   not finish, which is the status's (SWAP_SENT for a step that only receives: nothing was read). */
int sc_swap_row(const int *fds, const uint32_t *srcs, int steps, const uint8_t *ways, const uint8_t *header,
                size_t header_bytes, uint32_t tag, uint64_t seq, const uint8_t *data, uint8_t *into, size_t nbytes,
                uint8_t *inbound, int code, int op, int64_t spin_ns, int64_t wait_ns, int64_t left_ns, int *done,
                size_t *sent);

#endif
