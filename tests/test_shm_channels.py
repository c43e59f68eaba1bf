"""Lanes and channel blocks in real processes: every pair starts on its small lane, a writer moves
a pair to one of its own channel blocks the first time it sends that peer more than a lane slot,
takes a spare block back from a pair that has read everything when another peer needs one (moving
that pair back to its lane), and pairs left without a block keep working on their lane, slower.

With the default geometry and up to 8 local ranks every peer gets a block, so the suite's other
tests cover that case. Here the budget for blocks is cut (in the test process, before the ranks
fork from it), so that 5 ranks get 2 blocks each (their successor's and one spare, which three
peers take turns on) or none, and every collective that streams large messages runs over a mix of
lanes and blocks. Every rank checks every result, and reports which of its pairs ended up on a
block.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmcoll import ReduceKind
from shmcoll.transport import shm_layout

from harness import run_ranks

pytestmark = pytest.mark.multiprocess

SHM = {"SHMCOLL_TRANSPORT": "shm"}
N = 5
BIG = 1 << 20  # bytes per message: 256 lane slots, 4 block slots
ROUNDS = 2


def _expected_block(pg, value: float) -> np.ndarray:
    return np.full(BIG // 4, value, np.float32)


def _streams_over_lanes_and_blocks(pg):
    n, me = pg.world_size, pg.rank
    data = np.concatenate([np.full(BIG // 4, 100.0 * me + dst, np.float32) for dst in range(n)])
    for round_ in range(ROUNDS):
        got = pg.all_to_all(data)
        want = np.concatenate([np.full(BIG // 4, 100.0 * src + me, np.float32) for src in range(n)])
        assert np.array_equal(got, want), f"all_to_all round {round_}"
        x = np.arange(BIG // 4, dtype=np.float32) + me
        pg.all_reduce(x, ReduceKind.SUM)
        assert np.array_equal(x, n * np.arange(BIG // 4, dtype=np.float32) + n * (n - 1) / 2)
        for peer in range(n):  # point to point with every peer, in an order that cannot deadlock
            if peer == me:
                continue
            if me < peer:
                pg.send(peer, round_, _expected_block(pg, me * 10 + peer))
                assert np.array_equal(pg.recv(peer, round_), _expected_block(pg, peer * 10 + me))
            else:
                assert np.array_equal(pg.recv(peer, round_), _expected_block(pg, peer * 10 + me))
                pg.send(peer, round_, _expected_block(pg, me * 10 + peer))
        root = round_ % n
        block = pg.scatter(root, data if me == root else None)
        assert np.array_equal(block, np.full(BIG // 4, 100.0 * root + me, np.float32))
    out = pg.transport._out
    return sorted(pg.transport._local_of[p] for p, ch in out.items() if ch.in_block)


@pytest.mark.parametrize("min_blocks, per_rank", [(2, 2), (0, 0)], ids=["two-blocks-each", "lanes-only"])
def test_collectives_over_a_mix_of_lanes_and_blocks(monkeypatch, min_blocks, per_rank):
    monkeypatch.setattr(shm_layout, "BLOCKS_BUDGET", 0)
    monkeypatch.setattr(shm_layout, "MIN_BLOCKS_PER_RANK", min_blocks)
    on_block = run_ranks(N, _streams_over_lanes_and_blocks, env=SHM)
    for rank, peers in enumerate(on_block):
        assert len(peers) == per_rank, (rank, peers)
        if per_rank:
            assert (rank + 1) % N in peers, f"rank {rank}'s successor has no block: {peers}"


def _small_messages_stay_on_lanes(pg):
    for peer in range(pg.world_size):
        if peer != pg.rank:
            pg.send(peer, 1, np.arange(shm_layout.LANE_BYTES // 8, dtype=np.int64))
    for peer in range(pg.world_size):
        if peer != pg.rank:
            assert np.array_equal(pg.recv(peer, 1), np.arange(shm_layout.LANE_BYTES // 8, dtype=np.int64))
    return [ch.in_block for ch in pg.transport._out.values()]


def test_messages_that_fit_a_lane_slot_take_no_block():
    assert run_ranks(3, _small_messages_stay_on_lanes, env=SHM) == [[False, False]] * 3
