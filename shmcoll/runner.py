"""The machinery under a ProcessGroup: numbers every collective, runs it in call order with a
deadline, and turns a failure into the contract's error, breaking the group and aborting every peer.

A group's state lives in one Runner shared by cheap copies of the group (`copy.copy(pg)`), like the
Arc clone of the original design: same transport, same sequence numbers. Blocking calls run on the
caller's thread once the ordered worker (worker.py) is idle; spawned ones run on the worker.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from .algorithms.call import Call
from .config import Tuning
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, InvalidArgument, PeerLost
from .recorder import FlightRecorder, diagnosis
from .transport.base import Transport
from .transport.frame import Meta
from .transport.mailbox import AbortReason
from .types import U8, Collective
from .worker import CollectiveHandle, OrderedWorker

#: A rank not heard from (data or heartbeat) for this many seconds counts as silent in timeout reports.
SILENT_AFTER = 2.0
#: init()'s closing barrier runs on a tag and sequence number of its own, above every user call's,
#: so the first user collective is still number 0.
STARTUP_TAG = (1 << 32) - 1
STARTUP_SEQ = 1 << 62

_runners: weakref.WeakSet[Runner] = weakref.WeakSet()  # every live group's, for the fork hook below


class Plan(NamedTuple):
    """A validated call, ready to run now (blocking) or later on the ordered worker (spawned): its
    description (collective, dtype code, count, op, root) and its body, which runs the algorithm
    and returns the call's result."""

    coll: Collective
    code: int
    elements: int
    body: Callable[[Call], Any]
    op: int = 0
    root: int = 0


