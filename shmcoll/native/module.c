/* shmcoll._native: the Python face of the C kernels (reduce.c, words.c, board.c, peers.c, swap.c,
   duplex.c).

   Why C and not a JIT: every rank of a job would otherwise import a compiler (about 75 MiB and a
   second of start-up per process, times 32 ranks on one host); this module loads in microseconds
   and a call costs about a tenth of a microsecond. Arguments are buffers (numpy arrays, memory
   maps) checked here, so an index or a length never reaches memory outside them. Loops and waits
   release the GIL, so a spawned collective runs beside the caller's Python threads. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "board.h"
#include "duplex.h"
#include "peers.h"
#include "reduce.h"
#include "swap.h"
#include "words.h"

enum { RELEASE_GIL_FROM_BYTES = 64 * 1024 }; /* shorter loops keep the GIL: releasing costs more than they do */

/* A buffer held for one call, released by its end. */
typedef struct {
    Py_buffer view;
    int held;
} held_buffer;

static int hold(PyObject *obj, held_buffer *b, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, &b->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_ValueError, "%s: a contiguous%s buffer is needed", what, writable ? ", writable" : "");
        return -1;
    }
    b->held = 1;
    return 0;
}

static void release(held_buffer *b) {
    if (b->held)
        PyBuffer_Release(&b->view);
    b->held = 0;
}

static int check_count(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
    return -1;
}

/* A long long argument; -1 with an error set when it is not an integer. */
static int as_i64(PyObject *obj, int64_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* The address of the aligned `size`-byte item `index` of buffer b, or NULL with ValueError. */
static void *item(held_buffer *b, int64_t index, size_t size, const char *what) {
    if (index < 0 || (uint64_t)(index + 1) * size > (uint64_t)b->view.len) {
        PyErr_Format(PyExc_ValueError, "%s: item %lld is outside the buffer", what, (long long)index);
        return NULL;
    }
    char *p = (char *)b->view.buf + index * size;
    if ((uintptr_t)p % size != 0) {
        PyErr_Format(PyExc_ValueError, "%s: the buffer is not aligned for %zu-byte words", what, size);
        return NULL;
    }
    return p;
}

static PyObject *reduce_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer dst = {0}, src = {0};
    int64_t code, op;
    PyObject *result = NULL;
    if (check_count(nargs, 4, "reduce_into") || as_i64(args[2], &code) || as_i64(args[3], &op) ||
        hold(args[0], &dst, 1, "reduce_into dst") || hold(args[1], &src, 0, "reduce_into src"))
        goto done;
    if (!sc_has_loop(code, op)) {
        PyErr_Format(PyExc_ValueError, "no reduction for wire code %lld and op %lld", (long long)code, (long long)op);
        goto done;
    }
    size_t size = sc_element_size((int)code);
    if (dst.view.len != src.view.len || dst.view.len % size != 0) {
        PyErr_SetString(PyExc_ValueError, "reduce_into: dst and src differ in length");
        goto done;
    }
    if (dst.view.len >= RELEASE_GIL_FROM_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        sc_reduce(dst.view.buf, src.view.buf, dst.view.len / size, (int)code, (int)op);
        Py_END_ALLOW_THREADS
    } else {
        sc_reduce(dst.view.buf, src.view.buf, dst.view.len / size, (int)code, (int)op);
    }
    result = Py_NewRef(Py_None);
done:
    release(&dst);
    release(&src);
    return result;
}

static PyObject *scale_into(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer dst = {0};
    int64_t code, divisor;
    PyObject *result = NULL;
    if (check_count(nargs, 3, "scale_into") || as_i64(args[1], &code) || as_i64(args[2], &divisor) ||
        hold(args[0], &dst, 1, "scale_into dst"))
        goto done;
    size_t size = code >= CODE_F16 && code <= CODE_F64 ? sc_element_size((int)code) : 0;
    if (size == 0 || divisor == 0 || dst.view.len % size != 0) {
        PyErr_Format(PyExc_ValueError, "scale_into needs a float wire code and a divisor, got %lld and %lld",
                     (long long)code, (long long)divisor);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    sc_scale(dst.view.buf, dst.view.len / size, (int)code, divisor);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&dst);
    return result;
}

/* convert(kind, values, out): 0 f16 bits -> f64, 1 bf16 bits -> f64, 2 f64 -> f16 bits, 3 f64 -> bf16 bits. */
static PyObject *convert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer in = {0}, out = {0};
    int64_t kind;
    PyObject *result = NULL;
    if (check_count(nargs, 3, "convert") || as_i64(args[0], &kind) || hold(args[1], &in, 0, "convert values") ||
        hold(args[2], &out, 1, "convert out"))
        goto done;
    size_t in_size = kind < 2 ? 2 : 8, out_size = kind < 2 ? 8 : 2, n = (size_t)in.view.len / in_size;
    if (kind < 0 || kind > 3 || in.view.len % in_size || (size_t)out.view.len != n * out_size) {
        PyErr_SetString(PyExc_ValueError, "convert: unknown kind, or values and out differ in length");
        goto done;
    }
    if (kind == 0)
        sc_f16_to_f64(in.view.buf, out.view.buf, n);
    else if (kind == 1)
        sc_bf16_to_f64(in.view.buf, out.view.buf, n);
    else if (kind == 2)
        sc_f64_to_f16(in.view.buf, out.view.buf, n);
    else
        sc_f64_to_bf16(in.view.buf, out.view.buf, n);
    result = Py_NewRef(Py_None);
done:
    release(&in);
    release(&out);
    return result;
}

