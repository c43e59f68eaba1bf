"""Two-level reduce-scatter and reduce: shared memory inside each host, TCP between hosts.

Reduce-scatter. The n target blocks are dealt out inside each host by local index: local rank q of
a host with L ranks owns the blocks of every rank whose local index is q modulo L, so a rank always
owns its own block on its own host. Each owner folds its host's sum of those blocks straight out of
its host peers' staged arrays (single_copy.py; around the host's ring where the host forbids it);
each owner sends every one of them to its target on another host, and every rank folds the other
hosts' partial sums into its own: among hosts of as many ranks, as one row of duplexes (the one
block out and the one in at once between two hosts; among more, each step a shift of the hosts,
folding the host before first, then the one before it), else all out, then folded in host order.
Each block crosses (hosts - 1) host boundaries, once per other host: (hosts - 1) * S bytes in all
for S bytes per rank, against a flat ring's (n - 1) / n * S per boundary it crosses.

Reduce. Slices as the large all-reduce cuts them (two_level.py: K = min_local, one per column, or
from SPREAD_FROM_BYTES one per rank of the largest host, a smaller host's ranks owning runs of
them), reduce-scattered inside each host; each slice's owners, one per host, fold it into its
owner on the root's host (its target) across hosts, and the target passes the finished slice to
the root. Across hosts the slice goes down a binomial tree (binomial.py: the target takes in
ceil(log2 H) slices of H hosts' one after another, not H - 1), or, large among many hosts, by
halving.py's reduce (the target takes in 2(H-1)/H of one slice): select.reduce_across_hosts. A
rooted call has senders that hear from nobody outside their host, so it starts with the
hierarchy's barrier: a rank that disagrees about the call (root, size, dtype) fails every rank
there instead of leaving one waiting.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..transport.base import RangeStep
from ..transport.topology import Topology
from ..types import ReduceKind
from .binomial import binomial_reduce
from .call import Call, chunk_count, segment_bounds, sub_bounds
from .direct import recv_stream, send_stream, swap_stream
from .halving import halving_reduce
from .ring import ring_reduce_scatter, scale_if_avg, summed
from .select import Algorithm, reduce_across_hosts
from .single_copy import reduce_scatter_among
from .two_level import readers_in_host, runs_owned, slices_for, two_level_agree


@functools.lru_cache(maxsize=256)
def staging_order(topo: Topology, rank: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """The target ranks in the order this rank's host stages their blocks, and the range of that
    order (in blocks) each local rank owns: local rank q owns the ranks whose local index is q mod L.
    The same at every call of a group (twice per reduce-scatter: staging and the call), so kept."""
    host = topo.local_ranks(rank)
    width = len(host)
    groups = [[t for t in range(topo.world_size) if topo.local_index(t) % width == q] for q in range(width)]
    bounds = np.cumsum([0, *(len(g) for g in groups)]).tolist()
    return tuple(t for g in groups for t in g), tuple(zip(bounds[:-1], bounds[1:]))


def stage_for_reduce_scatter(topo: Topology, rank: int, data: np.ndarray) -> np.ndarray:
    """A copy of data (n equal blocks, in rank order) with its blocks in staging order: the scratch
    array two_level_reduce_scatter works in (made up front, so the caller's data may change at once)."""
    order, _ = staging_order(topo, rank)
    return data.reshape(topo.world_size, -1)[list(order)].reshape(-1)


def two_level_reduce_scatter(c: Call, topo: Topology, staged: np.ndarray, out: np.ndarray, op: ReduceKind,
                             single_copy: bool = False) -> None:
    """out = op over every rank's block c.rank; staged comes from stage_for_reduce_scatter. With
    single_copy (config.Tuning.single_copy, alike on every rank), each rank folds the blocks it
    owns straight out of its host peers' staged arrays where the host allows it
    (single_copy.reduce_scatter_among), else the host's ranks go around its ring."""
    host, block = topo.local_ranks(c.rank), len(staged) // c.size
    order, owned = staging_order(topo, c.rank)
    ranges = [(a * block, b * block) for a, b in owned]
    first, stop = owned[host.index(c.rank)]

    def across(c: Call) -> None:
        _reduce_scatter_across(c, topo, staged, out, op, order, range(first, stop), block)

    def over_rings(c: Call) -> None:
        ring_reduce_scatter(c, staged, summed(op), host, ranges)
        across(c)

    readers = readers_in_host(c, host, single_copy)
    if readers is None:
        over_rings(c)
        return
    size = block * staged.itemsize
    reduce_scatter_among(c, readers, staged, summed(op), (first * size, stop * size), over_rings, across)


def _reduce_scatter_across(c: Call, topo: Topology, staged: np.ndarray, out: np.ndarray, op: ReduceKind,
                           order: Sequence[int], owned: range, block: int) -> None:
    """Each block of staged this rank owns (at the staging positions `owned`: its host's partial
    sums) straight to its target on another host, and the other hosts' partial sums of this rank's
    own block folded into it; out = the result. Among more than two hosts of as many ranks, all in
    one row (_shifts); else, where the one block it sends goes to the one rank it receives from (as
    between two hosts of as many ranks), both at once (swap_stream); else every block out, then
    the partial sums folded in host order."""
    at = order.index(c.rank)
    mine = staged[at * block:(at + 1) * block]
    if topo.n_hosts > 2 and topo.min_local == topo.max_local:
        steps = _shifts(topo, c.rank, block, staged.itemsize, c.chunk_bytes)
        c.t.send_recv_ranges(steps, c.tag, staged, c.code, c.meta, c.deadline, summed(op))
    else:
        _streams_across(c, topo, staged, mine, op, order, owned, block)
    scale_if_avg(c, mine, op, c.size)
    out[:] = mine


def _streams_across(c: Call, topo: Topology, staged: np.ndarray, mine: np.ndarray, op: ReduceKind,
                    order: Sequence[int], owned: range, block: int) -> None:
    """_reduce_scatter_across's blocks out and partial sums in, where no row of shifts runs them:
    both at once with the one rank this rank both sends to and receives from, else every block
    out, then the sums folded in host order."""
    host, me = topo.local_ranks(c.rank), topo.local_index(c.rank)
    sources = [other[me % len(other)] for other in topo.hosts if other is not host]
    targets = [at for at in owned if order[at] != c.rank]
    if len(targets) == 1 and sources == [order[targets[0]]]:
        swap_stream(c, sources[0], staged[targets[0] * block:(targets[0] + 1) * block], mine, summed(op))
        return
    for at in targets:
        send_stream(c, order[at], staged[at * block:(at + 1) * block])
    for src in sources:
        recv_stream(c, src, mine, summed(op))


@functools.lru_cache(maxsize=256)
def _shifts(topo: Topology, rank: int, block: int, itemsize: int, chunk_bytes: int) -> tuple[RangeStep, ...]:
    """_reduce_scatter_across's steps among more than two hosts of as many ranks each, as one row
    (Transport.send_recv_ranges): in step k (1 .. hosts - 1) this rank's host's partial sum of its
    counterpart's block k hosts on goes out to it, while the counterpart k hosts back sends its
    host's partial sum of this rank's block, which is folded in (so the other hosts' sums fold in
    that order, from the host before this one backwards). Every rank's step k is the same shift of
    the hosts, as a ring's steps are, so no step waits on a later one. The frames are
    send_stream's; the same for every call of a kind, so kept."""
    order, _ = staging_order(topo, rank)
    h, me, n = topo.host_of[rank], topo.local_index(rank), topo.n_hosts
    mine, pieces = order.index(rank) * block, chunk_count(block, itemsize, chunk_bytes)
    steps: list[RangeStep] = []
    for k in range(1, n):
        to, src = topo.hosts[(h + k) % n][me], topo.hosts[(h - k) % n][me]
        at = order.index(to) * block
        steps += [(to, src, *s, *r, True) for s, r in zip(sub_bounds(at, at + block, pieces),
                                                          sub_bounds(mine, mine + block, pieces))]
    return tuple(steps)


def two_level_reduce(c: Call, topo: Topology, root: int, data: np.ndarray, op: ReduceKind) -> None:
    """In place on root; every rank's data is scratch. Cut into slices as the large all-reduce is
    (two_level.slices_for, Topology.slice_runs), each rank takes its slices across in slice order,
    and hands those it finished to the root only after all of them: the lowest slice not yet across
    always has all its owners at it, none held up by a root still busy with its own."""
    two_level_agree(c, topo)
    host = topo.local_ranks(c.rank)
    slices = slices_for(topo, data.nbytes)
    bounds, runs = segment_bounds(len(data), slices), topo.slice_runs(slices, len(host))
    ring_reduce_scatter(c, data, summed(op), host, runs_owned(bounds, runs, len(data)))
    targets = [_on_host_of(topo, root, topo.slice_column(s, slices)) for s in range(slices)]
    mine = runs[host.index(c.rank)]
    for s in mine:
        _column_reduce(c, data[slice(*bounds[s])], op, topo.slice_column(s, slices), targets[s])
    for s in mine:
        if targets[s] == c.rank != root:
            send_stream(c, root, data[slice(*bounds[s])])
    if c.rank == root:
        for s, target in enumerate(targets):
            if target != root:
                recv_stream(c, target, data[slice(*bounds[s])])


def _on_host_of(topo: Topology, rank: int, column: tuple[int, ...]) -> int:
    """The rank of `column` (one per host) on `rank`'s host."""
    return next(r for r in column if topo.host_of[r] == topo.host_of[rank])


def _column_reduce(c: Call, piece: np.ndarray, op: ReduceKind, column: tuple[int, ...], target: int) -> None:
    """The slice's owners (`column`, one per host) fold their hosts' sums of it into `target` (its
    owner on the root's host) as select.reduce_across_hosts says; the target finishes it."""
    _REDUCE_ACROSS[reduce_across_hosts(piece.nbytes, len(column))](c, piece, summed(op), column, target)
    if c.rank == target:
        scale_if_avg(c, piece, op, c.size)


_REDUCE_ACROSS = {Algorithm.BINOMIAL: binomial_reduce, Algorithm.HALVING_DOUBLING: halving_reduce}
