"""all_gather_v and scatter over the shared-memory board: one step when the data fits.

Their ranks hold different amounts (all_gather_v's lengths differ; a scatter's non-roots hold
nothing and know neither dtype nor shape), so no rank can decide alone between the board and the
rings. Every rank therefore publishes what it has, with a small int64 head describing it, or only
the head with a flag saying its data is too large for its entry. Every rank reads every entry (which
also checks that all made the same call), so all see the same flags and decide alike: done in one
step, or go on over the rings. Those that go on first wait until every peer has finished the board
step, because a peer still waiting on the board would take their ring frames for a mismatch.
"""

from __future__ import annotations

import numpy as np

from ..errors import CollectiveError
from ..transport.frame import MAX_NDIM
from ..types import WIRE_TYPES
from .call import Call
from .scatter_gather import lengths_from

_SIGNAL_CODE = 8  # the entries are raw bytes (uint8): the call's dtype is in its description
_HEAD = 3 + MAX_NDIM  # int64 words: [fits, dtype code, ndim, dim0, dim1, ...]
_HEAD_BYTES = 8 * _HEAD


def usable(board) -> bool:
    """Whether a transport's board (or None) has room for at least the head (every rank has the
    same board layout, so every rank answers alike)."""
    return board is not None and board.capacity >= _HEAD_BYTES


def _head(fits: bool, code: int, shape: tuple[int, ...]) -> np.ndarray:
    head = np.zeros(_HEAD, dtype=np.int64)
    head[:3] = int(fits), code, len(shape)
    head[3:3 + len(shape)] = shape
    return head


def _parse(entry: np.ndarray, src: int) -> tuple[bool, int, tuple[int, ...], np.ndarray]:
    """(fits, dtype code, shape, data bytes) of a rank's entry; a malformed head is a protocol error."""
    if len(entry) < _HEAD_BYTES:
        raise CollectiveError(f"rank {src} published a board entry too short for its head ({len(entry)} bytes)")
    head = np.frombuffer(entry[:_HEAD_BYTES].tobytes(), dtype=np.int64)
    fits, code, ndim = int(head[0]), int(head[1]), int(head[2])
    shape = tuple(int(d) for d in head[3:3 + ndim]) if 0 <= ndim <= MAX_NDIM else None
    if shape is None or min(shape, default=0) < 0 or (fits and code not in WIRE_TYPES):  # a scatter's
        # non-roots publish no data, and the call's placeholder dtype (they know no other)
        raise CollectiveError(f"rank {src} published a malformed board entry (dtype code {code}, ndim {ndim})")
    return bool(fits), code, shape, entry[_HEAD_BYTES:]


def _publish(c: Call, code: int, shape: tuple[int, ...], data: np.ndarray | None) -> None:
    """Our entry: the head, and data when there is some and it fits."""
    board, guard = c.t.board, c.t.board_guard(c.tag, c.meta)
    fits = data is not None and _HEAD_BYTES + data.nbytes <= board.capacity
    head = _head(fits, code, shape).view(np.uint8)
    entry = np.concatenate([head, data.reshape(-1).view(np.uint8)]) if fits else head
    board.publish(c.meta, _SIGNAL_CODE, entry, c.deadline, guard)


def _entries(c: Call) -> list[tuple[bool, int, tuple[int, ...], np.ndarray]]:
    board, guard = c.t.board, c.t.board_guard(c.tag, c.meta)
    return [_parse(board.read_any_size(src, c.meta.seq, c.meta, c.deadline, guard), src) for src in range(c.size)]


def _finish(c: Call, all_fit: bool) -> None:
    """Release our reading of the board; if the call goes on over the rings, wait for everyone."""
    c.t.board.finish(c.meta.seq)
    if not all_fit:
        c.t.board.wait_all_finished(c.meta.seq, c.deadline, lambda: c.t.check_health(True))


def board_all_gather_v(c: Call, code: int, shape: tuple[int, ...], local: np.ndarray, make_out):
    """Every rank's length (CollectiveMismatch on every rank if trailing dimensions differ, as all
    see all heads), and the gathered result when every piece fitted (else None: gather over the
    rings). make_out(lengths) -> (result, its 1-D storage view) allocates the result."""
    _publish(c, code, shape, local)
    entries = _entries(c)
    lengths = lengths_from([s for _, _, s, _ in entries], shape)
    all_fit = all(fits for fits, _, _, _ in entries)
    out = None
    if all_fit:
        out, flat = make_out(lengths)
        at, raw = 0, flat.view(np.uint8)
        for _, _, _, data in entries:
            raw[at:at + len(data)] = data
            at += len(data)
    _finish(c, all_fit)
    return lengths, out


def board_scatter(c: Call, root: int, code: int, store: np.ndarray | None, block_shape: tuple[int, ...]):
    """The root publishes its whole array (n blocks), the others only their call; every rank reads
    every entry (so all agree on the call) and copies its block from the root's. Returns (this
    rank's block, or None when the array did not fit: scatter over the rings; dtype code; shape)."""
    _publish(c, code, block_shape, store if c.rank == root else None)
    fits, code, shape, data = _entries(c)[root]
    block = None
    if fits:
        wire = WIRE_TYPES[code]
        block = np.empty(shape, dtype=wire.user if wire.user is not None else wire.storage)
        size = block.nbytes
        block.reshape(-1).view(np.uint8)[:] = data[c.rank * size:(c.rank + 1) * size]
    _finish(c, fits)
    return block, code, shape