static PyObject *load_word(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer mem = {0};
    int64_t index;
    PyObject *result = NULL;
    if (check_count(nargs, 2, "load_word") || as_i64(args[1], &index) || hold(args[0], &mem, 0, "load_word mem"))
        goto done;
    uint64_t *word = item(&mem, index, 8, "load_word");
    if (word)
        result = PyLong_FromUnsignedLongLong(sc_load_acquire(word));
done:
    release(&mem);
    return result;
}

static PyObject *address_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer buf = {0};
    PyObject *result = NULL;
    if (check_count(nargs, 1, "address_of") || hold(args[0], &buf, 0, "address_of buffer"))
        goto done;
    result = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)buf.view.buf);
done:
    release(&buf);
    return result;
}

static PyObject *store_and_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer mem = {0};
    int64_t index, value, sleepers_index;
    PyObject *result = NULL;
    if (check_count(nargs, 4, "store_and_wake") || as_i64(args[1], &index) || as_i64(args[2], &value) ||
        as_i64(args[3], &sleepers_index) || hold(args[0], &mem, 1, "store_and_wake mem"))
        goto done;
    uint64_t *word = item(&mem, index, 8, "store_and_wake word");
    uint32_t *sleepers = word ? item(&mem, sleepers_index, 4, "store_and_wake sleepers") : NULL;
    if (sleepers) {
        sc_store_and_wake(word, (uint64_t)value, sleepers);
        result = Py_NewRef(Py_None);
    }
done:
    release(&mem);
    return result;
}

static PyObject *wait_word(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer mem = {0};
    int64_t index, target, sleepers_index, spin_ns, slice_ns;
    int at_least;
    PyObject *result = NULL;
    if (check_count(nargs, 7, "wait_word") || as_i64(args[1], &index) || as_i64(args[2], &target) ||
        (at_least = PyObject_IsTrue(args[3])) < 0 || as_i64(args[4], &sleepers_index) ||
        as_i64(args[5], &spin_ns) || as_i64(args[6], &slice_ns) || hold(args[0], &mem, 1, "wait_word mem"))
        goto done;
    uint64_t *word = item(&mem, index, 8, "wait_word word");
    uint32_t *sleepers = word ? item(&mem, sleepers_index, 4, "wait_word sleepers") : NULL;
    if (!sleepers)
        goto done;
    bool reached;
    if (spin_ns > 0 || slice_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        reached = sc_wait_word(word, (uint64_t)target, at_least, sleepers, spin_ns, slice_ns);
        Py_END_ALLOW_THREADS
    } else {
        reached = sc_wait_word(word, (uint64_t)target, at_least, sleepers, 0, 0);
    }
    result = Py_NewRef(reached ? Py_True : Py_False);
done:
    release(&mem);
    return result;
}

/* Whether every offset `where` names lies inside mem, with room for an entry of `entry` bytes. */
static int where_fits(const struct board_call *c, size_t entry, Py_ssize_t mem_len) {
    for (int r = 0; r < c->ranks; r++) {
        for (int k = 0; k < 2; k++) {
            int64_t at = c->where[3 * r + k];
            if (at < 0 || at % 8 || at + BOARD_PAYLOAD_AT + (int64_t)entry > mem_len)
                return 0;
        }
        int64_t done = c->where[3 * r + 2];
        if (done < 0 || (done + 1) * 8 > mem_len)
            return 0;
    }
    return 1;
}

enum step_kind { STEP_ALL_REDUCE, STEP_BROADCAST, STEP_ALL_GATHER, STEP_GATHER_OPEN };

/* board_all_reduce's, board_broadcast's, board_all_gather's and board_gather_open's arguments,
   alike but for args[7]: an all-reduce's op, a broadcast's source (the board rank whose payload the
   others copy; past the last, nobody's), none for an all-gather (its later arguments come one place
   earlier). */
static PyObject *board_step(PyObject *const *args, Py_ssize_t nargs, const char *name, enum step_kind kind) {
    held_buffer mem = {0}, data = {0}, header = {0}, where = {0};
    int64_t rank, seq, code, op_or_source = 0, position, spin_ns, slice_ns, done_sleepers;
    PyObject *result = NULL;
    int gathers = kind == STEP_ALL_GATHER || kind == STEP_GATHER_OPEN;
    int late = gathers ? 7 : 8; /* where position and the arguments after it are */
    if (check_count(nargs, late + 4, name) || as_i64(args[4], &rank) || as_i64(args[5], &seq) ||
        as_i64(args[6], &code) || (!gathers && as_i64(args[7], &op_or_source)) ||
        as_i64(args[late], &position) || as_i64(args[late + 1], &spin_ns) || as_i64(args[late + 2], &slice_ns) ||
        as_i64(args[late + 3], &done_sleepers) || hold(args[0], &mem, 1, "board mem") ||
        hold(args[1], &data, kind != STEP_BROADCAST || rank != op_or_source, "board data") ||
        hold(args[2], &header, 0, "board header") || hold(args[3], &where, 0, "board where"))
        goto done;
    int source = kind == STEP_ALL_REDUCE ? BOARD_FOLD_ALL
                 : gathers               ? BOARD_GATHER_ALL
                                         : (int)(op_or_source < INT32_MAX ? op_or_source : INT32_MAX);
    struct board_call call = {
        .mem = mem.view.buf, .where = where.view.buf, .ranks = (int)(where.view.len / (3 * 8)), .rank = (int)rank,
        .data = data.view.buf, .nbytes = (size_t)data.view.len, .header = header.view.buf, .seq = (uint64_t)seq,
        .code = (int)code, .op = kind == STEP_ALL_REDUCE ? (int)op_or_source : 0, .source = source,
        .keeps_reading = kind == STEP_GATHER_OPEN,
    };
    size_t size = sc_element_size(call.code);
    int valid = kind == STEP_BROADCAST ? op_or_source >= 0
                : gathers              ? call.ranks > 0 && call.nbytes % (size_t)call.ranks == 0
                                       : call.nbytes == 0 || (sc_has_loop(code, op_or_source) && call.nbytes % size == 0);
    size_t entry = gathers && call.ranks > 0 ? call.nbytes / (size_t)call.ranks : call.nbytes;
    if (header.view.len != BOARD_HEADER_BYTES || where.view.len % 24 || (uintptr_t)call.where % 8 ||
        rank < 0 || rank >= call.ranks || seq < 0 || position < 0 || position > call.ranks || !valid ||
        !where_fits(&call, entry, mem.view.len) || (uintptr_t)call.mem % 8 ||
        !(call.done_sleepers = item(&mem, done_sleepers, 4, "board done sleepers"))) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s: arguments do not describe a board call", name);
        goto done;
    }
    int64_t status;
    Py_BEGIN_ALLOW_THREADS
    status = sc_board_step(&call, position, spin_ns, slice_ns);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(status);
