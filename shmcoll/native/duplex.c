/* A ring's or halving-doubling's step across hosts in C (duplex.h). In Python a large frame goes
   out in a blocking send while a reader thread takes the peer's: it allocates a buffer, copies
   the payload in, hands it over through the mailbox (a GIL switch each time), and only then is it
   folded, out of cache. Here one thread sends and reads both at once, the payload lands in place
   (or in a small scratch folded while the rest arrives), and the link stays busy both ways. The
   caller holds both connections' locks, so nobody else reads or writes those sockets meanwhile. */
#define _GNU_SOURCE
#include "duplex.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "host_range.h"
#include "reduce.h"
#include "swap.h"
#include "words.h"

/* Fold pending scratch bytes once this many have come (or the payload is whole): each batch is
   folded while the kernel receives the next, and still sits in cache. */
enum { FOLD_FROM_BYTES = 64 * 1024 };
/* Write finished bytes into the host peers' arrays once this many have come (or the frame is whole). */
enum { DELIVER_FROM_BYTES = 64 * 1024 };
/* What reading a frame did besides moving (1) or not (0): the connection ended, or the host range
   (host_range.h) failed to fold or deliver. */
enum { TOOK_ENDED = -1, TOOK_HOST_FAILED = -2 };

static size_t at_most(size_t bytes, size_t limit) { return bytes < limit ? bytes : limit; }

int sc_wait_ready(int fd, short events, int64_t ns) {
    struct pollfd p = {.fd = fd, .events = events};
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    return ppoll(&p, 1, &t, NULL);
}

int64_t sc_send_some(int fd, const uint8_t *header, size_t header_bytes, const uint8_t *data, size_t nbytes,
                     size_t done) {
    struct iovec parts[2];
    int count = 0;
    if (done < header_bytes)
        parts[count++] = (struct iovec){(void *)(header + done), header_bytes - done};
    size_t from = done > header_bytes ? done - header_bytes : 0;
    if (nbytes > from)
        parts[count++] = (struct iovec){(void *)(data + from), nbytes - from};
    if (!count)
        return 0;
    struct msghdr msg = {.msg_iov = parts, .msg_iovlen = count};
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0)
        return n;
    return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -errno;
}

/* A recv that cannot block (room > 0): the bytes read, 0 when nothing waits, -1 at the
   connection's end or on an error. */
static ssize_t take(int fd, void *to, size_t room, int flags) {
    ssize_t n = recv(fd, to, room, flags | MSG_DONTWAIT);
    if (n > 0)
        return n;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return 0;
    return -1;
}

/* Look at the next header on the socket: read a heartbeat, or the expected header (the payload
   follows), or give the socket up to the caller for anything else. 1 when it moved, 0 when a
   header is still on its way, -1 at the connection's end. */
static int take_header(const struct duplex_in *in, struct duplex_progress *p) {
    uint8_t seen[MAX_HEADER_BYTES];
    ssize_t n = take(in->fd, seen, in->header_bytes, MSG_PEEK);
    if (n <= 0)
        return (int)n;
    int is_expected = memcmp(seen, in->expect, (size_t)n) == 0, is_beat = memcmp(seen, in->beat, (size_t)n) == 0;
    if (!is_expected && !is_beat) {
        p->in_state = IN_ELSEWHERE;
        return 1;
    }
    if ((size_t)n < in->header_bytes)
        return 0;
    if (take(in->fd, seen, in->header_bytes, 0) != (ssize_t)in->header_bytes) /* peeked whole: cannot fall short */
        return -1;
    if (is_beat)
        p->beats++;
    else
        p->in_state = in->nbytes ? IN_BODY : IN_DONE;
    return 1;
}

/* Fold the whole elements waiting in scratch into their place; a split element's bytes stay. */
static void fold_pending(const struct duplex_in *in, struct duplex_progress *p) {
    size_t size = sc_element_size(in->code), pending = (size_t)p->pending, whole = pending / size * size;
    sc_reduce(in->into + (size_t)p->got - pending, in->scratch, whole / size, in->code, in->op);
    memmove(in->scratch, in->scratch + whole, pending - whole);
    p->pending = (int64_t)(pending - whole);
}

