"""shmcoll-bench's rows for all_gather_v and the pickled-object collectives (broadcast_object,
all_gather_object): their per-rank lengths, payloads, timed calls and checks.

Kept apart from bench_core.py because none of them fits its one-buffer-per-rank mould: all_gather_v
gives every rank a different length, and the object collectives move a Python `bytes` object
(pickled by the library) rather than a typed array.

all_gather_v: a size is the total output, as for all_gather (n * (size / n / itemsize) elements,
at least one per rank). Rank r contributes 1 element plus a share of the rest weighted r + 1
(v_lengths), so every rank's length differs once there is more than one element each, rank n-1
sending about n times as much as rank 0, and the lengths sum exactly to the reported count.

Objects: the payload is a `bytes` object; --dtype is ignored (the type column says "bytes"). For
broadcast_object a size is the root's payload; for all_gather_object the total of all ranks'
payloads (each rank sends size / n bytes, at least one), as for all_gather.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

VARIED = ("all_gather_v",)
OBJECTS = ("broadcast_object", "all_gather_object")
NEWEST = VARIED + OBJECTS
OBJECT_TYPE = "bytes"  # the type column of the object rows


def v_lengths(total: int, n: int) -> list[int]:
    """Every rank's all_gather_v length: 1 + a share of total - n weighted r + 1 (exact integer
    cumulative bounds, so they sum to `total`); deterministic, so every rank and the check agree."""
    extra, weight = max(0, total - n), n * (n + 1)
    bounds = [extra * r * (r + 1) // weight for r in range(n + 1)]
    return [1 + bounds[r + 1] - bounds[r] for r in range(n)]


def payload(rank: int, nbytes: int) -> bytes:
    """Rank `rank`'s check object: bytes that differ between ranks and along the payload."""
    return ((np.arange(nbytes, dtype=np.int64) * 3 + rank * 7) % 251).astype(np.uint8).tobytes()


def group_calls(pg, collective: str, bufs: list[np.ndarray], root: int) -> list[Callable]:
    """shmcoll's calls, one per buffer; an object is built from each (uint8) buffer beforehand, so the
    timed loop pays pickling and unpickling (the library's work) but not building the payload."""
    if collective == "all_gather_v":
        return [lambda b=b: pg.all_gather_v(b) for b in bufs]
    objs = [b.tobytes() for b in bufs]
    if collective == "broadcast_object":
        sent = objs if pg.rank == root else [None] * len(objs)  # non-roots pass nothing
        return [lambda o=o: pg.broadcast_object(root, o) for o in sent]
    return [lambda o=o: pg.all_gather_object(o) for o in objs]


def bytes_wrong(got, want: bytes) -> int:
    """Bytes of `got` that differ from `want`, plus the length difference; a non-bytes result: all wrong."""
    if not isinstance(got, bytes):
        return max(1, len(want))
    k = min(len(got), len(want))
    a, b = np.frombuffer(got, np.uint8, k), np.frombuffer(want, np.uint8, k)
    return int(np.count_nonzero(a != b)) + abs(len(got) - len(want))


def check(pg, collective: str, buf: np.ndarray, count: int, root: int) -> int:
    """One call on known inputs; wrong elements (or bytes) on this rank. `buf` is this rank's input
    (its all_gather_v length, or its payload's size in bytes); `count` the reported total."""
    n, rank = pg.world_size, pg.rank
    if collective == "all_gather_v":
        return _check_v(pg, buf, count)
    if collective == "broadcast_object":
        got = pg.broadcast_object(root, payload(root, len(buf)) if rank == root else None)
        return bytes_wrong(got, payload(root, len(buf)))
    got = pg.all_gather_object(payload(rank, len(buf)))
    if not isinstance(got, list) or len(got) != n:
        return max(1, count)
    return sum(bytes_wrong(got[r], payload(r, len(buf))) for r in range(n))


def _check_v(pg, buf: np.ndarray, count: int) -> int:
    """Every rank's segment of the concatenation, and the lengths list, compared exactly."""
    from .bench_core import _count_wrong, _fill, block_values

    n, rank = pg.world_size, pg.rank
    _fill(buf, lambda i: block_values(rank, i))
    out, lengths = pg.all_gather_v(buf)
    want = v_lengths(count, n)
    wrong = sum(int(a != b) for a, b in zip(list(lengths), want)) + abs(len(lengths) - n)
    wrong += abs(len(out) - count)
    bounds = np.cumsum([0, *want]).tolist()
    return wrong + sum(_count_wrong(out[bounds[r]:bounds[r + 1]], lambda i, r=r: block_values(r, i))
                       for r in range(n))
