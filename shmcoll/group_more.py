"""The collectives beyond the original design (reduce-scatter, reduce, gather, scatter,
all-to-all, all-gather-v), the object collectives and split: ProcessGroup's second half.

Kept apart so group.py stays the machinery (numbering, ordering, failures) plus the core calls.
Each method validates its arguments here, before anything is sent, and picks its algorithm from
facts every rank shares (sizes, the topology), so all ranks pick alike:
- across hosts, the two-level versions (algorithms/hier_reduce.py, hier.py);
- small reductions reuse all_reduce's one-step paths (board, one-shot) and keep the piece they need;
- small gathers, all-to-alls and all_gather_vs in one host use the shared-memory board;
- otherwise the flat algorithms of algorithms/scatter_gather.py.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING

import numpy as np

from . import validate as v
from .algorithms import scatter_gather as sg
from .algorithms.board import board_all_gather, board_all_to_all
from .algorithms.board_v import board_all_gather_v, has_room_for_heads
from .algorithms.call import Call
from .algorithms.hier_reduce import hier_reduce, hier_reduce_scatter, stage_for_reduce_scatter
from .errors import CollectiveMismatch, InvalidArgument
from .transport import sub
from .transport.frame import ROOTS_DTYPE
from .plan import Plan
from .types import Collective, ReduceKind
from .worker import CollectiveHandle

if TYPE_CHECKING:
    from .group import ProcessGroup


class MoreCollectives:
    """Mixed into ProcessGroup; relies on its machinery (_run, _spawn, _collective, _hosts, ...)."""

    # ---- reductions that leave a piece ----
    def reduce_scatter(self, data, op: ReduceKind = ReduceKind.SUM) -> np.ndarray:
        """Rank i gets slice i (along axis 0) of op over every rank's data, as a new array; data is
        only read (the algorithms work on a copy)."""
        return self._run(self._reduce_scatter_plan(data, op))

    def spawn_reduce_scatter(self, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        """Non-blocking reduce_scatter; data is copied now, so it may change at once; join() returns
        the new array."""
        return self._spawn("reduce_scatter", self._reduce_scatter_plan(data, op))

    def _reduce_scatter_plan(self, data, op) -> Plan:
        arr = v.as_array(data, "data", writable=False)
        wire, kind = v.reducible_wire(arr, op, "data")
        rows = v.equal_blocks(arr, self.world_size, "data", "reduce_scatter")
        flat = v.storage_view(arr, wire)
        out = np.empty((rows, *arr.shape[1:]), dtype=arr.dtype)
        mine = v.storage_view(out, wire)
        small, topo = self._all_reduce_algorithm(flat, kind, small_only=True), self._hosts()
        if small is not None:
            work, at = flat.copy(), self.rank * mine.size

            def run(c: Call) -> None:  # reduce everything in one step, keep our slice
                small(c, work)
                mine[:] = work[at:at + mine.size]
        elif topo is not None:
            work = stage_for_reduce_scatter(topo, self.rank, flat)
            run = lambda c: hier_reduce_scatter(c, topo, work, mine, kind)
        else:
            work = flat.copy()
            run = lambda c: sg.reduce_scatter(c, work, mine, kind)
        return Plan(Collective.REDUCE_SCATTER, wire.code, flat.size, lambda c: (run(c), out)[1], op=kind)

    def reduce(self, root: int, data, op: ReduceKind = ReduceKind.SUM):
        """In place on root; every rank's data is scratch space (hence writable everywhere)."""
        return self._run(self._reduce_plan(root, data, op))

    def spawn_reduce(self, root: int, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        """Non-blocking reduce; join() returns data, which must not be touched until then."""
        return self._spawn("reduce", self._reduce_plan(root, data, op))

    def _reduce_plan(self, root: int, data, op) -> Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(data, "data", writable=True)
        wire, kind = v.reducible_wire(arr, op, "data")
        flat = v.storage_view(arr, wire)
        small, topo = self._all_reduce_algorithm(flat, kind, small_only=True), self._hosts()
        if small is not None:  # the one-step all-reduce: the root's copy is the answer
            run = lambda c: small(c, flat)
        elif topo is not None:
            run = lambda c: hier_reduce(c, topo, root, flat, kind)
        else:
            run = lambda c: sg.reduce_to_root(c, root, flat, kind)
        return Plan(Collective.REDUCE, wire.code, flat.size, lambda c: (run(c), data)[1], op=kind, root=root)

    # ---- data movement ----
    def gather(self, root: int, local) -> np.ndarray | None:
        """Concatenation of every rank's local along axis 0 on root (as all_gather); None elsewhere."""
        return self._run(self._gather_plan(root, local))

    def spawn_gather(self, root: int, local) -> CollectiveHandle:
        """Non-blocking gather; join() returns what gather returns; leave local alone until then."""
        return self._spawn("gather", self._gather_plan(root, local))

    def _gather_plan(self, root: int, local) -> Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(local, "local", writable=False)
        wire = v.wire_of(arr, "local")
        flat_in = v.storage_view(arr, wire)
        on_board = self._fits_board(flat_in)
        out = None
        if self.rank == root or on_board:  # the board copies every block everywhere: others get scratch
            out = v.gathered_like(arr, self.world_size)
        flat_out = v.storage_view(out, wire) if out is not None else None
        topo, result = self._hosts(), out if self.rank == root else None
        if on_board:
            run = lambda c: board_all_gather(c, flat_in, flat_out)
        else:
            run = lambda c: sg.gather_to_root(c, root, flat_in, flat_out, topo)
        return Plan(Collective.GATHER, wire.code, flat_in.size, lambda c: (run(c), result)[1], root=root)

    def scatter(self, root: int, data=None) -> np.ndarray:
        """Root's data split along axis 0 into world_size equal blocks; rank i gets block i (a new
        array). Only the root's data is looked at (others pass None): the others learn dtype and
        shape from the frame they receive, so the call description carries neither."""
        return self._run(self._scatter_plan(root, data))

    def spawn_scatter(self, root: int, data=None) -> CollectiveHandle:
        """Non-blocking scatter; join() returns this rank's block; the root leaves data alone until then."""
        return self._spawn("scatter", self._scatter_plan(root, data))

    def _scatter_plan(self, root: int, data) -> Plan:
        root = v.rank_arg(root, self.world_size, "root")
        blocks, code, user = None, ROOTS_DTYPE, None
        if self.rank == root:
            if data is None:
                raise InvalidArgument("scatter: the root must pass the array to split (only other ranks pass None)")
            arr = v.as_array(data, "data", writable=False)
            wire = v.wire_of(arr, "data")
            rows = v.equal_blocks(arr, self.world_size, "data", "scatter")
            store = arr.view(wire.storage)
            blocks = [store[j * rows:(j + 1) * rows] for j in range(self.world_size)]
            code, user = wire.code, arr.dtype
        topo = self._hosts()

        def body(c: Call) -> np.ndarray:
            got = sg.scatter_from_root(c, root, blocks, code, topo)
            return got.view(user) if user is not None else got  # the root's comes back as storage

        return Plan(Collective.SCATTER, ROOTS_DTYPE, 0, body, root=root)

    def all_to_all(self, data) -> np.ndarray:
        """Block j (of world_size equal blocks along axis 0) goes to rank j; the result holds the
        blocks received, in source-rank order, as a new array of data's shape. Small inputs on one
        host go through the board in one step; otherwise each block goes straight from its source
        to its destination (across hosts too: it crosses a host boundary at most once)."""
        return self._run(self._all_to_all_plan(data))

    def spawn_all_to_all(self, data) -> CollectiveHandle:
        """Non-blocking all_to_all (say, overlapping an expert layer's exchange with compute);
        join() returns the new array; leave data alone until then."""
        return self._spawn("all_to_all", self._all_to_all_plan(data))

    def _all_to_all_plan(self, data) -> Plan:
        arr = v.as_array(data, "data", writable=False)
        wire = v.wire_of(arr, "data")
        v.equal_blocks(arr, self.world_size, "data", "all_to_all")
        out = np.empty(arr.shape, dtype=arr.dtype)
        flat_in, flat_out = v.storage_view(arr, wire), v.storage_view(out, wire)
        exchange = board_all_to_all if self._fits_board(flat_in) else sg.all_to_all
        return Plan(Collective.ALL_TO_ALL, wire.code, flat_in.size, lambda c: (exchange(c, flat_in, flat_out), out)[1])

    def all_gather_v(self, local) -> tuple[np.ndarray, list[int]]:
        """all_gather where each rank's length along axis 0 may differ (trailing dimensions and dtype
        may not): returns the concatenation in rank order and every rank's length. The call
        description carries the elements per row, which every rank knows; lengths are exchanged first."""
        return self._run(self._all_gather_v_plan(local))

    def spawn_all_gather_v(self, local) -> CollectiveHandle:
        """Non-blocking all_gather_v; join() returns (array, lengths); leave local alone until then."""
        return self._spawn("all_gather_v", self._all_gather_v_plan(local))

    def _all_gather_v_plan(self, local) -> Plan:
        arr = v.as_array(local, "local", writable=False)
        wire = v.wire_of(arr, "local")
        shape = arr.shape if arr.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        flat_in, topo, on_board = v.storage_view(arr, wire), self._hosts(), has_room_for_heads(self.transport.board)

        def make_out(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
            out = np.empty((sum(lengths), *shape[1:]), dtype=arr.dtype)
            return out, v.storage_view(out, wire)

        def body(c: Call):
            if on_board:  # one step when every piece fits; else the lengths are known already
                lengths, out = board_all_gather_v(c, wire.code, shape, flat_in, make_out)
                if out is not None:
                    return out, lengths
            else:
                lengths = sg.exchange_shapes(c, shape, topo)
            out, flat_out = make_out(lengths)
            sg.all_gather_v(c, flat_in, flat_out, lengths, row, topo)
            return out, lengths

        return Plan(Collective.ALL_GATHER_V, wire.code, row, body)

    # ---- Python objects (pickled; trusted ranks only) ----
    def broadcast_object(self, root: int, obj=None):
        """Root's obj on every rank (the root gets obj itself, others an unpickled copy).

        Security: non-roots unpickle what the root sent, and unpickling can run arbitrary code, so
        use this only between ranks you trust (the job secret keeps strangers off the wire)."""
        root = v.rank_arg(root, self.world_size, "root")
        payload = _pickled(obj) if self.rank == root else None
        size = np.array([payload.size if payload is not None else 0], dtype=np.int64)
        self.broadcast(root, size)  # first the size, so non-roots can allocate
        buf = payload if payload is not None else np.empty(int(size[0]), dtype=np.uint8)
        self.broadcast(root, buf)
        if self.rank == root:
            _raise_if_unpicklable(buf, root)  # the root keeps obj itself: no need to unpickle its copy
            return obj
        return _unpickled(buf, root)

    def all_gather_object(self, obj) -> list:
        """Every rank's obj, in rank order (unpickled copies, this rank's too).

        Security: this unpickles what every peer sent, and unpickling can run arbitrary code, so
        use it only between ranks you trust (the job secret keeps strangers off the wire)."""
        data, lengths = self.all_gather_v(_pickled(obj))
        bounds = np.cumsum([0, *lengths])
        return [_unpickled(data[bounds[r]:bounds[r + 1]], r) for r in range(self.world_size)]

    # ---- sub-groups ----
    def split(self, ranks) -> "ProcessGroup | None":
        """A group over the listed ranks, renumbered in list order; None on ranks not listed.

        A collective on this group: every rank calls it with the same list (checked: a
        disagreement raises CollectiveMismatch on every rank). The sub-group has its own sequence
        numbers, tag range and worker, so it may run concurrently with this group (another
        thread); it uses the two-level algorithms when its members span hosts, never the
        shared-memory board (that belongs to the root group's sequence numbers). A failure
        in either breaks both: they share one transport. Close sub-groups you no longer need (they
        hold one of a few thousand tag slots). Do not call split on two groups of the same process
        at once from different threads (slot choices would race)."""
        members = sub.check_ranks(ranks, self.world_size)
        t = self.transport
        root = t.root if isinstance(t, sub.SubTransport) else t
        views = self.all_gather_object((members, sub.used_slots(root)))
        for r, (theirs, _) in enumerate(views):
            if theirs != members:
                raise self._fail(CollectiveMismatch(f"split: rank {r} passed ranks {theirs}, this rank {members}"),
                                 None, time.monotonic(), "split")
        if self.rank not in members:
            return None
        slot = sub.pick_slot(views[m][1] for m in members)
        root_ranks = [t.ranks[m] for m in members] if isinstance(t, sub.SubTransport) else members
        return type(self)(sub.SubTransport(root, root_ranks, slot), tuning=self._st.tuning)


def _pickled(obj) -> np.ndarray:
    """uint8 bytes: a 0 byte then the pickle, or a lone 1 byte when obj cannot be pickled, so the
    peers learn of it (and raise too) instead of waiting for a collective that never comes."""
    try:
        raw = b"\0" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any pickling failure; reported on every rank by _unpickled
        raw = b"\1"
    return np.frombuffer(raw, dtype=np.uint8)


def _raise_if_unpicklable(buf: np.ndarray, sender: int) -> None:
    """The flag byte _pickled wrote: every rank raises alike when the sender's object had no pickle."""
    if buf[:1].tobytes() != b"\0":
        raise InvalidArgument(f"the object of rank {sender} could not be pickled")


def _unpickled(buf: np.ndarray, sender: int):
    _raise_if_unpicklable(buf, sender)
    return pickle.loads(buf[1:].tobytes())
