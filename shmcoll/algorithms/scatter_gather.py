"""Rooted and personalised collectives: reduce-scatter, reduce, gather, scatter, all-to-all and
all-gather with per-rank lengths. They run flat over whatever routing the transport does (the
hierarchical transport sends each frame over shared memory or TCP as the peer requires).

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

import numpy as np

from .. import kernels
from ..errors import CollectiveMismatch
from ..transport.base import check_meta
from ..transport.frame import MAX_NDIM
from ..types import WIRE_TYPES, ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .ring import ring_all_gather_owned, ring_reduce_scatter

_EMPTY = np.empty(0, dtype=np.uint8)
_SIGNAL_CODE = 8  # uint8: the empty frames of `agree` (valid whatever dtype the call carries)
_INT64_CODE = 6


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


def agree(c: Call) -> None:
    """Returns only once every rank has been seen making this very call (raises CollectiveMismatch
    otherwise): the rooted algorithms below need no further checks or acknowledgements."""
    exchange_all(c, _EMPTY, _SIGNAL_CODE)


def _send_stream(c: Call, to: int, data: np.ndarray) -> None:
    """Send in chunk-sized frames; the receiver knows the length, so it cuts the same way."""
    for a, b in sub_bounds(0, len(data), chunk_count(len(data), data.itemsize, c.chunk_bytes)):
        c.t.send(to, c.tag, data[a:b], c.code, c.meta, c.deadline)


def _recv_stream(c: Call, src: int, out: np.ndarray) -> None:
    for a, b in sub_bounds(0, len(out), chunk_count(len(out), out.itemsize, c.chunk_bytes)):
        c.t.recv_into(src, c.tag, out[a:b], c.code, c.deadline, c.meta)


def _ring_reduce_scatter_avg(c: Call, data: np.ndarray, op: ReduceKind, owned) -> None:
    """ring_reduce_scatter where rank i owns owned[i]; AVG is a SUM scaled by the owner (as in all_reduce)."""
    inner = ReduceKind.SUM if op is ReduceKind.AVG else op
    ring_reduce_scatter(c, data, inner, range(c.size), owned)
    if op is ReduceKind.AVG:
        a, b = owned[c.rank]
        kernels.scale_into(data[a:b], c.code, c.size)


def reduce_scatter(c: Call, data: np.ndarray, op: ReduceKind) -> None:
    """In place over a 1-D storage array whose length is a multiple of the world size: rank i ends
    with the reduction of slice i (other slices hold partial results). Each slice is folded once, in
    a fixed order, so the result does not depend on timing."""
    block = len(data) // c.size
    _ring_reduce_scatter_avg(c, data, op, [(i * block, (i + 1) * block) for i in range(c.size)])


def reduce_to_root(c: Call, root: int, data: np.ndarray, op: ReduceKind) -> None:
    """Ring reduce-scatter (bandwidth-optimal, every rank reduces 1/n), then every rank sends its
    reduced segment to the root. A rank that finished the ring heard, through its neighbours, from
    every rank's matching call, so the final sends need no acknowledgement."""
    if c.size == 1:
        return  # op over one input is the input (AVG divides by 1)
    owned = segment_bounds(len(data), c.size)
    _ring_reduce_scatter_avg(c, data, op, owned)
    if c.rank != root:
        a, b = owned[c.rank]
        _send_stream(c, root, data[a:b])
        return
    for src in range(c.size):
        if src != root:
            a, b = owned[src]
            _recv_stream(c, src, data[a:b])


def gather_to_root(c: Call, root: int, local: np.ndarray, out: np.ndarray | None) -> None:
    """out (on root only) receives every rank's block in rank order."""
    agree(c)
    if c.rank != root:
        _send_stream(c, root, local)
        return
    block = len(local)
    for src in range(c.size):
        piece = out[src * block:(src + 1) * block]
        if src == c.rank:
            piece[...] = local
        else:
            _recv_stream(c, src, piece)


def scatter_from_root(c: Call, root: int, blocks: list[np.ndarray] | None, code: int) -> np.ndarray:
    """The root sends blocks[j] (an n-d storage array of wire dtype `code`) to rank j in one frame
    whose header carries its dtype and shape, so the other ranks need to know neither in advance.
    Returns this rank's block: on the root in storage dtype, elsewhere as the wire's user dtype."""
    agree(c)
    if c.rank == root:
        for k in range(1, c.size):
            j = (root + k) % c.size
            c.t.send(j, c.tag, blocks[j], code, c.meta, c.deadline)
        return blocks[root].copy()  # storage dtype: the caller views it as the user's
    msg = c.t.recv(root, c.tag, c.deadline)
    check_meta(msg, c.meta)
    wire = WIRE_TYPES[msg.header.dtype]
    out = np.empty(msg.header.shape, dtype=wire.user if wire.user is not None else wire.storage)
    out.reshape(-1).view(np.uint8)[:] = msg.payload
    return out


def all_to_all(c: Call, data: np.ndarray, out: np.ndarray) -> None:
    """Pairwise exchange over 1-D storage arrays of n equal blocks: at step k send block r+k to
    rank r+k and receive rank r-k's block r. Every rank hears from every rank directly."""
    n, r = c.size, c.rank
    block = len(data) // n
    out[r * block:(r + 1) * block] = data[r * block:(r + 1) * block]
    for k in range(1, n):
        to, src = (r + k) % n, (r - k) % n
        _send_stream(c, to, data[to * block:(to + 1) * block])
        _recv_stream(c, src, out[src * block:(src + 1) * block])


def shape_header(shape: tuple[int, ...]) -> np.ndarray:
    """[ndim, dim0, dim1, ...] padded to a fixed size: what all_gather_v ranks tell each other."""
    head = np.zeros(1 + MAX_NDIM, dtype=np.int64)
    head[0] = len(shape)
    head[1:1 + len(shape)] = shape
    return head


def exchange_shapes(c: Call, shape: tuple[int, ...]) -> list[int]:
    """Every rank's length along axis 0; CollectiveMismatch (on every rank, as every rank sees every
    header) when the trailing dimensions differ."""
    heads = exchange_all(c, shape_header(shape), _INT64_CODE)
    mine = shape_header(shape)
    for src, head in enumerate(heads):
        if head[0] != mine[0] or not np.array_equal(head[2:], mine[2:]):
            theirs = tuple(int(d) for d in head[1:1 + int(head[0])])
            raise CollectiveMismatch(
                f"all_gather_v: rank {src} passed shape {theirs} but this rank passed {tuple(shape)}; "
                f"only the length along axis 0 may differ between ranks")
    return [int(head[1]) for head in heads]


def all_gather_v(c: Call, local: np.ndarray, out: np.ndarray, lengths: list[int], row: int) -> None:
    """out (1-D storage) receives every rank's `local` (lengths[i] rows of `row` elements) in rank
    order, copied around the ring; pieces of different (even zero) length are fine."""
    starts = np.concatenate([[0], np.cumsum(lengths)]) * row
    owned = [(int(starts[i]), int(starts[i + 1])) for i in range(c.size)]
    a, b = owned[c.rank]
    out[a:b] = local
    ring_all_gather_owned(c, out, range(c.size), owned)