/* The frame's finished bytes not yet in the host peers' arrays written there, once enough have
   come or the frame is whole: where the row delivers and this frame's bytes are final. */
static int deliver_finished(const struct duplex_in *in, const struct host_range *host,
                            const struct duplex_progress *p, int whole) {
    if (!host || !host->delivers || !in->final)
        return 0;
    size_t finished = (size_t)(p->got - p->pending), done = (size_t)host->words[HOST_STEP_DELIVERED];
    if (finished == done || (finished - done < DELIVER_FROM_BYTES && !whole))
        return 0;
    return sc_host_range_deliver(host, in->into + done, finished - done);
}

/* Read what has come of the payload: into place, or into scratch to fold; with a host range, a
   piece at most into place, each piece folded out of the host peers before it is written into or
   folded into. As take_header, or TOOK_HOST_FAILED. */
static int take_body(const struct duplex_in *in, const struct host_range *host, struct duplex_progress *p) {
    size_t left = in->nbytes - (size_t)p->got;
    int folds = in->op >= 0;
    uint8_t *to = folds ? in->scratch + p->pending : in->into + p->got;
    size_t room = folds ? at_most(left, in->scratch_bytes - (size_t)p->pending) : left;
    if (host && !folds) {
        room = at_most(room, host->piece);
        if (sc_host_range_ready(host, to, to + room))
            return TOOK_HOST_FAILED;
    }
    ssize_t n = take(in->fd, to, room, 0);
    if (n <= 0)
        return (int)n;
    p->got += n;
    p->pending += folds ? n : 0;
    int whole = (size_t)p->got == in->nbytes;
    if (folds && (whole || (size_t)p->pending >= FOLD_FROM_BYTES || (size_t)p->pending == in->scratch_bytes)) {
        uint8_t *at = in->into + p->got - p->pending;
        if (host && sc_host_range_ready(host, at, at + p->pending))
            return TOOK_HOST_FAILED;
        fold_pending(in, p);
    }
    if (deliver_finished(in, host, p, whole))
        return TOOK_HOST_FAILED;
    if (whole)
        p->in_state = IN_DONE;
    return 1;
}

static int receive_some(const struct duplex_in *in, const struct host_range *host, struct duplex_progress *p) {
    if (p->in_state == IN_WAITING)
        return take_header(in, p);
    return p->in_state == IN_BODY ? take_body(in, host, p) : 0;
}

/* Sleep until either socket can move (or ns pass): one pollfd when both are one connection. */
static void wait_either(const struct duplex_out *out, int sending, const struct duplex_in *in, int receiving,
                        int64_t ns) {
    struct pollfd fds[2];
    int count = 0;
    if (sending)
        fds[count++] = (struct pollfd){.fd = out->fd, .events = POLLOUT};
    if (receiving && count && in->fd == out->fd)
        fds[0].events |= POLLIN;
    else if (receiving)
        fds[count++] = (struct pollfd){.fd = in->fd, .events = POLLIN};
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    ppoll(fds, count, &t, NULL);
}

/* Bytes of our frame (header and payload) that may be out by now: out->lead_bytes of payload
   past what came of the peer's, all of it once the peer's frame is whole. */
static size_t may_send(const struct duplex_out *out, const struct duplex_in *in, const struct duplex_progress *p) {
    size_t total = out->header_bytes + out->nbytes;
    if (p->in_state >= IN_DONE)
        return total;
    return at_most(total, out->header_bytes + (size_t)p->got + out->lead_bytes);
}

/* With a host range, what may go out capped at one piece past what has, folded out of the host
   peers first: 0, or the errno of the fold. */
static int fold_before_sending(const struct duplex_out *out, const struct host_range *host,
                               const struct duplex_progress *p, size_t *allowed) {
    size_t from = (size_t)p->sent > out->header_bytes ? (size_t)p->sent - out->header_bytes : 0;
    *allowed = at_most(*allowed, out->header_bytes + from + host->piece);
    return sc_host_range_ready(host, out->data + from, out->data + (*allowed - out->header_bytes));
}

