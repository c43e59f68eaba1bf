"""The lean call path (lean.py) on a group of one, in this process: results as the general path
gives them, and a bounded memory of the kinds of call it has seen."""

from __future__ import annotations

import numpy as np

import shmcoll
from shmcoll.lean import MAX_PREPARED


def test_ever_new_sizes_keep_the_lean_path_bounded_and_right():
    with shmcoll.init(rank=0, world_size=1, timeout=10.0) as pg:
        for count in range(1, MAX_PREPARED + 50):
            x = np.arange(count, dtype=np.float32)
            pg.all_reduce(x, shmcoll.ReduceKind.AVG)
            assert np.array_equal(x, np.arange(count, dtype=np.float32))
            assert len(pg._lean._prepared) <= MAX_PREPARED
        assert pg._lean._prepared  # it kept preparing calls after starting over
