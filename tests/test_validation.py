"""Bad input at the public API, table-driven: every row must raise shmcoll.InvalidArgument (a
ValueError) with a message that says what is expected, and leave the group fully usable.

Each row runs on an in-process 1-rank group, and (grouped per call) on 2 real ranks where only one
rank makes the bad call while the other does not: a correct all_reduce after every bad call then
fails (mismatch, timeout or a wrong sum) if the bad call sent anything or used up a sequence number.
Positive rows check that valid but unusual inputs (0-d, 2-D, byte buffers, read-only inputs of
calls that only read) work, and that a closed group refuses every call.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import shmcoll
from shmcoll import TAG_RESERVED_BASE, DType, InvalidArgument, ReduceKind
from shmcoll.types import bfloat16

from bounds import WAIT_HANG_S
from harness import run_ranks

GROUP_TIMEOUT = 10.0  # a bad call that wrongly starts a collective fails the check after this


# ---------------------------------------------------------------- inputs

def f32(n: int = 4) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def strided(dtype=np.float32) -> np.ndarray:
    return np.arange(8).astype(dtype)[::2]


def fortran(dtype=np.float32) -> np.ndarray:
    return np.asfortranarray(np.arange(12).astype(dtype).reshape(3, 4))


WS = object()  # stands for the group's world size (the first rank that does not exist)


def rank_value(v, pg):
    return pg.world_size if v is WS else v


BAD_RANKS = {"-1": -1, "world_size": WS, "1.0": 1.0, "0.0": 0.0, "True": True, "False": False, "np.True_": np.True_,
             "'0'": "0", "None": None, "2**64": 2**64}
BAD_TAGS = {"-1": -1, "TAG_RESERVED_BASE": TAG_RESERVED_BASE, "2**32": 2**32, "2**40": 2**40, "1.5": 1.5,
            "0.0": 0.0, "True": True, "'0'": "0", "None": None, "np.int64(-1)": np.int64(-1)}
WRONG_TYPES = {"list": lambda: [1.0, 2.0], "str": lambda: "abcd", "None": lambda: None, "object": object,
               "float": lambda: 1.5, "dict": lambda: {"a": 1}}
BAD_DTYPES = {
    "object": lambda: np.array([1, None], dtype=object),
    "str": lambda: np.array(["a", "b"]),
    "bytes": lambda: np.array([b"a", b"b"]),
    "datetime64": lambda: np.array([1, 2], dtype="datetime64[s]"),
    "timedelta64": lambda: np.array([1, 2], dtype="timedelta64[s]"),
    "structured": lambda: np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
    "big-endian": lambda: np.zeros(2, dtype=">f4"),
    "float128": lambda: np.zeros(2, dtype=np.longdouble),
}
NOT_REDUCIBLE = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "uint32": np.uint32,
                 "uint64": np.uint64, "bool": np.bool_, "complex64": np.complex64, "complex128": np.complex128}
BAD_OPS = {"None": None, "'bogus'": "bogus", "7": 7, "-1": -1, "True": True, "1.0": 1.0, "DType.F32": DType.F32}
BAD_DEADLINES = {"-1": -1, "-1e-9": -1e-9, "nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                 "timedelta(-1s)": datetime.timedelta(seconds=-1),
                 "timedelta(-1us)": datetime.timedelta(microseconds=-1),
                 "None": None, "'1'": "1", "True": True, "object": object(), "complex": 1j,
                 "np.nan": np.float64("nan")}

# What each kind of message must mention (it says what the caller should pass instead).
RANK_MSG = r"rank"
TAG_MSG = r"tag.*TAG_RESERVED_BASE|TAG_RESERVED_BASE.*tag"
TYPE_MSG = r"numpy|array|buffer"
CONTIG_MSG = r"contiguous"
RO_MSG = r"read-only|writable|writeable"
DTYPE_MSG = r"dtype|float|int"
OP_MSG = r"ReduceKind|op"
INTOP_MSG = r"SUM.*PROD.*MIN.*MAX"
DEADLINE_MSG = r"deadline.*(seconds|timedelta)"
CLOSED_MSG = r"closed"


@dataclass(frozen=True)
class Row:
    call: str
    id: str
    fn: Callable  # fn(pg) makes the bad call
    match: str
    min_world: int = 1
    bug: str | None = None  # a known library bug: the row is an xfail

    @property
    def name(self) -> str:
        return f"{self.call}[{self.id}]"


def _add_reduction_rules(add, call: str, run, length: int) -> None:
    """The rows every reducing call shares (all_reduce's rules): wrong types, dtypes that cannot
    travel or reduce, AVG over integers, bad ops. run(pg, data, *op) makes the call; length: the
    element count of the arrays it gets (reduce_scatter's must divide by the world size)."""
    for k, make in WRONG_TYPES.items():
        add(call, f"data={k}", lambda pg, make=make: run(pg, make()), TYPE_MSG + "|read-only")
    for k, make in BAD_DTYPES.items():
        add(call, f"dtype={k}", lambda pg, make=make: run(pg, make()), DTYPE_MSG)
    for k, dt in NOT_REDUCIBLE.items():
        add(call, f"dtype={k}", lambda pg, dt=dt: run(pg, np.ones(length, dtype=dt)), DTYPE_MSG)
    for k, dt in (("int32", np.int32), ("int64", np.int64)):
        add(call, f"{k}-AVG", lambda pg, dt=dt: run(pg, np.ones(length, dtype=dt), ReduceKind.AVG), INTOP_MSG)
    for k, op in BAD_OPS.items():
        add(call, f"op={k}", lambda pg, op=op: run(pg, f32(), op), OP_MSG)


def _rows() -> list[Row]:
    rows: list[Row] = []

    def add(call, id_, fn, match, **kw):
        rows.append(Row(call, id_, fn, match, **kw))

    # ---- send / send_f32 / recv / recv_f32
    for k, v in BAD_RANKS.items():
        add("send", f"to={k}", lambda pg, v=v: pg.send(rank_value(v, pg), 0, f32()), RANK_MSG)
        add("send_f32", f"to={k}", lambda pg, v=v: pg.send_f32(rank_value(v, pg), 0, f32()), RANK_MSG)
        add("recv", f"src={k}", lambda pg, v=v: pg.recv(rank_value(v, pg), 0), RANK_MSG)
        add("recv_f32", f"src={k}", lambda pg, v=v: pg.recv_f32(rank_value(v, pg), 0), RANK_MSG)
    for k, v in BAD_TAGS.items():
        add("send", f"tag={k}", lambda pg, v=v: pg.send(0, v, f32()), TAG_MSG)
        add("send_f32", f"tag={k}", lambda pg, v=v: pg.send_f32(0, v, f32()), TAG_MSG)
        add("recv", f"tag={k}", lambda pg, v=v: pg.recv(0, v), TAG_MSG)
        add("recv_f32", f"tag={k}", lambda pg, v=v: pg.recv_f32(0, v), TAG_MSG)
    for k, make in WRONG_TYPES.items():
        add("send", f"data={k}", lambda pg, make=make: pg.send(0, 0, make()), TYPE_MSG)
        add("send_f32", f"data={k}", lambda pg, make=make: pg.send_f32(0, 0, make()), TYPE_MSG)
    for k, make in BAD_DTYPES.items():
        add("send", f"dtype={k}", lambda pg, make=make: pg.send(0, 0, make()), DTYPE_MSG)
    for k, make in (("a[::2]", strided), ("fortran-2d", fortran),
                    ("strided-memoryview", lambda: memoryview(bytearray(8))[::2])):
        add("send", k, lambda pg, make=make: pg.send(0, 0, make()), CONTIG_MSG)
        add("send_f32", k, lambda pg, make=make: pg.send_f32(0, 0, make()), CONTIG_MSG + "|float32")
    for k, dt in (("float64", np.float64), ("float16", np.float16), ("int32", np.int32)):
        add("send_f32", f"dtype={k}", lambda pg, dt=dt: pg.send_f32(0, 0, np.zeros(3, dtype=dt)), r"float32")

    # ---- all_reduce / spawn_all_reduce (same rules)
    for call in ("all_reduce", "spawn_all_reduce"):
        def run(pg, data, *op, call=call):
            return getattr(pg, call)(data, *op)

        _add_reduction_rules(add, call, run, 3)
        add(call, "read-only", lambda pg, run=run: run(pg, readonly(f32())), RO_MSG)
        add(call, "read-only-0d", lambda pg, run=run: run(pg, readonly(np.array(1.0))), RO_MSG)
        add(call, "bytes", lambda pg, run=run: run(pg, b"\x00" * 8), RO_MSG + "|" + DTYPE_MSG)
        add(call, "numpy-scalar", lambda pg, run=run: run(pg, np.float32(1.0)), RO_MSG)
        add(call, "a[::2]", lambda pg, run=run: run(pg, strided()), CONTIG_MSG)
        add(call, "fortran-2d", lambda pg, run=run: run(pg, fortran()), CONTIG_MSG)
        add(call, "transposed", lambda pg, run=run: run(pg, np.ones((2, 3), np.float64).T), CONTIG_MSG)
    add("all_reduce", "fake-dlpack", lambda pg: pg.all_reduce(_FakeDLPack()), TYPE_MSG)

    # ---- all_reduce_typed
    T = "all_reduce_typed"
    for k, (n, dt) in {"3-bytes-F16": (3, DType.F16), "1-byte-BF16": (1, DType.BF16), "6-bytes-F32": (6, DType.F32),
                       "12-bytes-F64": (12, DType.F64), "9-bytes-F64": (9, DType.F64)}.items():
        add(T, f"len={k}", lambda pg, n=n, dt=dt: pg.all_reduce_typed(bytearray(n), dt), r"multiple")
    add(T, "len-uint8-array", lambda pg: pg.all_reduce_typed(np.zeros(5, np.uint8), DType.F32), r"multiple")
    for k, make in {"bytes": lambda: b"\x00" * 8, "memoryview(bytes)": lambda: memoryview(b"\x00" * 8),
                    "readonly-uint8": lambda: readonly(np.zeros(8, np.uint8)),
                    "readonly-memoryview": lambda: memoryview(bytearray(8)).toreadonly()}.items():
        add(T, k, lambda pg, make=make: pg.all_reduce_typed(make(), DType.F32), RO_MSG)
    for k, dt in {"np.float32": np.float32, "'F32'": "F32", "3": 3, "None": None, "ReduceKind.SUM": ReduceKind.SUM,
                  "np.dtype": np.dtype(np.float16)}.items():
        add(T, f"dtype={k}", lambda pg, dt=dt: pg.all_reduce_typed(bytearray(8), dt), r"DType")
    wrong_arrays = {"float32-array": lambda: np.zeros(2, np.float32), "int8-array": lambda: np.zeros(8, np.int8)}
    for k, make in wrong_arrays.items():
        add(T, k, lambda pg, make=make: pg.all_reduce_typed(make(), DType.F32), r"uint8|bytes")
    for k, make in {"list": lambda: [0] * 8, "str": lambda: "abcdefgh", "None": lambda: None, "object": object,
                    "int": lambda: 8}.items():
        add(T, f"buf={k}", lambda pg, make=make: pg.all_reduce_typed(make(), DType.F32), r"bytearray|buffer|uint8")
    add(T, "uint8-a[::2]", lambda pg: pg.all_reduce_typed(np.zeros(16, np.uint8)[::2], DType.F32), CONTIG_MSG)
    add(T, "uint8-fortran-2d", lambda pg: pg.all_reduce_typed(np.zeros((4, 4), np.uint8, order="F"), DType.F32),
        CONTIG_MSG)
    for k, op in BAD_OPS.items():
        add(T, f"op={k}", lambda pg, op=op: pg.all_reduce_typed(bytearray(8), DType.F32, op), OP_MSG)
    add(T, "strided-memoryview", lambda pg: pg.all_reduce_typed(memoryview(bytearray(16))[::2], DType.F32),
        CONTIG_MSG)

    # ---- all_gather
    for k, make in WRONG_TYPES.items():
        add("all_gather", f"local={k}", lambda pg, make=make: pg.all_gather(make()), TYPE_MSG)
    for k, make in BAD_DTYPES.items():
        add("all_gather", f"dtype={k}", lambda pg, make=make: pg.all_gather(make()), DTYPE_MSG)
    add("all_gather", "a[::2]", lambda pg: pg.all_gather(strided()), CONTIG_MSG)
    add("all_gather", "fortran-2d", lambda pg: pg.all_gather(fortran()), CONTIG_MSG)

    # ---- broadcast
    for k, v in BAD_RANKS.items():
        add("broadcast", f"root={k}", lambda pg, v=v: pg.broadcast(rank_value(v, pg), f32()), RANK_MSG)
    for k, make in WRONG_TYPES.items():
        add("broadcast", f"data={k}", lambda pg, make=make: pg.broadcast(0, make()), TYPE_MSG + "|read-only")
    for k, make in BAD_DTYPES.items():
        add("broadcast", f"dtype={k}", lambda pg, make=make: pg.broadcast(0, make()), DTYPE_MSG)
    add("broadcast", "a[::2]", lambda pg: pg.broadcast(0, strided()), CONTIG_MSG)
    add("broadcast", "fortran-2d", lambda pg: pg.broadcast(0, fortran()), CONTIG_MSG)
    add("broadcast", "read-only-on-a-receiver",
        lambda pg: pg.broadcast((pg.rank + 1) % pg.world_size, readonly(f32())), RO_MSG, min_world=2)

    # ---- federated_average
    F = "federated_average"
    for k, dt in {"int32": np.int32, "int64": np.int64, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
                  "complex64": np.complex64}.items():
        add(F, f"dtype={k}", lambda pg, dt=dt: pg.federated_average(np.ones(3, dtype=dt), 1.0), r"float")
    for k, make in BAD_DTYPES.items():
        add(F, f"dtype={k}", lambda pg, make=make: pg.federated_average(make(), 1.0), DTYPE_MSG)
    for k, make in WRONG_TYPES.items():
        add(F, f"data={k}", lambda pg, make=make: pg.federated_average(make(), 1.0), TYPE_MSG + "|read-only")
    add(F, "read-only", lambda pg: pg.federated_average(readonly(f32()), 1.0), RO_MSG)
    add(F, "a[::2]", lambda pg: pg.federated_average(strided(), 1.0), CONTIG_MSG)
    add(F, "fortran-2d", lambda pg: pg.federated_average(fortran(), 1.0), CONTIG_MSG)
    for k, d in BAD_DEADLINES.items():
        add(F, f"deadline={k}", lambda pg, d=d: pg.federated_average(f32(), d), DEADLINE_MSG)
    add(F, "deadline=10**400", lambda pg: pg.federated_average(f32(), 10**400), DEADLINE_MSG)

    # ---- reduce_scatter / reduce (the rules of all_reduce, plus axis 0 divisible / a root)
    RS, R = "reduce_scatter", "reduce"
    for call, run in ((RS, lambda pg, d, *op: pg.reduce_scatter(d, *op)), (R, lambda pg, d, *op: pg.reduce(0, d, *op))):
        _add_reduction_rules(add, call, run, 4)
        add(call, "a[::2]", lambda pg, run=run: run(pg, strided()), CONTIG_MSG)
        add(call, "fortran-2d", lambda pg, run=run: run(pg, fortran()), CONTIG_MSG)
    add(RS, "0-d", lambda pg: pg.reduce_scatter(np.array(1.0)), r"0-d.*1-D")
    add(RS, "len-not-divisible", lambda pg: pg.reduce_scatter(f32(pg.world_size + 1)), r"divisible", min_world=2)
    add(R, "read-only", lambda pg: pg.reduce(0, readonly(f32())), RO_MSG)
    for k, v in BAD_RANKS.items():
        add(R, f"root={k}", lambda pg, v=v: pg.reduce(rank_value(v, pg), f32()), RANK_MSG)

    # ---- gather / all_gather_v / all_to_all (read-only inputs are fine) / scatter (the root's data)
    G, S, A2A, AGV = "gather", "scatter", "all_to_all", "all_gather_v"
    movers = ((G, lambda pg, d: pg.gather(0, d)), (S, lambda pg, d: pg.scatter(pg.rank, d)),
              (A2A, lambda pg, d: pg.all_to_all(d)), (AGV, lambda pg, d: pg.all_gather_v(d)))
    for call, run in movers:
        for k, make in WRONG_TYPES.items():
            add(call, f"data={k}", lambda pg, make=make, run=run: run(pg, make()), TYPE_MSG)
        for k, make in BAD_DTYPES.items():
            add(call, f"dtype={k}", lambda pg, make=make, run=run: run(pg, make()), DTYPE_MSG)
        add(call, "a[::2]", lambda pg, run=run: run(pg, strided()), CONTIG_MSG)
        add(call, "fortran-2d", lambda pg, run=run: run(pg, fortran()), CONTIG_MSG)
    for call, run in ((S, lambda pg, d: pg.scatter(pg.rank, d)), (A2A, lambda pg, d: pg.all_to_all(d))):
        add(call, "0-d", lambda pg, run=run: run(pg, np.array(1.0)), r"0-d.*1-D")
        add(call, "len-not-divisible", lambda pg, run=run: run(pg, f32(pg.world_size + 1)), r"divisible",
            min_world=2)
        add(call, "2-d-rows-not-divisible", lambda pg, run=run: run(pg, np.zeros((3, 2))), r"divisible",
            min_world=2)
    for call, run in ((G, lambda pg, r: pg.gather(r, f32())), (S, lambda pg, r: pg.scatter(r, f32()))):
        for k, v in BAD_RANKS.items():
            add(call, f"root={k}", lambda pg, v=v, run=run: run(pg, rank_value(v, pg)), RANK_MSG)
    return rows


class _FakeDLPack:
    """Claims to export DLPack but hands out something that is not a capsule."""

    def __dlpack__(self, **kwargs):
        return 5

    def __dlpack_device__(self):
        return (1, 0)


ROWS = _rows()
ROWS_BY_NAME = {r.name: r for r in ROWS}
assert len(ROWS_BY_NAME) == len(ROWS), "row names must be unique"
CALLS = sorted({r.call for r in ROWS})


def _param(row: Row):
    marks = [pytest.mark.xfail(strict=True, reason=f"BUG: {row.bug}")] if row.bug else []
    return pytest.param(row.name, id=row.name, marks=marks)


# ---------------------------------------------------------------- 1 rank, in process

@pytest.fixture(scope="module")
def solo():
    pg = shmcoll.init(rank=0, world_size=1, timeout=GROUP_TIMEOUT)
    yield pg
    pg.close()


def _expect_invalid(row: Row, call) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        call()
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, shmcoll.CollectiveError)
    assert re.search(row.match, str(err), re.IGNORECASE | re.DOTALL), f"{row.name}: message {str(err)!r}"
    return err


_marker = iter(range(1, 10**9))


def _assert_solo_usable(pg) -> None:
    data = np.array([3.0, -1.5, 7.0])
    assert pg.all_reduce(data, ReduceKind.MAX) is data
    np.testing.assert_array_equal(data, [3.0, -1.5, 7.0])
    m = next(_marker)
    pg.send(0, 0, np.array([m], dtype=np.int64))  # nothing stray is queued on tag 0 before it
    assert pg.recv(0, 0).tolist() == [m]
    pg.barrier()


@pytest.mark.parametrize("name", [_param(r) for r in ROWS if r.min_world <= 1])
def test_bad_call_on_one_rank_group(solo, name):
    row = ROWS_BY_NAME[name]
    _expect_invalid(row, lambda: row.fn(solo))
    _assert_solo_usable(solo)


# ---------------------------------------------------------------- 2 ranks, real processes

def _bad_calls(pg, names):
    """Each row twice: the bad call on rank 0 only, then on rank 1 only, each followed by a correct
    all_reduce on both ranks whose result is recorded."""
    out = []
    for i, name in enumerate(names):
        row = ROWS_BY_NAME[name]
        for bad_rank in (0, 1):
            rec = {"row": name, "bad_rank": bad_rank}
            if pg.rank == bad_rank:
                try:
                    row.fn(pg)
                    rec["raised"] = None
                except BaseException as exc:  # reported to the parent
                    rec.update(raised=type(exc).__name__, invalid=isinstance(exc, InvalidArgument),
                               value_error=isinstance(exc, ValueError), message=str(exc))
            data = np.array([pg.rank + 1.0, 10.0 * i + bad_rank])
            try:
                pg.all_reduce(data)
                rec["check"] = data.tolist()
            except BaseException as exc:  # reported to the parent
                rec["check"] = f"{type(exc).__name__}: {exc}"
            rec["want"] = [3.0, 2 * (10.0 * i + bad_rank)]
            out.append(rec)
    # nothing stray reached the peer on the tags the rows used; p2p still works both ways
    other = 1 - pg.rank
    for tag in (0, 1):
        pg.send(other, tag, np.array([100 + tag + pg.rank], dtype=np.int64))
    stray = [pg.recv(other, tag).tolist() != [100 + tag + other] for tag in (0, 1)]
    pg.barrier()
    return out, stray


@pytest.mark.multiprocess
@pytest.mark.parametrize("call", CALLS)
def test_bad_calls_on_two_ranks_leave_the_group_usable(call):
    names = [r.name for r in ROWS if r.call == call and not r.bug]
    results = run_ranks(2, _bad_calls, names, group_timeout=GROUP_TIMEOUT)
    problems = []
    for rank, (records, stray) in enumerate(results):
        assert stray == [False, False], f"rank {rank} received a message a bad call sent"
        for rec in records:
            row = ROWS_BY_NAME[rec["row"]]
            where = f"{rec['row']} (bad call on rank {rec['bad_rank']}), seen on rank {rank}"
            if rec["check"] != rec["want"]:
                problems.append(f"{where}: the next all_reduce gave {rec['check']}, want {rec['want']}")
            if rank != rec["bad_rank"]:
                continue
            if not rec.get("invalid") or not rec.get("value_error"):
                problems.append(f"{where}: raised {rec['raised']} ({rec.get('message')!r}), want InvalidArgument")
            elif not re.search(row.match, rec["message"], re.IGNORECASE | re.DOTALL):
                problems.append(f"{where}: message {rec['message']!r} does not match {row.match!r}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- valid but unusual inputs

def _valid_inputs(pg):
    n, r, other = pg.world_size, pg.rank, (pg.rank + 1) % pg.world_size
    got = {}
    zero_d = np.array(r + 1.0)
    pg.all_reduce(zero_d)
    got["0-d all_reduce"] = float(zero_d)
    two_d = np.arange(6, dtype=np.float32).reshape(2, 3) + r
    pg.all_reduce(two_d, ReduceKind.MAX)
    got["2-d all_reduce"] = two_d.tolist()
    ints = np.array([r + 1, -(r + 1)], dtype=np.int32)
    pg.all_reduce(ints, ReduceKind.PROD)
    got["int32 PROD"] = ints.tolist()
    empty = np.zeros(0, dtype=np.float64)
    pg.all_reduce(empty)
    got["size-0 all_reduce"] = empty.shape
    buf = bytearray(np.full(4, r + 1.0, dtype=np.float32).tobytes())
    assert pg.all_reduce_typed(memoryview(buf), DType.F32, ReduceKind.SUM) is not None
    got["typed memoryview"] = np.frombuffer(buf, dtype=np.float32).tolist()
    empty_buf = bytearray()
    pg.all_reduce_typed(empty_buf, DType.BF16)
    got["typed empty"] = len(empty_buf)
    h = pg.spawn_all_reduce(np.full(3, r + 1, dtype=np.int64), ReduceKind.MIN)
    got["spawn"] = h.join(WAIT_HANG_S).tolist()
    # read-only inputs are fine where nothing is written into them
    ro = readonly(np.arange(3, dtype=np.int16) + 10 * r)
    got["read-only all_gather"] = pg.all_gather(ro).tolist()
    got["0-d all_gather"] = pg.all_gather(np.array(r, dtype=np.uint8)).tolist()
    got["0-row all_gather"] = pg.all_gather(np.zeros((0, 2), dtype=np.bool_)).shape
    root_data = readonly(np.array([5.0, 6.0])) if r == 0 else np.zeros(2)
    pg.broadcast(0, root_data)
    got["broadcast read-only root"] = root_data.tolist()
    # byte buffers, read-only arrays and numpy integer ranks/tags for send
    pg.send(np.int64(other), np.int32(TAG_RESERVED_BASE - 1), memoryview(bytearray(b"abc%d" % r)))
    pg.send(other, 1, readonly(np.full((2, 2), r, dtype=np.float32)))
    pg.send_f32(other, 2, np.float32(r))  # a numpy scalar is a read-only 0-d array: fine to send
    pg.send(other, 3, b"xyz")
    left = (r - 1) % n
    msg = pg.recv(np.int32(left), TAG_RESERVED_BASE - 1)
    got["bytearray send"] = (msg.dtype.str, bytes(msg))
    msg = pg.recv(left, 1)
    got["read-only send"] = (msg.shape, msg.tolist())
    msg = pg.recv_f32(left, 2)
    got["0-d send_f32"] = (msg.shape, float(msg))
    got["bytes send"] = bytes(pg.recv(left, 3))
    fed = np.full(2, float(r), dtype=np.float16)
    count = pg.federated_average(fed, datetime.timedelta(seconds=20))
    got["federated f16 timedelta"] = (count, fed.tolist())
    if bfloat16() is not None:
        bf = np.full(2, float(r), dtype=bfloat16())
        pg.federated_average(bf, 20)  # an int deadline
        got["federated bf16"] = bf.astype(np.float64).tolist()
    pg.barrier()
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2])
def test_valid_unusual_inputs(n):
    for r, got in enumerate(run_ranks(n, _valid_inputs, group_timeout=GROUP_TIMEOUT)):
        left = (r - 1) % n
        assert got["0-d all_reduce"] == sum(k + 1.0 for k in range(n))
        assert got["2-d all_reduce"] == (np.arange(6).reshape(2, 3) + n - 1).tolist()
        assert got["int32 PROD"] == [math.factorial(n), (-1) ** n * math.factorial(n)]
        assert got["size-0 all_reduce"] == (0,)
        assert got["typed memoryview"] == [sum(k + 1.0 for k in range(n))] * 4
        assert got["typed empty"] == 0
        assert got["spawn"] == [1, 1, 1]
        assert got["read-only all_gather"] == [v + 10 * k for k in range(n) for v in range(3)]
        assert got["0-d all_gather"] == list(range(n))
        assert got["0-row all_gather"] == (0, 2)
        assert got["broadcast read-only root"] == [5.0, 6.0]
        assert got["bytearray send"] == ("|u1", b"abc%d" % left)
        assert got["read-only send"] == ((2, 2), [[float(left)] * 2] * 2)
        assert got["0-d send_f32"] == ((), float(left))
        assert got["bytes send"] == b"xyz"
        mean = sum(range(n)) / n
        assert got["federated f16 timedelta"] == (n if r == 0 else 0, [mean, mean])
        if bfloat16() is not None:
            assert got["federated bf16"] == [mean, mean]