int sc_duplex(const struct duplex_out *out, const struct duplex_in *in, const struct host_range *host,
              struct duplex_progress *p, int64_t spin_ns, int64_t wait_ns) {
    int64_t moved_at = sc_now_ns(), end = moved_at + wait_ns;
    size_t total = out->header_bytes + out->nbytes;
    int woke_idle = 0; /* the last wait ended with nothing to move: a header still on its way */
    for (;;) {
        size_t allowed = may_send(out, in, p);
        if (host && (size_t)p->sent < allowed && fold_before_sending(out, host, p, &allowed))
            return DUPLEX_HOST_FAILED;
        int64_t sent = (size_t)p->sent < allowed ? sc_send_some(out->fd, out->header, out->header_bytes, out->data,
                                                                allowed - out->header_bytes, (size_t)p->sent)
                                                  : 0;
        if (sent < 0)
            return (int)sent;
        p->sent += sent;
        int got = receive_some(in, host, p);
        if (got < 0)
            return got == TOOK_HOST_FAILED ? DUPLEX_HOST_FAILED : DUPLEX_ENDED;
        if (p->in_state == IN_ELSEWHERE)
            return DUPLEX_ELSEWHERE;
        int sending = (size_t)p->sent < total, receiving = p->in_state < IN_DONE;
        if (!sending && !receiving)
            return DUPLEX_DONE;
        int64_t now = sc_now_ns();
        if (sent || got) {
            moved_at = now;
            woke_idle = 0;
            continue;
        }
        if (now >= end)
            return DUPLEX_PENDING;
        if (now - moved_at < spin_ns || woke_idle) {
            sched_yield();
            woke_idle = 0;
        } else {
            wait_either(out, (size_t)p->sent < allowed, in, receiving, end - now); /* nothing moved since */
            woke_idle = 1;
        }
    }
}

/* Step k's frames' headers: ours (`header` with the call's tag and sequence number) with the sizes
   of what goes out written in, and the same with the source and sizes of what comes in. */
static void step_headers(const struct duplex_step *k, uint8_t *ours, uint8_t *expect, size_t header_bytes) {
    sc_put_le(ours + SWAP_NBYTES_AT, (uint64_t)k->out_bytes, 8);
    sc_put_le(ours + SWAP_DIM0_AT, (uint64_t)k->out_count, 8);
    memcpy(expect, ours, header_bytes);
    sc_put_le(expect + SWAP_SRC_AT, (uint64_t)k->src, 4);
    sc_put_le(expect + SWAP_NBYTES_AT, (uint64_t)k->in_bytes, 8);
    sc_put_le(expect + SWAP_DIM0_AT, (uint64_t)k->in_count, 8);
}

int sc_duplex_row(const struct duplex_step *steps, int count, int *at, const uint8_t *header, size_t header_bytes,
                  const uint8_t *beats, uint32_t tag, uint64_t seq, uint8_t *data, uint8_t *scratch,
                  size_t scratch_bytes, int code, int op, const struct host_range *host,
                  struct duplex_progress *progress, int64_t spin_ns, int64_t wait_ns) {
    uint8_t ours[MAX_HEADER_BYTES], expect[MAX_HEADER_BYTES];
    memcpy(ours, header, header_bytes);
    sc_put_le(ours + SWAP_TAG_AT, tag, 4);
    sc_put_le(ours + SWAP_SEQ_AT, seq, 8);
    int64_t end = sc_now_ns() + wait_ns;
    for (; *at < count; ++*at) {
        const struct duplex_step *k = &steps[*at];
        step_headers(k, ours, expect, header_bytes);
        struct duplex_out out = {(int)k->out_fd, ours, header_bytes, data + k->out_at, (size_t)k->out_bytes,
                                 (size_t)k->lead_bytes};
        struct duplex_in in = {(int)k->in_fd, expect, beats + (size_t)*at * header_bytes, header_bytes,
                               data + k->in_at, (size_t)k->in_bytes, scratch, k->folds ? scratch_bytes : 0,
                               code, k->folds ? op : -1, (int)k->final};
        int64_t left = end - sc_now_ns();
        int status = sc_duplex(&out, &in, host, progress, spin_ns, left > 0 ? left : 0);
        if (status != DUPLEX_DONE)
            return status;
        *progress = (struct duplex_progress){.beats = progress->beats};
        if (host)
            host->words[HOST_STEP_DELIVERED] = 0;
    }
    return DUPLEX_DONE;
}