done:
    release(&mem);
    release(&data);
    release(&header);
    release(&where);
    return result;
}

static PyObject *board_all_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return board_step(args, nargs, "board_all_reduce", STEP_ALL_REDUCE);
}

static PyObject *board_broadcast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return board_step(args, nargs, "board_broadcast", STEP_BROADCAST);
}

static PyObject *board_all_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return board_step(args, nargs, "board_all_gather", STEP_ALL_GATHER);
}

static PyObject *board_gather_open(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return board_step(args, nargs, "board_gather_open", STEP_GATHER_OPEN);
}

static PyObject *read_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer out = {0};
    int64_t pid, address;
    PyObject *result = NULL;
    if (check_count(nargs, 3, "read_peer") || as_i64(args[1], &pid) || as_i64(args[2], &address) ||
        hold(args[0], &out, 1, "read_peer out"))
        goto done;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_read_peer(out.view.buf, pid, (uint64_t)address, (size_t)out.view.len);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(error);
done:
    release(&out);
    return result;
}

/* Whether peers holds whole peer descriptors (struct peer_array), aligned, me is one of them, and
   [lo, hi) lies in own: a range of every rank's array (reduce_from_peers, write_to_peers,
   scale_to_peers). */
static int is_range_of_every_array(const held_buffer *own, const held_buffer *peers, int64_t me, int64_t lo,
                                   int64_t hi) {
    size_t ranks = (size_t)peers->view.len / sizeof(struct peer_array);
    return peers->view.len % sizeof(struct peer_array) == 0 && (uintptr_t)peers->view.buf % 8 == 0 && me >= 0 &&
           (size_t)me < ranks && lo >= 0 && hi >= lo && hi <= own->view.len;
}

/* None, or (rank, errno) of the read of or write into a peer's array that failed. */
static PyObject *peer_copy_result(int error, int failed) {
    return error ? Py_BuildValue("(ii)", failed, error) : Py_NewRef(Py_None);
}

static PyObject *reduce_from_peers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer own = {0}, peers = {0}, scratch = {0};
    int64_t me, lo, hi, code, op, deliver;
    PyObject *result = NULL;
    if (check_count(nargs, 9, "reduce_from_peers") || as_i64(args[2], &me) || as_i64(args[3], &lo) ||
        as_i64(args[4], &hi) || as_i64(args[5], &code) || as_i64(args[6], &op) || as_i64(args[8], &deliver) ||
        hold(args[0], &own, 1, "reduce_from_peers own") || hold(args[1], &peers, 0, "reduce_from_peers peers") ||
        hold(args[7], &scratch, 1, "reduce_from_peers scratch"))
        goto done;
    size_t size = sc_element_size((int)code), ranks = (size_t)peers.view.len / sizeof(struct peer_array);
    size_t piece = size ? (size_t)scratch.view.len / 2 / size * size : 0;
    if (!sc_has_loop(code, op) || !is_range_of_every_array(&own, &peers, me, lo, hi) || lo % size || hi % size ||
        piece == 0 || deliver < 0 || (deliver > 1 && (code < CODE_F16 || code > CODE_F64))) {
        PyErr_SetString(PyExc_ValueError, "reduce_from_peers: arguments do not describe a reduction");
        goto done;
    }
    int failed = -1, error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_reduce_from_peers(own.view.buf, peers.view.buf, (int)ranks, (int)me, (size_t)lo, (size_t)hi,
                                 (int)code, (int)op, deliver, scratch.view.buf, piece, &failed);
    Py_END_ALLOW_THREADS
    result = peer_copy_result(error, failed);
done:
    release(&own);
    release(&peers);
    release(&scratch);
    return result;
}

static PyObject *write_to_peers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer own = {0}, peers = {0};
    int64_t me, lo, hi;
    PyObject *result = NULL;
    if (check_count(nargs, 5, "write_to_peers") || as_i64(args[2], &me) || as_i64(args[3], &lo) ||
        as_i64(args[4], &hi) || hold(args[0], &own, 0, "write_to_peers own") ||
        hold(args[1], &peers, 0, "write_to_peers peers"))
        goto done;
    size_t ranks = (size_t)peers.view.len / sizeof(struct peer_array);
    if (!is_range_of_every_array(&own, &peers, me, lo, hi)) {
        PyErr_SetString(PyExc_ValueError, "write_to_peers: arguments do not describe a range of every array");
        goto done;
    }
    int failed = -1, error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_write_to_peers(own.view.buf, peers.view.buf, (int)ranks, (int)me, (size_t)lo, (size_t)hi, &failed);
    Py_END_ALLOW_THREADS
    result = peer_copy_result(error, failed);
done:
    release(&own);
    release(&peers);
    return result;
}

