"""From a validated call to a Plan: the algorithm algorithms/select.py picks, and the body that runs it.

One function per collective. Each takes arrays the ProcessGroup has already validated, allocates
what the call returns, asks `select` which algorithm runs (a choice every rank makes alike), and
returns a Plan whose body runs that algorithm and returns the call's result. Blocking calls and
their spawn_* twins share these, so both run the same algorithm on the same validated arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from .algorithms.barrier import dissemination_barrier
from .algorithms.board import board_all_gather, board_all_reduce, board_all_to_all, board_barrier, board_broadcast
from .algorithms.board_v import board_all_gather_v
from .algorithms.broadcast import chain_broadcast
from .algorithms.bruck import bruck_all_gather_blocks
from .algorithms.call import Call
from .algorithms.direct import (
    Agreement,
    agree,
    all_to_all_pairwise,
    exchange_shapes,
    gather_to_root,
    reduce_to_root,
    scatter_from_root,
)
from .algorithms.doubling_broadcast import doubling_broadcast
from .algorithms.federated import federated_average
from .algorithms.ring import (
    one_shot_all_reduce,
    ring_all_gather,
    ring_all_gather_v,
    ring_all_reduce,
    ring_reduce_scatter_blocks,
)
from .algorithms.select import NEIGHBOURHOOD, Algorithm, Setting, select, without_single_copy
from .algorithms.single_copy import (
    single_copy_all_gather,
    single_copy_all_reduce,
    single_copy_broadcast,
    single_copy_reduce_scatter,
)
from .algorithms.two_level import (
    two_level_agree,
    two_level_all_gather,
    two_level_all_gather_v,
    two_level_all_reduce,
    two_level_all_to_all,
    two_level_barrier,
    two_level_gather_heads,
    two_level_one_shot_all_reduce,
)
from .algorithms.two_level_broadcast import (
    two_level_broadcast,
    two_level_leaders_broadcast,
    two_level_one_shot_broadcast,
    two_level_scatter,
)
from .algorithms.two_level_reduce import stage_for_reduce_scatter, two_level_reduce, two_level_reduce_scatter
from .config import Tuning, one_shot_bytes_for
from .runner import Plan
from .transport.base import Transport
from .transport.frame import ROOTS_DTYPE
from .transport.topology import Topology
from .types import U8, Collective, ReduceKind, WireType
from .validate import gathered_like, storage_view

T = TypeVar("T")

#: The all-reduces that finish in one step; reduce and reduce_scatter reuse them for small arrays.
ONE_STEP = (Algorithm.BOARD, Algorithm.ONE_SHOT, Algorithm.TWO_LEVEL_ONE_SHOT)


@dataclass(frozen=True)
class Where:
    """What a plan needs to know of its group: this rank, the group's size, its hosts (the topology,
    only when the group spans several, so the two-level algorithms apply) and the selection setting."""

    rank: int
    size: int
    topology: Topology | None
    setting: Setting

    @classmethod
    def of(cls, t: Transport, tuning: Tuning) -> Where:
        topo = t.topology if t.topology is not None and t.topology.n_hosts > 1 else None
        hosts = topo.n_hosts if topo is not None else 1
        setting = Setting(hosts=hosts, board_bytes=t.board.capacity if t.board is not None else None,
                          one_shot_bytes=one_shot_bytes_for(tuning, hosts), size=t.world_size,
                          single_copy=tuning.single_copy)
        return cls(t.rank, t.world_size, topo, setting)

    @functools.cached_property
    def neighbourhoods(self) -> Topology:
        """Runs of consecutive ranks planned with as hosts, for NEIGHBOURHOODS."""
        return Topology.neighbourhoods(self.size, NEIGHBOURHOOD)

    @property
    def hosts(self) -> Topology:
        """The topology, for the two-level algorithms (select picks them only when there is one)."""
        assert self.topology is not None
        return self.topology


# ---- reductions ----

def all_reduce(w: Where, flat: np.ndarray, code: int, kind: ReduceKind, result: object) -> Plan:
    """In place over `flat` (the storage view of the caller's array); the body returns `result`."""
    reduce = all_reduce_algorithm(w, select(Collective.ALL_REDUCE, flat.nbytes, w.setting), kind)

    def body(c: Call) -> object:  # the hottest plan: no generic wrapper
        reduce(c, flat)
        return result

    return Plan(Collective.ALL_REDUCE, code, flat.size, body, kind)


def all_reduce_algorithm(w: Where, algorithm: Algorithm, kind: ReduceKind) -> Callable[[Call, np.ndarray], None]:
    """The all-reduce `algorithm` as a function of (call, data), data reduced in place (the lean
    path keeps one per kind of call)."""
    match algorithm:
        case Algorithm.BOARD:
            return lambda c, d: board_all_reduce(c, d, kind)
        case Algorithm.ONE_SHOT:
            return lambda c, d: one_shot_all_reduce(c, d, kind)
        case Algorithm.TWO_LEVEL_ONE_SHOT:
            return lambda c, d: two_level_one_shot_all_reduce(c, w.hosts, d, kind)
        case Algorithm.TWO_LEVEL:
            hosts, one_shot_bytes, single_copy = w.hosts, w.setting.one_shot_bytes, w.setting.single_copy
            return lambda c, d: two_level_all_reduce(c, hosts, d, kind, one_shot_bytes, single_copy)
        case Algorithm.NEIGHBOURHOODS:
            nearby = w.neighbourhoods
            return lambda c, d: two_level_all_reduce(c, nearby, d, kind, w.setting.one_shot_bytes)
        case Algorithm.SINGLE_COPY:
            usual = all_reduce_algorithm(w, without_single_copy(Collective.ALL_REDUCE, w.setting), kind)
            return lambda c, d: single_copy_all_reduce(c, d, kind, lambda c: usual(c, d))
    return lambda c, d: ring_all_reduce(c, d, kind)


def reduce_scatter(w: Where, arr: np.ndarray, wire: WireType, kind: ReduceKind) -> Plan:
    """Rank i gets slice i (along axis 0) of the reduction as a new array; the algorithms work on a
    copy of the input, made now, so the caller may change it at once."""
    flat = storage_view(arr, wire)
    out = np.empty((arr.shape[0] // w.size, *arr.shape[1:]), dtype=arr.dtype)
    mine = storage_view(out, wire)
    algorithm = select(Collective.REDUCE_SCATTER, flat.nbytes, w.setting)
    if algorithm in ONE_STEP:
        reduce, work, at = all_reduce_algorithm(w, algorithm, kind), flat.copy(), w.rank * mine.size

        def run(c: Call) -> None:  # reduce everything in one step, keep our slice
            reduce(c, work)
            mine[:] = work[at:at + mine.size]
    elif algorithm is Algorithm.TWO_LEVEL:
        staged = stage_for_reduce_scatter(w.hosts, w.rank, flat)
        single_copy = w.setting.single_copy
        run = lambda c: two_level_reduce_scatter(c, w.hosts, staged, mine, kind, single_copy)
    else:
        work = flat.copy()
        run = lambda c: ring_reduce_scatter_blocks(c, work, mine, kind)
        if algorithm is Algorithm.SINGLE_COPY:
            run = functools.partial(single_copy_reduce_scatter, work=work, out=mine, op=kind, fallback=run)
    return Plan(Collective.REDUCE_SCATTER, wire.code, flat.size, _returning(out, run), op=kind)


def reduce(w: Where, root: int, flat: np.ndarray, code: int, kind: ReduceKind, result: object) -> Plan:
    """In place on root; every rank's `flat` is scratch space. A one-step all-reduce leaves the
    answer everywhere, the root's copy included."""
    run = reduce_algorithm(w, select(Collective.REDUCE, flat.nbytes, w.setting), root, kind)
    return Plan(Collective.REDUCE, code, flat.size, _returning(result, run, flat), op=kind, root=root)


def reduce_algorithm(w: Where, algorithm: Algorithm, root: int,
                     kind: ReduceKind) -> Callable[[Call, np.ndarray], None]:
    """The reduce `algorithm` to `root` as a function of (call, data) (the lean path keeps one per
    kind of call): one of the one-step all-reduces, or a reduce proper."""
    if algorithm in ONE_STEP:
        return all_reduce_algorithm(w, algorithm, kind)
    if algorithm is Algorithm.TWO_LEVEL:
        return lambda c, d: two_level_reduce(c, w.hosts, root, d, kind)
    return lambda c, d: reduce_to_root(c, root, d, kind)


def federated(flat: np.ndarray, code: int, window: float) -> Plan:
    """Rank 0 averages what arrives within `window` seconds; the body returns the participant count."""
    return Plan(Collective.FEDERATED_AVERAGE, code, flat.size, lambda c: federated_average(c, flat, window))


# ---- data movement ----

def barrier(w: Where) -> Plan:
    algorithm = select(Collective.BARRIER, 0, w.setting)
    if algorithm is Algorithm.TWO_LEVEL:
        body: Callable[[Call], None] = lambda c: two_level_barrier(c, w.hosts)
    else:
        body = board_barrier if algorithm is Algorithm.BOARD else dissemination_barrier
    return Plan(Collective.BARRIER, U8.code, 0, body)  # empty uint8 frames


def broadcast(w: Where, root: int, flat: np.ndarray, code: int, result: object) -> Plan:
    cast = broadcast_algorithm(w, select(Collective.BROADCAST, flat.nbytes, w.setting), root)
    return Plan(Collective.BROADCAST, code, flat.size, _returning(result, cast, flat), root=root)


def broadcast_algorithm(w: Where, algorithm: Algorithm, root: int) -> Callable[[Call, np.ndarray], None]:
    """The broadcast `algorithm` from `root` as a function of (call, data), data overwritten in
    place on every other rank (the lean path keeps one per kind of call)."""
    match algorithm:
        case Algorithm.TWO_LEVEL:
            single_copy = w.setting.single_copy
            return lambda c, d: two_level_broadcast(c, w.hosts, root, d, single_copy)
        case Algorithm.TWO_LEVEL_LEADERS:
            return lambda c, d: two_level_leaders_broadcast(c, w.hosts, root, d)
        case Algorithm.TWO_LEVEL_ONE_SHOT:
            return lambda c, d: two_level_one_shot_broadcast(c, w.hosts, root, d)
        case Algorithm.BOARD:
            return lambda c, d: board_broadcast(c, root, d)
        case Algorithm.DOUBLING:
            return lambda c, d: doubling_broadcast(c, d, range(c.size), root)
        case Algorithm.SINGLE_COPY:
            return lambda c, d: single_copy_broadcast(c, root, d, lambda c: chain_broadcast(c, root, d))
    return lambda c, d: chain_broadcast(c, root, d)


def all_gather(w: Where, arr: np.ndarray, wire: WireType) -> Plan:
    out = gathered_like(arr, w.size)
    flat_in, flat_out = storage_view(arr, wire), storage_view(out, wire)
    gather = all_gather_algorithm(w, select(Collective.ALL_GATHER, flat_in.nbytes, w.setting))
    return Plan(Collective.ALL_GATHER, wire.code, flat_in.size, _returning(out, gather, flat_in, flat_out))


def all_gather_algorithm(w: Where, algorithm: Algorithm) -> Callable[[Call, np.ndarray, np.ndarray], None]:
    """The all-gather `algorithm` as a function of (call, local, out): out, 1-D, receives every
    rank's block in rank order (the lean path keeps one per kind of call)."""
    match algorithm:
        case Algorithm.TWO_LEVEL:
            return lambda c, local, out: two_level_all_gather(c, w.hosts, local, out, w.setting.single_copy)
        case Algorithm.BOARD:
            return board_all_gather
        case Algorithm.BRUCK:
            return bruck_all_gather_blocks
        case Algorithm.SINGLE_COPY:
            return lambda c, local, out: single_copy_all_gather(
                c, local=local, out=out, fallback=lambda c: ring_all_gather(c, local, out))
    return ring_all_gather


def gather(w: Where, root: int, arr: np.ndarray, wire: WireType) -> Plan:
    """The concatenation on root, None elsewhere. Where it runs as an all-gather (on the board, or
    small across hosts: select's TWO_LEVEL_ONE_SHOT), every rank gets it, as scratch."""
    flat_in = storage_view(arr, wire)
    algorithm = select(Collective.GATHER, flat_in.nbytes, w.setting)
    as_all_gather = _GATHER_AS_ALL_GATHER.get(algorithm)
    out = gathered_like(arr, w.size) if w.rank == root or as_all_gather is not None else None
    result = out if w.rank == root else None
    if out is not None and as_all_gather is not None:
        run = _returning(None, all_gather_algorithm(w, as_all_gather), flat_in, storage_view(out, wire))
    else:
        agreement, flat_out = _agreement(w, algorithm), storage_view(out, wire) if out is not None else None
        run = lambda c: gather_to_root(c, root, flat_in, flat_out, agreement)
    return Plan(Collective.GATHER, wire.code, flat_in.size, _returning(result, run), root=root)


#: The gathers that run as an all-gather, and the all-gather's algorithm for each.
_GATHER_AS_ALL_GATHER = {Algorithm.BOARD: Algorithm.BOARD, Algorithm.TWO_LEVEL_ONE_SHOT: Algorithm.TWO_LEVEL}


def scatter(w: Where, root: int, arr: np.ndarray | None, wire: WireType | None) -> Plan:
    """Rank i gets block i of the root's `arr` (only the root passes it, with its wire type): the
    others learn dtype and shape from the frames they receive, so the call carries neither."""
    blocks, code, user = None, ROOTS_DTYPE, None
    if arr is not None and wire is not None:
        rows, store = arr.shape[0] // w.size, arr.view(wire.storage)
        blocks = [store[j * rows:(j + 1) * rows] for j in range(w.size)]
        code, user = wire.code, arr.dtype
    algorithm = select(Collective.SCATTER, 0, w.setting)

    def body(c: Call) -> np.ndarray:
        if algorithm is Algorithm.TWO_LEVEL_DIRECT:
            got = two_level_scatter(c, w.hosts, root, blocks, code)
        else:
            got = scatter_from_root(c, root, blocks, code)
        return got.view(user) if user is not None else got  # the root's comes back as storage

    return Plan(Collective.SCATTER, ROOTS_DTYPE, 0, body, root=root)


def all_to_all(w: Where, arr: np.ndarray, wire: WireType) -> Plan:
    out = np.empty(arr.shape, dtype=arr.dtype)
    flat_in, flat_out = storage_view(arr, wire), storage_view(out, wire)
    algorithm = select(Collective.ALL_TO_ALL, flat_in.nbytes, w.setting)
    if algorithm is Algorithm.TWO_LEVEL_ONE_SHOT:
        exchange = lambda c, data, out: two_level_all_to_all(c, w.hosts, data, out)
    else:
        exchange = board_all_to_all if algorithm is Algorithm.BOARD else all_to_all_pairwise
    return Plan(Collective.ALL_TO_ALL, wire.code, flat_in.size, _returning(out, exchange, flat_in, flat_out))


def all_gather_v(w: Where, arr: np.ndarray, wire: WireType) -> Plan:
    """(concatenation, every rank's length); the call carries the elements per row, which every
    rank knows; the lengths are exchanged first (on the board, or across hosts in heads: with the
    data when all fits)."""
    shape = arr.shape if arr.ndim else (1,)
    row = int(np.prod(shape[1:], dtype=np.int64))
    flat_in = storage_view(arr, wire)
    algorithm = select(Collective.ALL_GATHER_V, flat_in.nbytes, w.setting)

    def make_out(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
        out = np.empty((sum(lengths), *shape[1:]), dtype=arr.dtype)
        return out, storage_view(out, wire)

    def body(c: Call) -> tuple[np.ndarray, list[int]]:
        if algorithm is Algorithm.BOARD_OR_RING:
            lengths, done = board_all_gather_v(c, wire.code, shape, flat_in, make_out)
        elif algorithm is Algorithm.TWO_LEVEL:
            lengths, done = two_level_gather_heads(c, w.hosts, wire.code, shape, flat_in, make_out)
        else:
            lengths, done = exchange_shapes(c, shape), None
        if done is not None:
            return done, lengths
        out, flat_out = make_out(lengths)
        sizes = [n * row for n in lengths]
        if algorithm is Algorithm.TWO_LEVEL:
            two_level_all_gather_v(c, w.hosts, flat_in, flat_out, sizes)
        else:
            ring_all_gather_v(c, flat_in, flat_out, sizes)
        return out, lengths

    return Plan(Collective.ALL_GATHER_V, wire.code, row, body)


def _returning(result: T, run: Callable[..., object], *args: object) -> Callable[[Call], T]:
    """A plan's body: run(call, *args), then return `result` (the output allocated beforehand)."""
    def body(c: Call) -> T:
        run(c, *args)
        return result
    return body


def _agreement(w: Where, algorithm: Algorithm) -> Agreement:
    """The agreement step of DIRECT (every rank with every rank) or TWO_LEVEL_DIRECT (the hierarchy's barrier)."""
    if algorithm is Algorithm.TWO_LEVEL_DIRECT:
        return lambda c: two_level_agree(c, w.hosts)
    return agree

