"""The measuring half of `shmcoll-bench`: sizes, inputs, the timed loop and the correctness check.

No printing and no argument parsing here (bench_cli.py does both), so every rank runs exactly the
same sequence of collectives: any decision that changes how many calls a rank makes (the time cap
on iterations) is taken from values every rank has gathered, never from a rank's own clock alone.

Semantics follow nccl-tests. A size is bytes. For all_gather and gather it is the total output
size, so each rank contributes size / n / itemsize elements (rounded down, at least one); for
reduce_scatter and all_to_all it is each rank's whole input (n blocks of size / n / itemsize
elements), for scatter the root's whole input; the reported size is what really moved (a multiple
of n elements). Bandwidths: algbw = bytes / time; busbw = algbw * factor, with factor 2(n-1)/n for
all_reduce, (n-1)/n for all_gather, reduce_scatter and all_to_all, 1 for broadcast and reduce
(nccl-tests' PERFORMANCE.md); gather and scatter are not defined there: (n-1)/n, as for all_gather
(each rank's own block never crosses the bus). A barrier has none. all_gather_v, broadcast_object
and all_gather_object (bench_objects.py: uneven lengths, pickled bytes objects) count like
all_gather, broadcast and all_gather: factor (n-1)/n, 1 and (n-1)/n.

Check inputs are small integers that every float type holds exactly, chosen so that every partial
result is exact too; the reference is therefore exact whatever order the library reduces in.

`pg` is anything with rank, world_size, all_reduce(buf, op), all_gather(buf) -> array,
broadcast(root, buf) and barrier() (and, for those collectives, reduce_scatter(buf, op) -> array,
reduce(root, buf, op), all_to_all(buf) -> array, gather(root, buf) -> array or None,
scatter(root, buf or None) -> array, all_gather_v(buf) -> (array, lengths), broadcast_object(root,
obj) and all_gather_object(obj) -> list): a shmcoll ProcessGroup, or a peer library's adapter
(bench_peers.py), so OpenMPI and gloo are timed and checked by this very code. An adapter may also
offer bench_calls(collective, bufs, op, root) -> one zero-argument call per buffer, to prepare
what its library needs (tensors, output buffers) outside the timed loop.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from shmcoll.types import ReduceKind

from . import bench_objects
from .bench_buffers import cycle_calls, llc, plan, rotating
from .bench_objects import NEWEST, OBJECT_TYPE, OBJECTS, VARIED, v_lengths

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter", "reduce", "all_to_all",
               "gather", "scatter", "all_gather_v", "broadcast_object", "all_gather_object")
IN_PLACE = {"all_reduce": "yes", "all_gather": "no", "broadcast": "yes", "barrier": "n/a", "reduce_scatter": "no",
            "reduce": "yes", "all_to_all": "no", "gather": "no", "scatter": "no", "all_gather_v": "no",
            "broadcast_object": "no", "all_gather_object": "no"}
REDUCING = ("all_reduce", "reduce_scatter", "reduce")  # the collectives that take --op
ROOTED = ("broadcast", "reduce", "gather", "scatter", "broadcast_object")  # rooted at ROOT
PER_RANK_BLOCKS = ("all_gather", "gather", "all_gather_v", "all_gather_object")  # a size is the whole output
SPLIT_INPUT = ("reduce_scatter", "all_to_all", "scatter")  # a size is one rank's input: n blocks
DTYPE_NAMES = {"f16": "half", "bf16": "bfloat16", "f32": "float", "f64": "double"}
OPS = {"sum": ReduceKind.SUM, "prod": ReduceKind.PROD, "min": ReduceKind.MIN, "max": ReduceKind.MAX,
       "avg": ReduceKind.AVG}
ROOT = 0                  # root of broadcast, reduce, gather and scatter
MIN_CAPPED_ITERS = 3      # the time cap never cuts the timed loop below this many calls
CHECK_CHUNK = 1 << 20     # elements per slice when building inputs and references (bounds memory)
_BROADCAST_FILL = 77.0    # what non-root ranks hold before the check broadcast (outside the root's range)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class UsageError(ValueError):
    """A bad command-line value; the CLI turns it into a usage message and exit status 2."""


def parse_size(text: str) -> int:
    """'8' -> 8, '64K' -> 65536, '1M' / '1MB' / '1MiB' -> 1048576 (binary units); at least 1 byte."""
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"not a size: {text!r} (use bytes, optionally with K, M, G or T, e.g. 64K)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise UsageError(f"a size must be at least 1 byte, got {text!r}")
    return value


def sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """MIN, MIN*f, MIN*f^2, ... while <= MAX (nccl-tests' loop); always strictly increasing."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise UsageError(f"need 1 <= MIN <= MAX, got MIN={min_bytes}, MAX={max_bytes}")
    if not factor > 1:
        raise UsageError(f"the factor must be > 1, got {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = max(size + 1, int(size * factor))
    return sizes


def resolve_dtype(name: str) -> np.dtype:
    """The numpy dtype of a --dtype name; bf16 needs the optional ml_dtypes package."""
    if name == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise UsageError("--dtype bf16 needs the ml_dtypes package: pip install 'shmcoll[bf16]' "
                             "(or pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    table = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
    if name not in table:
        raise UsageError(f"unknown dtype {name!r}; choose from {', '.join(DTYPE_NAMES)}")
    return np.dtype(table[name])


def bus_factor(collective: str, n: int) -> float | None:
    """nccl-tests' busbw / algbw ratio; None for barrier (no bandwidth). gather and scatter are not in
    nccl-tests' PERFORMANCE.md: (n-1)/n, like all_gather (the root's own block does not travel)."""
    share = (n - 1) / n
    return {"all_reduce": 2 * share, "all_gather": share, "broadcast": 1.0, "reduce_scatter": share,
            "reduce": 1.0, "all_to_all": share, "gather": share, "scatter": share, "all_gather_v": share,
            "broadcast_object": 1.0, "all_gather_object": share}.get(collective)


def has_dtype(collective: str) -> bool:
    """Whether --dtype means anything: not for barrier (no data) or the object rows (bytes objects)."""
    return collective != "barrier" and collective not in OBJECTS


def layout(collective: str, size: int, n: int, itemsize: int, rank: int = 0) -> tuple[int, int, int]:
    """(elements in rank `rank`'s input buffer, reported count, reported bytes) for a requested size;
    only all_gather_v's input depends on the rank (bench_objects.v_lengths)."""
    if collective == "barrier":
        return 0, 0, 0
    if collective in VARIED:
        total = max(1, size // (n * itemsize)) * n
        return v_lengths(total, n)[rank], total, total * itemsize
    if collective in PER_RANK_BLOCKS or collective in SPLIT_INPUT:
        per_rank = max(1, size // (n * itemsize))
        elems = per_rank if collective in PER_RANK_BLOCKS else per_rank * n
        return elems, per_rank * n, per_rank * n * itemsize
    count = max(1, size // itemsize)
    return count, count, count * itemsize


@dataclass(frozen=True)
class Spec:
    """One sweep, as every rank sees it."""

    collective: str
    dtype_name: str
    op_name: str
    iters: int
    warmup: int
    check: bool
    max_time: float  # seconds per size that the timed loop aims to stay under; 0: no cap
    cold: bool = False  # rotate through buffers that together exceed the last-level cache

    @property
    def reduces(self) -> bool:
        return self.collective in REDUCING


@dataclass
class Row:
    """One line of the table (wrong is None without --check); to_json adds the job's context."""

    size: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw: float | None  # GB/s (1e9 bytes per second)
    busbw: float | None
    wrong: int | None
    iters: int
    buffers: int = 1  # distinct buffers the timed loop rotated through (1: warm)

    def to_json(self, **context) -> dict:
        return {**asdict(self), **context}


def choose_iters(iters: int, per_call_s: float | None, max_time: float) -> int:
    """The requested count, cut so the timed loop takes about max_time (never below 3 or above iters)."""
    if not max_time or per_call_s is None or per_call_s <= 0 or per_call_s * iters <= max_time:
        return iters
    return min(iters, max(MIN_CAPPED_ITERS, int(max_time / per_call_s)))


# ---- inputs and references (float64 values of small integers; `i` is an int64 index array) ----

def reduce_input(op: ReduceKind, rank: int, n: int, i: np.ndarray) -> np.ndarray:
    """Rank `rank`'s all_reduce check input: integers whose every partial result stays exact."""
    own = (i % n) == rank  # exactly one rank "owns" each index
    if op in (ReduceKind.SUM, ReduceKind.AVG):  # a(i) + (n or 0) - 1: sums to n * a(i), so AVG is exact
        return (i % 5 - 2) + np.where(own, n - 1.0, -1.0)
    if op is ReduceKind.PROD:  # +-1 everywhere but one rank's 2: products stay in {+-1, +-2}
        return np.where(own, 2.0, np.where((i + rank) % 3 == 0, -1.0, 1.0))
    return ((i * 7 + rank * 3) % 11 - 5).astype(np.float64)  # MIN, MAX


def reduce_expected(op: ReduceKind, n: int, i: np.ndarray) -> np.ndarray:
    if op is ReduceKind.SUM:
        return n * (i % 5 - 2).astype(np.float64)
    if op is ReduceKind.AVG:
        return (i % 5 - 2).astype(np.float64)
    fold = {ReduceKind.PROD: np.multiply, ReduceKind.MIN: np.minimum, ReduceKind.MAX: np.maximum}[op]
    acc = reduce_input(op, 0, n, i)
    for r in range(1, n):
        acc = fold(acc, reduce_input(op, r, n, i))
    return acc


def block_values(rank: int, i: np.ndarray) -> np.ndarray:
    """Rank `rank`'s all_gather block, and the broadcast root's data: integers in [-30, 30]."""
    return ((i * 3 + rank * 7) % 61 - 30).astype(np.float64)


def _slices(count: int):
    for start in range(0, count, CHECK_CHUNK):
        stop = min(count, start + CHECK_CHUNK)
        yield start, stop, np.arange(start, stop, dtype=np.int64)


def _fill(buf: np.ndarray, values: Callable[[np.ndarray], np.ndarray]) -> None:
    for start, stop, i in _slices(len(buf)):
        buf[start:stop] = values(i).astype(buf.dtype)


def _count_wrong(buf: np.ndarray, expected: Callable[[np.ndarray], np.ndarray]) -> int:
    """Elements that differ from the float64 reference (NaN counts as wrong)."""
    return sum(int(np.count_nonzero(buf[start:stop].astype(np.float64) != expected(i)))
               for start, stop, i in _slices(len(buf)))


def check_once(pg, spec: Spec, dtype: np.dtype, elems: int, buf: np.ndarray | None = None,
               count: int | None = None) -> int:
    """One more call on known inputs (in `buf` when given, e.g. one of the cold views); wrong elements here.
    `count` (layout()'s reported count) is needed by all_gather_v only: it fixes every rank's length."""
    n, rank, op = pg.world_size, pg.rank, OPS[spec.op_name]
    if spec.collective == "barrier":
        pg.barrier()  # nothing to compare: "correct" means it returned on every rank
        return 0
    buf = np.empty(elems, dtype) if buf is None else buf
    if spec.collective in NEWEST:
        return bench_objects.check(pg, spec.collective, buf, elems * n if count is None else count, ROOT)
    if spec.collective == "all_reduce":
        _fill(buf, lambda i: reduce_input(op, rank, n, i))
        pg.all_reduce(buf, op)
        return _count_wrong(buf, lambda i: reduce_expected(op, n, i))
    if spec.collective == "all_gather":
        _fill(buf, lambda i: block_values(rank, i))
        out = pg.all_gather(buf)
        return sum(_count_wrong(out[r * elems:(r + 1) * elems], lambda i, r=r: block_values(r, i))
                   for r in range(n))
    if spec.collective in ("reduce_scatter", "reduce", "all_to_all", "gather", "scatter"):
        return _check_more(pg, spec.collective, op, buf)
    if rank == ROOT:
        _fill(buf, lambda i: block_values(ROOT, i))
    else:
        buf.fill(_BROADCAST_FILL)
    pg.broadcast(ROOT, buf)
    return _count_wrong(buf, lambda i: block_values(ROOT, i))


def _check_more(pg, collective: str, op: ReduceKind, buf: np.ndarray) -> int:
    """check_once for the collectives added later; `buf` is this rank's input (layout()'s elements)."""
    n, rank = pg.world_size, pg.rank
    if collective == "reduce_scatter":  # rank r gets block r of the reduction
        _fill(buf, lambda i: reduce_input(op, rank, n, i))
        block = len(buf) // n
        out = pg.reduce_scatter(buf, op)
        return _count_wrong(out, lambda i: reduce_expected(op, n, i + rank * block)) + abs(len(out) - block)
    if collective == "reduce":  # only the root's result is defined
        _fill(buf, lambda i: reduce_input(op, rank, n, i))
        pg.reduce(ROOT, buf, op)
        return _count_wrong(buf, lambda i: reduce_expected(op, n, i)) if rank == ROOT else 0
    if collective == "all_to_all":  # block s of the result is block `rank` of source s's input
        _fill(buf, lambda i: block_values(rank, i))
        block = len(buf) // n
        out = pg.all_to_all(buf)
        return sum(_count_wrong(out[s * block:(s + 1) * block], lambda i, s=s: block_values(s, i + rank * block))
                   for s in range(n)) + abs(len(out) - len(buf))
    if collective == "gather":  # the root holds every rank's block in rank order
        _fill(buf, lambda i: block_values(rank, i))
        out = pg.gather(ROOT, buf)
        if rank != ROOT:
            return 0 if out is None else 1
        elems = len(buf)
        return sum(_count_wrong(out[r * elems:(r + 1) * elems], lambda i, r=r: block_values(r, i))
                   for r in range(n)) + abs(len(out) - n * elems)
    # scatter: rank r gets block r of the root's input
    block = len(buf) // n
    if rank == ROOT:
        _fill(buf, lambda i: block_values(ROOT, i))
    # shmcoll's non-roots pass None; a peer adapter (it has bench_calls) takes a buffer of the root's size on
    # every rank, since its library needs the receive size (only the root's contents are read)
    out = pg.scatter(ROOT, buf if rank == ROOT or hasattr(pg, "bench_calls") else None)
    return _count_wrong(out, lambda i: block_values(ROOT, i + rank * block)) + abs(len(out) - block)


# ---- the timed loop ----

def group_calls(pg, collective: str, bufs: list[np.ndarray], op: ReduceKind, root: int) -> list[Callable]:
    """One zero-argument call per buffer, for a group without bench_calls (shmcoll's ProcessGroup)."""
    if collective == "all_reduce":
        return [lambda b=b: pg.all_reduce(b, op) for b in bufs]
    if collective == "all_gather":
        return [lambda b=b: pg.all_gather(b) for b in bufs]
    if collective == "reduce_scatter":
        return [lambda b=b: pg.reduce_scatter(b, op) for b in bufs]
    if collective == "reduce":
        return [lambda b=b: pg.reduce(root, b, op) for b in bufs]
    if collective == "all_to_all":
        return [lambda b=b: pg.all_to_all(b) for b in bufs]
    if collective == "gather":
        return [lambda b=b: pg.gather(root, b) for b in bufs]
    if collective == "scatter":
        return [lambda b=b: pg.scatter(root, b if pg.rank == root else None) for b in bufs]
    if collective in NEWEST:
        return bench_objects.group_calls(pg, collective, bufs, root)
    return [lambda b=b: pg.broadcast(root, b) for b in bufs]


def timed_call(pg, spec: Spec, bufs: list[np.ndarray]) -> Callable[[], object]:
    """A zero-argument call of the collective, on the next of `bufs` each time (buffers of ones:
    stable under PROD/MIN/MAX/AVG)."""
    if spec.collective == "barrier":
        return pg.barrier
    make = getattr(pg, "bench_calls", None)
    if make is None:
        make = lambda *a: group_calls(pg, *a)  # noqa: E731
    return cycle_calls(make(spec.collective, bufs, OPS[spec.op_name], ROOT))


def _max_over_ranks(pg, value: float) -> float:
    return float(pg.all_gather(np.array([value], np.float64)).max())


def measure(pg, spec: Spec, dtype: np.dtype, size: int) -> Row:
    """Warm up, agree on an iteration count, barrier, time the loop, optionally check; one Row.

    The time is each rank's mean over the timed loop, reported as the slowest rank's.
    """
    n = pg.world_size
    if spec.collective in OBJECTS:
        dtype = np.dtype(np.uint8)  # a payload of `size` bytes, built from a byte buffer
    elems, count, nbytes = layout(spec.collective, size, n, dtype.itemsize, pg.rank)
    bufs = [] if spec.collective == "barrier" else \
        rotating(dtype, elems, plan(elems * dtype.itemsize, spec.cold, llc()[0]))
    call = timed_call(pg, spec, bufs)
    fastest = None  # the fastest warmup call: later calls no longer pay compile or first-touch costs
    for _ in range(spec.warmup):
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        fastest = took if fastest is None else min(fastest, took)
    iters = spec.iters
    if spec.max_time and fastest is not None:
        iters = choose_iters(spec.iters, _max_over_ranks(pg, fastest), spec.max_time)
    pg.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    mean = (time.perf_counter() - t0) / iters
    last = bufs[-1] if spec.cold and bufs else None
    wrong = check_once(pg, spec, dtype, elems, last, count) if spec.check else 0
    stats = pg.all_gather(np.array([mean, wrong], np.float64)).reshape(n, 2)
    return make_row(spec, n, count, nbytes, float(stats[:, 0].max()),
                    int(stats[:, 1].sum()) if spec.check else None, iters, max(1, len(bufs)))


def make_row(spec: Spec, n: int, count: int, nbytes: int, seconds: float, wrong: int | None, iters: int,
             buffers: int = 1) -> Row:
    """The table row of one size from the slowest rank's time per call: nccl-tests' algbw and busbw."""
    factor = bus_factor(spec.collective, n)
    algbw = None if factor is None else (nbytes / seconds / 1e9 if seconds > 0 else 0.0)
    return Row(
        size=nbytes, count=count,
        type=DTYPE_NAMES[spec.dtype_name] if has_dtype(spec.collective) else
        "-" if spec.collective == "barrier" else OBJECT_TYPE,
        redop=spec.op_name if spec.reduces else "none",
        time_us=seconds * 1e6, algbw=algbw, busbw=None if algbw is None else algbw * factor,
        wrong=wrong, iters=iters, buffers=buffers,
    )


def transport_name(pg) -> str:
    """A short name for the transport the group really runs on."""
    t = pg.transport
    name = getattr(t, "name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(t).__name__
    known = {"NetTransport": "tcp", "TcpTransport": "tcp", "ShmTransport": "shm",
             "HierarchicalTransport": "hier", "HierTransport": "hier"}
    topology = getattr(t, "topology", None)
    if topology is not None:
        return f"{known.get(cls, cls)} ({topology.describe()})"
    return known.get(cls, cls)