# ---------------------------------------------------------------- a closed group

def _every_call(pg):
    """Every public call with valid arguments."""
    other = (pg.rank + 1) % pg.world_size
    return {
        "barrier": lambda: pg.barrier(),
        "send": lambda: pg.send(other, 0, f32()),
        "recv": lambda: pg.recv(other, 0),
        "send_f32": lambda: pg.send_f32(other, 0, f32()),
        "recv_f32": lambda: pg.recv_f32(other, 0),
        "all_reduce": lambda: pg.all_reduce(f32()),
        "all_reduce_typed": lambda: pg.all_reduce_typed(bytearray(8), DType.F32),
        "spawn_all_reduce": lambda: pg.spawn_all_reduce(f32()).join(WAIT_HANG_S),
        "all_gather": lambda: pg.all_gather(f32()),
        "broadcast": lambda: pg.broadcast(0, f32()),
        "federated_average": lambda: pg.federated_average(f32(), 1.0),
        "reduce_scatter": lambda: pg.reduce_scatter(f32(2 * pg.world_size)),
        "reduce": lambda: pg.reduce(0, f32()),
        "gather": lambda: pg.gather(0, f32()),
        "scatter": lambda: pg.scatter(0, f32(2 * pg.world_size) if pg.rank == 0 else None),
        "all_to_all": lambda: pg.all_to_all(f32(2 * pg.world_size)),
        "all_gather_v": lambda: pg.all_gather_v(f32()),
    }


