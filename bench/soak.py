"""Soak: thousands of random calls of every kind the contract has, every result checked exactly.

    shmcoll-run -n 3 python bench/soak.py --minutes 10 [--transport shm|tcp|hier] [--hosts H] [--seed 1]

Every rank draws the same sequence of calls from a shared seed: the kind (each collective of
ProcessGroup, blocking or spawned, all_reduce_typed, the object collectives, federated_average,
send/recv and send_f32/recv_f32 exchanges under user tags, split and close), the group (the world,
or one of up to four live sub-groups made by split along the way, nested ones included, and closed
along the way), dtype, op, shape (0 bytes to --max-bytes, 1-D or 2-D) and root. Each rank builds
its input from (seed, call, its world rank), so every rank can compute the exact expected result
of every call locally: reductions take small integers, so sums and products are exact in every
dtype and any reduction order; data movement takes random bits, compared bit for bit.

Spawned calls stay in flight (up to three, on any groups) while later calls run, blocking ones on
the same group queuing behind them; the caller leaves their data alone until join (but for
spawn_reduce_scatter, whose data is copied at the spawn: the soak overwrites it at once), and a
sub-group's are joined before it is closed. Rank 0 prints how many calls of each kind ran (the
"kinds:" line), how many sub-groups were made and how many calls ran on them, and the wrong
elements and resident memory of every rank after the first 500 calls and at the end (it must not
grow), and its peak. A rank that sees wrong elements names its first such calls on stderr. Exit
status 1 on any wrong result.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

import shmcoll
from shmcoll import DType, ProcessGroup, ReduceKind
from shmcoll.config import load_config
from shmcoll.types import TAG_RESERVED_BASE, bfloat16

BFLOAT16 = bfloat16()  # the soak covers bfloat16 whenever ml_dtypes is installed
FLOATS: list[np.dtype] = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
if BFLOAT16 is not None:
    FLOATS.append(BFLOAT16)
REDUCIBLE = FLOATS + [np.dtype(np.int32), np.dtype(np.int64)]
#: Data movement takes any fixed-size numeric or bool dtype (API.md, "Inputs").
MOVABLE = REDUCIBLE + [np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.uint64,
                                             np.bool_, np.complex64, np.complex128)]
INT_OPS = [ReduceKind.SUM, ReduceKind.PROD, ReduceKind.MIN, ReduceKind.MAX]
#: all_reduce_typed's element types, by the numpy dtype the soak builds its bytes from.
TYPED: dict[np.dtype, DType] = {
    np.dtype(np.float16): DType.F16, np.dtype(np.float32): DType.F32, np.dtype(np.float64): DType.F64,
    **({BFLOAT16: DType.BF16} if BFLOAT16 is not None else {})}
#: Calls after which each rank samples its resident memory: doubling steps tell growth from a plateau.
SAMPLE_AT = [500 * 2 ** k for k in range(8)]
#: Sub-groups alive at once, besides the world: enough to overlap, few enough to be drawn on often.
MAX_LIVE_SUBGROUPS = 4
#: federated_average's deadline: far beyond any arrival, so every rank is counted and the result is exact.
FEDERATED_DEADLINE_S = 60.0
#: Third seed entry of the streams every rank of a call shares (above any world rank, whose inputs use theirs).
SHARED = 1 << 30

Check = Callable[[Any], int]


@dataclass(frozen=True)
class Case:
    """One drawn call, alike on every rank: the input of group rank i comes from (seed, call, members[i])."""

    seed: int
    call: int
    members: tuple[int, ...]  # world ranks, in the group's rank order
    dtype: np.dtype
    op: ReduceKind
    rows: int
    tail: tuple[int, ...]  # trailing dimensions: () for a 1-D array
    root: int  # a group rank

    @property
    def size(self) -> int:
        """The group's world_size."""
        return len(self.members)

    def in_blocks(self) -> Case:
        """The case with rows cut to a multiple of the group size (reduce_scatter, scatter, all_to_all)."""
        return replace(self, rows=self.rows - self.rows % self.size)

    def shared(self, purpose: int) -> np.random.Generator:
        """A stream every rank of this call draws alike (lengths, peers, tags)."""
        return np.random.default_rng((self.seed, self.call, SHARED + purpose))

    def operand(self, rank: int) -> np.ndarray:
        """Group rank's input to a reduction: small integers, so every dtype and fold order is exact."""
        high = 2 if self.op is ReduceKind.PROD else 8
        rng = np.random.default_rng((self.seed, self.call, self.members[rank]))
        ints = rng.integers(-high, high + 1, size=(self.rows, *self.tail))
        return ints.astype(np.float64).astype(self.dtype)

    def reduced(self) -> np.ndarray:
        """op over every member's operand, folded in float64 (exact) and rounded once to the dtype."""
        stack = np.stack([self.operand(r).astype(np.float64) for r in range(self.size)])
        folds: dict[ReduceKind, Callable[..., np.ndarray]] = {
            ReduceKind.SUM: np.sum, ReduceKind.AVG: np.sum, ReduceKind.PROD: np.prod, ReduceKind.MIN: np.min,
            ReduceKind.MAX: np.max}
        fold = folds[self.op](stack, axis=0)
        return (fold / self.size if self.op is ReduceKind.AVG else fold).astype(self.dtype)

    def payload(self, rank: int, part: int = 0, rows: int | None = None) -> np.ndarray:
        """Group rank's data to move: random bits (NaN payloads, -0.0 and all), bools as 0 or 1."""
        shape = (self.rows if rows is None else rows, *self.tail)
        rng = np.random.default_rng((self.seed, self.call, self.members[rank], part))
        if self.dtype == np.bool_:
            return rng.integers(0, 2, size=shape).astype(np.bool_)
        raw = bytearray(rng.bytes(int(np.prod(shape)) * self.dtype.itemsize))
        return np.frombuffer(raw, dtype=self.dtype).reshape(shape)


