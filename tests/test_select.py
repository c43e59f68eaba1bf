"""algorithms/select.py: which algorithm runs each call, in one process, no I/O."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from shmcoll.algorithms.board_v import HEAD_BYTES
from shmcoll.algorithms.select import (
    GATHER_EVERYTHING_BYTES,
    HALVING_FROM_HOSTS,
    NEIGHBOURHOOD,
    ONE_SHOT_MAX_HOSTS,
    REDUCE_HALVING_FROM_BYTES,
    SMALL_BROADCAST_BYTES,
    SMALL_GATHER_BYTES,
    SPLIT_HOST_AT,
    Algorithm,
    Setting,
    across_hosts,
    gather_in_columns,
    reduce_across_hosts,
    select,
    small_across_hosts,
    without_single_copy,
)
from shmcoll.algorithms.single_copy import DESCRIPTOR_BYTES
from shmcoll.config import (
    ONE_SHOT_BYTES_ACROSS_HOSTS,
    ONE_SHOT_BYTES_ONE_HOST,
    Tuning,
    one_shot_bytes_for,
)
from shmcoll.plans import Where
from shmcoll.transport.tcp import SWAP_MAX_BYTES, NetTransport
from shmcoll.transport.topology import Topology
from shmcoll.types import Collective

KIB = 1 << 10
BOARD = 256 * KIB  # the default board entry (SHMCOLL_SHM_BOARD_BYTES)
ONE_SHOT = 16 * KIB  # the default one-step threshold (SHMCOLL_ONE_SHOT_BYTES)
SHM = Setting(hosts=1, board_bytes=BOARD, one_shot_bytes=ONE_SHOT)  # one host, shared memory
TCP = Setting(hosts=1, board_bytes=None, one_shot_bytes=ONE_SHOT)  # TCP only, or a sub-group
HOSTS = Setting(hosts=2, board_bytes=None, one_shot_bytes=ONE_SHOT)  # the hierarchy over two hosts
TCP4 = dataclasses.replace(TCP, size=4)
HOSTS4 = dataclasses.replace(HOSTS, size=4)

A = Algorithm
C = Collective

CASES = [
    # all_reduce: one step while small, then reading peers' memory, the ring, or the two-level form
    (C.ALL_REDUCE, 8, SHM, A.BOARD), (C.ALL_REDUCE, BOARD, SHM, A.BOARD), (C.ALL_REDUCE, BOARD + 1, SHM, A.SINGLE_COPY),
    (C.ALL_REDUCE, ONE_SHOT, TCP, A.ONE_SHOT), (C.ALL_REDUCE, ONE_SHOT + 1, TCP, A.RING),
    (C.ALL_REDUCE, ONE_SHOT, HOSTS, A.TWO_LEVEL_ONE_SHOT), (C.ALL_REDUCE, ONE_SHOT + 1, HOSTS, A.TWO_LEVEL),
    # reduce_scatter and reduce reuse all_reduce's one-step paths for small arrays
    (C.REDUCE_SCATTER, 8, SHM, A.BOARD), (C.REDUCE_SCATTER, BOARD + 1, SHM, A.SINGLE_COPY),
    (C.REDUCE_SCATTER, ONE_SHOT, TCP, A.ONE_SHOT), (C.REDUCE_SCATTER, ONE_SHOT + 1, TCP, A.RING),
    (C.REDUCE_SCATTER, 8, HOSTS, A.TWO_LEVEL_ONE_SHOT), (C.REDUCE_SCATTER, 300 * KIB, HOSTS, A.TWO_LEVEL),
    (C.REDUCE, 8, SHM, A.BOARD), (C.REDUCE, BOARD + 1, SHM, A.RING), (C.REDUCE, 8, TCP, A.ONE_SHOT),
    (C.REDUCE, ONE_SHOT + 1, TCP, A.RING), (C.REDUCE, 8, HOSTS, A.TWO_LEVEL_ONE_SHOT),
    (C.REDUCE, ONE_SHOT + 1, HOSTS, A.TWO_LEVEL),
    # movement: the board when the call fits it, else direct reads or the flat algorithm; two levels
    # across hosts
    (C.ALL_GATHER, BOARD, SHM, A.BOARD), (C.ALL_GATHER, BOARD + 1, SHM, A.SINGLE_COPY), (C.ALL_GATHER, 8, TCP, A.BRUCK),
    (C.ALL_GATHER, SMALL_GATHER_BYTES // 4, TCP4, A.BRUCK), (C.ALL_GATHER, SMALL_GATHER_BYTES // 4 + 1, TCP4, A.RING),
    (C.ALL_GATHER, 8, HOSTS, A.TWO_LEVEL),
    (C.BROADCAST, 8, SHM, A.BOARD), (C.BROADCAST, BOARD + 1, SHM, A.SINGLE_COPY), (C.BROADCAST, 8, TCP, A.DOUBLING),
    (C.BROADCAST, 8, HOSTS, A.TWO_LEVEL_ONE_SHOT), (C.BROADCAST, ONE_SHOT, HOSTS, A.TWO_LEVEL_ONE_SHOT),
    (C.BROADCAST, ONE_SHOT + 1, HOSTS, A.TWO_LEVEL_LEADERS),
    (C.BROADCAST, SMALL_BROADCAST_BYTES, HOSTS, A.TWO_LEVEL_LEADERS),
    (C.BROADCAST, SMALL_BROADCAST_BYTES + 1, HOSTS, A.TWO_LEVEL),
    (C.BROADCAST, SMALL_BROADCAST_BYTES + 1, TCP, A.CHAIN),
    (C.BARRIER, 0, SHM, A.BOARD), (C.BARRIER, 0, TCP, A.DISSEMINATION), (C.BARRIER, 0, HOSTS, A.TWO_LEVEL),
    (C.GATHER, 8, SHM, A.BOARD), (C.GATHER, BOARD + 1, SHM, A.DIRECT), (C.GATHER, 8, TCP, A.DIRECT),
    # across hosts a small gather or all_to_all is an all-gather of everything, each rank keeping its part
    (C.GATHER, 8, HOSTS, A.TWO_LEVEL_ONE_SHOT), (C.GATHER, GATHER_EVERYTHING_BYTES // 4, HOSTS4, A.TWO_LEVEL_ONE_SHOT),
    (C.GATHER, GATHER_EVERYTHING_BYTES // 4 + 1, HOSTS4, A.TWO_LEVEL_DIRECT),
    (C.SCATTER, 0, SHM, A.DIRECT), (C.SCATTER, 0, TCP, A.DIRECT), (C.SCATTER, 0, HOSTS, A.TWO_LEVEL_DIRECT),
    (C.ALL_TO_ALL, 8, SHM, A.BOARD), (C.ALL_TO_ALL, BOARD + 1, SHM, A.PAIRWISE), (C.ALL_TO_ALL, 8, TCP, A.PAIRWISE),
    (C.ALL_TO_ALL, 8, HOSTS, A.TWO_LEVEL_ONE_SHOT),
    (C.ALL_TO_ALL, GATHER_EVERYTHING_BYTES // 4, HOSTS4, A.TWO_LEVEL_ONE_SHOT),
    (C.ALL_TO_ALL, GATHER_EVERYTHING_BYTES // 4 + 1, HOSTS4, A.PAIRWISE),
    (C.ALL_GATHER_V, 8, SHM, A.BOARD_OR_RING), (C.ALL_GATHER_V, 1 << 30, SHM, A.BOARD_OR_RING),
    (C.ALL_GATHER_V, 8, TCP, A.RING), (C.ALL_GATHER_V, 8, HOSTS, A.TWO_LEVEL),
    (C.FEDERATED_AVERAGE, 8, SHM, A.DEADLINE), (C.FEDERATED_AVERAGE, 8, HOSTS, A.DEADLINE),
]


@pytest.mark.parametrize("coll,nbytes,where,expected", CASES,
                         ids=[f"{c.label}-{n}-{'shm' if w is SHM else 'tcp' if w in (TCP, TCP4) else 'hosts'}"
                              for c, n, w, _ in CASES])
def test_the_table(coll, nbytes, where, expected):
    assert select(coll, nbytes, where) is expected


def test_every_collective_has_an_algorithm_everywhere():
    """select is total over collectives, sizes and settings (point-to-point frames belong to none)."""
    settings = [SHM, TCP, HOSTS, Setting(hosts=3, board_bytes=None, one_shot_bytes=0),
                Setting(hosts=1, board_bytes=0, one_shot_bytes=0)]
    for coll, nbytes, where in itertools.product(list(C)[1:], [0, 1, ONE_SHOT, BOARD, 1 << 40], settings):
        assert isinstance(select(coll, nbytes, where), Algorithm), (coll, nbytes, where)


@pytest.mark.parametrize("coll", list(C)[1:], ids=lambda c: c.label)
def test_across_hosts_never_the_board(coll):
    """A group spanning hosts has no board: nothing may choose one there, at any size."""
    for nbytes in (0, 8, ONE_SHOT, BOARD):
        assert select(coll, nbytes, HOSTS) not in (A.BOARD, A.BOARD_OR_RING)


def test_one_shot_threshold_is_the_tuning_knob():
    tuned = Setting(hosts=1, board_bytes=None, one_shot_bytes=1 * KIB)
    assert select(C.ALL_REDUCE, KIB, tuned) is A.ONE_SHOT
    assert select(C.ALL_REDUCE, KIB + 1, tuned) is A.RING
    assert select(C.ALL_REDUCE, 8, Setting(hosts=1, board_bytes=None, one_shot_bytes=0)) is A.RING


@pytest.mark.parametrize("hosts, default", [(1, ONE_SHOT_BYTES_ONE_HOST), (2, ONE_SHOT_BYTES_ACROSS_HOSTS),
                                           (3, ONE_SHOT_BYTES_ACROSS_HOSTS), (1024, ONE_SHOT_BYTES_ACROSS_HOSTS)])
def test_the_one_step_size_follows_how_the_steps_across_hosts_run(hosts, default):
    """Across hosts every step of one is an exchange or a hand-off in one C call, which takes up to
    SWAP_MAX_BYTES: one step goes that far; on one host, less far; SHMCOLL_ONE_SHOT_BYTES overrides
    both."""
    assert one_shot_bytes_for(Tuning(), hosts) == default
    assert one_shot_bytes_for(Tuning(one_shot_bytes=5), hosts) == 5
    assert ONE_SHOT_BYTES_ACROSS_HOSTS == SWAP_MAX_BYTES > ONE_SHOT_BYTES_ONE_HOST


def test_a_board_too_small_for_all_gather_v_heads_is_not_used():
    assert select(C.ALL_GATHER_V, 8, Setting(board_bytes=HEAD_BYTES)) is A.BOARD_OR_RING
    assert select(C.ALL_GATHER_V, 8, Setting(board_bytes=HEAD_BYTES - 64)) is A.RING


def test_where_of_a_tcp_group():
    """A group over TCP alone: one 'host' as far as the algorithms go, no board, the tuning's threshold."""
    t = NetTransport(0, 1, {})
    try:
        where = Where.of(t, Tuning(one_shot_bytes=123))
    finally:
        t.close()
    assert (where.rank, where.size, where.topology) == (0, 1, None)
    assert where.setting == Setting(hosts=1, board_bytes=None, one_shot_bytes=123, size=1)