/* Bytes a scale_to_peers divides and writes at a time: with the peers' lines, it stays in cache. */
enum { SCALE_PIECE_BYTES = 128 * 1024 };

static PyObject *scale_to_peers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer own = {0}, peers = {0};
    int64_t me, lo, hi, code, divisor;
    PyObject *result = NULL;
    if (check_count(nargs, 7, "scale_to_peers") || as_i64(args[2], &me) || as_i64(args[3], &lo) ||
        as_i64(args[4], &hi) || as_i64(args[5], &code) || as_i64(args[6], &divisor) ||
        hold(args[0], &own, 1, "scale_to_peers own") || hold(args[1], &peers, 0, "scale_to_peers peers"))
        goto done;
    size_t ranks = (size_t)peers.view.len / sizeof(struct peer_array);
    size_t size = code >= 0 && code <= INT32_MAX ? sc_element_size((int)code) : 0;
    if (!is_range_of_every_array(&own, &peers, me, lo, hi) || !size || lo % (int64_t)size ||
        (hi - lo) % (int64_t)size || divisor < 1 || !sc_has_loop((int)code, OP_AVG)) {
        PyErr_SetString(PyExc_ValueError, "scale_to_peers: arguments do not describe a range of every array");
        goto done;
    }
    int failed = -1, error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_scale_to_peers(own.view.buf, peers.view.buf, (int)ranks, (int)me, (size_t)lo, (size_t)hi, (int)code,
                              divisor, SCALE_PIECE_BYTES / size * size, &failed);
    Py_END_ALLOW_THREADS
    result = peer_copy_result(error, failed);
done:
    release(&own);
    release(&peers);
    return result;
}

/* n ints of a sequence (a tuple of fds or ranks) into out[SWAP_MAX_STEPS]; -1 with an error set. */
static int int_row(PyObject *seq, int64_t *out, Py_ssize_t *n, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast)
        return -1;
    int failed = 0;
    *n = PySequence_Fast_GET_SIZE(fast);
    if (*n > SWAP_MAX_STEPS) {
        PyErr_Format(PyExc_ValueError, "%s: more than %d steps", what, SWAP_MAX_STEPS);
        failed = -1;
    }
    for (Py_ssize_t i = 0; !failed && i < *n; ++i)
        failed = as_i64(PySequence_Fast_GET_ITEM(fast, i), &out[i]);
    Py_DECREF(fast);
    return failed;
}

/* A step's way (swap.h): a kind, and empty frames only where that kind sends or receives one
   without folding, of a 1-D array's call (an empty frame's header is that of an array of none). */
static int way_is_valid(uint8_t way, const uint8_t *header, size_t header_bytes) {
    int kind = way & WAY_KIND_MASK, flags = way & ~WAY_KIND_MASK;
    if (kind >= WAY_COUNT || (flags & ~(WAY_OURS_EMPTY | WAY_THEIRS_EMPTY)))
        return 0;
    if (!flags)
        return 1;
    int sends = kind == WAY_SWAP || kind == WAY_GIVE, receives = kind == WAY_SWAP || kind == WAY_TAKE;
    return header_bytes >= SWAP_DIM0_AT + 8 && header[SWAP_NDIM_AT] == 1 && (sends || !(flags & WAY_OURS_EMPTY)) &&
           (receives || !(flags & WAY_THEIRS_EMPTY));
}

/* Whether a row's ways place anything into `into`: a root's broadcast only sends (and meets), so
   its array may be read-only. */
static int row_writes(const uint8_t *ways, Py_ssize_t steps) {
    for (Py_ssize_t i = 0; i < steps; ++i)
        if ((ways[i] & WAY_KIND_MASK) != WAY_GIVE && !(ways[i] & WAY_THEIRS_EMPTY))
            return 1;
    return 0;
}

/* Whether a row's ways fold a peer's array into data (else its bytes are only copied, of any
   dtype: a broadcast's). */
static int row_folds(const uint8_t *ways, Py_ssize_t steps) {
    for (Py_ssize_t i = 0; i < steps; ++i) {
        int kind = ways[i] & WAY_KIND_MASK;
        if (kind == WAY_THEIRS_FIRST || kind == WAY_OWN_FIRST || kind == WAY_FOLD_IN)
            return 1;
    }
    return 0;
}

