/* One small frame each way with a TCP peer in one call: the pairwise step of the small all-reduce
   across hosts, without Python between the send, the wait and the fold. */
#ifndef SHMCOLL_SWAP_H
#define SHMCOLL_SWAP_H

#include <stddef.h>
#include <stdint.h>

/* sc_swap_frames' results; below 0: -errno of a send that failed. */
enum {
    SWAP_DONE = 0,    /* sent, and the peer's frame read and folded into data */
    SWAP_SENT = 1,    /* sent; the peer's frame is not (whole) in the socket yet, or another frame is first */
    SWAP_PARTIAL = 2, /* the socket took only *sent bytes within the wait: the caller sends the rest */
};

/* Send header then data on connected socket fd (non-blocking), then wait for the peer's frame:
   its header must equal `expect` byte for byte (the same call, from the peer) and its payload be
   data's length. Once the whole frame waits in the socket it is read into `inbound` (header then
   payload) and folded: data = data op theirs, or theirs op data where !own_first (float
   operations in one order on both ends: bitwise the same result); empty frames only meet. The
   wait polls for spin_ns, yielding the core between looks, then sleeps in ppoll; wait_ns bounds
   the whole call. Nothing but that frame is ever read. */
int sc_swap_frames(int fd, const uint8_t *header, size_t header_bytes, uint8_t *data, size_t nbytes,
                   const uint8_t *expect, uint8_t *inbound, int code, int op, int own_first, int64_t spin_ns,
                   int64_t wait_ns, size_t *sent);

#endif
