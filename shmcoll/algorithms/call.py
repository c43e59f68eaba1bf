"""What an algorithm gets to know about one collective call, and how it cuts arrays into pieces."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import CollectiveError
from ..transport.base import BoardGuard, Transport
from ..transport.frame import Meta
from ..transport.shm_board import Board

#: Bytes per frame when a large array streams through a ring or chain (send and reduce overlap).
DEFAULT_CHUNK_BYTES = 1 << 20


class Call(NamedTuple):
    """One collective call: the transport, its tag and description (Meta), dtype code and deadline.
    (A named tuple: one is built for every call, and takes a third of a frozen dataclass's time.)"""

    t: Transport
    tag: int
    meta: Meta
    code: int
    deadline: float
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    @property
    def rank(self) -> int:
        return self.t.rank

    @property
    def size(self) -> int:
        return self.t.world_size

    @property
    def board(self) -> Board:
        """The transport's shared-memory board (select.py picks a board algorithm only where there is one)."""
        board = self.t.board
        if board is None:
            raise CollectiveError(f"a board algorithm ran on the {self.t.name} transport, which has no board")
        return board

    def board_guard(self) -> BoardGuard:
        """What this call's board waits run between looks."""
        return self.t.board_guard(self.tag, self.meta)


def segment_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, length) into `parts` contiguous pieces whose lengths differ by at most one."""
    return [(i * length // parts, (i + 1) * length // parts) for i in range(parts)]


def chunk_count(max_elems: int, itemsize: int, chunk_bytes: int) -> int:
    """How many frames a piece of up to max_elems elements streams in (at least one, even when empty)."""
    per_chunk = max(1, chunk_bytes // max(1, itemsize))
    return max(1, -(-max_elems // per_chunk))


def sub_bounds(start: int, stop: int, pieces: int) -> list[tuple[int, int]]:
    """Split [start, stop) into `pieces` nearly equal parts (so every segment has the same chunk count)."""
    return [(start + a, start + b) for a, b in segment_bounds(stop - start, pieces)]
