"""ProcessGroup: the public API of API.md, one section per concern, as the contract lists them.

Every call validates its arguments first (validate.py: InvalidArgument before anything is sent),
then hands a Plan (plans.py: the algorithm select.py picks, and its body) to the group's Runner
(runner.py), which numbers it, runs it in call order with a deadline, and turns failures into the
contract's errors. A spawn_* call builds the same Plan and runs it on the ordered worker instead.
The algorithms and transports below know nothing of users.

`copy.copy(pg)` is a cheap handle on the same group (same transport, same sequence numbers).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

import numpy as np

from . import plans
from . import validate as v
from .algorithms.barrier import dissemination_barrier
from .config import Tuning
from .errors import CollectiveMismatch, InvalidArgument
from .lean import LeanPath
from .runner import Runner
from .transport import sub
from .transport.base import Transport
from .transport.frame import Meta
from .types import WIRE_TYPES, ReduceKind
from .worker import CollectiveHandle


class ProcessGroup:
    """A group of ranks and the collectives among them (API.md, "ProcessGroup")."""

    def __init__(self, transport: Transport, *, tuning: Tuning | None = None,
                 on_close: list[Callable[[], None]] | None = None):
        """Wrap a transport (init() builds one; so may a user). on_close: called once by close()."""
        tuning = tuning or Tuning()
        self._runner = Runner(transport, tuning, list(on_close or []))
        self._where = plans.Where.of(transport, tuning)
        self._lean = LeanPath.for_group(self._runner, transport, self._where)

    # ---- identity ----
    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < world_size."""
        return self.transport.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.transport.world_size

    @property
    def is_leader(self) -> bool:
        """True on rank 0 only."""
        return self.rank == 0

    @property
    def transport(self) -> Transport:
        """The transport this group runs on (shared by copies of the group)."""
        return self._runner.transport

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, world_size={self.world_size}, transport={self.transport.name})"

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- point to point ----
    def send(self, to: int, tag: int, data) -> None:
        """Send an array to rank `to` under a user tag (0 <= tag < TAG_RESERVED_BASE)."""
        to, tag = v.rank_arg(to, self.world_size, "to"), v.tag_arg(tag)
        arr = v.as_array(data, "data", writable=False)
        wire = v.wire_of(arr, "data")
        self._runner.point_to_point(
            f"send to rank {to}", lambda d: self.transport.send(to, tag, arr.view(wire.storage), wire.code, Meta(), d))

    def recv(self, src: int, tag: int) -> np.ndarray:
        """The next message from `src` with `tag`, as a new array; dtype, shape and length come from
        the wire. Messages of one (src, tag) arrive in send order; other tags never block it."""
        src, tag = v.rank_arg(src, self.world_size, "src"), v.tag_arg(tag)
        msg = self._runner.point_to_point(f"recv from rank {src}",
                                          lambda d: self.transport.recv(src, tag, d, strict=False))
        wire = WIRE_TYPES[msg.header.dtype]
        return msg.payload.view(wire.array_dtype).reshape(msg.header.shape)

    def send_f32(self, to: int, tag: int, data) -> None:
        """send(), restricted to float32 data."""
        arr = v.as_array(data, "data", writable=False)
        if arr.dtype != np.float32:
            raise InvalidArgument(f"send_f32 takes float32 data, not {arr.dtype}; use send() for other dtypes")
        self.send(to, tag, arr)

    def recv_f32(self, src: int, tag: int) -> np.ndarray:
        """recv(); CollectiveMismatch when the message is not float32."""
        out = self.recv(src, tag)
        if out.dtype != np.float32:
            raise CollectiveMismatch(f"recv_f32: rank {src} sent {out.dtype} on tag {tag}, not float32 (use recv())")
        return out

    # ---- reductions ----
    def all_reduce(self, data, op: ReduceKind = ReduceKind.SUM):
        """In place: every rank ends with op over every rank's data, bitwise identical everywhere.
        Returns data."""
        if self._lean is None or not self._lean.all_reduce(data, op):  # lean.py: the common case, compiled
            self._runner.run(self._all_reduce_plan(data, op))
        return data

    def spawn_all_reduce(self, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        """Non-blocking all_reduce on the ordered worker; join() returns the reduced array. Leave
        data alone until then."""
        return self._runner.spawn(self._all_reduce_plan(data, op))

    def _all_reduce_plan(self, data, op) -> plans.Plan:
        arr = v.as_array(data, "data", writable=True)
        wire, kind = v.reducible_wire(arr, op, "data")
        return plans.all_reduce(self._where, v.storage_view(arr, wire), wire.code, kind, arr)

    def all_reduce_typed(self, buf, dtype, op: ReduceKind = ReduceKind.SUM):
        """all_reduce over raw little-endian bytes (bytearray, writable memoryview, uint8 array)
        holding `dtype` (a DType) elements. Returns buf."""
        flat, wire = v.typed_buffer(buf, dtype)
        self._runner.run(plans.all_reduce(self._where, flat, wire.code, v.reduce_kind(op), buf))
        return buf

    def reduce_scatter(self, data, op: ReduceKind = ReduceKind.SUM) -> np.ndarray:
        """Rank i gets slice i (along axis 0, whose length world_size divides) of op over every
        rank's data, as a new array; data is only read."""
        if self._lean is not None and (out := self._lean.reduce_scatter(data, op)) is not None:  # lean.py
            return out
        return self._runner.run(self._reduce_scatter_plan(data, op))

    def spawn_reduce_scatter(self, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        """Non-blocking reduce_scatter; data is copied now, so it may change at once; join() returns
        the new array."""
        return self._runner.spawn(self._reduce_scatter_plan(data, op))

    def _reduce_scatter_plan(self, data, op) -> plans.Plan:
        arr = v.as_array(data, "data", writable=False)
        wire, kind = v.reducible_wire(arr, op, "data")
        v.equal_blocks(arr, self.world_size, "data", "reduce_scatter")
        return plans.reduce_scatter(self._where, arr, wire, kind)

    def reduce(self, root: int, data, op: ReduceKind = ReduceKind.SUM):
        """In place on root: op over every rank's data. Every rank's data is scratch space (so it
        must be writable everywhere); on other ranks it is left unspecified. Returns data."""
        if self._lean is None or not self._lean.reduce(root, data, op):  # lean.py: the common case
            self._runner.run(self._reduce_plan(root, data, op))
        return data

    def spawn_reduce(self, root: int, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        """Non-blocking reduce; join() returns data, which must not be touched until then."""
        return self._runner.spawn(self._reduce_plan(root, data, op))

    def _reduce_plan(self, root: int, data, op) -> plans.Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(data, "data", writable=True)
        wire, kind = v.reducible_wire(arr, op, "data")
        return plans.reduce(self._where, root, v.storage_view(arr, wire), wire.code, kind, data)

    def federated_average(self, data, deadline) -> int:
        """Rank 0 averages the data of every rank that arrives within `deadline` (seconds or a
        timedelta, from rank 0's call; its own data always counts) and every rank's data becomes
        that average. Returns the participant count on rank 0, 0 elsewhere. Stragglers never stall
        rank 0, and a late vector never leaks into a later round."""
        arr = v.as_array(data, "data", writable=True)
        wire = v.wire_of(arr, "data")
        if not wire.is_float:
            raise InvalidArgument(f"federated_average averages floating-point data, not {arr.dtype}")
        window = v.seconds_arg(deadline, "deadline")
        return self._runner.run(plans.federated(v.storage_view(arr, wire), wire.code, window))

    # ---- data movement ----
    def barrier(self) -> None:
        """Returns on every rank only after every rank has entered it."""
        if self._lean is None or not self._lean.barrier():
            self._runner.run(plans.barrier(self._where))

    def broadcast(self, root: int, data):
        """In place: every rank ends with root's data (same dtype and length everywhere). Returns data."""
        if self._lean is None or not self._lean.broadcast(root, data):  # lean.py: the common case
            self._runner.run(self._broadcast_plan(root, data))
        return data

    def spawn_broadcast(self, root: int, data) -> CollectiveHandle:
        """Non-blocking broadcast; join() returns data, which must not be touched until then
        (non-roots receive into it in the background)."""
        return self._runner.spawn(self._broadcast_plan(root, data))

    def _broadcast_plan(self, root: int, data) -> plans.Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(data, "data", writable=root != self.rank)
        wire = v.wire_of(arr, "data")
        return plans.broadcast(self._where, root, v.storage_view(arr, wire), wire.code, data)

    def all_gather(self, local) -> np.ndarray:
        """Every rank's local concatenated along axis 0 in rank order, as a new array (a 1-D input
        of length L gives world_size * L; a 0-d input counts as one row)."""
        if self._lean is not None and (out := self._lean.all_gather(local)) is not None:  # lean.py
            return out
        return self._runner.run(self._all_gather_plan(local))

    def spawn_all_gather(self, local) -> CollectiveHandle:
        """Non-blocking all_gather; join() returns the new array. Leave local alone until then."""
        return self._runner.spawn(self._all_gather_plan(local))

    def _all_gather_plan(self, local) -> plans.Plan:
        arr = v.as_array(local, "local", writable=False)
        return plans.all_gather(self._where, arr, v.wire_of(arr, "local"))

    def all_gather_v(self, local) -> tuple[np.ndarray, list[int]]:
        """all_gather where each rank's length along axis 0 may differ (trailing dimensions and
        dtype may not): the concatenation in rank order and every rank's length."""
        return self._runner.run(self._all_gather_v_plan(local))

    def spawn_all_gather_v(self, local) -> CollectiveHandle:
        """Non-blocking all_gather_v; join() returns (array, lengths). Leave local alone until then."""
        return self._runner.spawn(self._all_gather_v_plan(local))

    def _all_gather_v_plan(self, local) -> plans.Plan:
        arr = v.as_array(local, "local", writable=False)
        return plans.all_gather_v(self._where, arr, v.wire_of(arr, "local"))

    def gather(self, root: int, local) -> np.ndarray | None:
        """On root, every rank's local concatenated along axis 0 in rank order (as all_gather);
        None elsewhere."""
        return self._runner.run(self._gather_plan(root, local))

    def spawn_gather(self, root: int, local) -> CollectiveHandle:
        """Non-blocking gather; join() returns what gather returns. Leave local alone until then."""
        return self._runner.spawn(self._gather_plan(root, local))

    def _gather_plan(self, root: int, local) -> plans.Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(local, "local", writable=False)
        return plans.gather(self._where, root, arr, v.wire_of(arr, "local"))

    def scatter(self, root: int, data=None) -> np.ndarray:
        """Root's data split along axis 0 into world_size equal blocks; rank i gets block i as a new
        array. Only the root's data is looked at (others pass None)."""
        return self._runner.run(self._scatter_plan(root, data))

    def spawn_scatter(self, root: int, data=None) -> CollectiveHandle:
        """Non-blocking scatter; join() returns this rank's block. The root leaves data alone until then."""
        return self._runner.spawn(self._scatter_plan(root, data))

    def _scatter_plan(self, root: int, data) -> plans.Plan:
        root = v.rank_arg(root, self.world_size, "root")
        if self.rank != root:
            return plans.scatter(self._where, root, None, None)
        if data is None:
            raise InvalidArgument("scatter: the root must pass the array to split (only other ranks pass None)")
        arr = v.as_array(data, "data", writable=False)
        wire = v.wire_of(arr, "data")
        v.equal_blocks(arr, self.world_size, "data", "scatter")
        return plans.scatter(self._where, root, arr, wire)

    def all_to_all(self, data) -> np.ndarray:
        """Axis 0 of data split into world_size equal blocks; block j goes to rank j. Returns the
        blocks received, in source-rank order, as a new array of data's shape."""
        return self._runner.run(self._all_to_all_plan(data))

    def spawn_all_to_all(self, data) -> CollectiveHandle:
        """Non-blocking all_to_all (say, overlapping an expert layer's exchange with compute);
        join() returns the new array. Leave data alone until then."""
        return self._runner.spawn(self._all_to_all_plan(data))

    def _all_to_all_plan(self, data) -> plans.Plan:
        arr = v.as_array(data, "data", writable=False)
        wire = v.wire_of(arr, "data")
        v.equal_blocks(arr, self.world_size, "data", "all_to_all")
        return plans.all_to_all(self._where, arr, wire)

    # ---- Python objects (pickled: between trusted ranks only) ----
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
    def split(self, ranks) -> ProcessGroup | None:
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
                raise self._runner.fail(CollectiveMismatch(f"split: rank {r} passed ranks {theirs}, this rank "
                                                           f"{members}"), None, time.monotonic(), "split")
        if self.rank not in members:
            return None
        slot = sub.pick_slot(views[m][1] for m in members)
        root_ranks = [t.ranks[m] for m in members] if isinstance(t, sub.SubTransport) else members
        return type(self)(sub.SubTransport(root, root_ranks, slot), tuning=self._runner.tuning)

    # ---- life cycle ----
    def close(self) -> None:
        """Release sockets, shared memory and threads; idempotent."""
        self._runner.close()

    def _startup_barrier(self) -> None:
        """init()'s last step: one barrier over the new transport, on a tag of its own."""
        self._runner.startup_barrier(dissemination_barrier)


def _pickled(obj) -> np.ndarray:
    """uint8 bytes: a 0 byte then the pickle, or a lone 1 byte when obj cannot be pickled, so the
    peers learn of it (and raise too) instead of waiting for a collective that never comes."""
    try:
        raw = b"\0" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # any pickling failure; reported on every rank by _unpickled
        raw = b"\1"
    return np.frombuffer(raw, dtype=np.uint8)


def _raise_if_unpicklable(buf: np.ndarray, sender: int) -> None:
    """The flag byte _pickled wrote: every rank raises alike when the sender's object had no pickle."""
    if buf[:1].tobytes() != b"\0":
        raise InvalidArgument(f"the object of rank {sender} could not be pickled")


def _unpickled(buf: np.ndarray, sender: int):
    _raise_if_unpicklable(buf, sender)
    return pickle.loads(buf[1:].tobytes())