def wrong_elements(got, want: np.ndarray) -> int:
    """Elements that differ bit for bit (so -0.0 and NaN payloads count too); all when dtype or shape is off."""
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
        return max(want.size, 1)
    if want.size == 0:
        return 0
    bits = np.ascontiguousarray(got).view(np.uint8).reshape(want.size, -1)
    return int(np.count_nonzero((bits != np.ascontiguousarray(want).view(np.uint8).reshape(want.size, -1)).any(1)))


def in_place_wrong(got, data: np.ndarray, want: np.ndarray) -> int:
    """An in-place call: the result must be in `data`, and what the call returned must be it too."""
    return wrong_elements(data, want) + (0 if got is data else wrong_elements(got, want))


def blocks(arr: np.ndarray, n: int) -> list[np.ndarray]:
    """arr split along axis 0 into n equal blocks, as the block collectives split it."""
    return np.split(arr, n) if len(arr) else [arr] * n


# ---- collectives that have a spawn_ form: each returns (what the call returned, its check) ----

def all_reduce_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """In place on every rank, bitwise alike everywhere."""
    data, want = case.operand(g.rank), case.reduced()
    run = g.spawn_all_reduce if spawn else g.all_reduce
    return run(data, case.op), lambda got: in_place_wrong(got, data, want)


def reduce_scatter_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """Rank i gets block i of the reduction, as a new array."""
    case = case.in_blocks()
    data, want = case.operand(g.rank), blocks(case.reduced(), case.size)[g.rank]
    if not spawn:
        return g.reduce_scatter(data, case.op), lambda got: wrong_elements(got, want)
    handle = g.spawn_reduce_scatter(data, case.op)
    data[...] = 1  # its docstring: data is copied at the spawn, so it may change at once
    return handle, lambda got: wrong_elements(got, want)


def reduce_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """In place on the root only: other ranks' data is left unspecified, so it is not checked."""
    data, want, is_root = case.operand(g.rank), case.reduced(), g.rank == case.root
    run = g.spawn_reduce if spawn else g.reduce
    return run(case.root, data, case.op), lambda got: in_place_wrong(got, data, want) if is_root else 0


def broadcast_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """Non-roots start from zeros, so an element left unwritten shows."""
    want = case.payload(case.root)
    data = want.copy() if g.rank == case.root else np.zeros_like(want)
    run = g.spawn_broadcast if spawn else g.broadcast
    return run(case.root, data), lambda got: in_place_wrong(got, data, want)


def all_gather_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """Every member's data concatenated along axis 0 in rank order."""
    want = np.concatenate([case.payload(r) for r in range(case.size)])
    run = g.spawn_all_gather if spawn else g.all_gather
    return run(case.payload(g.rank)), lambda got: wrong_elements(got, want)