@pytest.mark.parametrize("hosts, small", [(2, A.ONE_SHOT), (ONE_SHOT_MAX_HOSTS, A.ONE_SHOT),
                                         (ONE_SHOT_MAX_HOSTS + 1, A.RECURSIVE_DOUBLING), (1024, A.RECURSIVE_DOUBLING)])
def test_two_level_slices_cross_hosts_in_few_steps_while_small(hosts, small):
    assert across_hosts(ONE_SHOT, ONE_SHOT, hosts) is small
    assert small_across_hosts(hosts) is small


@pytest.mark.parametrize("hosts, large", [(2, A.RING), (HALVING_FROM_HOSTS - 1, A.RING),
                                         (HALVING_FROM_HOSTS, A.HALVING_DOUBLING), (1024, A.HALVING_DOUBLING)])
def test_large_two_level_slices_cross_many_hosts_by_halving_and_doubling(hosts, large):
    assert across_hosts(ONE_SHOT + 1, ONE_SHOT, hosts) is large


@pytest.mark.parametrize("hosts, slice_bytes, expected", [
    (2, 1 << 30, A.BINOMIAL), (HALVING_FROM_HOSTS - 1, 1 << 30, A.BINOMIAL),
    (HALVING_FROM_HOSTS, REDUCE_HALVING_FROM_BYTES - 1, A.BINOMIAL),
    (HALVING_FROM_HOSTS, REDUCE_HALVING_FROM_BYTES, A.HALVING_DOUBLING), (1024, 1 << 30, A.HALVING_DOUBLING)])
