"""Rooted and personalised collectives: reduce-scatter, reduce, gather, scatter, all-to-all and
all-gather with per-rank lengths, flat (every rank a peer of every other).

Across hosts, reduce-scatter, reduce and all_gather_v have two-level versions (hier_reduce.py,
hier.py). Gather, scatter and all-to-all stay flat over the hierarchical transport's routing: each
of their blocks has one source and one destination, so a direct send already crosses a host
boundary at most once; staging through host leaders would add copies, not save bytes. Only their
agreement step (below) goes through the hierarchy's barrier instead of all pairs.

Mismatch safety. A collective must fail on *every* rank when ranks disagree about the call, never
return on some and hang on none. Symmetric algorithms get that for free: in a ring every rank
hears from its left neighbour, and a rank that stops (mismatch detected) starves everyone
downstream into the abort it broadcasts; in a pairwise exchange every rank hears from every rank.
Rooted ones do not: a gather's senders receive nothing, and two ranks that each believe they are
root wait for each other forever. Those start with `agree`: every rank sends an empty frame to every
other and checks each one it receives, so a rank that passes knows that all ranks made the same
call, and a rank that fails aborts the group for the others.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import CollectiveError, CollectiveMismatch
from ..transport.frame import MAX_NDIM
from ..transport.topology import Topology
from ..types import I64, U8, WIRE_TYPES, ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .hier import hier_all_gather, hier_all_gather_v, hier_barrier
from .ring import ring_all_gather_owned, ring_reduce_scatter_op

_EMPTY = np.empty(0, dtype=np.uint8)
_SIGNAL_CODE = U8.code  # the empty frames of `agree` (valid whatever dtype the call carries)
_INT64_CODE = I64.code


def exchange_all(c: Call, vec: np.ndarray, code: int) -> list[np.ndarray]:
    """Every rank sends `vec` (same size everywhere) to every other rank; returns all, by rank.
    Step k sends to r+k first, so no rank is the target of everyone at once."""
    n, r = c.size, c.rank
    for k in range(1, n):
        c.t.send((r + k) % n, c.tag, vec, code, c.meta, c.deadline)
    got = [vec] * n
    for k in range(1, n):
        src = (r - k) % n
        got[src] = np.empty_like(vec)
        c.t.recv_into(src, c.tag, got[src], code, c.deadline, c.meta)
    return got


def agree(c: Call, topo: Topology | None = None) -> None:
    """Returns only once every rank has been seen making this very call (raises CollectiveMismatch
    otherwise): the rooted algorithms need no further checks or acknowledgements. Across hosts the
    hierarchy's barrier does it (every frame carries the call's description; a rank leaves it only
    after hearing, through the leaders, from every rank) with one message per host pair, not per
    rank pair."""
    if topo is not None:
        hier_barrier(replace(c, code=_SIGNAL_CODE), topo)
    else:
        exchange_all(c, _EMPTY, _SIGNAL_CODE)


def _stream_bounds(c: Call, data: np.ndarray) -> list[tuple[int, int]]:
    """The frames a piece streams in; both ends know its length, so both cut it the same way."""
    return sub_bounds(0, len(data), chunk_count(len(data), data.itemsize, c.chunk_bytes))


def send_stream(c: Call, to: int, data: np.ndarray) -> None:
    """Send a 1-D piece in chunk-sized frames (the receiver cuts its copy the same way)."""
    for a, b in _stream_bounds(c, data):
        c.t.send(to, c.tag, data[a:b], c.code, c.meta, c.deadline)


def recv_stream(c: Call, src: int, out: np.ndarray, op: ReduceKind | None = None) -> None:
    """Receive what send_stream sent into out: copied, or folded in with op (out = out op received)."""
    for a, b in _stream_bounds(c, out):
        c.t.recv_into(src, c.tag, out[a:b], c.code, c.deadline, c.meta, op)


def reduce_scatter(c: Call, work: np.ndarray, out: np.ndarray, op: ReduceKind) -> None:
    """out = op over every rank's block c.rank of `work` (a 1-D scratch copy of the input, n equal
    blocks; it ends holding partial results). Each block is folded once, along the ring, in a fixed
    order, so the result does not depend on timing."""
    block = len(work) // c.size
    ring_reduce_scatter_op(c, work, op, range(c.size), [(i * block, (i + 1) * block) for i in range(c.size)])
    out[:] = work[c.rank * block:(c.rank + 1) * block]


def reduce_to_root(c: Call, root: int, data: np.ndarray, op: ReduceKind) -> None:
    """Ring reduce-scatter (bandwidth-optimal, every rank reduces 1/n), then every rank sends its
    reduced segment to the root. A rank that finished the ring heard, through its neighbours, from
    every rank's matching call, so the final sends need no acknowledgement."""
    if c.size == 1:
        return  # op over one input is the input (AVG divides by 1)
    owned = segment_bounds(len(data), c.size)
    ring_reduce_scatter_op(c, data, op, range(c.size), owned)
    if c.rank != root:
        a, b = owned[c.rank]
        send_stream(c, root, data[a:b])
        return
    for src in range(c.size):
        if src != root:
            a, b = owned[src]
            recv_stream(c, src, data[a:b])


def gather_to_root(c: Call, root: int, local: np.ndarray, out: np.ndarray | None,
                   topo: Topology | None = None) -> None:
    """out (on root only) receives every rank's block in rank order."""
    agree(c, topo)
    if c.rank != root:
        send_stream(c, root, local)
        return
    block = len(local)
    for src in range(c.size):
        piece = out[src * block:(src + 1) * block]
        if src == c.rank:
            piece[...] = local
        else:
            recv_stream(c, src, piece)