def all_gather_v_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """Lengths differ per rank (0 included), drawn from the call's shared stream so everyone knows them."""
    lengths = [int(n) for n in case.shared(0).integers(0, case.rows + 1, size=case.size)]
    want = np.concatenate([case.payload(r, rows=n) for r, n in enumerate(lengths)])
    run = g.spawn_all_gather_v if spawn else g.all_gather_v
    return run(case.payload(g.rank, rows=lengths[g.rank])), \
        lambda got: wrong_elements(got[0], want) + int(list(got[1]) != lengths)


def gather_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """The concatenation on the root, None on every other rank."""
    is_root = g.rank == case.root
    want = np.concatenate([case.payload(r) for r in range(case.size)]) if is_root else None
    run = g.spawn_gather if spawn else g.gather
    return run(case.root, case.payload(g.rank)), \
        lambda got: wrong_elements(got, want) if want is not None else int(got is not None)


def scatter_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """The root's array in equal blocks, block i to rank i; non-roots pass None."""
    case = case.in_blocks()
    whole = case.payload(case.root)
    want = blocks(whole, case.size)[g.rank]
    run = g.spawn_scatter if spawn else g.scatter
    return run(case.root, whole if g.rank == case.root else None), lambda got: wrong_elements(got, want)


def all_to_all_call(g: ProcessGroup, case: Case, spawn: bool) -> tuple[Any, Check]:
    """Block j of every rank's array goes to rank j; the result is in source-rank order."""
    case = case.in_blocks()
    want = np.concatenate([blocks(case.payload(s), case.size)[g.rank] for s in range(case.size)])
    run = g.spawn_all_to_all if spawn else g.all_to_all
    return run(case.payload(g.rank)), lambda got: wrong_elements(got, want)


SPAWNABLE: dict[str, Callable[[ProcessGroup, Case, bool], tuple[Any, Check]]] = {
    "all_reduce": all_reduce_call, "reduce_scatter": reduce_scatter_call, "reduce": reduce_call,
    "broadcast": broadcast_call, "all_gather": all_gather_call, "all_gather_v": all_gather_v_call,
    "gather": gather_call, "scatter": scatter_call, "all_to_all": all_to_all_call}


# ---- calls without a spawn_ form: each returns its wrong elements on this rank ----

def all_reduce_typed_call(g: ProcessGroup, case: Case) -> int:
    """Raw bytes in each container the contract names: bytearray, writable memoryview, uint8 array."""
    want, raw = case.reduced(), bytearray(case.operand(g.rank).tobytes())
    buf: Any = [raw, memoryview(raw), np.frombuffer(raw, dtype=np.uint8)][case.call % 3]
    g.all_reduce_typed(buf, TYPED[case.dtype], case.op)
    return wrong_elements(np.frombuffer(raw, dtype=case.dtype).reshape(want.shape), want)


def some_object(case: Case, rank: int) -> object:
    """A small picklable value particular to (call, rank): nested containers of ints, text and bytes."""
    rng = np.random.default_rng((case.seed, case.call, case.members[rank], SHARED))
    n = int(rng.integers(0, 64))
    return {"call": case.call, "rank": case.members[rank], "ints": [int(x) for x in rng.integers(-2**40, 2**40, n)],
            "text": "é∑" * n, "blob": rng.bytes(int(rng.integers(0, 4096))), "pair": (n, n / 3, None)}


def broadcast_object_call(g: ProcessGroup, case: Case) -> int:
    """The root's object on every rank; non-roots pass nothing."""
    want = some_object(case, case.root)
    got = g.broadcast_object(case.root, want) if g.rank == case.root else g.broadcast_object(case.root)
    return int(got != want)


def all_gather_object_call(g: ProcessGroup, case: Case) -> int:
    """Every member's object, in rank order: a wrong or missing one counts once."""
    want = [some_object(case, r) for r in range(case.size)]
    got = g.all_gather_object(some_object(case, g.rank))
    return sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))


def barrier_call(g: ProcessGroup, case: Case) -> int:
    """Nothing to compare: it must return, in its place in the call order."""
    g.barrier()
    return 0


def federated_average_call(g: ProcessGroup, case: Case) -> int:
    """A deadline far beyond any arrival: every rank takes part, so the average is exact and known."""
    case = replace(case, op=ReduceKind.AVG)
    data, want = case.operand(g.rank), case.reduced()
    deadline = FEDERATED_DEADLINE_S if case.call % 2 else datetime.timedelta(seconds=FEDERATED_DEADLINE_S)
    count = g.federated_average(data, deadline)
    return wrong_elements(data, want) + int(count != (case.size if g.rank == 0 else 0))


