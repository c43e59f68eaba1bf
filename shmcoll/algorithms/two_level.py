"""Two-level collectives: shared memory inside each host, TCP between hosts.

Each collective runs in phases: an inner one among the ranks of each host (shared memory), an
outer one across hosts (TCP), and an inner one again; one copy of the data crosses each host
boundary, not one per rank. The transport routes every send by peer, so the phases only choose who
talks to whom. All phases share the call's tag: messages of one (source, tag) arrive in order and
every rank runs the phases in the same order, so a phase never takes a later phase's message.

A large all-reduce is cut into K slices, K = the smallest host's rank count: local rank j < K of
every host owns slice j and all-reduces it across hosts with its peers of the same local rank (K
rings busy at once); a larger host's extra ranks only take part inside their host. From
SPREAD_FROM_BYTES it is cut into as many slices as the largest host has ranks instead; on each
host every rank owns a run of them (Topology.slice_runs: one each on the largest host, several on
a smaller one), and each slice is all-reduced among its owners, one per host, so no rank of a
larger host idles while its peers cross. Its in-host phases read the host's peers' arrays
directly where the host allows it (single_copy.py: each rank folds its slices out of its peers'
arrays, and writes them, finished, into theirs), else they go around the host's shared-memory ring.
A small all-reduce and the barrier meet on each host's board first; then between 2 hosts local
rank j < K of every host crosses with its peers of the same local rank (its column: K exchanges at
once, each rank holding its host's result already), among more only the leaders (each host's
lowest rank, column 0) do (select.crossing_columns); the ranks of no column hear from their
leader. A small all-gather goes the same way (each host gathers its blocks on its board, the
columns gather every host's by Bruck); a large one among hosts of as many ranks in columns too
(each column's blocks gathered across hosts, by recursive doubling or around a ring, then read
straight out of the host peers' arrays), else through one leader per host. Reduce-scatter and
reduce are in two_level_reduce.py, broadcast in two_level_broadcast.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ..kept import keep
from ..transport.base import HostRange, PeerStep, Transport
from ..transport.shm_board import Board
from ..transport.topology import Topology
from ..types import U8, ReduceKind
from .barrier import dissemination_barrier, doubling_barrier
from .board import gather_on_board, host_board_all_reduce
from .board_v import HEAD_BYTES, piece_head, read_head
from .broadcast import chain_broadcast
from .bruck import bruck_all_gather
from .call import Call, segment_bounds
from .direct import SIGNAL_CODE, lengths_from
from .doubling import doubling_steps, recursive_doubling_all_reduce
from .doubling_gather import doubling_all_gather_owned
from .halving import halving_doubling_all_reduce
from .overlap import Crossing, Piece, crossing_pieces
from .ring import (
    Bounds,
    one_shot_all_reduce,
    ring_all_gather_owned,
    ring_all_reduce,
    ring_all_reduce_steps,
    ring_reduce_scatter,
    scale_if_avg,
    summed,
)
from .select import (
    Algorithm,
    across_hosts,
    crossing_columns,
    gather_across_hosts,
    gather_in_columns,
    small_across_hosts,
)
from .single_copy import (
    DESCRIPTOR_BYTES,
    OneRow,
    Readers,
    all_reduce_among,
    all_reduce_in_one_row,
    gather_blocks_among,
    one_row,
)

_NOTHING = np.empty(0, dtype=np.uint8)  # what a barrier's steps carry: only the call's description


def two_level_all_reduce(c: Call, topo: Topology, data: np.ndarray, op: ReduceKind, one_shot_bytes: int,
                         single_copy: bool = False) -> None:
    """Reduce-scatter in the host, all-reduce of each slice across hosts, all-gather in the host.
    Each element is reduced at one place and copied from there: bitwise identical everywhere.
    With single_copy (config.Tuning.single_copy, alike on every rank), the host's ranks read each
    other's arrays for the in-host phases where the host allows it (single_copy.all_reduce_among):
    every byte crosses between the host's processes once, where the rings copy it twice.
    Each rank owns a run of slices (Topology.slice_runs; slices_for) and takes them across hosts
    one after another, each among its slice's owners: every rank orders its slices alike, so the
    lowest slice not yet across always has all its owners at it."""
    divisor = c.size if op is ReduceKind.AVG else 1  # an AVG's sum is divided as it is written back
    one = _in_one_row(c, topo, data, one_shot_bytes, single_copy)
    if one is not None:
        all_reduce_in_one_row(c, one, data, summed(op), divisor)
        return
    host, owned, mine = _layout(topo, c.rank, len(data), data.itemsize, _may_overlap(c, topo, single_copy))

    def across(piece: Piece, host_range: HostRange | None = None) -> None:
        """A piece of one of this rank's slices, in bytes (_slices), summed across hosts among the
        slice's owners; where the host's ranks read each other's arrays, as the host range they
        fold (and divide for AVG as they write it back: Crossing.divisor)."""
        a, b, column = mine[piece]
        _across(c, data[a:b], summed(op), column, one_shot_bytes, host_range)

    def over_rings(c: Call) -> None:
        ring_reduce_scatter(c, data, summed(op), host, owned)
        for piece in mine:
            across(piece)
            a, b, _ = mine[piece]
            scale_if_avg(c, data[a:b], op, c.size)
        ring_all_gather_owned(c, data, host, owned)

    readers = readers_in_host(c, host, single_copy)
    if readers is None:
        over_rings(c)
        return
    all_reduce_among(c, readers, data, summed(op), over_rings,
                     Crossing(tuple(mine), across, c.t.overlap, divisor))


def _may_overlap(c: Call, topo: Topology, single_copy: bool) -> bool:
    """Whether some host may overlap its in-host work with its pieces crossing hosts, so every
    column cuts its slices in pieces (_crossing_pieces): alike on every rank."""
    return single_copy and c.t.overlap_in_group and topo.n_hosts < topo.world_size


def _in_one_row(c: Call, topo: Topology, data: np.ndarray, one_shot_bytes: int, single_copy: bool) -> OneRow | None:
    """The usual large all-reduce as single_copy.all_reduce_in_one_row runs it, where its host's
    ranks have agreed to read each other's arrays, this rank's slice crosses hosts whole around a
    ring, and the transport runs that ring as a native row: worked out once per kind of call and
    kept on the host's board; None where the call is not that (all_reduce_among runs it, as it
    runs a kind's first call, where the host agrees). 2 + 2 ranks on 2 cores (simulated hosts),
    blocks of calls alternating in one job, this way against all_reduce_among's: 1 MiB 1370 against
    1475 us per call (CPU per rank 676 against 722), AVG 1447 against 1508, 4 MiB 4986 against
    5133, 512 KiB even (its range of 256 KiB comes back through the row, where all_reduce_among
    writes it back after: ROW_FOLDS_FROM_BYTES)."""
    board = c.t.host_board
    if board is None or not board.single_copy_agreed:
        return None
    key = (OneRow, c.meta[1:], c.code, one_shot_bytes, single_copy, c.chunk_bytes)
    one = board.kept.get(key)
    if one is None:
        one = keep(board.kept, key, _one_row(c, topo, data, one_shot_bytes, single_copy), ONE_ROWS_KEPT)
    return one if isinstance(one, OneRow) and one.row is not None else None


#: Kinds of large all-reduce a host's board keeps a OneRow (or that it is not one) for.
ONE_ROWS_KEPT = 64


def _one_row(c: Call, topo: Topology, data: np.ndarray, one_shot_bytes: int, single_copy: bool) -> OneRow | bool:
    """_in_one_row's OneRow for calls like c, or False where they are not the usual call."""
    host, _, mine = _layout(topo, c.rank, len(data), data.itemsize, _may_overlap(c, topo, single_copy))
    readers = readers_in_host(c, host, single_copy)
    if readers is None or readers.board.host_ranks != host or len(mine) != 1:
        return False
    (piece, (a, b, column)), = mine.items()
    if across_hosts(piece[1] - piece[0], one_shot_bytes, len(column)) is not Algorithm.RING:
        return False
    ring = ring_all_reduce_steps(column, c.rank, b - a, data.itemsize, c.chunk_bytes)
    return one_row(c, readers, data, piece, (a, b), ring, c.t.prepare_range_row(ring, data.itemsize))