def test_a_large_reduce_crosses_hosts_down_a_tree_or_by_halving_when_large_among_many(hosts, slice_bytes, expected):
    assert reduce_across_hosts(slice_bytes, hosts) is expected


@pytest.mark.parametrize("hosts, expected", [(2, A.DOUBLING_GATHER), (3, A.RING), (4, A.DOUBLING_GATHER),
                                            (6, A.RING), (1024, A.DOUBLING_GATHER), (1023, A.RING)])
def test_a_large_all_gathers_columns_double_among_a_power_of_two_of_hosts(hosts, expected):
    assert gather_in_columns(hosts) is expected


# ---------------------------------------------------------------------------------------------
# many ranks on one host: a large all-reduce over neighbourhoods instead of one long ring
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size, expected", [(2, A.RING), (SPLIT_HOST_AT - 1, A.RING), (SPLIT_HOST_AT, A.NEIGHBOURHOODS),
                                            (64, A.NEIGHBOURHOODS)])
def test_a_large_all_reduce_of_many_ranks_without_single_copy_runs_over_neighbourhoods(size, expected):
    many = Setting(hosts=1, board_bytes=BOARD, one_shot_bytes=ONE_SHOT, size=size)
    assert select(C.ALL_REDUCE, BOARD + 1, many) is A.SINGLE_COPY  # at any size, where ranks may read each other
    assert without_single_copy(C.ALL_REDUCE, many) is expected
    assert select(C.ALL_REDUCE, BOARD + 1, dataclasses.replace(many, single_copy=False)) is expected
    tiny_board = dataclasses.replace(many, board_bytes=DESCRIPTOR_BYTES - 64)  # no room to say where the array is
    assert select(C.ALL_REDUCE, BOARD + 1, tiny_board) is expected
    assert select(C.ALL_REDUCE, BOARD, many) is A.BOARD  # small calls keep their one step
    assert without_single_copy(C.REDUCE_SCATTER, many) is A.RING  # only the all-reduce is split
    assert select(C.ALL_REDUCE, BOARD + 1, Setting(hosts=1, board_bytes=None, size=size)) is A.RING  # no shm
    assert select(C.ALL_REDUCE, BOARD + 1, Setting(hosts=2, board_bytes=None, size=size)) is A.TWO_LEVEL