def exchange_plan(case: Case) -> tuple[list[int], list[int]]:
    """Who sends to whom (a ring shift, or random pairs with any odd one out sending to itself) and
    the user tags of the messages each sends, repeats included (same-tag messages keep their order)."""
    rng = case.shared(1)
    if rng.integers(2) and case.size > 1:
        shift = int(rng.integers(1, case.size))
        dest = [(r + shift) % case.size for r in range(case.size)]
    else:
        order, dest = [int(r) for r in rng.permutation(case.size)], list(range(case.size))
        for a, b in zip(order[0::2], order[1::2]):
            dest[a], dest[b] = b, a
    pool = [0, TAG_RESERVED_BASE - 1, *(int(t) for t in rng.integers(0, TAG_RESERVED_BASE, size=2))]
    return dest, [pool[int(i)] for i in rng.integers(0, len(pool), size=int(rng.integers(1, 4)))]


def exchange(g: ProcessGroup, case: Case, f32: bool) -> int:
    """Every rank sends all its messages, then receives its source's in another order: by tag,
    highest first, so a recv is not held up by unread messages on other tags."""
    dest, tags = exchange_plan(case)
    src = dest.index(g.rank)
    send, recv = (g.send_f32, g.recv_f32) if f32 else (g.send, g.recv)
    for part, tag in enumerate(tags):
        send(dest[g.rank], tag, case.payload(g.rank, part))
    order = sorted(range(len(tags)), key=lambda part: -tags[part])
    return sum(wrong_elements(recv(src, tags[part]), case.payload(src, part)) for part in order)


ONLY_BLOCKING: dict[str, Callable[[ProcessGroup, Case], int]] = {
    "all_reduce_typed": all_reduce_typed_call, "broadcast_object": broadcast_object_call,
    "all_gather_object": all_gather_object_call, "barrier": barrier_call,
    "federated_average": federated_average_call,
    "send_recv": lambda g, case: exchange(g, case, f32=False),
    "send_recv_f32": lambda g, case: exchange(g, case, f32=True)}
GROUP_KINDS = ["split", "close"]
KINDS = [*SPAWNABLE, *(f"spawn_{name}" for name in SPAWNABLE), *ONLY_BLOCKING, *GROUP_KINDS]
#: The dtypes each kind draws from: reductions the reducible ones, float-only calls floats, movers any.
DTYPES_OF: dict[str, list[np.dtype]] = {
    **{kind: MOVABLE for kind in KINDS},
    **{kind: REDUCIBLE for kind in ("all_reduce", "reduce_scatter", "reduce")},
    **{f"spawn_{kind}": REDUCIBLE for kind in ("all_reduce", "reduce_scatter", "reduce")},
    "all_reduce_typed": list(TYPED), "federated_average": FLOATS, "send_recv_f32": [np.dtype(np.float32)]}


# ---- groups and calls in flight ----

@dataclass
class Group:
    """A group every rank knows of: its members (world ranks, in its rank order); pg on members only."""

    ident: int
    members: tuple[int, ...]
    pg: ProcessGroup | None


class Tally:
    """This rank's wrong elements, and the first calls that had any, so a failure can be found again."""

    def __init__(self) -> None:
        self.wrong = 0
        self.first: list[str] = []

    def add(self, wrong: int, what: str) -> None:
        self.wrong += wrong
        if wrong and len(self.first) < 10:
            self.first.append(f"{what}: {wrong} wrong")


