"""Direct algorithms: each block goes straight from its source to its destination.

Gather, scatter and all-to-all move every block once, from the rank that has it to the rank that
wants it, so even across hosts a direct send crosses a host boundary at most once; staging through
host leaders would add copies, not save bytes. Also here: the building blocks the other algorithms
stream with (send_stream, recv_stream) and the exchanges of lengths and shapes.

Mismatch safety. A collective must fail on *every* rank when ranks disagree about the call, never
return on some and hang on none. Symmetric algorithms get that for free: in a ring every rank
hears from its left neighbour, and a rank that stops (mismatch detected) starves everyone
downstream into the abort it broadcasts; in a pairwise exchange every rank hears from every rank.
Rooted ones do not: a gather's senders receive nothing, and two ranks that each believe they are
root wait for each other forever. Those start with an agreement step (`agree`, or the two-level
one across hosts): every rank sends an empty frame to every other and checks each one it receives,
so a rank that passes knows that all ranks made the same call, and a rank that fails aborts the
group for the others.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CollectiveError, CollectiveMismatch
from ..transport.frame import MAX_NDIM
from ..types import I64, U8, WIRE_TYPES, ReduceKind
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .ring import ring_reduce_scatter_op

#: An agreement step: returns only once every rank has been seen making this very call.
Agreement = Callable[[Call], None]

_EMPTY = np.empty(0, dtype=np.uint8)
SIGNAL_CODE = U8.code  # the empty frames of agreement steps (valid whatever dtype the call carries)
INT64_CODE = I64.code


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
    otherwise): the rooted algorithms need no further checks or acknowledgements."""
    exchange_all(c, _EMPTY, SIGNAL_CODE)


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


def swap_stream(c: Call, peer: int, out: np.ndarray, into: np.ndarray, op: ReduceKind | None = None) -> None:
    """send_stream of out to peer while receiving what peer's send_stream sends into `into` (of
    out's length), copied or folded in with op: both ways at once, in one row of duplexes
    (Transport.send_recv_row), so neither end's send waits on the other's receive. The frames are
    send_stream's and recv_stream's: a peer may take those instead."""
    c.t.send_recv_row(peer, peer, c.tag, [(out[a:b], into[a:b], op) for a, b in _stream_bounds(c, out)], c.code,
                      c.meta, c.deadline)


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
                   agreement: Agreement = agree) -> None:
    """out (on root only) receives every rank's block in rank order."""
    agreement(c)
    if c.rank != root:
        send_stream(c, root, local)
        return
    assert out is not None, "the root passes the output"
    block = len(local)
    for src in range(c.size):
        piece = out[src * block:(src + 1) * block]
        if src == c.rank:
            piece[...] = local
        else:
            recv_stream(c, src, piece)


def scatter_from_root(c: Call, root: int, blocks: list[np.ndarray] | None, code: int) -> np.ndarray:
    """After the agreement step (agree), the root sends blocks[j] (an n-d storage array of wire
    dtype `code`) to rank j: first a small frame with its dtype code and shape (the other ranks
    know neither in advance), then the block in chunk-sized frames that land straight in the new
    array. Returns this rank's block: on the root in storage dtype, elsewhere as the wire's user
    dtype. Across hosts a scatter runs two_level_broadcast.two_level_scatter instead."""
    agree(c)
    if c.rank == root:
        assert blocks is not None, "the root passes its blocks"
        for k in range(1, c.size):
            j = (root + k) % c.size
            head = np.concatenate([[code], shape_header(blocks[j].shape)])
            c.t.send(j, c.tag, head, INT64_CODE, c.meta, c.deadline)
            send_stream(c._replace(code=code), j, blocks[j].reshape(-1))
        return blocks[root].copy()  # storage dtype: the caller views it as the user's
    head = np.empty(2 + MAX_NDIM, dtype=np.int64)
    c.t.recv_into(root, c.tag, head, INT64_CODE, c.deadline, c.meta)
    code, shape = block_description(head, root)
    wire = WIRE_TYPES[code]
    out = np.empty(shape, dtype=wire.array_dtype)
    recv_stream(c._replace(code=code), root, out.reshape(-1).view(wire.storage))
    return out


def block_description(head: np.ndarray, root: int) -> tuple[int, tuple[int, ...]]:
    """The dtype code and shape a scatter root announced; a root that announces nonsense broke the
    protocol (its frames passed the job's authentication, so this is a bug, not an attack)."""
    code, ndim = int(head[0]), int(head[1])
    shape = tuple(int(d) for d in head[2:2 + ndim])
    if code not in WIRE_TYPES or not 0 <= ndim <= MAX_NDIM or min(shape, default=0) < 0:
        raise CollectiveError(f"scatter: root {root} announced an invalid block (dtype code {code}, shape {shape})")
    return code, shape


def all_to_all_pairwise(c: Call, data: np.ndarray, out: np.ndarray) -> None:
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


def exchange_shapes(c: Call, shape: tuple[int, ...]) -> list[int]:
    """Every rank's length along axis 0; CollectiveMismatch (on every rank, as every rank sees every
    header) when the trailing dimensions differ."""
    return shapes_to_lengths(exchange_all(c, shape_header(shape), INT64_CODE), shape)


def shapes_to_lengths(heads: list[np.ndarray], shape: tuple[int, ...]) -> list[int]:
    """Every rank's length along axis 0 from every rank's shape_header (see lengths_from)."""
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
