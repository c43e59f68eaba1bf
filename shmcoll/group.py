"""ProcessGroup: validates every call, numbers collectives, orders them, and turns failures into
the contract's errors. The algorithms and the transport below it know nothing of users.

A group's state lives in one shared object, so `copy.copy(pg)` is a cheap handle on the same group
(same transport, same sequence numbers), like the Arc clone of the original design.

This file holds that machinery and the original design's calls; the later ones (reduce-scatter,
gather, all-to-all, objects, split, ...) come from the MoreCollectives mixin in group_more.py.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import validate as v
from .algorithms.barrier import dissemination_barrier
from .algorithms.board import board_all_gather, board_all_reduce, board_barrier, board_broadcast
from .algorithms.broadcast import chain_broadcast
from .algorithms.call import Call
from .algorithms.federated import federated_average
from .algorithms.hier import hier_all_gather, hier_barrier, hier_broadcast, small_all_reduce, two_level_all_reduce
from .algorithms.ring import one_shot_all_reduce, ring_all_gather, ring_all_reduce
from .config import Tuning
from .recorder import FlightRecorder, diagnosis
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, InvalidArgument, PeerLost
from .transport.base import Transport
from .transport.frame import Meta
from .transport.mailbox import AbortReason
from .transport.topology import Topology
from .types import TAG_RESERVED_BASE, U8, WIRE_TYPES, Collective, ReduceKind
from .group_more import MoreCollectives
from .plan import Plan
from .worker import CollectiveHandle, OrderedWorker

#: A rank not heard from (data or heartbeat) for this many seconds counts as silent in timeout reports.
SILENT_AFTER = 2.0
#: The root group's collective tags: [2**30, 2**31). Sub-groups (split) use [2**31, 2**32 - 1), see transport/sub.py.
_TAG_SPAN = TAG_RESERVED_BASE
_STARTUP_TAG = (1 << 32) - 1  # above every sequence number's tag
_STARTUP_SEQ = 1 << 62  # a sequence number no user collective reaches


def _root_tag(seq: int) -> int:
    return TAG_RESERVED_BASE + seq % _TAG_SPAN


@dataclass
class _State:
    transport: Transport
    tuning: Tuning
    on_close: list[Callable[[], None]]
    seq: int = 0
    broken: CollectiveError | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    worker: OrderedWorker = field(default_factory=OrderedWorker)
    recorder: FlightRecorder = field(default_factory=FlightRecorder)


class ProcessGroup(MoreCollectives):
    def __init__(self, transport: Transport, *, tuning: Tuning | None = None,
                 on_close: list[Callable[[], None]] | None = None):
        self._st = _State(transport, tuning or Tuning(), list(on_close or []))

    # ---- identity ----
    @property
    def rank(self) -> int:
        return self._st.transport.rank

    @property
    def world_size(self) -> int:
        return self._st.transport.world_size

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def transport(self) -> Transport:
        return self._st.transport

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, world_size={self.world_size}, transport={type(self.transport).__name__})"

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- point to point ----
    def send(self, to: int, tag: int, data) -> None:
        to, tag = v.rank_arg(to, self.world_size, "to"), v.tag_arg(tag)
        arr = v.as_array(data, "data", writable=False)
        wire = v.wire_of(arr, "data")
        self._p2p(f"send to rank {to}", lambda d: self.transport.send(to, tag, arr.view(wire.storage), wire.code, Meta(), d))

    def recv(self, src: int, tag: int) -> np.ndarray:
        src, tag = v.rank_arg(src, self.world_size, "src"), v.tag_arg(tag)
        msg = self._p2p(f"recv from rank {src}", lambda d: self.transport.recv(src, tag, d, strict=False))
        wire = WIRE_TYPES[msg.header.dtype]
        return msg.payload.view(wire.user if wire.user is not None else wire.storage).reshape(msg.header.shape)

    def send_f32(self, to: int, tag: int, data) -> None:
        arr = v.as_array(data, "data", writable=False)
        if arr.dtype != np.float32:
            raise InvalidArgument(f"send_f32 takes float32 data, not {arr.dtype}; use send() for other dtypes")
        self.send(to, tag, arr)

    def recv_f32(self, src: int, tag: int) -> np.ndarray:
        out = self.recv(src, tag)
        if out.dtype != np.float32:
            raise CollectiveMismatch(f"recv_f32: rank {src} sent {out.dtype} on tag {tag}, not float32 (use recv())")
        return out

    # ---- collectives ----
    def barrier(self) -> None:
        topo = self._hosts()
        if topo is not None:
            body = lambda c: hier_barrier(c, topo)
        else:
            body = board_barrier if self.transport.board is not None else dissemination_barrier
        self._collective(Collective.BARRIER, U8.code, 0, body)  # empty uint8 frames

    def _startup_barrier(self) -> None:
        """init()'s last step, on a tag of its own: the first user collective is still number 0."""
        self._check_usable()
        meta = Meta(seq=_STARTUP_SEQ, coll=Collective.BARRIER, dtype=U8.code)
        self._execute(meta, dissemination_barrier, tag=_STARTUP_TAG)

    def all_reduce(self, data, op: ReduceKind = ReduceKind.SUM):
        arr = v.as_array(data, "data", writable=True)
        wire, kind = v.reducible_wire(arr, op, "data")
        flat = v.storage_view(arr, wire)
        self._collective(Collective.ALL_REDUCE, wire.code, flat.size, self._all_reduce_body(flat, kind), op=kind)
        return data

    def all_reduce_typed(self, buf, dtype, op: ReduceKind = ReduceKind.SUM):
        flat, wire = v.typed_buffer(buf, dtype)
        kind = v.reduce_kind(op)
        self._collective(Collective.ALL_REDUCE, wire.code, flat.size, self._all_reduce_body(flat, kind), op=kind)
        return buf

    def spawn_all_reduce(self, data, op: ReduceKind = ReduceKind.SUM) -> CollectiveHandle:
        arr = v.as_array(data, "data", writable=True)
        wire, kind = v.reducible_wire(arr, op, "data")
        flat = v.storage_view(arr, wire)
        meta = self._next_meta(Collective.ALL_REDUCE, wire.code, flat.size, op=kind)
        body = self._all_reduce_body(flat, kind)
        return self._st.worker.submit("all_reduce", lambda: (self._execute(meta, body), arr)[1])

    def all_gather(self, local) -> np.ndarray:
        return self._run(self._all_gather_plan(local))

    def spawn_all_gather(self, local) -> CollectiveHandle:
        """Non-blocking all_gather (in call order on the worker); join() returns the new array.
        `local` must stay unchanged until then."""
        return self._spawn("all_gather", self._all_gather_plan(local))

    def _all_gather_plan(self, local) -> Plan:
        arr = v.as_array(local, "local", writable=False)
        wire = v.wire_of(arr, "local")
        out = v.gathered_like(arr, self.world_size)
        flat_in, flat_out = v.storage_view(arr, wire), v.storage_view(out, wire)
        topo = self._hosts()
        if topo is not None:
            gather = lambda c, i, o: hier_all_gather(c, topo, i, o)
        else:
            gather = board_all_gather if self._fits_board(flat_in) else ring_all_gather
        return Plan(Collective.ALL_GATHER, wire.code, flat_in.size, lambda c: (gather(c, flat_in, flat_out), out)[1])

    def broadcast(self, root: int, data):
        return self._run(self._broadcast_plan(root, data))

    def spawn_broadcast(self, root: int, data) -> CollectiveHandle:
        """Non-blocking broadcast (in call order on the worker); join() returns `data`, which must
        not be touched until then (non-roots receive into it in the background)."""
        return self._spawn("broadcast", self._broadcast_plan(root, data))

    def _broadcast_plan(self, root: int, data) -> Plan:
        root = v.rank_arg(root, self.world_size, "root")
        arr = v.as_array(data, "data", writable=root != self.rank)
        wire = v.wire_of(arr, "data")
        flat = v.storage_view(arr, wire)
        topo = self._hosts()
        if topo is not None:
            cast = lambda c, r, d: hier_broadcast(c, topo, r, d)
        else:
            cast = board_broadcast if self._fits_board(flat) else chain_broadcast
        return Plan(Collective.BROADCAST, wire.code, flat.size, lambda c: (cast(c, root, flat), data)[1], root=root)

    def federated_average(self, data, deadline) -> int:
        arr = v.as_array(data, "data", writable=True)
        wire = v.wire_of(arr, "data")
        if not wire.is_float:
            raise InvalidArgument(f"federated_average averages floating-point data, not {arr.dtype}")
        window = v.seconds_arg(deadline, "deadline")
        flat = v.storage_view(arr, wire)
        return self._collective(Collective.FEDERATED_AVERAGE, wire.code, flat.size,
                                lambda c: federated_average(c, flat, window))

    # ---- life cycle ----
    def close(self) -> None:
        st = self._st
        with st.lock:
            if st.closed:
                return
            st.closed = True
        st.worker.stop(timeout=st.transport.timeout)
        st.transport.close()
        for hook in st.on_close:
            hook()

    # ---- machinery ----
    def _check_usable(self) -> None:
        st = self._st
        if st.closed:
            raise InvalidArgument("this ProcessGroup is closed")
        if st.broken is not None:
            raise _same_kind(st.broken, f"this group is broken by an earlier failure and cannot be used: {st.broken}")

    def _next_meta(self, coll: int, code: int, count: int, *, op: int = 0, root: int = 0) -> Meta:
        self._check_usable()
        with self._st.lock:
            seq = self._st.seq
            self._st.seq += 1
        return Meta(seq=seq, coll=coll, dtype=code, count=count, op=int(op), root=root)

    def _run(self, plan: Plan):
        return self._collective(plan.coll, plan.code, plan.count, plan.body, op=plan.op, root=plan.root)

    def _spawn(self, name: str, plan: Plan) -> CollectiveHandle:
        """Number the call now (call order is what matches ranks), run it on the ordered worker."""
        meta = self._next_meta(plan.coll, plan.code, plan.count, op=plan.op, root=plan.root)
        return self._st.worker.submit(name, lambda: self._execute(meta, plan.body))

    def _collective(self, coll: int, code: int, count: int, body: Callable[[Call], Any], *, op: int = 0, root: int = 0):
        meta = self._next_meta(coll, code, count, op=op, root=root)
        if not self._st.worker.wait_idle(self._st.transport.timeout):
            raise self._fail(CollectiveTimeout("spawned collectives issued before it did not finish"), meta, time.monotonic())
        self._check_usable()  # a spawned collective may have failed meanwhile
        return self._execute(meta, body)

    def _execute(self, meta: Meta, body: Callable[[Call], Any], tag: int | None = None):
        t = self._st.transport
        start = time.monotonic()
        tag = t.tag_of(meta.seq) if tag is None else tag
        call = Call(t, tag, meta, meta.dtype, start + t.timeout, self._st.tuning.chunk_bytes)
        self._debug("start", meta, start)
        try:
            result = body(call)
        except CollectiveError as exc:
            raise self._fail(exc, meta, start) from exc
        except BaseException as exc:  # Ctrl-C or a bug mid-call: peers must not wait for us
            self._fail(CollectiveError(f"interrupted by {type(exc).__name__}: {exc}"), meta, start)
            raise
        if time.monotonic() > call.deadline:  # e.g. a stopped process resumed: its peers gave up on this call
            raise self._fail(CollectiveTimeout("it finished only after its deadline, when the other ranks had "
                                               "already given up on it (was this process stopped or starved?)"),
                             meta, start)
        if meta.seq != _STARTUP_SEQ:
            self._st.recorder.completed(meta, time.monotonic() - start)
        self._debug("end", meta, start)
        return result

    def _p2p(self, what: str, action: Callable[[float], Any]):
        self._check_usable()
        start = time.monotonic()
        try:
            return action(start + self._st.transport.timeout)
        except (CollectiveTimeout, PeerLost) as exc:
            raise self._fail(exc, None, start, what) from exc

    def _fail(self, exc: CollectiveError, meta: Meta | None, start: float, what: str | None = None) -> CollectiveError:
        """Describe the failure, break the group, and tell every peer so nobody waits for us."""
        st = self._st
        what = what or f"{Collective(meta.coll).label} (sequence number {meta.seq})"
        detail = str(exc)
        if isinstance(exc, CollectiveTimeout):
            detail += f" (timeout {st.transport.timeout:g} s); {self._silence_report()}"
        if isinstance(exc, (CollectiveTimeout, CollectiveMismatch)):
            detail += f"; {diagnosis(st.recorder, st.transport.last_heard(), self.rank, start)}"
        error = _same_kind(exc, f"rank {self.rank}: {what} failed: {detail}")
        if st.broken is None:
            st.broken = error
        st.transport.abort(AbortReason(type(error).__name__, str(error), getattr(error, "peer", None)))
        return error

    def _silence_report(self) -> str:
        """Which ranks went quiet: not even a heartbeat for a while (stopped, hung or cut off)."""
        now, heard = time.monotonic(), self._st.transport.last_heard()
        silent = [r for r, t in enumerate(heard) if r != self.rank and t < now - SILENT_AFTER]
        if not silent:
            return "every rank was still sending heartbeats (a live rank is stuck elsewhere, or called another collective)"
        how_long = ", ".join(f"rank {r} for {now - heard[r]:.1f} s" if heard[r] else f"rank {r} never" for r in silent)
        return f"silent ranks: {silent} (not heard from: {how_long})"

    def _hosts(self) -> Topology | None:
        """The topology when the group spans several hosts (the two-level algorithms apply), else None."""
        topo = self.transport.topology
        return topo if topo is not None and topo.n_hosts > 1 else None

    def _fits_board(self, flat: np.ndarray) -> bool:
        """Small enough for the shared-memory board (every rank decides alike: by size alone)."""
        board = self.transport.board
        return board is not None and flat.nbytes <= board.capacity

    def _all_reduce_body(self, flat: np.ndarray, kind: ReduceKind) -> Callable[[Call], None]:
        algorithm = self._all_reduce_algorithm(flat, kind)
        return lambda c: algorithm(c, flat)

    def _all_reduce_algorithm(self, flat: np.ndarray, kind: ReduceKind,
                              small_only: bool = False) -> Callable[[Call, np.ndarray], None] | None:
        """The shared-memory board or a one-shot (one step) for small arrays, the bandwidth-optimal
        ring for large ones; across hosts the two-level versions of the latter two. Every rank picks
        the same: the choice depends on the size (and the topology every rank shares) alone.
        small_only: None instead of a bandwidth-optimal algorithm (for reduce and reduce_scatter,
        which reuse the one-step paths on small arrays)."""
        topo, one_shot = self._hosts(), self._st.tuning.one_shot_bytes
        if topo is not None:
            if flat.nbytes <= one_shot:
                return lambda c, d: small_all_reduce(c, topo, d, kind)
            large = lambda c, d: two_level_all_reduce(c, topo, d, kind, one_shot)
        elif self._fits_board(flat):
            return lambda c, d: board_all_reduce(c, d, kind)
        elif flat.nbytes <= one_shot:
            return lambda c, d: one_shot_all_reduce(c, d, kind)
        else:
            large = lambda c, d: ring_all_reduce(c, d, kind)
        return None if small_only else large

    def _debug(self, event: str, meta: Meta, start: float) -> None:
        if self._st.tuning.debug:
            took = f" in {1e6 * (time.monotonic() - start):.1f} us" if event == "end" else ""
            print(f"[shmcoll rank {self.rank}] {event} {Collective(meta.coll).label} seq={meta.seq} "
                  f"count={meta.count}{took}", file=sys.stderr, flush=True)


def _same_kind(exc: CollectiveError, message: str) -> CollectiveError:
    """A new error of exc's class (PeerLost keeps its peer) with a fuller message."""
    if isinstance(exc, PeerLost):
        return PeerLost(message, exc.peer)
    return type(exc)(message)

