/* A large all-reduce's data movement on one host when ranks may read each other's memory: every
   byte crosses between processes once, copied by the kernel straight out of (or into) the peer's
   array, instead of twice through shared memory (algorithms/single_copy.py says when this runs).

   The fold is in rank order, piece by piece, over a scratch area small enough to stay in cache:
   rank 0 folds into its own array; any other rank starts from rank 0's piece in scratch, folds
   the rest in (its own piece at its turn), and copies the result into its array. Where asked, the
   finished piece is then divided (AVG) and written into every peer's array at the same bytes
   while it is still in cache: the peers' lines were just read for the fold, so no byte of it
   goes to memory and back again. Only the owner of a range reads or writes that range in any
   array during this step. */
#define _GNU_SOURCE
#include "peers.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>

#include "reduce.h"

/* process_vm_readv or process_vm_writev: the same call, the copy going one way or the other. */
typedef ssize_t (*cross_copy)(pid_t, const struct iovec *, unsigned long, const struct iovec *, unsigned long,
                              unsigned long);

/* n bytes between `local` and `address` in process pid, by `copy`, resumed after partial copies
   and signals: 0, or the errno of the copy that failed. */
static int copy_with_peer(cross_copy copy, uint8_t *local, int64_t pid, uint64_t address, size_t n) {
    while (n > 0) {
        struct iovec mine = {local, n}, remote = {(void *)(uintptr_t)address, n};
        ssize_t done = copy((pid_t)pid, &mine, 1, &remote, 1, 0);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return done < 0 ? errno : EFAULT;  /* 0 bytes: the range is not mapped in the peer */
        local += done, address += (uint64_t)done, n -= (size_t)done;
    }
    return 0;
}

int sc_read_peer(void *out, int64_t pid, uint64_t address, size_t n) {
    return copy_with_peer(process_vm_readv, out, pid, address, n);
}

int sc_write_peer(const void *in, int64_t pid, uint64_t address, size_t n) {
    return copy_with_peer(process_vm_writev, (uint8_t *)(uintptr_t)in, pid, address, n);
}

/* Divide a finished piece (divisor > 1: AVG), then write it into every peer's array. */
static int deliver_piece(uint8_t *piece, size_t n, const struct peer_array *peers, int ranks, int me, size_t at,
                         int code, int64_t divisor, int *failed) {
    if (divisor > 1)
        sc_scale(piece, n / sc_element_size(code), code, divisor);
    for (int k = 1; k < ranks; k++) {
        int r = (me + k) % ranks;
        int error = sc_write_peer(piece, peers[r].pid, peers[r].address + at, n);
        if (error) {
            *failed = r;
            return error;
        }
    }
    return 0;
}

int sc_write_to_peers(const uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi,
                      int *failed) {
    return deliver_piece((uint8_t *)(uintptr_t)own + lo, hi - lo, peers, ranks, me, lo, 0, 1, failed);
}

int sc_scale_to_peers(uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi, int code,
                      int64_t divisor, size_t piece, int *failed) {
    for (size_t at = lo; at < hi; at += piece) {
        int error = deliver_piece(own + at, hi - at < piece ? hi - at : piece, peers, ranks, me, at, code, divisor,
                                  failed);
        if (error)
            return error;
    }
    return 0;
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
enum { HUGE_PAGE = 2 << 20 };

int sc_collapse_to_huge_pages(void *start, size_t n) {
    uintptr_t from = ((uintptr_t)start + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
    uintptr_t to = ((uintptr_t)start + n) & ~(uintptr_t)(HUGE_PAGE - 1);
    if (to <= from)
        return 0;
    return madvise((void *)from, to - from, MADV_COLLAPSE) == 0 ? 0 : errno;
}

int sc_reduce_from_peers(uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi,
                         int code, int op, int64_t deliver, uint8_t *scratch, size_t piece,
                         int *failed) {
    size_t size = sc_element_size(code);
    uint8_t *acc_area = scratch, *incoming = scratch + piece;
    for (size_t at = lo; at < hi; at += piece) {
        size_t n = hi - at < piece ? hi - at : piece;
        uint8_t *acc = me == 0 ? own + at : acc_area;
        for (int r = 0; r < ranks; r++) {
            int error = 0;
            if (r == 0 && me != 0)
                error = sc_read_peer(acc, peers[0].pid, peers[0].address + at, n);
            else if (r == me && me != 0)
                sc_reduce(acc, own + at, n / size, code, op);
            else if (r != me)
                error = sc_read_peer(incoming, peers[r].pid, peers[r].address + at, n);
            if (error) {
                *failed = r;
                return error;
            }
            if (r != me && r != 0)
                sc_reduce(acc, incoming, n / size, code, op);
        }
        if (me != 0)
            memcpy(own + at, acc, n);
        if (deliver) {
            int error = deliver_piece(own + at, n, peers, ranks, me, at, code, deliver, failed);
            if (error)
                return error;
        }
    }
    return 0;
}
