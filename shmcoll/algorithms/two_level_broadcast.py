"""Two-level broadcast: shared memory inside each host, TCP between hosts.

Small (up to one_shot_bytes): the way two_level.py's small all-reduce goes. One compiled step on
each host's board, where the root's host takes the root's array and the other hosts' ranks only
meet; then the crossing columns (two_level.small_crossing: all of them between 2 hosts, else the
leaders) pass the array on from the root's host by doubling (doubling_broadcast.py, each step one
native duplex over TCP), and each leader hands it to its host's ranks of no column.

Middling (up to select.SMALL_BROADCAST_BYTES): the root hands the array to its leader, the leaders
pass it on by doubling, each leader hands it to its host: it crosses each host boundary once, where
the columns would carry it once each.

Large: one pipelined chain through the root's host, then host after host.

Each phase starts once the one before came in, so a rank that returns has heard from every rank
making the call: disagreement fails everywhere.
"""

from __future__ import annotations

import numpy as np

from ..transport.shm_board import Board
from ..transport.topology import Topology
from .barrier import dissemination_barrier
from .board import host_board_broadcast
from .broadcast import chain_broadcast
from .call import Call
from .doubling_broadcast import doubling_broadcast, give, take
from .two_level import from_leader, host_board, small_crossing


def two_level_one_shot_broadcast(c: Call, topo: Topology, root: int, data: np.ndarray) -> None:
    """A small array the way the small all-reduce goes: one step in each host (_in_host_broadcast:
    the root's host takes the root's array, the other hosts' ranks only meet), then each crossing
    column (small_crossing) passes it on from the root's host by doubling, each of a rank's steps
    one native duplex over TCP, and the leader hands it to the ranks of no column. Each phase starts
    only once the one before came in, so a rank that returns has heard, through its host's step and
    its column, from every rank making the same call: disagreement fails everywhere."""
    host = topo.local_ranks(c.rank)
    board = _in_host_broadcast(c, host, data, root if root in host else None)
    column, first = small_crossing(topo, c.rank)
    if column is not None:
        doubling_broadcast(c, data, column, topo.host_of[root])
    from_leader(c, host, board, data, first, keeps=root)


def _in_host_broadcast(c: Call, host: tuple[int, ...], data: np.ndarray, root: int | None) -> Board | None:
    """data from root (None: on another host) to the host's ranks, every one of which meets every
    other: one compiled step on the host's board, which it returns, or, for an array larger than a
    board entry, by doubling (or a barrier) over the rings; nothing for a rank alone on its host."""
    board = host_board(c.t, host)
    if board is not None and data.nbytes <= board.capacity:
        host_board_broadcast(c, data, root)
        return board
    if len(host) == 1:
        return None
    if root is None:
        dissemination_barrier(c, host)
    else:
        doubling_broadcast(c, data, host, host.index(root))
    return None


def two_level_leaders_broadcast(c: Call, topo: Topology, root: int, data: np.ndarray) -> None:
    """A small array in 2 + ceil(log2 hosts) steps, against the chain's one per rank: the root's
    host leader takes it from the root, the leaders pass it on by doubling (doubling_broadcast.py),
    each leader hands it to its host. Every other rank sends its leader an empty frame first, and
    each phase starts only once the one before came in, so a rank that returns has heard, through
    the leaders, from every rank making the same call: disagreement fails everywhere."""
    host = topo.local_ranks(c.rank)
    leader = host[0]
    if c.rank != leader:
        give(c, leader, data, c.rank == root)
        take(c, leader, data, c.rank != root)
        return
    for peer in host[1:]:
        take(c, peer, data, peer == root)
    doubling_broadcast(c, data, topo.leaders(), topo.host_of[root])
    for peer in host[1:]:
        give(c, peer, data, peer != root)


def two_level_broadcast(c: Call, topo: Topology, root: int, data: np.ndarray) -> None:
    """One pipelined chain through the root's host first, then host after host: the data crosses
    each host boundary once, and the chain's arrival and completion signals keep every rank from
    returning before the last one has the data (so disagreement fails everywhere)."""
    home = topo.local_ranks(root)
    order = [root, *(r for r in home if r != root)]
    order += [r for h in topo.hosts if h is not home for r in h]
    chain_broadcast(c, root, data, order=order)