static PyObject *swap_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer ways = {0}, header = {0}, data = {0}, into = {0}, inbound = {0};
    int64_t fd_list[SWAP_MAX_STEPS], src_list[SWAP_MAX_STEPS];
    int64_t tag, seq, code, op, spin_ns, wait_ns, left_ns;
    Py_ssize_t steps = 0, srcs = 0;
    PyObject *result = NULL;
    if (check_count(nargs, 14, "swap_row") || int_row(args[0], fd_list, &steps, "swap_row fds") ||
        int_row(args[1], src_list, &srcs, "swap_row srcs") || hold(args[2], &ways, 0, "swap_row ways") ||
        as_i64(args[4], &tag) || as_i64(args[5], &seq) || as_i64(args[9], &code) || as_i64(args[10], &op) ||
        as_i64(args[11], &spin_ns) || as_i64(args[12], &wait_ns) || as_i64(args[13], &left_ns) ||
        hold(args[3], &header, 0, "swap_row header") ||
        hold(args[6], &data, row_folds(ways.view.buf, ways.view.len), "swap_row data") ||
        hold(args[7], &into, row_writes(ways.view.buf, ways.view.len), "swap_row into") ||
        hold(args[8], &inbound, 1, "swap_row inbound"))
        goto done;
    size_t size = sc_element_size((int)code);
    int fds[SWAP_MAX_STEPS];
    uint32_t peers[SWAP_MAX_STEPS];
    const uint8_t *way = ways.view.buf;
    int valid = steps == srcs && ways.view.len == steps &&
                into.view.len == data.view.len &&
                (data.view.len == 0 || !row_folds(way, steps) ||
                 (sc_has_loop(code, op) && data.view.len % size == 0 && into.view.buf == data.view.buf)) &&
                header.view.len >= SWAP_SEQ_AT + 8 && header.view.len <= MAX_HEADER_BYTES && tag >= 0 &&
                tag <= UINT32_MAX && seq >= 0 &&
                inbound.view.len == header.view.len + data.view.len && spin_ns >= 0 && wait_ns >= 0 && left_ns >= 0;
    for (Py_ssize_t i = 0; valid && i < steps; ++i) {
        valid = fd_list[i] >= 0 && fd_list[i] <= INT32_MAX && src_list[i] >= 0 && src_list[i] <= UINT32_MAX &&
                way_is_valid(way[i], header.view.buf, (size_t)header.view.len);
        fds[i] = (int)fd_list[i];
        peers[i] = (uint32_t)src_list[i];
    }
    if (!valid) {
        PyErr_SetString(PyExc_ValueError, "swap_row: arguments do not describe exchanges");
        goto done;
    }
    size_t sent = 0;
    int status, finished;
    Py_BEGIN_ALLOW_THREADS
    status = sc_swap_row(fds, peers, (int)steps, way, header.view.buf, (size_t)header.view.len,
                         (uint32_t)tag, (uint64_t)seq, data.view.buf, into.view.buf, (size_t)data.view.len,
                         inbound.view.buf, (int)code, (int)op, spin_ns, wait_ns, left_ns, &finished, &sent);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(iin)", status, finished, (Py_ssize_t)sent);
done:
    release(&ways);
    release(&header);
    release(&data);
    release(&into);
    release(&inbound);
    return result;
}

/* Whether a duplex's arguments describe one: frames within their buffers, a loop for the fold, and
   progress a previous call could have left. */
static int duplex_is_valid(const struct duplex_out *out, const struct duplex_in *in, const struct duplex_progress *p,
                           int64_t spin_ns, int64_t wait_ns) {
    size_t size = sc_element_size(in->code);
    int folds = in->op >= 0;
    if (out->fd < 0 || in->fd < 0 || out->header_bytes == 0 || in->header_bytes == 0 || out->lead_bytes == 0 ||
        in->header_bytes > MAX_HEADER_BYTES || spin_ns < 0 || wait_ns < 0)
        return 0;
    if (folds && (!sc_has_loop(in->code, in->op) || in->nbytes % size || in->scratch_bytes < size))
        return 0;
    return p->sent >= 0 && (size_t)p->sent <= out->header_bytes + out->nbytes && p->got >= 0 &&
           (size_t)p->got <= in->nbytes && p->pending >= 0 && p->pending <= p->got &&
           (size_t)p->pending <= (folds ? in->scratch_bytes : 0) && p->in_state >= IN_WAITING &&
           p->in_state <= IN_ELSEWHERE && p->beats >= 0;
}