def scatter_from_root(c: Call, root: int, blocks: list[np.ndarray] | None, code: int,
                      topo: Topology | None = None) -> np.ndarray:
    """The root sends blocks[j] (an n-d storage array of wire dtype `code`) to rank j: first a
    small frame with its dtype code and shape (the other ranks know neither in advance), then the
    block in chunk-sized frames that land straight in the new array. Returns this rank's block: on
    the root in storage dtype, elsewhere as the wire's user dtype."""
    agree(c, topo)
    if c.rank == root:
        for k in range(1, c.size):
            j = (root + k) % c.size
            head = np.concatenate([[code], shape_header(blocks[j].shape)])
            c.t.send(j, c.tag, head, _INT64_CODE, c.meta, c.deadline)
            send_stream(replace(c, code=code), j, blocks[j].reshape(-1))
        return blocks[root].copy()  # storage dtype: the caller views it as the user's
    head = np.empty(2 + MAX_NDIM, dtype=np.int64)
    c.t.recv_into(root, c.tag, head, _INT64_CODE, c.deadline, c.meta)
    code, shape = _block_description(head, root)
    wire = WIRE_TYPES[code]
    out = np.empty(shape, dtype=wire.user if wire.user is not None else wire.storage)
    recv_stream(replace(c, code=code), root, out.reshape(-1).view(wire.storage))
    return out


def _block_description(head: np.ndarray, root: int) -> tuple[int, tuple[int, ...]]:
    """The dtype code and shape a scatter root announced; a root that announces nonsense broke the
    protocol (its frames passed the job's authentication, so this is a bug, not an attack)."""
    code, ndim = int(head[0]), int(head[1])
    shape = tuple(int(d) for d in head[2:2 + ndim])
    if code not in WIRE_TYPES or not 0 <= ndim <= MAX_NDIM or min(shape, default=0) < 0:
        raise CollectiveError(f"scatter: root {root} announced an invalid block (dtype code {code}, shape {shape})")
    return code, shape


def all_to_all(c: Call, data: np.ndarray, out: np.ndarray) -> None:
    """Pairwise exchange over 1-D storage arrays of n equal blocks: at step k send block r+k to
    rank r+k and receive rank r-k's block r, chunk by chunk in turn, so each chunk is taken
    straight into `out` as it arrives (no rank's send waits on a full channel holding its input).
    Every rank hears from every rank directly."""
    n, r = c.size, c.rank
    block = len(data) // n
    out[r * block:(r + 1) * block] = data[r * block:(r + 1) * block]
    pieces = sub_bounds(0, block, chunk_count(block, data.itemsize, c.chunk_bytes))
    for k in range(1, n):
        to, src = (r + k) % n, (r - k) % n
        for a, b in pieces:
            c.t.send(to, c.tag, data[to * block + a:to * block + b], c.code, c.meta, c.deadline)
            c.t.recv_into(src, c.tag, out[src * block + a:src * block + b], c.code, c.deadline, c.meta)


def shape_header(shape: tuple[int, ...]) -> np.ndarray:
    """[ndim, dim0, dim1, ...] padded to a fixed size: what all_gather_v ranks tell each other."""
    head = np.zeros(1 + MAX_NDIM, dtype=np.int64)
    head[0] = len(shape)
    head[1:1 + len(shape)] = shape
    return head


def exchange_shapes(c: Call, shape: tuple[int, ...], topo: Topology | None = None) -> list[int]:
    """Every rank's length along axis 0; CollectiveMismatch (on every rank, as every rank sees every
    header) when the trailing dimensions differ. Across hosts the headers travel by the two-level
    all-gather (one frame per host pair, not per rank pair)."""
    mine = shape_header(shape)
    if topo is not None:
        gathered = np.empty(c.size * len(mine), dtype=np.int64)
        hier_all_gather(replace(c, code=_INT64_CODE), topo, mine, gathered)
        heads = list(gathered.reshape(c.size, len(mine)))
    else:
        heads = exchange_all(c, mine, _INT64_CODE)
    return lengths_from([tuple(int(d) for d in head[1:1 + int(head[0])]) for head in heads], shape)


def lengths_from(shapes: list[tuple[int, ...]], mine: tuple[int, ...]) -> list[int]:
    """Every rank's length along axis 0, from every rank's shape; CollectiveMismatch when a rank's
    trailing dimensions differ from ours (every rank sees every shape, so every rank raises)."""
    for src, theirs in enumerate(shapes):
        if len(theirs) != len(mine) or theirs[1:] != tuple(mine[1:]):
            raise CollectiveMismatch(
                f"all_gather_v: rank {src} passed shape {theirs} but this rank passed {tuple(mine)}; "
                f"only the length along axis 0 may differ between ranks")
    return [theirs[0] for theirs in shapes]


def all_gather_v(c: Call, local: np.ndarray, out: np.ndarray, lengths: list[int], row: int,
                 topo: Topology | None = None) -> None:
    """out (1-D storage) receives every rank's `local` (lengths[i] rows of `row` elements) in rank
    order, copied around the ring (or in two levels across hosts); pieces of different (even zero)
    length are fine."""
    if topo is not None:
        hier_all_gather_v(c, topo, local, out, [n * row for n in lengths])
        return
    starts = np.concatenate([[0], np.cumsum(lengths)]) * row
    owned = [(int(starts[i]), int(starts[i + 1])) for i in range(c.size)]
    a, b = owned[c.rank]
    out[a:b] = local
    ring_all_gather_owned(c, out, range(c.size), owned)
