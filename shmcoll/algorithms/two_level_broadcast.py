"""Two-level broadcast: shared memory inside each host, TCP between hosts.

Small (up to one_shot_bytes): the way two_level.py's small all-reduce goes. One compiled step on
each host's board, where the root's host takes the root's array and the other hosts' ranks only
meet; then the crossing columns (two_level.small_crossing: all of them between 2 hosts, else the
leaders) pass the array on from the root's host by doubling (doubling_broadcast.py, each step one
native duplex over TCP), and each leader hands it to its host's ranks of no column.

Middling (up to select.SMALL_BROADCAST_BYTES): the root hands the array to its leader, the leaders
pass it on by doubling, each leader hands it to its host: it crosses each host boundary once, where
the columns would carry it once each.

Large: in K slices, K = the smallest host's rank count, as the large all-reduce cuts it. The root's
host takes the whole array from the root (single_copy.broadcast_among, else a chain), local rank j
< K of every host carries slice j across hosts in its column by doubling, and every other host's
ranks gather the slices from their carriers (single_copy.gather_owned_among, else around the
host's ring): the array crosses each host boundary once, in K streams at once. Among many hosts
each doubling step carries the whole slice, so the root's host sends it ceil(log2 hosts) times; a
pipelined chain, or a scatter and all-gather in the column, would send it about once (not measured
here: 2 cores hold 4 hosts).

Each phase starts once the one before came in, and where a rank could otherwise return before it
has heard from every rank making the call (the large form's root host, once its columns crossed)
a barrier ends the call, so disagreement fails everywhere.
"""

from __future__ import annotations

import functools

import numpy as np

from ..transport.shm_board import Board
from ..transport.topology import Topology
from .barrier import dissemination_barrier
from .board import host_board_broadcast
from .broadcast import chain_broadcast
from .call import Call, segment_bounds
from .doubling_broadcast import doubling_broadcast, give, take
from .ring import ring_all_gather_owned
from .single_copy import broadcast_among, gather_owned_among
from .two_level import from_leader, host_board, readers_in_host, small_crossing


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


def two_level_broadcast(c: Call, topo: Topology, root: int, data: np.ndarray, single_copy: bool = False) -> None:
    """A large array in K slices, as the large all-reduce cuts it (K = the smallest host's rank
    count): every rank of the root's host takes the whole array from the root (reading it where the
    host allows, else down a chain), local rank j < K of every host passes slice j across hosts in
    its column by doubling (native duplexes), and every other host's ranks gather the slices from
    the ranks that carried them (reading them, else around the host's ring). The array crosses each
    host boundary once, in K streams at once. A barrier among all ranks ends the call, so nobody
    returns before every rank has checked every other's call (disagreement fails everywhere)."""
    host = topo.local_ranks(c.rank)
    bounds = segment_bounds(len(data), topo.min_local)
    readers = readers_in_host(c, host, single_copy)
    if root in host:
        chain = functools.partial(chain_broadcast, root=root, data=data, order=[root, *(r for r in host if r != root)])
        if readers is None:
            chain(c)
        else:
            broadcast_among(c, readers, root, data, chain)
    j = host.index(c.rank)
    if j < len(bounds):
        a, b = bounds[j]
        doubling_broadcast(c, data[a:b], topo.column(j), topo.host_of[root])
    if root not in host:
        owned = [bounds[i] if i < len(bounds) else (len(data), len(data)) for i in range(len(host))]
        rings = functools.partial(ring_all_gather_owned, data=data, ring=host, owned=owned)
        if readers is None:
            rings(c)
        else:
            gather_owned_among(c, readers, data, owned, rings)
    dissemination_barrier(c)
