"""A validated collective call, ready to run now (blocking call) or later on the ordered worker
(spawn_*): both paths share one validation and algorithm choice."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .algorithms.call import Call


class Plan(NamedTuple):
    """The call's description (collective code, dtype code, count, op, root) and its body, which
    runs the algorithm and returns the call's result."""

    coll: int
    code: int
    count: int
    body: Callable[[Call], Any]
    op: int = 0
    root: int = 0
