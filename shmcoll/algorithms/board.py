"""Small collectives over a shared-memory board: one write per rank, then everyone reads everyone.

A ring would take 2(n-1) dependent steps and a one-shot over rings n-1 sends per rank; here each
rank writes once and the only waiting is for the others to publish, which is what matters when
ranks outnumber cores. Every rank folds the entries in rank order: results are bitwise identical.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..transport.base import BoardGuard
from ..transport.shm_board import Board, entry_header
from ..types import ReduceKind
from .call import Call
from .ring import scale_if_avg

_EMPTY = np.empty(0, dtype=np.uint8)


def board_all_reduce(c: Call, data: np.ndarray, op: ReduceKind) -> None:
    _compiled_step(c, data, op)
    scale_if_avg(c, data, op, c.size)


def board_barrier(c: Call) -> None:
    """An all-reduce of nothing: publish, wait for every entry, finish (lean.py's barrier, too)."""
    _compiled_step(c, _EMPTY, ReduceKind.SUM)


def host_board_all_reduce(c: Call, data: np.ndarray, op: ReduceKind) -> None:
    """data reduced among this host's ranks of a group across hosts, in one step on the host's
    board (the in-host step of two_level.py's small all-reduce), not divided for AVG."""
    board = c.t.host_board
    assert board is not None
    _compiled_step(c, data, op, board, lambda: c.t.host_board_guard(c.tag, c.meta))


def _compiled_step(c: Call, data: np.ndarray, op: ReduceKind, board: Board | None = None,
                   guard: Callable[[], BoardGuard] | None = None) -> None:
    """The board's compiled all-reduce (Board.all_reduce) over data, a 1-D storage array, among the
    board's ranks (the group's board and its guard, unless given others); lean.py runs the same
    step with the same header (entry_header), so ranks may take either path."""
    board = c.board if board is None else board
    header = entry_header(c.rank, c.meta, c.code, data)
    board.all_reduce(c.meta.seq, data, header, c.code, int(op), c.deadline, guard or c.board_guard, c.meta)


def board_broadcast(c: Call, root: int, data: np.ndarray) -> None:
    """The root publishes its array, the others only their call; all check all, and the others copy
    the root's: one compiled step (Board.broadcast)."""
    header = entry_header(c.rank, c.meta, c.code, data)
    c.board.broadcast(c.meta.seq, data, header, c.code, root, c.deadline, c.board_guard, c.meta)


def host_board_broadcast(c: Call, data: np.ndarray, root: int | None) -> None:
    """data from root (a rank of this host, or None: the host's ranks only meet) to this host's
    ranks of a group across hosts, in one compiled step on the host's board (the in-host step of
    two_level_broadcast.py's small broadcast)."""
    board = c.t.host_board
    assert board is not None
    header = entry_header(c.rank, c.meta, c.code, data)
    board.broadcast(c.meta.seq, data, header, c.code, root, c.deadline, lambda: c.t.host_board_guard(c.tag, c.meta),
                    c.meta)


def board_all_gather(c: Call, local: np.ndarray, out: np.ndarray) -> None:
    """Every rank publishes its block; every rank copies every block into place: one compiled step
    (Board.all_gather; the board's ranks are the group's, in rank order)."""
    block = len(local)
    out[c.rank * block:(c.rank + 1) * block] = local
    gather_on_board(c, c.board, out, local, c.board_guard)


def gather_on_board(c: Call, board: Board, out: np.ndarray, block: np.ndarray,
                    guard: Callable[[], BoardGuard]) -> None:
    """Every board rank's block of out (one equal block per rank of board.host_ranks, in that
    order; this rank's, `block`, in place) into every board rank's out, in one compiled step. The
    header describes one block, as publish's does, so ranks may take either way."""
    header = entry_header(c.rank, c.meta, c.code, block)
    board.all_gather(c.meta.seq, out, header, c.code, c.deadline, guard, c.meta)


def board_all_to_all(c: Call, data: np.ndarray, out: np.ndarray) -> None:
    """Every rank publishes its whole input (n blocks); every rank copies block `rank` of every
    entry: a small all-to-all in one step instead of n - 1 pairwise exchanges."""
    board, guard = c.board, c.board_guard()
    board.publish(c.meta, c.code, data, c.deadline, guard)
    block, r = len(data) // c.size, c.rank
    for src in range(c.size):
        entry = board.read(src, c.meta.seq, c.meta, c.deadline, guard).view(out.dtype)
        out[src * block:(src + 1) * block] = entry[r * block:(r + 1) * block]
    board.finish(c.meta.seq)