#: Bytes from which a large all-reduce across uneven hosts cuts as many slices as the largest host
#: has ranks, so each rank of a larger host takes one across, where below it the larger host's
#: ranks past the smallest host's count idle across hosts while one peer folds, carries and writes
#: back their share too. Spread, the smaller host's ranks cross several slices one after another:
#: more steps, which a small call pays for (`--layout 1+3,1+2 --columns hier,openmpi --rounds 2`,
#: alternating, ms, spread / not): on links of 4 Gbit/s, 1 + 3 64 MiB 184-188 / 197-213, 32 MiB
#: 92-99 / 99-102, 16 MiB 47.5-50.8 / 51.3-51.7, 1 MiB 4.4-4.6 / 4.0-4.4; 1 + 2 64 MiB 164-169 /
#: 181. Between namespaces on 2 cores, where the copies of the link take the cores the spread ranks
#: want: 1 + 3 1 MiB 3.2-3.9 / 2.9-3.2, 16 MiB 34-40 / 30-32, 32 MiB 61-63 / 57-66, 64 MiB 111-128
#: / 117-122; 1 + 2 1 MiB 2.3-3.0 / 1.9-2.0.
SPREAD_FROM_BYTES = 32 << 20


def slices_for(topo: Topology, nbytes: int) -> int:
    """How many slices a large all-reduce of nbytes per rank cuts its array into across hosts: one
    per rank of the smallest host, or from SPREAD_FROM_BYTES one per rank of the largest."""
    return topo.max_local if nbytes >= SPREAD_FROM_BYTES else topo.min_local


