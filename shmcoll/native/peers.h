/* Reading a peer process's memory directly (Linux cross-memory attach, process_vm_readv). */
#ifndef SHMCOLL_PEERS_H
#define SHMCOLL_PEERS_H

#include <stddef.h>
#include <stdint.h>

/* One peer's array as it published it: its board descriptor (single_copy.py's DESCRIPTOR_BYTES),
   of which only the pid and the address of the array's first byte are read here. The whole
   descriptor, so the rows a board step gathers are the peers the calls below take, as they are. */
struct peer_array {
    int64_t pid;
    uint64_t address;
    int64_t rest[6];
};

/* Copy n bytes at `address` in process pid into out: 0, or the errno of the read that failed. */
int sc_read_peer(void *out, int64_t pid, uint64_t address, size_t n);

/* Copy n bytes from `in` to `address` in process pid: 0, or the errno of the write that failed. */
int sc_write_peer(const void *in, int64_t pid, uint64_t address, size_t n);

/* Bytes [lo, hi) of every rank's array folded in rank order into own[lo, hi) (own is rank me's
   array): peers' bytes are read into scratch, `piece` bytes at a time (two pieces of scratch);
   where `deliver` is not 0, each finished piece is then divided by it where it is above 1 (AVG)
   and written into every peer's array at the same bytes. 0, or the errno of the read or write
   that failed with *failed set to the peer's rank. */
int sc_reduce_from_peers(uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi,
                         int code, int op, int64_t deliver, uint8_t *scratch, size_t piece,
                         int *failed);

/* Bytes [lo, hi) of own (rank me's array) written into every other rank's array at the same bytes,
   the next rank first: 0, or the errno of the write that failed with *failed set to its rank. */
int sc_write_to_peers(const uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi,
                      int *failed);

/* As sc_write_to_peers, each `piece` bytes (whole elements of `code`) divided by divisor first
   (AVG's last step), and written while still in cache: one pass over the range, not two. */
int sc_scale_to_peers(uint8_t *own, const struct peer_array *peers, int ranks, int me, size_t lo, size_t hi, int code,
                      int64_t divisor, size_t piece, int *failed);

/* Ask the kernel to back the whole 2 MiB-aligned huge pages inside [start, start + n) with huge
   pages now (MADV_COLLAPSE): 0, or the errno (EINVAL before Linux 6.1, or where THP is off). */
int sc_collapse_to_huge_pages(void *start, size_t n);

#endif
