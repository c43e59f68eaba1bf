/* The small all-reduce's steps between hosts, in C (swap.h). In Python the same exchange runs
   through about a hundred function calls per message (framing, locks, the mailbox, the fold): tens
   of microseconds of one core for an 8-byte message that the kernel carries in a few, and where
   ranks outnumber cores that time is taken from the peer being waited for. The frame is the one
   transport/frame.py writes; the caller holds the connection's locks, so nobody else reads or
   writes the socket meanwhile, and anything unexpected is left in the socket for the caller. */
#define _GNU_SOURCE
#include "swap.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>

#include "duplex.h"
#include "reduce.h"
#include "words.h"

/* Send header and data, waiting for room until end_ns: the bytes sent, or -errno. */
static int64_t send_frame(int fd, const uint8_t *header, size_t header_bytes, const uint8_t *data, size_t nbytes,
                          int64_t end_ns) {
    size_t total = header_bytes + nbytes, done = 0;
    while (done < total) {
        int64_t n = sc_send_some(fd, header, header_bytes, data, nbytes, done);
        if (n < 0)
            return n;
        done += (size_t)n;
        int64_t left = end_ns - sc_now_ns();
        if (!n && (left <= 0 || sc_wait_ready(fd, POLLOUT, left) <= 0))
            break;
    }
    return (int64_t)done;
}

/* The peer's frame, once whole in the socket and announced by `expect`, read into inbound:
   1 when read, 0 when it is not there (yet), -1 when something else comes first. */
static int take_frame(int fd, const uint8_t *expect, size_t header_bytes, uint8_t *inbound, size_t total) {
    ssize_t seen = recv(fd, inbound, total, MSG_PEEK | MSG_DONTWAIT);
    if (seen == 0 || (seen < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        return -1; /* the connection's end, or an error: the caller's reader reports it */
    if (seen < 0)
        return 0;
    size_t compared = (size_t)seen < header_bytes ? (size_t)seen : header_bytes;
    if (memcmp(inbound, expect, compared) != 0)
        return -1;
    if ((size_t)seen < total)
        return 0;
    return recv(fd, inbound, total, MSG_DONTWAIT) == (ssize_t)total ? 1 : -1; /* peeked whole: cannot fall short */
}

/* The peer's payload into data (swap_row's `into`), as `way` says: folded in one order or the
   other, or copied. */
static void place(uint8_t *data, uint8_t *theirs, size_t nbytes, int code, int op, int way) {
    if (way == WAY_TAKE || way == WAY_SWAP) {
        memcpy(data, theirs, nbytes);
        return;
    }
    size_t n = nbytes / sc_element_size(code);
    if (way == WAY_OWN_FIRST || way == WAY_FOLD_IN) {
        sc_reduce(data, theirs, n, code, op);
    } else {
        sc_reduce(theirs, data, n, code, op);
        memcpy(data, theirs, nbytes);
    }
}

/* Wait for the peer's frame until end, then read it and place it into `into`. */
static int receive_frame(int fd, uint8_t *into, size_t nbytes, const uint8_t *expect, size_t header_bytes,
                         uint8_t *inbound, int code, int op, int way, int64_t start, int64_t spin_ns, int64_t end) {
    for (;;) {
        int got = take_frame(fd, expect, header_bytes, inbound, header_bytes + nbytes);
        if (got < 0)
            return SWAP_SENT;
        if (got > 0) {
            if (nbytes > 0)
                place(into, inbound + header_bytes, nbytes, code, op, way);
            return SWAP_DONE;
        }
        int64_t now = sc_now_ns();
        if (now >= end)
            return SWAP_SENT;
        if (now - start < spin_ns)
            sched_yield();
        else if (sc_wait_ready(fd, POLLIN, end - now) > 0)
            sched_yield(); /* readable, but maybe only part of the frame: let its sender go on */
    }
}

/* A frame's two headers: the array's, and an empty frame's (the same call's, with no payload). */
struct headers {
    const uint8_t *full, *empty;
};

/* One step of the row (swap.h): send, where the way sends; then wait for the peer's frame, read
   it and place it, where the way receives; either frame empty where the way's flags say so. */
static int run_step(int fd, int way, struct headers ours, size_t header_bytes, const uint8_t *data, uint8_t *into,
                    size_t nbytes, struct headers expect, uint8_t *inbound, int code, int op, int64_t spin_ns,
                    int64_t wait_ns, size_t *sent) {
    int64_t start = sc_now_ns(), end = start + wait_ns;
    int kind = way & WAY_KIND_MASK, ours_empty = way & WAY_OURS_EMPTY, theirs_empty = way & WAY_THEIRS_EMPTY;
    *sent = 0;
    if (kind != WAY_TAKE && kind != WAY_FOLD_IN) {
        size_t out = ours_empty ? 0 : nbytes;
        int64_t n = send_frame(fd, ours_empty ? ours.empty : ours.full, header_bytes, data, out, end);
        if (n < 0)
            return (int)n;
        *sent = (size_t)n;
        if ((size_t)n < header_bytes + out)
            return SWAP_PARTIAL;
    }
    if (kind == WAY_GIVE)
        return SWAP_DONE;
    return receive_frame(fd, into, theirs_empty ? 0 : nbytes, theirs_empty ? expect.empty : expect.full, header_bytes,
                         inbound, code, op, kind, start, spin_ns, end);
}

/* The same header with no payload: an empty frame of the same call. */
static void empty_of(uint8_t *empty, const uint8_t *full, size_t header_bytes) {
    memcpy(empty, full, header_bytes);
    sc_put_le(empty + SWAP_NBYTES_AT, 0, 8);
    sc_put_le(empty + SWAP_DIM0_AT, 0, 8);
}

int sc_swap_row(const int *fds, const uint32_t *srcs, int steps, const uint8_t *ways, const uint8_t *header,
                size_t header_bytes, uint32_t tag, uint64_t seq, const uint8_t *data, uint8_t *into, size_t nbytes,
                uint8_t *inbound, int code, int op, int64_t spin_ns, int64_t wait_ns, int64_t left_ns, int *done,
                size_t *sent) {
    uint8_t ours[MAX_HEADER_BYTES], expect[MAX_HEADER_BYTES], ours_empty[MAX_HEADER_BYTES],
        expect_empty[MAX_HEADER_BYTES];
    memcpy(ours, header, header_bytes);
    sc_put_le(ours + SWAP_TAG_AT, tag, 4);
    sc_put_le(ours + SWAP_SEQ_AT, seq, 8);
    empty_of(ours_empty, ours, header_bytes);
    memcpy(expect, ours, header_bytes);
    memcpy(expect_empty, ours_empty, header_bytes);
    int64_t end = sc_now_ns() + left_ns;
    for (*done = 0; *done < steps; ++*done) {
        int i = *done;
        sc_put_le(expect + SWAP_SRC_AT, srcs[i], 4);
        sc_put_le(expect_empty + SWAP_SRC_AT, srcs[i], 4);
        int64_t left = end - sc_now_ns();
        int64_t wait = left < 0 ? 0 : left < wait_ns ? left : wait_ns;
        int status = run_step(fds[i], ways[i], (struct headers){ours, ours_empty}, header_bytes, data, into, nbytes,
                              (struct headers){expect, expect_empty}, inbound, code, op, spin_ns, wait, sent);
        if (status != SWAP_DONE)
            return status;
    }
    return SWAP_DONE;
}
