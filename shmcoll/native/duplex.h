/* One frame out to a TCP peer while one comes in from a peer (the same or another), both at once:
   a step of a ring or of halving-doubling across hosts, without Python between the sends, the
   reads and the folds. */
#ifndef SHMCOLL_DUPLEX_H
#define SHMCOLL_DUPLEX_H

#include <stddef.h>
#include <stdint.h>

#include "host_range.h"

/* sc_duplex's results; below 0: -errno of a send that failed. */
enum {
    DUPLEX_DONE = 0,      /* our frame is sent, and the peer's read */
    DUPLEX_PENDING = 1,   /* the wait ran out first: call again with the same progress */
    DUPLEX_ENDED = 2,     /* the incoming connection ended or failed (EOF, reset): maybe mid-frame */
    DUPLEX_ELSEWHERE = 3, /* another frame came first (IN_ELSEWHERE): nothing more is read or sent here */
    DUPLEX_HOST_FAILED = 4, /* the host range's read or write of a host peer's array failed (its words say) */
};

/* Frame headers up to this size (transport/frame.py's are 116 bytes): the native exchanges with
   TCP peers (sc_duplex, and sc_swap_row in swap.c) refuse longer ones. */
enum { MAX_HEADER_BYTES = 256 };

/* A duplex sends at most out->lead_bytes of payload ahead of what it has read of the peer's
   frame, until that frame is whole. Two ends that each pour a whole frame into the connection fill
   both sockets' queues and then move at about half the speed (between network namespaces under
   reno, 16 MiB took 4.8 to 13.4 ms from one connection to the next, with a 128 KiB lead 4.3 to
   4.4 ms: bench/link_exchange.py). Each end keeps sending while it reads, so the lead only paces
   two busy ends; it caps one connection at about 2 * lead per round trip. No exchange waits on
   itself: in a ring, the end whose left peer's frame is whole sends the rest. The caller chooses
   the lead per connection (transport/tcp.py: larger where no timer paces the connection). */

/* Where the incoming frame stands (progress->in_state). */
enum { IN_WAITING = 0, IN_BODY = 1, IN_DONE = 2, IN_ELSEWHERE = 3 };

/* The frame going out: header, then data, on connected socket fd, at most lead_bytes (> 0) of
   payload ahead of the peer's frame (above). */
struct duplex_out {
    int fd;
    const uint8_t *header;
    size_t header_bytes;
    const uint8_t *data;
    size_t nbytes;
    size_t lead_bytes;
};

/* The frame coming in on fd: its header must equal `expect` byte for byte (the same call, from the
   peer); headers equal to `beat` (the peer's heartbeat) before it are read and counted. Its
   payload goes into `into`: copied (op < 0), or read into scratch and folded, into = into op
   theirs, a batch at a time while the rest is still arriving. `final`: nothing later in the call
   changes those bytes of `into` again, so a host range that delivers writes them into its host
   peers' arrays as they come. */
struct duplex_in {
    int fd;
    const uint8_t *expect;
    const uint8_t *beat;
    size_t header_bytes;
    uint8_t *into;
    size_t nbytes;
    uint8_t *scratch;
    size_t scratch_bytes;
    int code;
    int op;
    int final;
};

/* How far a duplex got, kept by the caller between calls (Python's int64[5]). sent: bytes of our
   frame sent; got: payload bytes of the peer's frame read; pending: of those, bytes in scratch not
   folded yet; in_state: IN_*; beats: heartbeats read. */
struct duplex_progress {
    int64_t sent, got, pending, in_state, beats;
};

/* Move both frames as far as they go within wait_ns: sending whatever the socket takes (up to
   out->lead_bytes past what came of the peer's payload), reading whatever has come; while
   neither can move it polls, yielding the core between looks, until spin_ns have passed since
   anything moved, then sleeps in ppoll. With a host range (NULL: none), out's data and in's `into`
   lie in it: each piece is folded out of the host peers just before any of it goes out or is
   written or folded into, and final bytes are delivered (host_range.h). Anything but a heartbeat or the expected header first on
   the incoming socket is left there, and the call returns at once (DUPLEX_ELSEWHERE): the
   caller's reader must drain that socket while the rest of the frame goes out, since a peer doing
   the same would otherwise wait for this end to read, and this end for it. Nothing past the
   peer's frame is ever read. */
int sc_duplex(const struct duplex_out *out, const struct duplex_in *in, const struct host_range *host,
              struct duplex_progress *progress, int64_t spin_ns, int64_t wait_ns);

/* One step of a row (sc_duplex_row): bytes [out_at, out_at + out_bytes) of the row's data
   (out_count elements, what its frame's header says) out to the peer on out_fd while rank src's
   frame of the same call comes in on in_fd into bytes [in_at, in_at + in_bytes) (in_count
   elements), folded with the row's op (folds) or copied; lead_bytes as a duplex's; final as a
   duplex_in's. As int64 words: Python keeps a row as an int64 array of DUPLEX_STEP_WORDS per step. */
struct duplex_step {
    int64_t out_fd, in_fd, src, out_at, out_bytes, out_count, in_at, in_bytes, in_count, folds, lead_bytes, final;
};
enum { DUPLEX_STEP_WORDS = 12 };

/* A ring's or halving-doubling's steps in a row, from step *at on: each moves as sc_duplex moves
   one, its frames' headers made from `header` (ours, of the call's array: the tag, sequence number
   and payload's size written in, and the source of the frame that comes in), beats + k *
   header_bytes the heartbeat header of step k's peer. A whole step advances *at and starts
   *progress over; a step starts once the one before is whole, so it may send what an earlier one
   received. With a host range, data lies in it (sc_duplex). Within wait_ns in all: sc_duplex's
   result for the step at *at, DUPLEX_DONE once every step is whole. */
int sc_duplex_row(const struct duplex_step *steps, int count, int *at, const uint8_t *header, size_t header_bytes,
                  const uint8_t *beats, uint32_t tag, uint64_t seq, uint8_t *data, uint8_t *scratch,
                  size_t scratch_bytes, int code, int op, const struct host_range *host,
                  struct duplex_progress *progress, int64_t spin_ns, int64_t wait_ns);

/* n bytes of v at field, little-endian: a frame header's field. */
static inline void sc_put_le(uint8_t *field, uint64_t v, int n) {
    for (int k = 0; k < n; ++k)
        field[k] = (uint8_t)(v >> (8 * k));
}

/* One non-blocking sendmsg of what is left of header + data after `done` bytes: the bytes it
   took (0 when the socket has no room), or -errno. */
int64_t sc_send_some(int fd, const uint8_t *header, size_t header_bytes, const uint8_t *data, size_t nbytes,
                     size_t done);

/* Wait until fd is ready for `events` or `ns` nanoseconds have passed (0: only look): ppoll's result. */
int sc_wait_ready(int fd, short events, int64_t ns);

#endif
