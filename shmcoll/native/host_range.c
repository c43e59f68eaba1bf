/* A rank's range of its array as the row across hosts folds and delivers it (host_range.h). */
#include "host_range.h"

#include "reduce.h"

static int failed_at(const struct host_range *h, int error, int failed) {
    h->words[HOST_ERROR] = error;
    h->words[HOST_FAILED] = failed;
    return error;
}

int sc_host_range_ready(const struct host_range *h, const uint8_t *from, const uint8_t *to) {
    const uint8_t *start = h->own + h->lo, *end = h->own + h->hi;
    from = from > start ? from : start;
    to = to < end ? to : end;
    if (to <= from)
        return 0;
    size_t first = (size_t)(from - start) / h->piece, last = ((size_t)(to - start) + h->piece - 1) / h->piece;
    for (size_t i = first; i < last; i++) {
        if (h->words[HOST_FOLDED + i])
            continue;
        size_t lo = h->lo + i * h->piece, hi = lo + h->piece < h->hi ? lo + h->piece : h->hi;
        int failed = 0, error = sc_reduce_from_peers(h->own, h->peers, h->ranks, h->me, lo, hi, h->code, h->op, 0,
                                                     h->scratch, h->piece, &failed);
        if (error)
            return failed_at(h, error, failed);
        h->words[HOST_FOLDED + i] = 1;
    }
    return 0;
}

int sc_host_range_deliver(const struct host_range *h, const uint8_t *from, size_t n) {
    int failed = 0, error = sc_write_to_peers(h->own, h->peers, h->ranks, h->me, (size_t)(from - h->own),
                                              (size_t)(from - h->own) + n, &failed);
    if (error)
        return failed_at(h, error, failed);
    h->words[HOST_DELIVERED] += (int64_t)n;
    h->words[HOST_STEP_DELIVERED] += (int64_t)n;
    return 0;
}