class Runner:
    """One group's sequence numbers, worker, flight recorder and failure state."""

    def __init__(self, transport: Transport, tuning: Tuning, on_close: list[Callable[[], None]]):
        self.transport, self.tuning, self._on_close = transport, tuning, on_close
        self._seq = itertools.count()  # next() is atomic: the caller's thread and spawn_* share it
        self._broken: CollectiveError | None = None
        self._closed = False
        self._owner: int | None = None  # set in a forked child: the parent's pid, which owns the group
        self._lock = threading.Lock()
        self._calling = threading.Lock()  # held while a thread numbers and runs a call of this group
        self._worker = OrderedWorker()
        self.recorder = FlightRecorder()  # the calls completed last, for a failure's report
        _runners.add(self)

    # ---- running calls ----
    def run(self, plan: Plan) -> Any:
        """A blocking collective: numbered now, run on this thread after every spawned one before it."""
        self._enter(plan.coll)
        try:
            meta = self._next_meta(plan)
            if not self._worker.wait_idle(self.transport.timeout):
                raise self.fail(CollectiveTimeout("spawned collectives issued before it did not finish"), meta,
                                time.monotonic())
            self.check_usable()  # a spawned collective may have failed meanwhile
            return self._execute(meta, plan.body)
        finally:
            self._calling.release()

    def spawn(self, plan: Plan) -> CollectiveHandle:
        """A non-blocking collective: numbered now (call order is what matches ranks), run on the
        ordered worker; the handle's join() returns the body's result."""
        self._enter(plan.coll)
        try:
            meta = self._next_meta(plan)
            return self._worker.submit(plan.coll.label, lambda: self._execute(meta, plan.body))
        finally:
            self._calling.release()

    def _enter(self, coll: Collective) -> None:
        """Claim the group for this thread's call, or refuse it before it takes a sequence number.
        Ranks match collectives by call order, and two threads calling at once would make that
        order a race between them: data of one call could meet another's on a peer."""
        if not self._calling.acquire(False):
            raise InvalidArgument(
                f"{coll.label}: another thread is inside a collective of this group right now. Calls on one group "
                f"must come one at a time (ranks match them by call order): call from one thread, use spawn_* "
                f"for background work, or give each thread its own group with split()")

    def startup_barrier(self, body: Callable[[Call], Any]) -> None:
        """init()'s last step, on the tag and sequence number of its own."""
        self.check_usable()
        self._execute(Meta(seq=STARTUP_SEQ, coll=Collective.BARRIER, dtype=U8.code), body, tag=STARTUP_TAG)

    def point_to_point(self, what: str, action: Callable[[float], Any]) -> Any:
        """send/recv: action(deadline); a lost peer or a timeout breaks the group as a collective's would."""
        self.check_usable()
        start = time.monotonic()
        try:
            return action(start + self.transport.timeout)
        except (CollectiveTimeout, PeerLost) as exc:
            raise self.fail(exc, None, start, what) from exc

    def lean_seq(self) -> int | None:
        """The sequence number of a call that runs at once on this thread without a Plan (lean.py),
        or None when it must take the general path: the group is closed or broken, another thread
        is in a call, a spawned call is still running, or calls are traced (SHMCOLL_DEBUG). A number
        given holds the group for this thread until lean_done()."""
        if self._broken is not None or self._closed or self.tuning.debug:
            return None
        if not self._calling.acquire(False):
            return None  # another thread's call: the general path says so
        if not self._worker.idle():
            self._calling.release()
            return None
        return next(self._seq)

    def lean_done(self) -> None:
        """The end of a call lean_seq numbered."""
        self._calling.release()

    def _next_meta(self, plan: Plan) -> Meta:
        self.check_usable()
        seq = next(self._seq)
        return Meta(seq=seq, coll=plan.coll, dtype=plan.code, elements=plan.elements, op=int(plan.op), root=plan.root)

    def _execute(self, meta: Meta, body: Callable[[Call], Any], tag: int | None = None) -> Any:
        t = self.transport
        start = time.monotonic()
        tag = t.tag_of(meta.seq) if tag is None else tag
        call = Call(t, tag, meta, meta.dtype, start + t.timeout, self.tuning.chunk_bytes)
        self._debug("start", meta, start)
        try:
            result = body(call)
        except BaseException as exc:
            self.failed(exc, meta, start)
        if time.monotonic() > call.deadline:
            self.late(meta, start)
        if meta.seq != STARTUP_SEQ:
            self.recorder.completed(meta, time.monotonic() - start)
        self._debug("end", meta, start)
        return result

    # ---- failures ----
    def failed(self, exc: BaseException, meta: Meta, start: float) -> NoReturn:
        """A call's body raised exc: break the group, tell the peers, raise the contract's error (a
        CollectiveError) or exc itself (Ctrl-C or a bug mid-call: peers must not wait for us). Ctrl-C
        or an exit (KeyboardInterrupt, SystemExit) means this rank is leaving: peers get PeerLost."""
        if isinstance(exc, CollectiveError):
            raise self.fail(exc, meta, start) from exc
        if isinstance(exc, Exception):
            self.fail(CollectiveError(f"interrupted by {type(exc).__name__}: {exc}"), meta, start)
        else:
            rank = self.transport.rank
            self.fail(PeerLost(f"rank {rank} was interrupted by {type(exc).__name__} and left the group", rank),
                      meta, start)
        raise exc

    def late(self, meta: Meta, start: float) -> NoReturn:
        """A call that finished after its deadline (a stopped process resumed, say) fails: its peers
        have already given up on it."""
        raise self.fail(CollectiveTimeout("it finished only after its deadline, when the other ranks had already "
                                          "given up on it (was this process stopped or starved?)"), meta, start)

    def check_usable(self) -> None:
        if self._owner is not None:
            raise InvalidArgument(
                f"this ProcessGroup belongs to process {self._owner}, which forked this one: a forked child "
                f"cannot use its parent's group (call shmcoll.init() in the child for a group of its own)")
        if self._closed:
            raise InvalidArgument("this ProcessGroup is closed")
        if self._broken is not None:
            raise same_kind(self._broken, f"this group is broken by an earlier failure and cannot be used: "
                                          f"{self._broken}")

    def fail(self, exc: CollectiveError, meta: Meta | None, start: float, what: str | None = None) -> CollectiveError:
        """Describe the failure, break the group, and tell every peer so nobody waits for us."""
        t, rank = self.transport, self.transport.rank
        if what is None:
            what = f"{Collective(meta.coll).label} (sequence number {meta.seq})" if meta is not None else "call"
        detail = str(exc)
        if isinstance(exc, CollectiveTimeout):
            detail += f" (timeout {t.timeout:g} s); {self._silence_report()}"
        if isinstance(exc, (CollectiveTimeout, CollectiveMismatch)):
            detail += f"; {diagnosis(self.recorder, t.last_heard(), rank, start)}"
        error = same_kind(exc, f"rank {rank}: {what} failed: {detail}")
        if self._broken is None:
            self._broken = error
        t.abort(AbortReason(type(error).__name__, str(error), getattr(error, "peer", None)))
        return error

    def _silence_report(self) -> str:
        """Which ranks went quiet: not even a heartbeat for a while (stopped, hung or cut off)."""
        now, heard, me = time.monotonic(), self.transport.last_heard(), self.transport.rank
        silent = [r for r, t in enumerate(heard) if r != me and t < now - SILENT_AFTER]
        if not silent:
            return ("every rank was still sending heartbeats (a live rank is stuck elsewhere, or called another "
                    "collective)")
        how_long = ", ".join(f"rank {r} for {now - heard[r]:.1f} s" if heard[r] else f"rank {r} never" for r in silent)
        return f"silent ranks: {silent} (not heard from: {how_long})"

    def _debug(self, event: str, meta: Meta, start: float) -> None:
        if self.tuning.debug:
            took = f" in {1e6 * (time.monotonic() - start):.1f} us" if event == "end" else ""
            print(f"[shmcoll rank {self.transport.rank}] {event} {Collective(meta.coll).label} seq={meta.seq} "
                  f"count={meta.elements}{took}", file=sys.stderr, flush=True)

    # ---- life cycle ----
    def close(self) -> None:
        """Stop the worker, release the transport, run the close hooks; idempotent. In a forked
        child it does nothing (the fork hook marks inherited groups closed): the sockets, shared
        memory and peers are the parent's."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._worker.stop(timeout=self.transport.timeout)
        self.transport.close()
        for hook in self._on_close:
            hook()


def same_kind(exc: CollectiveError, message: str) -> CollectiveError:
    """A new error of exc's class (PeerLost keeps its peer) with a fuller message."""
    if isinstance(exc, PeerLost):
        return PeerLost(message, exc.peer)
    return type(exc)(message)


def _disown_inherited_groups() -> None:
    """In a forked child: every group it inherited belongs to the parent. The child must not close,
    abort or say goodbye on it (its exit, sys.exit included, would end the parent's job), and a
    call on it is refused (check_usable)."""
    parent = os.getppid()
    for runner in list(_runners):
        runner._owner, runner._closed = parent, True
        runner._lock, runner._calling = threading.Lock(), threading.Lock()  # a parent thread may have held them


os.register_at_fork(after_in_child=_disown_inherited_groups)