def _slices(count: int, itemsize: int, slices: int, runs: tuple[range, ...],
            may_overlap: bool) -> tuple[tuple[Bounds, ...], tuple[dict[Piece, int], ...]]:
    """For a large all-reduce of count elements cut into `slices`, of which each local index of a
    host owns a run (`runs`): the element range each owns, and the pieces (in bytes) its slices
    cross hosts in, each with its slice, empty slices left out (nothing crosses for them)."""
    bounds = segment_bounds(count, slices)
    owned = runs_owned(bounds, runs, count)
    pieces = tuple({piece: s for s in run if bounds[s][1] > bounds[s][0]
                    for piece in _crossing_pieces(may_overlap, (bounds[s][0] * itemsize, bounds[s][1] * itemsize),
                                                  itemsize)} for run in runs)
    return owned, pieces


@functools.lru_cache(maxsize=256)
def _layout(topo: Topology, rank: int, count: int, itemsize: int, may_overlap: bool
            ) -> tuple[tuple[int, ...], tuple[Bounds, ...], dict[Piece, tuple[int, int, tuple[int, ...]]]]:
    """A large all-reduce's layout at `rank`, the same for every call of a kind, so kept: its host,
    the element range each local index owns (_slices), and the pieces (in bytes) its slices cross
    hosts in, each with its elements and the ranks it crosses among (its slice's owners)."""
    host = topo.local_ranks(rank)
    slices = slices_for(topo, count * itemsize)
    owned, pieces = _slices(count, itemsize, slices, topo.slice_runs(slices, len(host)), may_overlap)
    mine = {piece: (piece[0] // itemsize, piece[1] // itemsize, topo.slice_column(s, slices))
            for piece, s in pieces[host.index(rank)].items()}
    return host, owned, mine


def runs_owned(bounds: Sequence[Bounds], runs: Sequence[range], count: int) -> tuple[Bounds, ...]:
    """The element range each run of slices (of `bounds`, cutting count elements) covers; an empty
    run, an empty range at the end."""
    return tuple((bounds[run[0]][0], bounds[run[-1]][1]) if run else (count, count) for run in runs)


def _crossing_pieces(may_overlap: bool, byte_range: Piece, itemsize: int) -> list[Piece]:
    """The pieces a slice crosses hosts in, cut alike by all its owners (whether their hosts read
    their peers, take their rings or have them alone): overlap.crossing_pieces where some host may
    overlap them with reading its peers (may_overlap: single copy is on, some host has several
    ranks and some rank of the group overlaps, alike on every rank), else one, since in turn pieces
    only add steps across hosts (4 hosts of one rank, 4 MiB: 11.8-12.9 ms in pieces against
    10.4-11.7; 2 + 2 ranks on 2 cores, 16 MiB, alternating: 27.6-31.2 ms whole against 28.0-34.0)."""
    return crossing_pieces(byte_range, itemsize) if may_overlap else [byte_range]


def readers_in_host(c: Call, host: tuple[int, ...], single_copy: bool) -> Readers | None:
    """The host's ranks as they read each other's arrays in a large call's in-host phases; None
    where they go around the host's ring instead: without single_copy, or a board to meet on."""
    board = host_board(c.t, host)
    if not single_copy or board is None or board.capacity < DESCRIPTOR_BYTES:
        return None
    return Readers.of_host(c, board, host)


def _across(c: Call, piece: np.ndarray, op: ReduceKind, ranks: tuple[int, ...], one_shot_bytes: int,
            host_range: HostRange | None) -> None:
    """piece all-reduced among ranks, one per host; a host range (the in-host fold still to do) goes
    with a ring's row, and is folded first for any other algorithm."""
    algorithm = across_hosts(piece.nbytes, one_shot_bytes, len(ranks))
    if algorithm is Algorithm.RING:
        ring_all_reduce(c, piece, op, ranks, host_range)
        return
    if host_range is not None:
        host_range.fold_rest()
    _ALL_REDUCE_ACROSS[algorithm](c, piece, op, ranks)


AcrossHosts = Callable[[Call, np.ndarray, ReduceKind, Sequence[int]], None]
_ALL_REDUCE_ACROSS: dict[Algorithm, AcrossHosts] = {
    Algorithm.ONE_SHOT: one_shot_all_reduce, Algorithm.RING: ring_all_reduce,
    Algorithm.RECURSIVE_DOUBLING: recursive_doubling_all_reduce,
    Algorithm.HALVING_DOUBLING: halving_doubling_all_reduce}


def two_level_one_shot_all_reduce(c: Call, topo: Topology, data: np.ndarray, op: ReduceKind) -> None:
    """Latency first: one step in the host (on its board, where the array fits, else one-shot),
    which leaves every rank there with its host's sum; one-shot (or recursive doubling) in each
    crossing column (small_crossing), in host order, so every column folds the same sums alike;
    the leader hands the result to the ranks of no column."""
    host = topo.local_ranks(c.rank)
    board = _in_host_step(c, host, data, summed(op))
    column, first = small_crossing(topo, c.rank)
    if column is not None:
        column_all_reduce(topo.n_hosts)(c, data, summed(op), column)
    from_leader(c, host, board, data, first)
    scale_if_avg(c, data, op, c.size)


def small_crossing(topo: Topology, rank: int) -> tuple[tuple[int, ...] | None, int]:
    """Whom `rank` crosses hosts with in a small all-reduce or barrier: its column, or None where it
    hears from its leader; and the local index from which its host's leader hands the result on."""
    crossing = crossing_columns(topo.n_hosts, topo.min_local)
    j = topo.local_index(rank)
    return (topo.column(j) if j < crossing else None), crossing


def column_all_reduce(hosts: int) -> AcrossHosts:
    """The small all-reduce's step among one rank per host (a column): f(c, data, op, column)."""
    return _ALL_REDUCE_ACROSS[small_across_hosts(hosts)]


def column_steps(column: Sequence[int], rank: int) -> tuple[PeerStep, ...] | None:
    """The small all-reduce's steps in `rank`'s column as one row of Transport.exchanges(), where
    column_all_reduce runs nothing else: two hosts' one-shot (one exchange), or recursive
    doubling's; else None."""
    n = len(column)
    if n > 2 and small_across_hosts(n) is not Algorithm.RECURSIVE_DOUBLING:
        return None
    return doubling_steps(column, rank)


def _in_host_step(c: Call, host: tuple[int, ...], data: np.ndarray, op: ReduceKind) -> Board | None:
    """data reduced among the host's ranks in one step: on the host's board (one compiled step),
    which it returns, or, for an array larger than a board entry, by one-shot over the rings."""
    board = host_board(c.t, host)
    if board is not None and data.nbytes <= board.capacity:
        host_board_all_reduce(c, data, op)
        return board
    one_shot_all_reduce(c, data, op, host)
    return None


def host_board(t: Transport, host: tuple[int, ...]) -> Board | None:
    """The board this host's ranks can meet on in one step: none for a rank alone on its host, or
    without shared memory (TCP only)."""
    return t.host_board if len(host) > 1 else None


def from_leader(c: Call, host: tuple[int, ...], board: Board | None, data: np.ndarray, first: int = 1,
                keeps: int | None = None) -> None:
    """The host's leader hands data to the host's ranks from local index `first` on (those of no
    crossing column), which receive it; `keeps` (a broadcast's root) has it already and gets an
    empty frame, which still tells it that the call went through everywhere. Where the host step ran
    on `board`, the leader first waits for them to leave it: a rank still between board waits would
    take these frames for another call's."""
    if c.rank == host[0] and first < len(host):
        if board is not None:
            board.wait_all_finished(c.meta.seq, c.deadline, lambda: c.t.check_health(True))
        for peer in host[first:]:
            c.t.send(peer, c.tag, _NOTHING if peer == keeps else data, c.code, c.meta, c.deadline)
    elif host.index(c.rank) >= first:
        c.t.recv_into(host[0], c.tag, _NOTHING if c.rank == keeps else data, c.code, c.deadline, c.meta)


def two_level_all_gather(c: Call, topo: Topology, local: np.ndarray, out: np.ndarray,
                         single_copy: bool = False) -> None:
    """out receives every rank's equal-sized block in rank order (see two_level_all_gather_v)."""
    two_level_all_gather_v(c, topo, local, out, [len(local)] * c.size, single_copy)


def two_level_all_to_all(c: Call, topo: Topology, data: np.ndarray, out: np.ndarray) -> None:
    """A small all_to_all across hosts the way board_all_to_all runs one on a host: every rank's
    whole input (n equal blocks) gathered by every rank, by the small all-gather's steps, which
    keeps block `rank` of each (select.GATHER_EVERYTHING_BYTES)."""
    everything = np.empty(len(data) * c.size, dtype=data.dtype)
    two_level_all_gather(c, topo, data, everything)
    block = len(data) // c.size
    out.reshape(c.size, block)[...] = everything.reshape(c.size, c.size, block)[:, c.rank]


def two_level_all_gather_v(c: Call, topo: Topology, local: np.ndarray, out: np.ndarray, sizes: list[int],
                           single_copy: bool = False) -> None:
    """Gather in the host, exchange whole hosts' blocks across hosts, hand the rest out. Rank r
    contributes sizes[r] elements (any, even zero); out holds them in rank order. A small total
    goes the small all-reduce's way (_all_gather_by_columns); a large one, among hosts of as many
    ranks with single_copy (config.Tuning.single_copy, alike on every rank), in columns
    (_all_gather_in_columns), else around the host's ring and the leaders' (gather_across_hosts).
    An all_gather_v passes no single_copy: its lengths took this call's step on the host's board
    already (two_level_gather_heads), where the columns' blocks would be read.

    The blocks are staged in host order, so each host's blocks are contiguous; when ranks are
    already numbered host by host (the launcher's placement) the staging area is `out` itself.
    """
    lay = _gather_layout(topo, tuple(sizes), c.rank)
    staged = out if lay.in_place else np.empty_like(out)
    staged[slice(*lay.staged_at[c.rank])] = local
    form = gather_across_hosts(staged.nbytes)
    if form is Algorithm.TWO_LEVEL_ONE_SHOT:
        _all_gather_by_columns(c, topo, staged, lay.blocks, lay.spans)
    elif single_copy and topo.min_local == topo.max_local:
        _all_gather_in_columns(c, topo, staged, lay.staged_at)
    else:
        host = topo.local_ranks(c.rank)
        ring_all_gather_owned(c, staged, host, lay.blocks)
        if c.rank == host[0]:
            ring_all_gather_owned(c, staged, topo.leaders(), lay.spans)
        lo, hi = lay.spans[topo.host_of[c.rank]]
        for a, b in ((0, lo), (hi, len(staged))):
            chain_broadcast(c, host[0], staged[a:b], order=host)
    if staged is not out:
        for r, (a, b) in enumerate(lay.staged_at):
            out[lay.starts[r]:lay.starts[r] + b - a] = staged[a:b]


def _all_gather_in_columns(c: Call, topo: Topology, staged: np.ndarray,
                           staged_at: Sequence[tuple[int, int]]) -> None:
    """A large all-gather among hosts of as many ranks: each column (local rank j of every host)
    gathers its members' blocks across hosts (select.gather_in_columns: by recursive doubling
    among a power of two of hosts, else around a ring), all columns at once, then each rank
    reads the blocks its host peers' columns brought straight out of their arrays
    (single_copy.gather_blocks_among; where the host forbids it, around the host's ring once per
    host). Every block crosses to each other host once, as through the leaders, but in K streams,
    and reaches each host peer in one copy, where the leaders' way went around the host's ring
    before and after the crossing and handed the other hosts' blocks on down a chain: 2 + 2
    simulated hosts on 2 cores, alternating, 1 MiB per rank 2.7-2.9 ms against 5.0-5.2, 4 MiB
    10.8-11.7 against 16.2-16.7; between namespace hosts, 16 MiB gathered, 0.56-0.71x OpenMPI's
    time against 1.16-1.24x."""
    host = topo.local_ranks(c.rank)
    brought = [tuple(staged_at[r] for r in topo.column(j)) for j in range(len(host))]
    j = host.index(c.rank)
    doubles = gather_in_columns(len(topo.hosts)) is Algorithm.DOUBLING_GATHER
    (doubling_all_gather_owned if doubles else ring_all_gather_owned)(c, staged, topo.column(j), brought[j])
    if len(host) == 1:
        return

    def around_the_host(c: Call) -> None:
        for h in range(len(topo.hosts)):
            ring_all_gather_owned(c, staged, host, [blocks[h] for blocks in brought])

    readers = readers_in_host(c, host, True)
    if readers is None:
        around_the_host(c)
    else:
        gather_blocks_among(c, readers, staged, brought, around_the_host)


class _GatherLayout(NamedTuple):
    """Where a two-level all-gather(_v) stages every rank's block (in host order)."""

    in_place: bool  # ranks numbered host by host: out itself is the staging area
    staged_at: tuple[tuple[int, int], ...]  # each rank's block in the staging area, by rank
    starts: tuple[int, ...]  # each rank's block's start in out, by rank
    blocks: tuple[tuple[int, int], ...]  # the staged blocks of this rank's host, in host order
    spans: tuple[tuple[int, int], ...]  # each host's staged blocks together, by host


@functools.lru_cache(maxsize=256)
def _gather_layout(topo: Topology, sizes: tuple[int, ...], rank: int) -> _GatherLayout:
    """The layout of an all-gather of `sizes` elements per rank, alike for every call of a kind,
    so kept."""
    order = [r for h in topo.hosts for r in h]
    at = dict(zip(order, np.cumsum([0, *(sizes[r] for r in order)]).tolist()))
    staged_at = tuple((at[r], at[r] + sizes[r]) for r in range(len(sizes)))
    return _GatherLayout(order == sorted(order), staged_at, tuple(np.cumsum([0, *sizes]).tolist()),
                         tuple(staged_at[r] for r in topo.local_ranks(rank)),
                         tuple((staged_at[h[0]][0], staged_at[h[-1]][1]) for h in topo.hosts))


def _all_gather_by_columns(c: Call, topo: Topology, staged: np.ndarray, blocks: Sequence[tuple[int, int]],
                           spans: Sequence[tuple[int, int]]) -> None:
    """The small all-reduce's shape: every rank of a host gathers the host's blocks in one step (on
    its board, _gather_in_host), the crossing columns (small_crossing) gather every host's span by
    Bruck, and each leader hands the whole array to the ranks of no column. Every rank heard, through
    its host's step and its column or its leader, from every rank before it returns."""
    host = topo.local_ranks(c.rank)
    board = _gather_in_host(c, host, staged, blocks)
    column, first = small_crossing(topo, c.rank)
    if column is not None:
        bruck_all_gather(c, staged, spans, column)
    from_leader(c, host, board, staged, first)


def _gather_in_host(c: Call, host: tuple[int, ...], staged: np.ndarray,
                    blocks: Sequence[tuple[int, int]]) -> Board | None:
    """Every host rank's block (blocks: the host's, back to back in staged) into every host rank's
    staged: on the host's board, which it returns, where every block fits an entry (in one compiled
    step where the blocks are equal); else by Bruck over the rings. Each host decides for itself:
    both leave the same array on every rank. A board holds one entry per rank and call, so where
    this call took a step there already (all_gather_v's lengths, gathered the same way first), its
    blocks go over the rings once no host peer still waits there."""
    board = host_board(c.t, host)
    sizes = {b - a for a, b in blocks}
    used = board is not None and board.published(c.rank, c.meta.seq)
    if board is None or used or max(sizes) * staged.itemsize > board.capacity:
        if board is not None and used:
            board.wait_all_finished(c.meta.seq, c.deadline, lambda: c.t.check_health(True))
        bruck_all_gather(c, staged, blocks, host)
        return None
    mine = host.index(c.rank)
    if len(sizes) == 1:
        gather_on_board(c, board, staged[blocks[0][0]:blocks[-1][1]], staged[slice(*blocks[mine])],
                        lambda: c.t.host_board_guard(c.tag, c.meta))
        return board
    guard = c.t.host_board_guard(c.tag, c.meta)
    board.publish(c.meta, c.code, staged[slice(*blocks[mine])], c.deadline, guard)
    for i, (src, (a, b)) in enumerate(zip(host, blocks)):
        if i != mine:
            staged[a:b] = board.read_any_size(src, c.meta.seq, c.meta, c.deadline, guard).view(staged.dtype)
    board.finish(c.meta.seq)
    return board


def two_level_barrier(c: Call, topo: Topology) -> None:
    """Host barrier, then across hosts: nobody leaves before every host's ranks all arrived. On the
    host's board that is one compiled step, then a doubling barrier in each crossing column
    (small_crossing: each holds one rank of every host, which left its host's step), then the
    leader's word to the ranks of none; without a board (TCP only), dissemination barriers in the
    host and a doubling barrier among the leaders between them."""
    host = topo.local_ranks(c.rank)
    board = host_board(c.t, host)
    if board is None:
        dissemination_barrier(c, host)
        if c.rank == host[0]:
            doubling_barrier(c, topo.leaders())
        dissemination_barrier(c, host)
        return
    host_board_all_reduce(c, _NOTHING, ReduceKind.SUM)
    column, first = small_crossing(topo, c.rank)
    if column is not None:
        doubling_barrier(c, column)
    from_leader(c, host, board, _NOTHING, first)


def two_level_agree(c: Call, topo: Topology) -> None:
    """The agreement step of rooted calls (direct.agree) across hosts: the hierarchy's barrier. Every
    frame carries the call's description and a rank leaves only after hearing, through its host's
    board and its column (or its leader), from every rank, with at most K messages per host pair
    (K ranks per host) instead of one per rank pair."""
    two_level_barrier(c._replace(code=SIGNAL_CODE), topo)


#: Bytes of each rank's head in an all_gather_v across hosts (two_level_gather_heads): its piece's
#: dtype and shape, and the piece itself where it fits. 2 + 2 simulated hosts on 2 cores, 8-byte
#: pieces: 612-628 us, where the shapes and then the pieces, each gathered in a step of their own
#: (the second off the board, which a call may take once), took 935-1074.
GATHER_V_HEAD_BYTES = 1024


def two_level_gather_heads(c: Call, topo: Topology, code: int, shape: tuple[int, ...], local: np.ndarray,
                           make_out: Callable[[list[int]], tuple[np.ndarray, np.ndarray]]
                           ) -> tuple[list[int], np.ndarray | None]:
    """all_gather_v's first step across hosts, as board_v.board_all_gather_v's on one host: every
    rank's head (its piece's shape, and the piece where it fits in GATHER_V_HEAD_BYTES) gathered by
    every rank in one small all-gather (two_level_all_gather). All see all heads, so all know alike
    every rank's length (CollectiveMismatch everywhere where trailing dimensions differ) and whether
    every piece came along: then the result (make_out(lengths) allocates it and its 1-D storage
    view), else None, and two_level_all_gather_v gathers the pieces."""
    fits = HEAD_BYTES + local.nbytes <= GATHER_V_HEAD_BYTES
    mine = np.zeros(GATHER_V_HEAD_BYTES, dtype=np.uint8)
    mine[:HEAD_BYTES] = piece_head(fits, code, shape).view(np.uint8)
    if fits:
        mine[HEAD_BYTES:HEAD_BYTES + local.nbytes] = local.view(np.uint8)
    heads = np.empty((c.size, GATHER_V_HEAD_BYTES), dtype=np.uint8)
    two_level_all_gather(c._replace(code=U8.code), topo, mine, heads.reshape(-1))
    described = heads[:, :HEAD_BYTES].copy().view(np.int64).tolist()  # one list of words per rank
    entries = [read_head(words, src) for src, words in enumerate(described)]
    lengths = lengths_from([piece_shape for _, _, piece_shape in entries], shape)
    if not all(piece_fits for piece_fits, _, _ in entries):
        return lengths, None
    out, flat = make_out(lengths)
    raw, at = flat.view(np.uint8), 0
    for src, (_, _, piece_shape) in enumerate(entries):
        nbytes = math.prod(piece_shape) * flat.itemsize
        raw[at:at + nbytes] = heads[src, HEAD_BYTES:HEAD_BYTES + nbytes]
        at += nbytes
    return lengths, out