class InFlight:
    """Spawned calls not joined yet, oldest first: they stay in flight across later calls (on their
    own group, which queue behind them, and on others), and are joined with the same draws everywhere."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.pending: list[tuple[int, Any, Check, str]] = []  # (group ident, handle, check, what)

    def add(self, ident: int, handle, check: Check, what: str) -> None:
        self.pending.append((ident, handle, check, what))

    def join(self, keep: int = 0, ident: int | None = None) -> None:
        """Join all but the newest `keep` (of group `ident` only, if given), and check their results."""
        mine = [p for p in self.pending if ident is None or p[0] == ident]
        for entry in mine[:max(0, len(mine) - keep)]:
            self.pending.remove(entry)
            _, handle, check, what = entry
            self.tally.add(check(handle.join(timeout=600)), what)


class Groups:
    """The world and the live sub-groups, alike on every rank. A sub-group is split off the world or
    off a live sub-group with members drawn from the shared stream, so every rank agrees on it."""

    def __init__(self, world: ProcessGroup):
        self.world = Group(0, tuple(range(world.world_size)), world)
        self.subs: list[Group] = []
        self.made = self.most_live = 0

    def pick(self, rng: np.random.Generator) -> Group:
        """The world half the time, else a live sub-group (so sub-groups see plenty of calls)."""
        if not self.subs or rng.integers(2):
            return self.world
        return self.subs[int(rng.integers(len(self.subs)))]

    def split(self, rng: np.random.Generator) -> int:
        """A new sub-group of a random parent; 1 unless members got their group and the rest None."""
        parent = self.pick(rng)
        picked = [int(i) for i in rng.permutation(len(parent.members))[:int(rng.integers(1, len(parent.members) + 1))]]
        self.made += 1
        group = Group(self.made, tuple(parent.members[i] for i in picked), None)
        self.subs.append(group)
        self.most_live = max(self.most_live, len(self.subs))
        if parent.pg is None:
            return 0
        group.pg = parent.pg.split(picked)
        if parent.pg.rank not in picked:
            return int(group.pg is not None)
        me = picked.index(parent.pg.rank)
        return int(group.pg is None or group.pg.rank != me or group.pg.world_size != len(picked))

    def close(self, rng: np.random.Generator, in_flight: InFlight) -> None:
        """Close a random live sub-group after joining its spawned calls (close is this rank's own act)."""
        group = self.subs.pop(int(rng.integers(len(self.subs))))
        in_flight.join(ident=group.ident)
        if group.pg is not None:
            group.pg.close()

    def close_all(self, in_flight: InFlight) -> None:
        """The end of the soak: every live sub-group closed, its spawned calls joined first."""
        while self.subs:
            self.close(np.random.default_rng(0), in_flight)


# ---- the soak ----

def draw_case(rng: np.random.Generator, kind: str, group: Group, seed: int, call: int, max_bytes: int) -> Case:
    """dtype, op, shape (0 bytes to max_bytes, 1-D mostly) and root: the same draws on every rank."""
    dtypes = DTYPES_OF[kind]
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    ops = list(ReduceKind) if dtype in FLOATS else INT_OPS
    op = ops[int(rng.integers(len(ops)))]
    tail = () if rng.integers(4) else (int(rng.integers(1, 5)),)
    size = int(rng.choice([0, 1, 7, int(rng.integers(1, 4096)), int(rng.integers(1, max_bytes + 1))]))
    rows = size // (dtype.itemsize * int(np.prod(tail)))
    return Case(seed, call, group.members, dtype, op, rows, tail, int(rng.integers(len(group.members))))


def group_kind(kind: str, groups: Groups) -> str:
    """split and close keep between 0 and MAX_LIVE_SUBGROUPS sub-groups alive: one that cannot run
    turns into the other."""
    if kind == "split" and len(groups.subs) >= MAX_LIVE_SUBGROUPS:
        return "close"
    if kind == "close" and not groups.subs:
        return "split"
    return kind


def described(kind: str, group: Group, case: Case) -> str:
    """A call as a failure report names it: enough to find it again under the same seed."""
    return (f"call {case.call} {kind} on group {group.ident} (world ranks {list(group.members)}), "
            f"{case.dtype} {case.op.name} shape {(case.rows, *case.tail)} root {case.root}")


def run_call(kind: str, group: Group, case: Case, tally: Tally, in_flight: InFlight) -> None:
    """One call on a group this rank is a member of: checked now, or (spawned) when joined."""
    assert group.pg is not None
    what = described(kind, group, case)
    if kind in ONLY_BLOCKING:
        return tally.add(ONLY_BLOCKING[kind](group.pg, case), what)
    name = kind.removeprefix("spawn_")
    outcome, check = SPAWNABLE[name](group.pg, case, name != kind)
    if name == kind:
        return tally.add(check(outcome), what)
    in_flight.add(group.ident, outcome, check, what)


class Soak:
    """The drawn calls, run until rank 0's clock says stop, with their tallies."""

    def __init__(self, pg: ProcessGroup, seed: int, max_bytes: int):
        self.pg, self.seed, self.max_bytes = pg, seed, max_bytes
        self.rng = np.random.default_rng(seed)
        self.tally = Tally()
        self.groups, self.in_flight = Groups(pg), InFlight(self.tally)
        self.counts = {kind: 0 for kind in KINDS}
        self.calls = self.on_subgroups = self.rss_warm = 0
        self.trend = np.zeros(len(SAMPLE_AT), np.int64)

    def step(self) -> None:
        """Draw and run one call, then join all but up to three spawned calls, with the same draws everywhere."""
        kind = group_kind(KINDS[int(self.rng.integers(len(KINDS)))], self.groups)
        if kind == "split":
            self.tally.add(self.groups.split(self.rng), f"call {self.calls} split (sub-group {self.groups.made})")
        elif kind == "close":
            self.groups.close(self.rng, self.in_flight)
        else:
            group = self.groups.pick(self.rng)
            case = draw_case(self.rng, kind, group, self.seed, self.calls, self.max_bytes)
            self.on_subgroups += group is not self.groups.world
            if group.pg is not None:
                run_call(kind, group, case, self.tally, self.in_flight)
        self.in_flight.join(keep=int(self.rng.integers(4)))
        self.counts[kind] += 1
        self.calls += 1

    def sample_memory(self) -> None:
        """Resident memory after 500 calls (the baseline) and after each of SAMPLE_AT."""
        if self.calls == 500:
            self.rss_warm = resident_bytes()
        if self.calls in SAMPLE_AT:
            self.trend[SAMPLE_AT.index(self.calls)] = resident_bytes()

    def run(self, minutes: float) -> None:
        """Calls until rank 0's clock runs out; every rank stops at the same call (checked every 50)."""
        end, go = time.monotonic() + 60 * minutes, np.ones(1, np.int32)
        while go[0]:
            self.step()
            self.sample_memory()
            if self.calls % 50 == 0:
                go[0] = int(time.monotonic() < end) if self.pg.rank == 0 else 0
                self.pg.broadcast(0, go)
        self.in_flight.join()
        self.groups.close_all(self.in_flight)


def resident_bytes() -> int:
    """This process's resident set now (ru_maxrss gives only the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def report(soak: Soak, minutes: float) -> int:
    """Rank 0 prints every rank's figures; the exit status: 1 if any rank saw a wrong element."""
    pg = soak.pg
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    final = resident_bytes()
    warm = soak.rss_warm or final  # (under 500 calls: no baseline)
    mine = np.array([soak.tally.wrong, warm, final, peak, *soak.trend], np.int64)
    for line in soak.tally.first:
        print(f"soak rank {pg.rank}: {line}", file=sys.stderr, flush=True)
    every = pg.all_gather(mine).reshape(pg.world_size, -1)
    if pg.rank == 0:
        print(f"soak: {pg.transport.name} transport, {pg.world_size} ranks, {minutes:g} min, "
              f"seed {soak.seed}: {soak.calls} collectives")
        print("  kinds: " + " ".join(f"{kind}={n}" for kind, n in soak.counts.items()))
        print(f"  sub-groups: {soak.groups.made} made, up to {soak.groups.most_live} live at once, "
              f"{soak.on_subgroups} calls on them")
        for rank, (bad, warm, final, top, *samples) in enumerate(every):
            print(f"  rank {rank}: wrong elements {bad}; resident {warm / 2**20:.0f} MiB after 500 calls, "
                  f"{final / 2**20:.0f} MiB at the end; peak {top / 2**20:.0f} MiB; resident MiB after N calls: "
                  + ", ".join(f"{at}: {mib / 2**20:.0f}" for at, mib in zip(SAMPLE_AT, samples) if mib))
    return 1 if every[:, 0].sum() else 0


def main(argv=None) -> int:
    """Set up the (simulated) host, soak the group, report; the exit status says whether all was right."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--max-bytes", type=int, default=4 << 20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--transport", default=None)
    p.add_argument("--hosts", type=int, default=None,
                   help="simulate this many hosts (ranks split in equal runs, each its own SHMCOLL_HOST_ID)")
    args = p.parse_args(argv)
    if args.hosts:
        cfg = load_config()
        os.environ["SHMCOLL_HOST_ID"] = f"simulated-host-{cfg.rank * args.hosts // cfg.world_size}"
    with shmcoll.init(transport=args.transport) as pg:
        soak = Soak(pg, args.seed, args.max_bytes)
        soak.run(args.minutes)
        return report(soak, args.minutes)


if __name__ == "__main__":
    sys.exit(main())