static PyObject *duplex(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer header = {0}, data = {0}, expect = {0}, beat = {0}, into = {0}, scratch = {0}, progress = {0};
    int64_t out_fd, in_fd, code, op, spin_ns, wait_ns, lead_bytes;
    PyObject *result = NULL;
    if (check_count(nargs, 14, "duplex") || as_i64(args[0], &out_fd) || as_i64(args[3], &in_fd) ||
        as_i64(args[8], &code) || as_i64(args[9], &op) || as_i64(args[10], &spin_ns) || as_i64(args[11], &wait_ns) ||
        as_i64(args[13], &lead_bytes) ||
        hold(args[1], &header, 0, "duplex header") || hold(args[2], &data, 0, "duplex data") ||
        hold(args[4], &expect, 0, "duplex expect") || hold(args[5], &beat, 0, "duplex beat") ||
        hold(args[6], &into, 1, "duplex into") || hold(args[7], &scratch, 1, "duplex scratch") ||
        hold(args[12], &progress, 1, "duplex progress"))
        goto done;
    struct duplex_out out = {(int)out_fd, header.view.buf, (size_t)header.view.len, data.view.buf,
                             (size_t)data.view.len, lead_bytes > 0 ? (size_t)lead_bytes : 0};
    struct duplex_in in = {(int)in_fd, expect.view.buf, beat.view.buf, (size_t)expect.view.len, into.view.buf,
                           (size_t)into.view.len, scratch.view.buf, (size_t)scratch.view.len, (int)code,
                           op < 0 ? -1 : (int)op, 0};
    struct duplex_progress *p = progress.view.buf;
    if (progress.view.len != sizeof *p || (uintptr_t)p % 8 || beat.view.len != expect.view.len ||
        !duplex_is_valid(&out, &in, p, spin_ns, wait_ns)) {
        PyErr_SetString(PyExc_ValueError, "duplex: arguments do not describe a frame each way");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = sc_duplex(&out, &in, NULL, p, spin_ns, wait_ns);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(status);
done:
    release(&header);
    release(&data);
    release(&expect);
    release(&beat);
    release(&into);
    release(&scratch);
    release(&progress);
    return result;
}

/* Whether a row's steps lie within data (their ranges) and describe duplexes: valid fds, a lead,
   counts of elements, and for the folds a loop, whole elements and a scratch of one at least. */
static int row_steps_are_valid(const struct duplex_step *steps, Py_ssize_t count, size_t data_bytes,
                               size_t scratch_bytes, int64_t code, int64_t op) {
    for (Py_ssize_t i = 0; i < count; ++i) {
        const struct duplex_step *k = &steps[i];
        if (k->out_fd < 0 || k->out_fd > INT32_MAX || k->in_fd < 0 || k->in_fd > INT32_MAX || k->src < 0 ||
            k->src > UINT32_MAX || k->lead_bytes <= 0 || k->out_at < 0 || k->out_bytes < 0 || k->in_at < 0 ||
            k->in_bytes < 0 || k->out_count < 0 || k->in_count < 0 ||
            (uint64_t)k->out_at + (uint64_t)k->out_bytes > data_bytes ||
            (uint64_t)k->in_at + (uint64_t)k->in_bytes > data_bytes)
            return 0;
        if (k->folds && !(sc_has_loop((int)code, (int)op) && k->in_bytes % sc_element_size((int)code) == 0 &&
                          scratch_bytes >= sc_element_size((int)code)))
            return 0;
    }
    return 1;
}

/* The buffers a host range holds: own, peers, scratch and words. */
enum { HOST_BUFFERS = 4 };

/* A duplex_row's host range from its Python tuple (own, peers, scratch, words, me, lo, hi, piece,
   delivers), holding its buffers in held: 0, or -1 with an error set where the tuple does not
   describe a range of own that holds the row's data (NULL: none), folded with (code, op). */
static int hold_host_range(PyObject *arg, struct host_range *h, held_buffer held[HOST_BUFFERS],
                           const held_buffer *data, int64_t code, int64_t op) {
    int64_t me, lo, hi, piece, delivers;
    if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 9) {
        PyErr_SetString(PyExc_ValueError, "duplex_row: a host range is a tuple of 9");
        return -1;
    }
    PyObject *const *items = &PyTuple_GET_ITEM(arg, 0);
    if (hold(items[0], &held[0], 1, "host range own") || hold(items[1], &held[1], 0, "host range peers") ||
        hold(items[2], &held[2], 1, "host range scratch") || hold(items[3], &held[3], 1, "host range words") ||
        as_i64(items[4], &me) || as_i64(items[5], &lo) || as_i64(items[6], &hi) || as_i64(items[7], &piece) ||
        as_i64(items[8], &delivers))
        return -1;
    uint8_t *own = held[0].view.buf, *at = data ? data->view.buf : own + lo;
    Py_ssize_t len = data ? data->view.len : 0;
    size_t ranks = (size_t)held[1].view.len / sizeof(struct peer_array), size = sc_element_size((int)code);
    size_t pieces = piece > 0 && hi >= lo ? (size_t)((hi - lo + piece - 1) / piece) : 0;
    int valid = piece > 0 && lo >= 0 && hi >= lo && hi <= held[0].view.len && sc_has_loop((int)code, (int)op) &&
                piece % size == 0 && (hi - lo) % size == 0 &&
                held[1].view.len % sizeof(struct peer_array) == 0 && (uintptr_t)held[1].view.buf % 8 == 0 &&
                me >= 0 && (size_t)me < ranks && ranks <= INT32_MAX && held[2].view.len >= 2 * piece &&
                (uintptr_t)held[3].view.buf % 8 == 0 && (size_t)held[3].view.len >= (HOST_FOLDED + pieces) * 8 &&
                at >= own + lo && at + len <= own + hi && (size_t)(at - own - lo) % size == 0;
    if (!valid) {
        PyErr_SetString(PyExc_ValueError, "duplex_row: the host range does not hold the row's data");
        return -1;
    }
    *h = (struct host_range){own, held[1].view.buf, (int)ranks, (int)me, (int)code, (int)op, delivers != 0,
                             (size_t)lo, (size_t)hi, (size_t)piece, held[2].view.buf, held[3].view.buf};
    return 0;
}

static PyObject *duplex_row(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer steps = {0}, at = {0}, header = {0}, beats = {0}, data = {0}, scratch = {0}, progress = {0};
    int64_t tag, seq, code, op, spin_ns, wait_ns;
    PyObject *result = NULL;
    held_buffer host_held[HOST_BUFFERS] = {{{0}, 0}};
    struct host_range host_range, *host = NULL;
    if (check_count(nargs, 14, "duplex_row") || as_i64(args[4], &tag) || as_i64(args[5], &seq) ||
        as_i64(args[8], &code) || as_i64(args[9], &op) || as_i64(args[10], &spin_ns) || as_i64(args[11], &wait_ns) ||
        hold(args[0], &steps, 0, "duplex_row steps") || hold(args[1], &at, 1, "duplex_row at") ||
        hold(args[2], &header, 0, "duplex_row header") || hold(args[3], &beats, 0, "duplex_row beats") ||
        hold(args[6], &data, 1, "duplex_row data") || hold(args[7], &scratch, 1, "duplex_row scratch") ||
        hold(args[12], &progress, 1, "duplex_row progress"))
        goto done;
    if (args[13] != Py_None) {
        if (hold_host_range(args[13], &host_range, host_held, &data, code, op))
            goto done;
        host = &host_range;
    }
    Py_ssize_t count = steps.view.len / (Py_ssize_t)sizeof(struct duplex_step);
    struct duplex_step *row = steps.view.buf;
    int64_t *next = at.view.buf;
    struct duplex_progress *p = progress.view.buf;
    size_t header_bytes = (size_t)header.view.len;
    int valid = steps.view.len % (Py_ssize_t)sizeof(struct duplex_step) == 0 && (uintptr_t)row % 8 == 0 &&
                count <= INT32_MAX && at.view.len == sizeof *next && (uintptr_t)next % 8 == 0 && *next >= 0 &&
                *next <= count && header_bytes >= SWAP_DIM0_AT + 8 && header_bytes <= MAX_HEADER_BYTES &&
                header.view.len && ((const uint8_t *)header.view.buf)[SWAP_NDIM_AT] == 1 &&
                beats.view.len == count * header.view.len && tag >= 0 && tag <= UINT32_MAX && seq >= 0 &&
                progress.view.len == sizeof *p && (uintptr_t)p % 8 == 0 &&
                row_steps_are_valid(row, count, (size_t)data.view.len, (size_t)scratch.view.len, code, op);
    if (valid && *next < count) {
        const struct duplex_step *k = &row[*next];
        struct duplex_out out = {(int)k->out_fd, header.view.buf, header_bytes, data.view.buf, (size_t)k->out_bytes,
                                 (size_t)k->lead_bytes};
        struct duplex_in in = {(int)k->in_fd, header.view.buf, beats.view.buf, header_bytes, data.view.buf,
                               (size_t)k->in_bytes, scratch.view.buf, (size_t)scratch.view.len, (int)code,
                               k->folds ? (int)op : -1, (int)k->final};
        valid = duplex_is_valid(&out, &in, p, spin_ns, wait_ns);
    }
    if (!valid) {
        PyErr_SetString(PyExc_ValueError, "duplex_row: arguments do not describe a row of duplexes");
        goto done;
    }
    int status, step = (int)*next;
    Py_BEGIN_ALLOW_THREADS
    status = sc_duplex_row(row, (int)count, &step, header.view.buf, header_bytes, beats.view.buf, (uint32_t)tag,
                           (uint64_t)seq, data.view.buf, scratch.view.buf, (size_t)scratch.view.len, (int)code,
                           (int)op, host, p, spin_ns, wait_ns);
    Py_END_ALLOW_THREADS
    *next = step;
    result = PyLong_FromLong(status);
done:
    release(&steps);
    release(&at);
    release(&header);
    release(&beats);
    release(&data);
    release(&scratch);
    release(&progress);
    for (int i = 0; i < HOST_BUFFERS; i++)
        release(&host_held[i]);
    return result;
}

