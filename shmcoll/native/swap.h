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
    SWAP_SRC_AT = 12,    /* the source rank (4 bytes) */
    SWAP_TAG_AT = 16,    /* the tag (4 bytes) */
    SWAP_SEQ_AT = 28,    /* the call's sequence number (8 bytes) */
    SWAP_MAX_STEPS = 64, /* steps in one row (bits of lower_mask) */
};

/* Pairwise exchanges with TCP peers in a row (recursive doubling's steps), step i with the peer
   on connected socket fds[i] (non-blocking). Each step sends our frame, `header` (at most
   MAX_HEADER_BYTES, duplex.h) with tag and seq written in, then data; a caller may keep one header
   per kind of call and pass each call's numbers. Then it waits for the peer's frame: its header must
   equal ours with srcs[i] as the source, byte for byte (the same call, from that peer), and its
   payload be data's length.
   Once the whole frame waits in the socket it is read into `inbound` (header then payload) and
   folded: data = data op theirs where bit i of lower_mask is set, else theirs op data (float
   operations in one order on both ends: bitwise the same result); empty frames only meet. Each
   wait polls for spin_ns, yielding the core between looks, then sleeps in ppoll, for at most
   wait_ns and within left_ns of the row's start. Nothing but those frames is ever read. *done:
   the steps finished; the row stops at the first step that does not finish, which is the
   status's. */
int sc_swap_row(const int *fds, const uint32_t *srcs, int steps, uint64_t lower_mask, const uint8_t *header,
                size_t header_bytes, uint32_t tag, uint64_t seq, uint8_t *data, size_t nbytes, uint8_t *inbound,
                int code, int op, int64_t spin_ns, int64_t wait_ns, int64_t left_ns, int *done, size_t *sent);

#endif
