"""What `shmcoll-bench` reads from its user and feeds its checks: sizes, dtypes, ops, exact inputs and
their references.

Kept free of any collective or library so that every other bench module can use it: the
descriptors (collectives.py) build their check inputs and count wrong elements with these helpers,
the option parser (options.py) parses sizes and dtypes with them.

Check inputs are small integers that every float type holds exactly (bfloat16 included), chosen
so that every partial result is exact too: the float64 reference is therefore exact whatever order
a library reduces in, and any difference is a wrong element. Inputs and references are built in
slices of CHECK_CHUNK elements, so a check of a 64 MiB buffer does not hold a float64 copy of it.

all_gather_v's lengths (v_lengths) and the object payloads (payload) live here too: the check and
the sizing of those collectives both derive from them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator

import numpy as np

from shmcoll.types import ReduceKind

DTYPE_NAMES = {"f16": "half", "bf16": "bfloat16", "f32": "float", "f64": "double"}
OPS = {"sum": ReduceKind.SUM, "prod": ReduceKind.PROD, "min": ReduceKind.MIN, "max": ReduceKind.MAX,
       "avg": ReduceKind.AVG}
CHECK_CHUNK = 1 << 20     # elements per slice when building inputs and references (bounds memory)
BROADCAST_FILL = 77.0     # what non-root ranks hold before a checked broadcast (outside the root's range)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

#: f(i) for an int64 index array i: the float64 value every element at those indices should hold
Values = Callable[[np.ndarray], np.ndarray]


class UsageError(ValueError):
    """A bad command-line value; the CLI turns it into a usage message and exit status 2."""


# ---- sizes and types ----

def parse_size(text: str) -> int:
    """'8' -> 8, '64K' -> 65536, '1M' / '1MB' / '1MiB' -> 1048576 (binary units); at least 1 byte."""
    m = _SIZE_RE.match(text)
    if not m:
        raise UsageError(f"not a size: {text!r} (use bytes, optionally with K, M, G or T, e.g. 64K)")
    value = int(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise UsageError(f"a size must be at least 1 byte, got {text!r}")
    return value


def parse_float32_sizes(text: str) -> list[int]:
    """'8,64K,1M' -> [8, 65536, 1048576]: distinct sizes in increasing order, each rounded down to
    whole float32s (at least one), for benchmarks of float32 buffers."""
    return sorted({max(4, parse_size(part) // 4 * 4) for part in text.split(",") if part.strip()})


def parse_world_sizes(text: str, least: int) -> list[int]:
    """'8,16, 32' -> [8, 16, 32]: comma-separated world sizes, each at least `least`."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < least:
        raise UsageError(f"{text!r}: give world sizes of at least {least} as comma-separated integers, e.g. 2,4")
    return sizes


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


# ---- check inputs and references (float64 values of small integers; `i` is an int64 index array) ----

def reduce_input(op: ReduceKind, rank: int, n: int, i: np.ndarray) -> np.ndarray:
    """Rank `rank`'s input to a checked reduction: integers whose every partial result stays exact."""
    own = (i % n) == rank  # exactly one rank "owns" each index
    if op in (ReduceKind.SUM, ReduceKind.AVG):  # a(i) + (n or 0) - 1: sums to n * a(i), so AVG is exact
        return (i % 5 - 2) + np.where(own, n - 1.0, -1.0)
    if op is ReduceKind.PROD:  # +-1 everywhere but one rank's 2: products stay in {+-1, +-2}
        return np.where(own, 2.0, np.where((i + rank) % 3 == 0, -1.0, 1.0))
    return ((i * 7 + rank * 3) % 11 - 5).astype(np.float64)  # MIN, MAX


def reduce_expected(op: ReduceKind, n: int, i: np.ndarray) -> np.ndarray:
    """The exact reduction of every rank's reduce_input at indices i."""
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
    """Rank `rank`'s block in a checked data movement (gather, scatter, broadcast ...): integers in [-30, 30]."""
    return ((i * 3 + rank * 7) % 61 - 30).astype(np.float64)


def _slices(count: int) -> Iterator[tuple[int, int, np.ndarray]]:
    for start in range(0, count, CHECK_CHUNK):
        stop = min(count, start + CHECK_CHUNK)
        yield start, stop, np.arange(start, stop, dtype=np.int64)


def fill(buf: np.ndarray, values: Values) -> None:
    """buf[i] = values(i), converted to buf's dtype, slice by slice."""
    for start, stop, i in _slices(len(buf)):
        buf[start:stop] = values(i).astype(buf.dtype)


def count_wrong(buf: np.ndarray, expected: Values) -> int:
    """Elements that differ from the float64 reference expected(i) (NaN counts as wrong)."""
    return sum(int(np.count_nonzero(buf[start:stop].astype(np.float64) != expected(i)))
               for start, stop, i in _slices(len(buf)))


def blocks_wrong(out: np.ndarray, bounds: list[int], expected: Callable[[int, np.ndarray], np.ndarray]) -> int:
    """Wrong elements of a concatenation whose block r is out[bounds[r]:bounds[r + 1]] and should hold
    expected(r, i) at its index i."""
    return sum(count_wrong(out[bounds[r]:bounds[r + 1]], functools.partial(expected, r))
               for r in range(len(bounds) - 1))


# ---- all_gather_v and the object payloads ----

def v_lengths(total: int, n: int) -> list[int]:
    """Every rank's all_gather_v length: 1 + a share of total - n weighted r + 1 (exact integer
    cumulative bounds, so they sum to `total`); deterministic, so every rank and the check agree."""
    extra, weight = max(0, total - n), n * (n + 1)
    bounds = [extra * r * (r + 1) // weight for r in range(n + 1)]
    return [1 + bounds[r + 1] - bounds[r] for r in range(n)]


def payload_values(rank: int, i: np.ndarray) -> np.ndarray:
    """The bytes (as float64 values in [0, 250]) at indices i of rank `rank`'s check object."""
    return ((i * 3 + rank * 7) % 251).astype(np.float64)


def payload(rank: int, nbytes: int) -> bytes:
    """Rank `rank`'s check object: bytes that differ between ranks and along the payload."""
    return payload_values(rank, np.arange(nbytes, dtype=np.int64)).astype(np.uint8).tobytes()


def bytes_wrong(got: object, want: bytes) -> int:
    """Bytes of `got` that differ from `want`, plus the length difference; a non-bytes result: all wrong."""
    if not isinstance(got, bytes):
        return max(1, len(want))
    k = min(len(got), len(want))
    a, b = np.frombuffer(got, np.uint8, k), np.frombuffer(want, np.uint8, k)
    return int(np.count_nonzero(a != b)) + abs(len(got) - len(want))
