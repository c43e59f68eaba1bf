/* A rank's range of its array in a large all-reduce across hosts, as the row that carries it across
   (duplex.h) sees it where the host's ranks read each other's arrays (algorithms/single_copy.py).
   The range is folded out of the host peers' arrays a piece at a time just before the row sends
   that piece or folds a frame into it, and each byte the row finishes is written into every host
   peer's array as it comes: each piece is read from memory once for all three, where a fold of the
   whole range before the row and a write-back after it each take it through memory again. */
#ifndef SHMCOLL_HOST_RANGE_H
#define SHMCOLL_HOST_RANGE_H

#include <stddef.h>
#include <stdint.h>

#include "peers.h"

/* The words a host range keeps between calls of a row (Python's int64 array, zeros to start):
   bytes written into the peers' arrays in all and during the current step, the errno and the
   position of the peer whose read or write failed, then one word per piece, 1 once folded. */
enum { HOST_DELIVERED, HOST_STEP_DELIVERED, HOST_ERROR, HOST_FAILED, HOST_FOLDED };

/* Bytes [lo, hi) of `own` (the array of position me among `ranks` host ranks, whose arrays peers
   describes) folded with (code, op) in pieces of `piece` bytes from lo, through scratch (two
   pieces); where `delivers`, the row's finished bytes go into the peers' arrays. */
struct host_range {
    uint8_t *own;
    const struct peer_array *peers;
    int ranks, me, code, op, delivers;
    size_t lo, hi, piece;
    uint8_t *scratch;
    int64_t *words;
};

/* Fold every piece overlapping [from, to) (addresses in own) not folded yet: 0, or the errno of the
   peer's read that failed (words say which peer). */
int sc_host_range_ready(const struct host_range *h, const uint8_t *from, const uint8_t *to);

/* The bytes [from, from + n) of own, finished, written into every peer's array at the same bytes,
   counted in HOST_DELIVERED and HOST_STEP_DELIVERED: 0, or the errno of the write that failed. */
int sc_host_range_deliver(const struct host_range *h, const uint8_t *from, size_t n);

#endif