CALL_NAMES = ("barrier", "send", "recv", "send_f32", "recv_f32", "all_reduce", "all_reduce_typed",
              "spawn_all_reduce", "all_gather", "broadcast", "federated_average", "reduce_scatter", "reduce",
              "gather", "scatter", "all_to_all", "all_gather_v")


def _after_close(pg):
    pg.barrier()
    pg.close()
    pg.close()  # idempotent
    out = {}
    for name, call in _every_call(pg).items():
        try:
            call()
            out[name] = "returned"
        except InvalidArgument as exc:
            out[name] = str(exc)
        except BaseException as exc:  # reported to the parent
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2])
def test_calls_after_close_raise_invalid_argument(n):
    for rank, out in enumerate(run_ranks(n, _after_close, group_timeout=GROUP_TIMEOUT)):
        assert set(out) == set(CALL_NAMES)
        for name, text in out.items():
            assert re.search(CLOSED_MSG, text), f"rank {rank}: {name} after close gave {text!r}"


def test_closed_group_in_process_and_context_manager():
    with shmcoll.init(rank=0, world_size=1, timeout=GROUP_TIMEOUT) as pg:
        data = f32()
        pg.all_reduce(data)
    for call in _every_call(pg).values():
        with pytest.raises(InvalidArgument, match=CLOSED_MSG):
            call()
    pg.close()


