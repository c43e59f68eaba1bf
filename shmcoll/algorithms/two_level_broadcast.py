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

A scatter across hosts starts as a small broadcast (two_level_scatter): only the root knows its
blocks' dtype and shape, so it broadcasts them in SCATTER_HEAD_BYTES, with every block where all
fit; the broadcast is also the call's agreement step.
"""

from __future__ import annotations

import functools

import numpy as np

from ..transport.frame import MAX_NDIM
from ..transport.shm_board import Board
from ..transport.topology import Topology
from ..types import U8, WIRE_TYPES
from .barrier import dissemination_barrier
from .board import host_board_broadcast
from .broadcast import chain_broadcast
from .call import Call, segment_bounds
from .direct import block_description, recv_stream, send_stream, shape_header
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


#: Bytes a scatter across hosts broadcasts first: the blocks' dtype code and shape, and every
#: block where they fit after them. A small broadcast takes about the time of the agreement step
#: it replaces, and grows slowly with its size: between namespace hosts on 2 cores
#: (bench/hosts_compare.py --collective scatter, us per call, 2 x 2 and 4 x 1, alternating), with
#: this head of 16 KiB a scatter of 4 KiB in all took 442-465 against 705-785 with a head of 4 KiB
#: (which it did not fit), 256 KiB 828-962 against 793-873, 1 MiB 1375-1520 against 1292-1537;
#: with 64 KiB, 32 B took 465-513 against 426-442 and 1 MiB 1545-1640.
SCATTER_HEAD_BYTES = 16 << 10
_FITS, _DESCRIPTION = 0, 8  # byte offsets in the head: the flag, then [code, ndim, dim0, ...]
_BLOCKS_AT = 8 * (3 + MAX_NDIM)  # where the blocks start, where they fit


def two_level_scatter(c: Call, topo: Topology, root: int, blocks: list[np.ndarray] | None,
                      code: int) -> np.ndarray:
    """Rank j's block j of the root's `blocks` (n-d storage arrays of wire dtype `code`, alike in
    shape): the root broadcasts their description, and all of them where they fit
    (SCATTER_HEAD_BYTES), the small broadcast's way (two_level_one_shot_broadcast, which is also
    the call's agreement: a rank that returns has heard from every rank making it); where they do
    not fit, it then sends each rank its block straight. Returns the block as scatter_from_root
    does: in storage dtype on the root, the wire's user dtype elsewhere."""
    head = np.zeros(SCATTER_HEAD_BYTES, dtype=np.uint8)
    if c.rank == root:
        assert blocks is not None, "the root passes its blocks"
        _describe(head, blocks, code)
    two_level_one_shot_broadcast(c._replace(code=U8.code), topo, root, head)
    code, shape = block_description(head[_DESCRIPTION:_BLOCKS_AT].view(np.int64), root)
    fits = bool(head[_FITS])
    if c.rank == root:
        assert blocks is not None
        if not fits:
            for k in range(1, c.size):
                j = (root + k) % c.size
                send_stream(c._replace(code=code), j, blocks[j].reshape(-1))
        return blocks[root].copy()
    wire = WIRE_TYPES[code]
    out = np.empty(shape, dtype=wire.array_dtype)
    flat = out.reshape(-1).view(wire.storage)
    if fits:
        at = _BLOCKS_AT + c.rank * flat.nbytes
        flat.view(np.uint8)[:] = head[at:at + flat.nbytes]
    else:
        recv_stream(c._replace(code=code), root, flat)
    return out


def _describe(head: np.ndarray, blocks: list[np.ndarray], code: int) -> None:
    """The root's head: its blocks' dtype code and shape, and the blocks after them where all fit."""
    described = np.concatenate([[code], shape_header(blocks[0].shape)])
    head[_DESCRIPTION:_DESCRIPTION + described.nbytes] = described.view(np.uint8)
    size = blocks[0].nbytes
    if _BLOCKS_AT + len(blocks) * size <= len(head):
        head[_FITS] = 1
        for j, block in enumerate(blocks):
            at = _BLOCKS_AT + j * size
            head[at:at + size] = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