static PyObject *host_range_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    held_buffer held[HOST_BUFFERS] = {{{0}, 0}};
    struct host_range host;
    int64_t code, op;
    PyObject *result = NULL;
    if (check_count(nargs, 3, "host_range_fold") || as_i64(args[1], &code) || as_i64(args[2], &op) ||
        hold_host_range(args[0], &host, held, NULL, code, op))
        goto done;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_host_range_ready(&host, host.own + host.lo, host.own + host.hi);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(error);
done:
    for (int i = 0; i < HOST_BUFFERS; i++)
        release(&held[i]);
    return result;
}

static PyObject *collapse_to_huge_pages(PyObject *self, PyObject *arg) {
    held_buffer mem = {0};
    if (hold(arg, &mem, 0, "collapse_to_huge_pages"))
        return NULL;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = sc_collapse_to_huge_pages(mem.view.buf, (size_t)mem.view.len);
    Py_END_ALLOW_THREADS
    release(&mem);
    return PyLong_FromLong(error);
}

static PyObject *use_cpu_specific_loops(PyObject *self, PyObject *arg) {
    int use = PyObject_IsTrue(arg);
    if (use < 0)
        return NULL;
    return PyBool_FromLong(sc_use_cpu_specific_loops(use));
}

static PyMethodDef methods[] = {
    {"reduce_into", (PyCFunction)(void (*)(void))reduce_into, METH_FASTCALL, "reduce_into(dst, src, code, op)"},
    {"scale_into", (PyCFunction)(void (*)(void))scale_into, METH_FASTCALL, "scale_into(dst, code, divisor)"},
    {"convert", (PyCFunction)(void (*)(void))convert, METH_FASTCALL, "convert(kind, values, out)"},
    {"load_word", (PyCFunction)(void (*)(void))load_word, METH_FASTCALL, "load_word(mem, word)"},
    {"store_and_wake", (PyCFunction)(void (*)(void))store_and_wake, METH_FASTCALL,
     "store_and_wake(mem, word, value, sleepers)"},
    {"wait_word", (PyCFunction)(void (*)(void))wait_word, METH_FASTCALL,
     "wait_word(mem, word, target, at_least, sleepers, spin_ns, slice_ns) -> reached"},
    {"board_all_reduce", (PyCFunction)(void (*)(void))board_all_reduce, METH_FASTCALL,
     "board_all_reduce(mem, data, header, where, rank, seq, code, op, position, spin_ns, slice_ns, done_sleepers)"},
    {"board_broadcast", (PyCFunction)(void (*)(void))board_broadcast, METH_FASTCALL,
     "board_broadcast(mem, data, header, where, rank, seq, code, source, position, spin_ns, slice_ns, "
     "done_sleepers)"},
    {"board_all_gather", (PyCFunction)(void (*)(void))board_all_gather, METH_FASTCALL,
     "board_all_gather(mem, out, header, where, rank, seq, code, position, spin_ns, slice_ns, done_sleepers)"},
    {"board_gather_open", (PyCFunction)(void (*)(void))board_gather_open, METH_FASTCALL,
     "board_gather_open(mem, out, header, where, rank, seq, code, position, spin_ns, slice_ns, done_sleepers): "
     "board_all_gather, this rank's reading not marked done"},
    {"address_of", (PyCFunction)(void (*)(void))address_of, METH_FASTCALL,
     "address_of(buffer) -> the address of a contiguous buffer's first byte in this process"},
    {"read_peer", (PyCFunction)(void (*)(void))read_peer, METH_FASTCALL,
     "read_peer(out, pid, address) -> 0, or the errno of the failed read: len(out) bytes of process pid's "
     "memory at address"},
    {"write_to_peers", (PyCFunction)(void (*)(void))write_to_peers, METH_FASTCALL,
     "write_to_peers(own, peers, me, lo, hi) -> None, or (rank, errno) of the failed write: own[lo:hi] into "
     "every other rank's array at the same bytes"},
    {"scale_to_peers", (PyCFunction)(void (*)(void))scale_to_peers, METH_FASTCALL,
     "scale_to_peers(own, peers, me, lo, hi, code, divisor) -> None, or (rank, errno) of the failed write: "
     "write_to_peers with each piece of own[lo:hi] divided by divisor first"},
    {"reduce_from_peers", (PyCFunction)(void (*)(void))reduce_from_peers, METH_FASTCALL,
     "reduce_from_peers(own, peers, me, lo, hi, code, op, scratch, deliver) -> None, or (rank, errno) of the "
     "failed read or write: bytes [lo, hi) of every rank's array (peers: each rank's descriptor, pid and "
     "address first) folded in rank order into own; deliver 0 keeps the result there, d >= 1 also divides "
     "each piece by d (where d > 1) and writes it into every peer's array"},
    {"swap_row", (PyCFunction)(void (*)(void))swap_row, METH_FASTCALL,
     "swap_row(fds, srcs, ways, header, tag, seq, data, into, inbound, code, op, spin_ns, wait_ns, left_ns) -> "
     "(status, done, sent): pairwise steps with TCP peers in a row (native/swap.h), ways[i] step i's WAY_*"},
    {"host_range_fold", (PyCFunction)(void (*)(void))host_range_fold, METH_FASTCALL,
     "host_range_fold(host, code, op) -> 0, or the errno of the failed read (the words say whose): every piece of "
     "a host range (duplex_row's) not folded yet folded out of the host peers' arrays"},
    {"duplex_row", (PyCFunction)(void (*)(void))duplex_row, METH_FASTCALL,
     "duplex_row(steps, at, header, beats, tag, seq, data, scratch, code, op, spin_ns, wait_ns, progress, host) -> "
     "status: duplexes in a row from step at[0] on (native/duplex.h), at[0] advanced past each whole step"},
    {"duplex", (PyCFunction)(void (*)(void))duplex, METH_FASTCALL,
     "duplex(out_fd, header, data, in_fd, expect, beat, into, scratch, code, op, spin_ns, wait_ns, progress, "
     "lead_bytes) -> status: one frame out while one comes in (native/duplex.h); op < 0 copies; progress: "
     "int64[5], kept between calls"},
    {"collapse_to_huge_pages", collapse_to_huge_pages, METH_O,
     "collapse_to_huge_pages(buffer) -> 0, or the errno: back the whole huge pages inside the buffer with huge "
     "pages now (MADV_COLLAPSE)"},
    {"use_cpu_specific_loops", use_cpu_specific_loops, METH_O,
     "use_cpu_specific_loops(use) -> whether in use: this CPU's faster 16-bit loops (the default), or the "
     "portable ones, which give the same bits (for tests and benchmarks)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "shmcoll._native", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    sc_use_cpu_specific_loops(1);
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "BOARD_DONE", BOARD_DONE) < 0 ||
              PyModule_AddIntConstant(m, "SWAP_DONE", SWAP_DONE) < 0 ||
              PyModule_AddIntConstant(m, "WAY_THEIRS_FIRST", WAY_THEIRS_FIRST) < 0 ||
              PyModule_AddIntConstant(m, "WAY_OWN_FIRST", WAY_OWN_FIRST) < 0 ||
              PyModule_AddIntConstant(m, "WAY_GIVE", WAY_GIVE) < 0 ||
              PyModule_AddIntConstant(m, "WAY_TAKE", WAY_TAKE) < 0 ||
              PyModule_AddIntConstant(m, "WAY_FOLD_IN", WAY_FOLD_IN) < 0 ||
              PyModule_AddIntConstant(m, "WAY_SWAP", WAY_SWAP) < 0 ||
              PyModule_AddIntConstant(m, "WAY_OURS_EMPTY", WAY_OURS_EMPTY) < 0 ||
              PyModule_AddIntConstant(m, "WAY_THEIRS_EMPTY", WAY_THEIRS_EMPTY) < 0 ||
              PyModule_AddIntConstant(m, "SWAP_SENT", SWAP_SENT) < 0 ||
              PyModule_AddIntConstant(m, "SWAP_PARTIAL", SWAP_PARTIAL) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_DONE", DUPLEX_DONE) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_STEP_WORDS", DUPLEX_STEP_WORDS) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_PENDING", DUPLEX_PENDING) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_ENDED", DUPLEX_ENDED) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_ELSEWHERE", DUPLEX_ELSEWHERE) < 0 ||
              PyModule_AddIntConstant(m, "DUPLEX_HOST_FAILED", DUPLEX_HOST_FAILED) < 0 ||
              PyModule_AddIntConstant(m, "HOST_DELIVERED", HOST_DELIVERED) < 0 ||
              PyModule_AddIntConstant(m, "HOST_ERROR", HOST_ERROR) < 0 ||
              PyModule_AddIntConstant(m, "HOST_FAILED", HOST_FAILED) < 0 ||
              PyModule_AddIntConstant(m, "HOST_FOLDED", HOST_FOLDED) < 0 ||
              PyModule_AddIntConstant(m, "PEER_BYTES", sizeof(struct peer_array)) < 0 ||
              PyModule_AddIntConstant(m, "IN_WAITING", IN_WAITING) < 0 ||
              PyModule_AddIntConstant(m, "IN_BODY", IN_BODY) < 0 ||
              PyModule_AddIntConstant(m, "IN_DONE", IN_DONE) < 0 ||
              PyModule_AddIntConstant(m, "IN_ELSEWHERE", IN_ELSEWHERE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