# ---------------------------------------------------------------- init

LAUNCHER_PREFIXES = ("SHMCOLL_", "OMPI_", "PMI_", "SLURM_", "MASTER_", "MPI_")
LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}


@pytest.fixture
def bare_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(LAUNCHER_PREFIXES) or key in LAUNCHER_NAMES:
            monkeypatch.delenv(key)


@pytest.mark.parametrize("transport", ["bogus", "", "TCP", 1])
def test_init_unknown_transport(bare_env, transport):
    with pytest.raises(InvalidArgument, match="transport") as info:
        shmcoll.init(rank=0, world_size=1, transport=transport)
    assert isinstance(info.value, ValueError)
    assert "tcp" in str(info.value)  # names what is accepted


def test_init_unknown_transport_from_environment(bare_env, monkeypatch):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "carrier-pigeon")
    with pytest.raises(InvalidArgument, match="SHMCOLL_TRANSPORT"):
        shmcoll.init(rank=0, world_size=1)
    with shmcoll.init(rank=0, world_size=1, transport="tcp") as pg:  # the explicit argument wins
        assert pg.world_size == 1


def test_init_without_environment_is_a_group_of_one(bare_env):
    with shmcoll.init() as pg:
        assert (pg.rank, pg.world_size) == (0, 1)
        x = np.arange(3.0)
        pg.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0]


