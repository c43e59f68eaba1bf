"""A small flight recorder: the last collectives a group completed, for the error that ends it.

When a call times out or ranks disagree, the question is always "where was everyone?". Each rank's
error therefore says which ranks it heard from during the failed call and the last few calls it
completed itself: comparing the ranks' errors shows who fell behind, or who called something else.
"""

from __future__ import annotations

import collections

from .transport.frame import Meta, describe_call

#: How many completed collectives each group remembers.
RECORDED = 5


class FlightRecorder:
    def __init__(self, size: int = RECORDED):
        # deque.append and list(deque) are atomic in CPython: the spawn worker and the caller's
        # thread both record without a lock
        self._done: collections.deque[tuple[Meta, int, float]] = collections.deque(maxlen=size)

    def completed(self, meta: Meta, seconds: float, seq: int | None = None) -> None:
        """Call `meta` completed in `seconds`; seq, when given, replaces meta's (a template's) sequence number."""
        self._done.append((meta, meta.seq if seq is None else seq, seconds))

    def recent(self) -> str:
        """'#7 all_reduce(...) in 41 us, #8 barrier(...) in 9 us' (oldest first), or 'none'."""
        done = list(self._done)
        return ", ".join(f"#{seq} {describe_call(m._replace(seq=seq))} in {_human(s)}" for m, seq, s in done) or "none"


def heard_from(last_heard: list[float], me: int, since: float) -> list[int]:
    """Ranks with a sign of life (data, heartbeat, a live pid) since `since` (time.monotonic())."""
    return [r for r, t in enumerate(last_heard) if r != me and t >= since]


def diagnosis(recorder: FlightRecorder, last_heard: list[float], me: int, since: float) -> str:
    """What the error of a failed call adds: who was heard from during it, what completed before it."""
    return (f"ranks heard from during this call: {heard_from(last_heard, me, since)}; "
            f"last collectives completed on rank {me}: {recorder.recent()}")


def _human(seconds: float) -> str:
    if seconds < 1e-2:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