@pytest.mark.parametrize("coll, usual", [(C.ALL_REDUCE, A.RING), (C.REDUCE_SCATTER, A.RING),
                                         (C.ALL_GATHER, A.RING), (C.BROADCAST, A.CHAIN)])
def test_large_calls_that_may_not_read_peers_take_their_usual_algorithm(coll, usual):
    assert without_single_copy(coll, SHM) is usual
    assert select(coll, BOARD + 1, dataclasses.replace(SHM, single_copy=False)) is usual
    large = max(BOARD, SMALL_BROADCAST_BYTES, SMALL_GATHER_BYTES) + 1
    assert select(coll, large, TCP) is usual  # no board: nowhere to say where the array is


@pytest.mark.parametrize("n", [1, 2, 5, 15, 16, 17, 23, 32, 63, 64, 100])
@pytest.mark.parametrize("size", [1, 2, 3, NEIGHBOURHOOD])
def test_neighbourhoods_are_even_runs_of_consecutive_ranks(n, size):
    topo = Topology.neighbourhoods(n, size)
    assert [r for run in topo.hosts for r in run] == list(range(n))
    lengths = [len(run) for run in topo.hosts]
    assert max(lengths) - min(lengths) <= 1
    assert topo.n_hosts == max(1, round(n / size))
    assert all(topo.host_of[r] == i for i, run in enumerate(topo.hosts) for r in run)