def test_init_with_half_a_numbering_names_the_other_half(bare_env):
    with pytest.raises(InvalidArgument, match="SHMCOLL_WORLD_SIZE"):
        shmcoll.init(rank=0)
    with pytest.raises(InvalidArgument, match="SHMCOLL_RANK"):
        shmcoll.init(world_size=2)


@pytest.mark.parametrize("kwargs", [
    dict(rank=-1, world_size=1), dict(rank=1, world_size=1), dict(rank=0, world_size=0),
    dict(rank=True, world_size=1), dict(rank=0.0, world_size=1), dict(rank=0, world_size=1, timeout=-1),
    dict(rank=0, world_size=1, timeout=math.nan), dict(rank=0, world_size=1, timeout=0),
    dict(rank=0, world_size=2), dict(rank=0, world_size=2, master_addr="127.0.0.1"),
    dict(rank=0, world_size=2, master_addr="127.0.0.1", master_port=70000),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_init_bad_arguments(bare_env, kwargs):
    with pytest.raises(InvalidArgument):
        shmcoll.init(**kwargs)


# ---------------------------------------------------------------- validate.py helpers, directly

def test_validate_helpers():
    from shmcoll import validate as v

    assert v.rank_arg(np.int64(2), 3, "to") == 2 and type(v.rank_arg(np.int64(2), 3, "to")) is int
    assert v.tag_arg(np.uint32(TAG_RESERVED_BASE - 1)) == TAG_RESERVED_BASE - 1
    assert v.seconds_arg(datetime.timedelta(milliseconds=1500), "deadline") == 1.5
    assert v.seconds_arg(0, "deadline") == 0.0
    assert v.reduce_kind(ReduceKind.AVG) is ReduceKind.AVG
    arr = np.zeros((2, 3), dtype=np.float16)
    assert v.as_array(arr, "data", writable=True) is arr
    raw = bytearray(8)
    flat, wire = v.typed_buffer(raw, DType.BF16)
    assert flat.dtype == np.uint16 and flat.size == 4 and wire is DType.BF16.wire
    flat[0] = 0xFFFF  # a view: writes land in the caller's buffer
    assert raw[:2] == b"\xff\xff"
