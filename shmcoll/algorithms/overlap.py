"""A range's work in its host and its step across hosts at once, piece by piece.

A large two-level all-reduce folds each rank's range out of its host peers' arrays, all-reduces it
across hosts, and writes it back into the peers' arrays. One after another, the link idles while
the host's memory works and the other way round; where the link is slower than memory (a NIC,
not two processes on one machine) the in-host phases add their whole time to the call. So the
range goes in pieces: while piece i crosses hosts on a helper thread, the calling thread folds
piece i + 1 and writes back the pieces that came back. The C calls on both threads release the
GIL, so the two really run at once. Where the cores are too few for a second thread per rank
(config.overlaps_across_hosts), the pieces go in turn on the calling thread: the same frames cross
hosts either way, so each rank chooses for itself. Every rank of a column cuts its range alike
(crossing_pieces), also where its host takes its rings or it is alone on its host; in a group where
no rank overlaps (the ranks say at start-up), nobody cuts.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from ..errors import CollectiveTimeout
from ..transport.base import HostRange
from .call import segment_bounds

Piece = tuple[int, int]

#: A range that crosses hosts goes in up to this many pieces, none under CROSSING_PIECE_BYTES:
#: overlapped, the first piece's fold and the last one's write are all of the in-host phases the
#: link waits for. In turn, about as fast as whole (2 + 2 namespace hosts on 2 cores, 16 MiB,
#: alternating: 29-32 ms against 32-34 in a slow hour, 22.0-25.7 against 22.0-24.6 in a quicker
#: one). Overlapped on a 4 Gbit/s link, 64 MiB: 184 ms in 4 pieces, 189-191 in 8, 182-193 in 16.
CROSSING_PIECES = 4
CROSSING_PIECE_BYTES = 1 << 20


class Crossing(NamedTuple):
    """What a rank's range does between its fold in the host and its write-back: far(piece,
    host_range) for each of `pieces` (its sum across hosts), overlapped with the in-host work or
    not. In turn, a large piece goes to far as a host range (transport.base.HostRange) for its row
    to fold and, where divisor is 1, to write back as it goes; else host_range is None. Each piece
    is divided by `divisor` (AVG's count, else 1) as it is written back."""

    pieces: Sequence[Piece]
    far: Callable[[Piece, HostRange | None], None]
    overlap: bool
    divisor: int


#: Seconds past a call's deadline that the caller waits for its helper: the helper's own waits end
#: at the deadline, so it is back well within this.
HELPER_GRACE_S = 5.0


def crossing_pieces(byte_range: Piece, itemsize: int) -> list[Piece]:
    """The pieces a column's range crosses hosts in: up to CROSSING_PIECES, none under
    CROSSING_PIECE_BYTES, whole elements each; one piece for a smaller range. Every rank of a column
    cuts alike, however its host does its in-host phases: the frames across hosts follow the cut."""
    lo, hi = byte_range
    count = max(1, min(CROSSING_PIECES, (hi - lo) // CROSSING_PIECE_BYTES))
    return [(lo + a * itemsize, lo + b * itemsize) for a, b in segment_bounds((hi - lo) // itemsize, count)]


def in_pieces(pieces: Sequence[Piece], near: Callable[[Piece], None], far: Callable[[Piece], None],
              after: Callable[[Piece], None], deadline: float, overlap: bool) -> None:
    """near(p), far(p), after(p) for each piece, in order: far(p) on a helper thread while near(p + 1)
    runs here, where `overlap` and there are several; else all on this thread, piece after piece."""
    if overlap and len(pieces) > 1:
        _overlapped(pieces, near, far, after, deadline)
        return
    for piece in pieces:
        near(piece)
        far(piece)
        after(piece)


def _overlapped(pieces: Sequence[Piece], near: Callable[[Piece], None], far: Callable[[Piece], None],
                after: Callable[[Piece], None], deadline: float) -> None:
    """near(p) for each piece in order on this thread; far(p) on a helper thread once near(p) is
    done, in order (far exchanges frames with other hosts, which come in the order they were
    sent); after(p) here once far(p) is done. Returns, or raises what any of them raised, only when
    no far runs any more and the helper has ended: nothing of the call goes on after it. A helper
    of the call's own (starting one takes tens of microseconds, against milliseconds for the
    pieces) belongs to no group, so none outlives the call or waits behind another group's."""
    helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmcoll-across")
    crossing: list[Future[None]] = []
    try:
        for piece in pieces:
            near(piece)
            crossing.append(helper.submit(far, piece))
        for piece, done in zip(pieces, crossing):
            _result(done, deadline)
            after(piece)
    finally:
        idle = not concurrent.futures.wait(crossing, timeout=_left(deadline)).not_done
        helper.shutdown(wait=idle, cancel_futures=True)


def _result(done: Future[None], deadline: float) -> None:
    try:
        done.result(timeout=_left(deadline))
    except concurrent.futures.TimeoutError:
        raise CollectiveTimeout("the step across hosts did not finish by the deadline") from None


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic()) + HELPER_GRACE_S
