"""A range's pieces worked in the host and across hosts at once, or in turn (algorithms/overlap.py).

No processes: near, far and after here only record what ran, where and when.
"""

from __future__ import annotations

import threading
import time

import pytest

from shmcoll.algorithms import overlap
from shmcoll.errors import CollectiveTimeout, PeerLost

PIECES = [(0, 4), (4, 8), (8, 12), (12, 16)]


class Record:
    """What ran, in order, and on which thread."""

    def __init__(self, slow_far_s: float = 0.0, fail_at: tuple[int, int] | None = None):
        self.events: list[tuple[str, tuple[int, int], str]] = []
        self.lock = threading.Lock()
        self.slow_far_s, self.fail_at = slow_far_s, fail_at
        self.far_running = 0

    def note(self, what: str, piece: tuple[int, int]) -> None:
        with self.lock:
            self.events.append((what, piece, threading.current_thread().name))

    def near(self, piece):
        self.note("near", piece)

    def far(self, piece):
        self.far_running += 1
        try:
            time.sleep(self.slow_far_s)
            self.note("far", piece)
            if piece == self.fail_at:
                raise PeerLost("rank 3's connection ended", 3)
        finally:
            self.far_running -= 1

    def after(self, piece):
        self.note("after", piece)

    def order(self, what: str) -> list[tuple[int, int]]:
        return [piece for w, piece, _ in self.events if w == what]

    def position(self, what: str, piece: tuple[int, int]) -> int:
        return next(i for i, (w, p, _) in enumerate(self.events) if (w, p) == (what, piece))


def _run(record: Record, overlapped: bool, deadline_s: float = 30.0) -> None:
    overlap.in_pieces(PIECES, record.near, record.far, record.after, time.monotonic() + deadline_s, overlapped)


def test_in_turn_each_piece_goes_near_far_after_on_the_calling_thread():
    record = Record()
    _run(record, overlapped=False)
    here = threading.current_thread().name
    assert record.events == [(what, piece, here) for piece in PIECES for what in ("near", "far", "after")]


def test_one_piece_needs_no_helper():
    record = Record()
    overlap.in_pieces(PIECES[:1], record.near, record.far, record.after, time.monotonic() + 30, True)
    here = threading.current_thread().name
    assert record.events == [(what, PIECES[0], here) for what in ("near", "far", "after")]


def test_overlapped_pieces_cross_on_a_helper_in_order_and_come_back_in_order():
    """far runs on the helper, in piece order, each after its piece's near; after runs here once
    its piece's far is done. With a slow far, the calling thread works on later pieces meanwhile."""
    record = Record(slow_far_s=0.02)
    _run(record, overlapped=True)
    here = threading.current_thread().name
    assert record.order("near") == record.order("far") == record.order("after") == PIECES
    for what, _, thread in record.events:
        assert thread.startswith("shmcoll-across") if what == "far" else thread == here
    for piece in PIECES:
        assert record.position("near", piece) < record.position("far", piece) < record.position("after", piece)
    assert record.position("near", PIECES[1]) < record.position("far", PIECES[0])  # the two at once
    assert not [t for t in threading.enumerate() if t.name.startswith("shmcoll-across")]  # none outlives the call


def test_a_piece_that_fails_across_hosts_fails_the_call_once_no_piece_crosses_any_more():
    """The helper's error reaches the caller, and in_pieces returns only when the helper is idle:
    nothing of the call goes on after it. Pieces after the failed one are not written back."""
    record = Record(slow_far_s=0.01, fail_at=PIECES[1])
    with pytest.raises(PeerLost, match="rank 3"):
        _run(record, overlapped=True)
    assert record.far_running == 0
    assert record.order("after") == PIECES[:1]


def test_a_helper_past_the_deadline_is_a_timeout(monkeypatch):
    """A far still running past the deadline (and the grace after it) fails the call with
    CollectiveTimeout rather than waiting on."""
    monkeypatch.setattr(overlap, "HELPER_GRACE_S", 0.05)
    release = threading.Event()

    def stuck_far(piece):
        release.wait(10)

    try:
        with pytest.raises(CollectiveTimeout, match="deadline"):
            overlap.in_pieces(PIECES[:2], lambda p: None, stuck_far, lambda p: None, time.monotonic() + 0.05, True)
    finally:
        release.set()


def test_calls_on_two_threads_have_a_helper_each():
    """Calls of different groups on different threads never queue behind each other's pieces: each
    piece of one call waits across for the other call's, so both helpers live at once (one helper
    for both would break the barrier) and their thread ids cannot be one reused."""
    names: dict[str, set[int]] = {}
    both = threading.Barrier(2, timeout=10)

    def across(seen: set[int]) -> None:
        seen.add(threading.get_ident())
        both.wait()

    def call(tag: str) -> None:
        seen: set[int] = set()
        overlap.in_pieces(PIECES, lambda p: None, lambda p: across(seen), lambda p: None, time.monotonic() + 30, True)
        names[tag] = seen

    threads = [threading.Thread(target=call, args=(tag,)) for tag in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(names["a"]) == len(names["b"]) == 1
    assert names["a"] != names["b"]
