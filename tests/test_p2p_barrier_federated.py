"""barrier, tagged send/recv and federated_average in real processes."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

import shmcoll
from shmcoll import TAG_RESERVED_BASE

from bounds import NEVER_S, WAIT_HANG_S
from harness import CTX, run_ranks
from params import FLOAT_DTYPES, WORLD_SIZES

# over tcp, shm and every simulated multi-host layout
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("layout")]


def _barrier(pg, arrived):
    for round_ in range(1, 4):
        if pg.rank == pg.world_size - 1:
            np.linalg.svd(np.random.default_rng(round_).standard_normal((300, 300)))  # arrive last, for real
        with arrived.get_lock():
            arrived.value += 1
        pg.barrier()
        seen = arrived.value
        pg.barrier()  # nobody starts the next round before everybody has read the counter
        assert seen >= round_ * pg.world_size, f"left barrier {round_} after only {seen} arrivals"
    return True


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_barrier_waits_for_everyone(n):
    arrived = CTX.Value("i", 0)
    assert run_ranks(n, _barrier, arrived) == [True] * n


def _ring_messages(pg):
    n, r = pg.world_size, pg.rank
    right, left = (r + 1) % n, (r - 1) % n
    for tag in (0, 7, TAG_RESERVED_BASE - 1):
        pg.send(right, tag, np.arange(5, dtype=np.int16).reshape(5, 1) + r)  # shape travels
    pg.send(right, 3, np.float32(r))  # 0-d
    pg.send(r, 9, np.array([r, r], dtype=np.uint8))  # to itself
    pg.send_f32(right, 11, np.full(4, r, dtype=np.float32))
    # read in another order than sent: a recv on one tag is not blocked by unread messages on others
    got = {tag: pg.recv(left, tag) for tag in (TAG_RESERVED_BASE - 1, 3, 0, 7)}
    return got, pg.recv(r, 9), pg.recv_f32(left, 11)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_tagged_send_recv(n):
    for r, (got, own, f32) in enumerate(run_ranks(n, _ring_messages)):
        left = (r - 1) % n
        for tag in (0, 7, TAG_RESERVED_BASE - 1):
            assert got[tag].dtype == np.int16 and got[tag].shape == (5, 1)
            np.testing.assert_array_equal(got[tag].ravel(), np.arange(5) + left)
        assert got[3].shape == () and got[3].dtype == np.float32 and got[3] == left
        np.testing.assert_array_equal(own, [r, r])
        assert f32.dtype == np.float32 and np.all(f32 == left)


def _fifo_per_tag(pg):
    if pg.rank == 0:
        for i in range(50):
            pg.send(1, i % 2, np.array([i], dtype=np.int64))
        pg.send(1, 5, np.zeros(3, dtype=np.float64))
        return None
    odd = [int(pg.recv(0, 1)[0]) for _ in range(25)]
    even = [int(pg.recv(0, 0)[0]) for _ in range(25)]
    with pytest.raises(shmcoll.CollectiveMismatch):
        pg.recv_f32(0, 5)
    return odd, even


def test_messages_of_one_tag_arrive_in_send_order():
    _, (odd, even) = run_ranks(2, _fifo_per_tag)
    assert odd == list(range(1, 50, 2)) and even == list(range(0, 50, 2))


def _federated_every_dtype(pg):
    """One round per float dtype, in one group."""
    out = []
    for dtype in FLOAT_DTYPES:
        data = np.full(6, float(pg.rank + 1), dtype=dtype)
        count = pg.federated_average(data, datetime.timedelta(seconds=WAIT_HANG_S))  # a deadline as a timedelta
        out.append((count, data.astype(np.float64)))
    return out


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_federated_average_everyone_in_time(n):
    results = run_ranks(n, _federated_every_dtype)
    for i, dtype in enumerate(FLOAT_DTYPES):
        assert [per_rank[i][0] for per_rank in results] == [n] + [0] * (n - 1), np.dtype(dtype).name
        want = np.float64(np.float64(sum(range(1, n + 1)) / n).astype(dtype))
        for per_rank in results:
            np.testing.assert_array_equal(per_rank[i][1], want)


def _federated_straggler(pg, released):
    """The last rank misses round 1 (it waits for rank 0 to finish the round), then is on time."""
    straggler = pg.world_size - 1
    out = []
    for round_ in (1, 2):
        data = np.full(4, 10.0 * round_ + pg.rank, dtype=np.float32)
        if pg.rank == straggler and round_ == 1:
            if not released.wait(WAIT_HANG_S):
                raise TimeoutError("rank 0 never finished round 1")
        count = pg.federated_average(data, 0.5 if round_ == 1 else WAIT_HANG_S)
        if pg.rank == 0 and round_ == 1:
            released.set()
        out.append((count, data.copy()))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_federated_straggler_is_skipped_and_never_leaks(n):
    released = CTX.Event()
    results = run_ranks(n, _federated_straggler, released)
    (c1, avg1), (c2, avg2) = results[0]
    assert c1 == n - 1 and np.all(avg1 == np.float32(np.mean([10.0 + r for r in range(n - 1)])))
    assert c2 == n and np.all(avg2 == np.float32(np.mean([20.0 + r for r in range(n)])))
    for rank_rounds in results:  # every rank, the straggler too, ends each round with rank 0's average
        assert np.array_equal(rank_rounds[0][1], avg1) and np.array_equal(rank_rounds[1][1], avg2)


def _federated_dead(pg):
    import os

    if pg.rank == pg.world_size - 1:
        os._exit(0)  # dies without a goodbye
    counts = []
    for _ in range(3):
        data = np.full(3, float(pg.rank), dtype=np.float64)
        counts.append(pg.federated_average(data, NEVER_S))  # must not wait out its deadline for the dead rank
        counts.append(float(data[0]))
    return counts


def test_federated_rounds_go_on_after_a_rank_dies():
    n = 3
    # three rounds in less time than one round's deadline (NEVER_S): none waited for the dead rank
    results = run_ranks(n, _federated_dead, may_die={n - 1}, timeout=WAIT_HANG_S)
    assert results[0] == [2, 0.5] * 3
    assert results[1] == [0, 0.5] * 3
