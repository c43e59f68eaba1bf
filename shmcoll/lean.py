"""The call path of the common calls, with nothing on it that can be worked out once.

The common case: all_reduce of a C-contiguous, writable numpy array of a reducible dtype with a
ReduceKind, small enough for the shared-memory board, and barrier; every rank on this host (or a
group of one). That is the loss, metric, norm and flag of every training step, and there Python's
overhead is most of the time a call takes. What such a call needs besides its data (wire code, its
description for errors, the frame header but for the sequence number) is derived once per (dtype,
element count, op) and kept. A call then takes a sequence number and runs the board's compiled step
(kernels.board_all_reduce; a barrier is an all-reduce of nothing); only a wait that outlasts a slice
comes back to Python for the failure checks. A broadcast of a C-contiguous numpy array (writable but
on the root) is kept per (dtype, element count, root) the same way: on one host one that fits the
board runs its compiled step (kernels.board_broadcast, through Board.broadcast), and any other runs
its algorithm as a larger all_reduce does (below). So does a reduce, per (dtype, element count, op,
root): a small one is a one-step all-reduce (plans.reduce_algorithm), whose step runs here as the
all-reduce's does, under the reduce's own description and header, and so does a small reduce_scatter
(per dtype, shape and op) on a copy of its input, each rank keeping its block. An all_gather of a
C-contiguous numpy array is kept per (dtype, shape): on one host one within a board entry runs its
compiled step (kernels.board_all_gather) into a new array, this rank's block copied in first.

A group across hosts (LeanAcrossHosts) runs its small all-reduce, reduce, reduce-scatter and barrier
the same way as far as the host's board goes: what is worked out once is the call's description, its
board header, whom the rank crosses hosts with and how, and those peers' connections. An
all-reduce's exchanges across hosts (a small reduce's and reduce-scatter's are the same) then run in
a row (Transport.swap_row: one native call over TCP, sending the board's header with the call's tag
and sequence number written in) where two hosts' one-shot or recursive doubling is all its column
does; otherwise the steps across hosts and back are two_level.py's own.

A larger all_reduce of such an array takes the same entry: its algorithm, as plans.py would run it
(plans.all_reduce_algorithm), is kept per kind of call with the rest, and a call runs it with a
Call of its own, without validation, planning or the runner's wrapper around every collective. On
a large call that is little of its time, but where ranks share cores every microsecond of Python a
rank spends is one its host peers wait for (2 hosts x 2 ranks on 2 cores: 50 us more Python per
call made a 1 MiB all-reduce 150 us slower).

Across hosts a small broadcast (two_level_broadcast.two_level_one_shot_broadcast's, within a board
entry and one frame per step) runs here too: the host's board step, the column's doubling steps
as one prepared row, the leader's hand-on. So does a small all-gather among hosts of as many ranks,
numbered host by host: the host's board step, then each Bruck step of the column in one native
call (two_level._all_gather_by_columns's frames). Any other broadcast or all-gather across hosts
runs its algorithm that way (plans.broadcast_algorithm, plans.all_gather_algorithm): the lean path
only skips the general path's work around it.

Anything else, or anything unusual (a spawned call still running, another thread's call, a broken
or closed group, SHMCOLL_DEBUG), returns False before touching anything, and group.py takes the
general path: validate.py, plans.py, runner.py. Errors are the same on both paths: the failure
path builds the same guard and reports through the same Runner.fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from . import kernels
from .algorithms import two_level
from .algorithms.barrier import doubling_barrier
from .algorithms.bruck import bruck_schedule
from .algorithms.call import Call
from .algorithms.doubling import doubling_steps
from .algorithms.doubling_broadcast import cast_steps, in_one_row
from .algorithms.ring import summed
from .algorithms.select import Algorithm, gather_across_hosts, select
from .errors import InvalidArgument
from .kept import keep
from .plans import Where, all_gather_algorithm, all_reduce_algorithm, broadcast_algorithm, reduce_algorithm
from .runner import Runner
from .transport import frame
from .transport.base import NOT_STARTED, BoardGuard, PeerStep, Transport, Way
from .transport.frame import DATA, Meta
from .transport.shm_board import DONE_SLEEPERS, WAIT_SLICE_NS, Board, entry_header
from .transport.tcp import SWAP_MAX_BYTES, SwapRow
from .transport.topology import Topology
from .types import U8, Collective, ReduceKind
from .validate import gathered_like, reducible_wire, wire_of

_NOTHING = np.empty(0, np.uint8)  # a barrier's data
#: Kinds of call (dtype, count, op) remembered per group; training repeats a handful.
MAX_PREPARED = 1024
#: Largest all-gather (in all) whose Bruck steps among more than two hosts run here as rows
#: (LeanAcrossHosts._gather): such a step sends, then receives, where the general path's duplex
#: does both at once, and the blocks go through a rotated copy. On 4 hosts x 1 (namespaces) the
#: rows took 380-410 us at 16 B against 430-540, about as long at 64 KiB, longer at 256 KiB.
ROTATED_GATHER_BYTES = 64 << 10


class _BruckStep(NamedTuple):
    """One step of Bruck's all-gather across hosts (bruck.py) in one native call: `hosts` hosts'
    blocks out to `to`, as many in from `src` (one swap where they are one peer)."""

    to: int
    src: int
    distance: int  # in hosts: what comes in lands this far along the rotated array
    hosts: int  # how many hosts' blocks go each way
    header: bytes  # the frame of what goes out, sequence number 0
    row: SwapRow


class _GatherRows(NamedTuple):
    """A small all-gather across hosts of as many ranks each, numbered host by host
    (LeanAcrossHosts._gathering): the host's blocks in the output, and this rank's Bruck steps in
    its crossing column (none for a rank of no column, which hears from its leader)."""

    mine: slice  # this host's blocks in the output
    steps: tuple[_BruckStep, ...]


def _unchosen(flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
    raise AssertionError("a prepared call runs only once LeanPath._with_step chose what runs it")


def _nothing_to_exchange(flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
    """A call in a group of one."""


class _Prepared(NamedTuple):
    """What one kind of call (a barrier; an all_reduce's dtype, element count and op) needs,
    worked out on its first call."""

    storage: np.dtype  # the dtype the board step sees (16-bit floats as their uint16 bits)
    code: int
    op: int
    meta: Meta  # the call's description, sequence number 0
    header: np.ndarray  # its frame header, sequence number 0
    average: bool
    fold: ReduceKind  # what partial results fold with across hosts (AVG summed, divided at the end)
    #: The algorithm of a call past the board's step (plans.all_reduce_algorithm: AVG included;
    #: plans.reduce_algorithm, plans.broadcast_algorithm), run with a Call as the general path runs
    #: it; None where the board's step runs.
    algorithm: Callable[[Call, np.ndarray], None] | None = None
    source: int = 0  # a broadcast's root as the board step takes it (Board.board_source)
    #: A broadcast's steps across hosts in this rank's column (doubling_broadcast.cast_steps), and
    #: their prepared row where the transport runs one (lean across hosts only).
    cast_row: tuple[Sequence[PeerStep], SwapRow | None] | None = None
    gather_rows: _GatherRows | None = None  # an all-gather's steps across hosts (lean across hosts only)
    shape: tuple[int, ...] = ()  # an all-gather's or a reduce-scatter's output
    #: What runs such a call: run(flat, p, seq, start), chosen once (LeanPath._with_step)
    run: Callable[[np.ndarray, _Prepared, int, float], None] = _unchosen


class LeanPath:
    """The common calls of one group (ProcessGroup.all_reduce, reduce, reduce_scatter, broadcast,
    all_gather and barrier try it first)."""

    def __init__(self, runner: Runner, transport: Transport, where: Where, board: Board | None):
        """board: the board the call's step runs on (None: a group of one, or a rank alone on its
        host across hosts)."""
        self._runner, self._t, self._group_where, self._setting = runner, transport, where, where.setting
        self._chunk_bytes = runner.tuning.chunk_bytes
        self._prepared: dict[tuple, _Prepared | None] = {}  # all_reduce's, by (dtype, count, op)
        self._casts: dict[tuple, _Prepared | None] = {}  # broadcast's, by (dtype, count, root)
        self._reduces: dict[tuple, _Prepared | None] = {}  # reduce's, by (dtype, count, op, root)
        self._gathers: dict[tuple, _Prepared | None] = {}  # all_gather's, by (dtype, shape)
        self._scatters: dict[tuple, _Prepared | None] = {}  # reduce_scatter's, by (dtype, shape, op)
        self._alone = transport.world_size == 1  # nothing to exchange
        if board is not None:  # what every step passes to the compiled call, looked up once
            self._board, self._mem, self._where, self._spin_ns = board, board.mem, board.host_where, board.spin_ns
            self._board_rank = board.host_ranks.index(transport.rank)  # this rank's row of _where
        self._barrier = self._with_step(self._prepare_call(Collective.BARRIER, U8.code, _NOTHING, ReduceKind.SUM, 0))

    @classmethod
    def for_group(cls, runner: Runner, transport: Transport, where: Where) -> LeanPath | None:
        """One for a group alone, whose every rank shares this host's board, or that spans hosts
        where this rank is alone on its host or shares a board with the others there; else None."""
        board, setting, topology = transport.board, where.setting, where.topology
        if transport.world_size == 1 or (board is not None and setting.hosts == 1
                                         and len(board.where) == transport.world_size):
            return cls(runner, transport, where, board)
        if topology is not None and (transport.host_board is not None
                                     or len(topology.local_ranks(transport.rank)) == 1):
            return LeanAcrossHosts(runner, transport, where, topology)
        return None

    def all_reduce(self, data, op) -> bool:
        """Run data's all_reduce and return True, or return False, having done nothing, when the
        call is not the common case."""
        if type(data) is not np.ndarray or type(op) is not ReduceKind:
            return False
        flags = data.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
        key = (data.dtype, data.size, op)
        p = self._prepared.get(key)
        if p is None and (p := self._keep(self._prepared, key, self._prepare_all_reduce, data, op)) is None:
            return False
        flat = data if data.ndim == 1 and data.dtype is p.storage else data.reshape(-1).view(p.storage)
        return self._run(flat, p)

    def reduce(self, root, data, op) -> bool:
        """Run root's reduce of data and return True, or return False, having done nothing, when
        the call is not the common case (as for all_reduce, and an int root of the group)."""
        if (type(data) is not np.ndarray or type(op) is not ReduceKind or type(root) is not int
                or not 0 <= root < self._t.world_size):
            return False
        flags = data.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
        key = (data.dtype, data.size, op, root)
        p = self._reduces.get(key)
        if p is None and (p := self._keep(self._reduces, key, self._prepare_reduce, data, op, root)) is None:
            return False
        flat = data if data.ndim == 1 and data.dtype is p.storage else data.reshape(-1).view(p.storage)
        return self._run(flat, p)

    def barrier(self) -> bool:
        """Run a barrier and return True, or return False, having done nothing, when it must take
        the general path."""
        return self._run(_NOTHING, self._barrier)

    def broadcast(self, root, data) -> bool:
        """Run root's broadcast of data and return True, or return False, having done nothing, when
        the call is not the common case (a C-contiguous numpy array, writable but on the root, of a
        dtype that can be sent, and an int root of the group)."""
        if type(data) is not np.ndarray or type(root) is not int or not 0 <= root < self._t.world_size:
            return False
        flags = data.flags
        if not (flags.c_contiguous and (flags.writeable or root == self._t.rank)):
            return False
        key = (data.dtype, data.size, root)
        p = self._casts.get(key)
        if p is None and (p := self._keep(self._casts, key, self._prepare_broadcast, data, root)) is None:
            return False
        flat = data if data.ndim == 1 and data.dtype is p.storage else data.reshape(-1).view(p.storage)
        return self._run(flat, p)

    def all_gather(self, local) -> np.ndarray | None:
        """Every rank's local concatenated along axis 0 (as ProcessGroup.all_gather returns it), or
        None, having done nothing, when the call is not the common case (a C-contiguous numpy array
        of a dtype that can be sent, gathered on this host's board or across hosts)."""
        if type(local) is not np.ndarray or not local.flags.c_contiguous:
            return None
        key = (local.dtype, local.shape)
        p = self._gathers.get(key)
        if p is None and (p := self._keep(self._gathers, key, self._prepare_all_gather, local)) is None:
            return None
        out = np.empty(p.shape, local.dtype)
        flat, block, at = out.reshape(-1).view(p.storage), local.size, self._t.rank * local.size
        flat[at:at + block] = local.reshape(-1).view(p.storage)
        return out if self._run(flat, p) else None

    def reduce_scatter(self, data, op) -> np.ndarray | None:
        """Block `rank` (along axis 0) of op over every rank's data, as a new array (as
        ProcessGroup.reduce_scatter returns it), or None, having done nothing, when the call is not
        the common case: a C-contiguous numpy array of a reducible dtype whose first axis the group
        cuts in equal blocks, small enough for the one-step all-reduce (plans.reduce_scatter's
        ONE_STEP) that runs here on a copy of it, under the reduce-scatter's own description."""
        if type(data) is not np.ndarray or type(op) is not ReduceKind or not data.flags.c_contiguous:
            return None
        key = (data.dtype, data.shape, op)
        p = self._scatters.get(key)
        if p is None and (p := self._keep(self._scatters, key, self._prepare_reduce_scatter, data, op)) is None:
            return None
        work = data.reshape(-1).view(p.storage).copy()
        if not self._run(work, p):
            return None
        out = np.empty(p.shape, data.dtype)
        mine = out.reshape(-1).view(p.storage)
        at = self._t.rank * mine.size
        mine[:] = work[at:at + mine.size]
        return out

    def _keep(self, kept: dict[tuple, _Prepared | None], key: tuple, prepare: Callable[..., _Prepared | None],
              *args) -> _Prepared | None:
        """What a kind of call not in `kept` needs (prepare(*args)), kept under key; None, kept too,
        for one that is not the common case (known then from an earlier call). The entries' hit
        path (the lookup, the flat view) stays inline in each: one more Python call there cost
        0.5-0.8 us of a 7 us call (2 ranks, 8 B)."""
        if key in kept:
            return None
        p = prepare(*args)
        return keep(kept, key, None if p is None else self._with_step(p), MAX_PREPARED)

    def _with_step(self, p: _Prepared) -> _Prepared:
        """p with what runs calls of its kind, chosen once rather than at every call."""
        if p.algorithm is not None:
            return p._replace(run=self._by_algorithm)
        if self._alone:
            return p._replace(run=_nothing_to_exchange)
        if p.meta.coll == Collective.BROADCAST:
            return p._replace(run=self._cast)
        if p.meta.coll == Collective.ALL_GATHER:
            return p._replace(run=self._gather)
        return p._replace(run=self._averaged if p.average else self._reduce)

    def _prepare_all_reduce(self, data: np.ndarray, op: ReduceKind) -> _Prepared | None:
        """None when calls like this one are not the common case (or are invalid: the general path says so)."""
        where = self._group_where
        return self._prepare_reduction(Collective.ALL_REDUCE, data, op, 0,
                                       lambda algorithm, kind: all_reduce_algorithm(where, algorithm, kind))

    def _prepare_reduce(self, data: np.ndarray, op: ReduceKind, root: int) -> _Prepared | None:
        """As _prepare_all_reduce: a small reduce is a one-step all-reduce (plans.reduce_algorithm),
        whose step runs here as the all-reduce's does, under the reduce's own description."""
        where = self._group_where
        return self._prepare_reduction(Collective.REDUCE, data, op, root,
                                       lambda algorithm, kind: reduce_algorithm(where, algorithm, root, kind))

    def _prepare_reduction(self, coll: Collective, data: np.ndarray, op: ReduceKind, root: int,
                           algorithm_of: Callable[[Algorithm, ReduceKind], Callable[[Call, np.ndarray], None]]
                           ) -> _Prepared | None:
        """What an all-reduce or a reduce (coll) needs: the board's step where select() picks it,
        else the algorithm algorithm_of(selected, kind) builds; None for an op or dtype that cannot
        be reduced."""
        try:
            wire, kind = reducible_wire(data, op, "data")
        except InvalidArgument:
            return None
        p = self._prepare_call(coll, wire.code, data.reshape(-1).view(wire.storage), kind, data.size, root)
        algorithm = select(coll, data.nbytes, self._setting)
        if self._runs(algorithm, data):
            return p
        return p._replace(algorithm=algorithm_of(algorithm, kind))

    def _prepare_reduce_scatter(self, data: np.ndarray, op: ReduceKind) -> _Prepared | None:
        """As _prepare_reduce; None for data the group cannot cut in equal blocks (the general path
        says so), and for one larger than the one-step all-reduce this path runs."""
        n = self._t.world_size
        if data.ndim == 0 or data.shape[0] % n:
            return None
        where = self._group_where
        p = self._prepare_reduction(Collective.REDUCE_SCATTER, data, op, 0,
                                    lambda algorithm, kind: all_reduce_algorithm(where, algorithm, kind))
        if p is None or p.algorithm is not None:
            return None
        return p._replace(shape=(data.shape[0] // n, *data.shape[1:]))

    def _prepare_broadcast(self, data: np.ndarray, root: int) -> _Prepared | None:
        """None for a dtype that cannot be sent (the general path says so)."""
        try:
            wire = wire_of(data, "data")
        except InvalidArgument:
            return None
        flat = data.reshape(-1).view(wire.storage)
        p = self._prepare_call(Collective.BROADCAST, wire.code, flat, ReduceKind.SUM, data.size, root)
        algorithm = select(Collective.BROADCAST, data.nbytes, self._setting)
        if self._alone:
            return p
        if self._casts_on_board(algorithm, data):
            return self._casting(p, root)
        return p._replace(algorithm=broadcast_algorithm(self._group_where, algorithm, root))

    def _casting(self, p: _Prepared, root: int) -> _Prepared:
        """p as _cast runs a broadcast from root: the root's place on the board."""
        return p._replace(source=self._board.board_source(root))

    def _prepare_all_gather(self, local: np.ndarray) -> _Prepared | None:
        """None for a dtype that cannot be sent (the general path says so), or an all-gather this
        path does not run (_gathering)."""
        try:
            wire = wire_of(local, "local")
        except InvalidArgument:
            return None
        flat = local.reshape(-1).view(wire.storage)
        p = self._prepare_call(Collective.ALL_GATHER, wire.code, flat, ReduceKind.SUM, local.size)
        p = p._replace(shape=gathered_like(local, self._t.world_size).shape)
        return p if self._alone else self._gathering(p, select(Collective.ALL_GATHER, flat.nbytes, self._setting))

    def _gathering(self, p: _Prepared, algorithm: Algorithm) -> _Prepared | None:
        """p as this path runs an all-gather selected to run `algorithm`, or None where the general
        path runs it: here the board's step (a larger all-gather reads its peers' arrays, which this
        path leaves to the general one)."""
        return p if algorithm == Algorithm.BOARD else None

    def _casts_on_board(self, algorithm: Algorithm, data: np.ndarray) -> bool:
        """Whether a broadcast of data selected to run `algorithm` runs here (_cast: the board's
        step), not as its algorithm."""
        return algorithm == Algorithm.BOARD

    def _runs(self, algorithm: Algorithm, data: np.ndarray) -> bool:
        """Whether calls like this one, selected to run `algorithm`, take the board's step (in a
        group of one, anything goes: there is nothing to exchange); the others run their algorithm."""
        return self._alone or algorithm == Algorithm.BOARD

    def _prepare_call(self, coll: Collective, code: int, flat: np.ndarray, kind: ReduceKind,
                      elements: int, root: int = 0) -> _Prepared:
        """The description and header the general path (runner.py's Meta, board.py's step) gives this
        call (a broadcast's op is 0: SUM)."""
        meta = Meta(seq=0, coll=coll, dtype=code, elements=elements, op=int(kind), root=root)
        return _Prepared(flat.dtype, code, int(kind), meta, entry_header(self._t.rank, meta, code, flat),
                         kind == ReduceKind.AVG, summed(kind))

    def _run(self, flat: np.ndarray, p: _Prepared) -> bool:
        """As Runner.run runs the general path's board call: sequence number, deadline, failures, record."""
        runner = self._runner
        seq = runner.lean_seq()
        if seq is None:
            return False
        try:
            start = time.monotonic()
            try:
                p.run(flat, p, seq, start)
            except BaseException as exc:
                runner.failed(exc, p.meta.numbered(seq), start)
            end = time.monotonic()
            if end > start + self._t.timeout:
                runner.late(p.meta.numbered(seq), start)
            runner.recorder.completed(p.meta, end - start, seq)
        finally:
            runner.lean_done()
        return True

    def _by_algorithm(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """A call past the board's step: its algorithm, with a Call as the general path runs it."""
        assert p.algorithm is not None
        p.algorithm(Call(self._t, self._t.tag_of(seq), p.meta.numbered(seq), p.code, start + self._t.timeout,
                         self._chunk_bytes), flat)

    def _averaged(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """An AVG: the SUM's exchange, then the division."""
        self._reduce(flat, p, seq, start)
        kernels.scale_into(flat, p.code, self._t.world_size)

    def _reduce(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """The call's exchange (flat summed over the group, in place), failures raised."""
        self._on_board(flat, p, seq, start)

    def _on_board(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """The all-reduce among the board's ranks (flat reduced in place), failures raised."""
        status = kernels.board_all_reduce(self._mem, flat, p.header, self._where, self._board_rank, seq, p.code,
                                          p.op, 0, self._spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)
        if status != kernels.BOARD_DONE:
            self._rest(status, seq, flat, p, start)

    def _cast(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """The broadcast among the board's ranks in one compiled step (as Board.broadcast runs it),
        failures raised."""
        status = kernels.board_broadcast(self._mem, flat, p.header, self._where, self._board_rank, seq, p.code,
                                         p.source, 0, self._spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)
        if status != kernels.BOARD_DONE:
            meta = p.meta._replace(seq=seq)
            guard = self._board_guard(self._t.tag_of(seq), meta)
            self._board.broadcast_rest(status, seq, flat, p.header, p.code, p.source, start + self._t.timeout, guard,
                                       meta)

    def _gather(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """The all-gather among the board's ranks in one compiled step (as Board.all_gather runs it;
        flat: the whole output, this rank's block in place), failures raised."""
        status = kernels.board_all_gather(self._mem, flat, p.header, self._where, self._board_rank, seq, p.code, 0,
                                          self._spin_ns, WAIT_SLICE_NS, DONE_SLEEPERS)
        if status != kernels.BOARD_DONE:
            meta = p.meta._replace(seq=seq)
            guard = self._board_guard(self._t.tag_of(seq), meta)
            self._board.all_gather_rest(status, seq, flat, p.header, p.code, start + self._t.timeout, guard, meta)

    def _rest(self, status: int, seq: int, flat: np.ndarray, p: _Prepared, start: float) -> None:
        """A wait outlasted the first slice: go on with the failure checks between slices."""
        meta = p.meta._replace(seq=seq)
        guard = self._board_guard(self._t.tag_of(seq), meta)
        self._board.all_reduce_rest(status, seq, flat, p.header, p.code, p.op, start + self._t.timeout, guard, meta)

    def _board_guard(self, tag: int, meta: Meta) -> BoardGuard:
        return self._t.board_guard(tag, meta)


class LeanAcrossHosts(LeanPath):
    """The same calls in a group that spans hosts (two_level.py's small all-reduce and barrier):
    the step on this host's board runs from the prepared header as above, then the exchange
    across hosts (by column, or among the leaders) and the leader's hand-on send the frames
    two_level.py's would, so ranks may take either path."""

    def __init__(self, runner: Runner, transport: Transport, where: Where, topology: Topology):
        self._host, self._host_of, self._hosts = topology.local_ranks(transport.rank), topology.host_of, topology.hosts
        self._column, self._first_handed = two_level.small_crossing(topology, transport.rank)
        self._reduce_across = two_level.column_all_reduce(topology.n_hosts)
        self._steps = two_level.column_steps(self._column, transport.rank) if self._column is not None else None
        self._rows = self._prepare_rows(transport)
        self._swap_row = transport.row_transport().swap_row
        self._handing = self._first_handed < len(self._host)  # some rank of this host hears from its leader
        self._host_board = two_level.host_board(transport, self._host)
        super().__init__(runner, transport, where, self._host_board)

    def _prepare_rows(self, transport: Transport) -> dict[int, tuple[Sequence[PeerStep], SwapRow]]:
        """Per collective, the column's exchanges across hosts where they run as one native call
        (Transport.prepare_row), with their steps: the all-reduce's (column_steps) and the
        barrier's (those doubling_barrier meets in)."""
        if self._column is None:
            return {}
        rows: dict[int, tuple[Sequence[PeerStep], SwapRow]] = {}
        meetings = doubling_steps(self._column, transport.rank)
        for coll, steps in ((Collective.ALL_REDUCE, self._steps), (Collective.BARRIER, meetings)):
            row = transport.prepare_row(steps) if steps else None
            if steps and row is not None:
                rows[int(coll)] = (steps, row)
        if int(Collective.ALL_REDUCE) in rows:  # a small reduce's and reduce-scatter's are the all-reduce's
            rows[int(Collective.REDUCE)] = rows[int(Collective.REDUCE_SCATTER)] = rows[int(Collective.ALL_REDUCE)]
        return rows

    def _runs(self, algorithm: Algorithm, data: np.ndarray) -> bool:
        """The small two-level all-reduce, its host's step on the board (two_level._in_host_step: where
        the array fits) or none (this rank alone on its host)."""
        board = self._host_board
        return algorithm == Algorithm.TWO_LEVEL_ONE_SHOT and (board is None or data.nbytes <= board.capacity)

    def _reduce(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        if self._host_board is not None:
            self._on_board(flat, p, seq, start)
        tag, deadline = self._t.tag_of(seq), start + self._t.timeout
        row = self._rows.get(p.meta.coll)
        if row is not None:
            self._row_across(*row, flat, p, tag, seq, deadline)
        elif self._column is not None:
            self._across(self._column, flat, p, tag, seq, deadline)
        if self._handing:
            two_level.from_leader(Call(self._t, tag, p.meta._replace(seq=seq), p.code, deadline), self._host,
                                  self._host_board, flat, self._first_handed)

    def _board_guard(self, tag: int, meta: Meta) -> BoardGuard:
        return self._t.host_board_guard(tag, meta)

    def _casts_on_board(self, algorithm: Algorithm, data: np.ndarray) -> bool:
        """The small two-level broadcast (two_level_broadcast.two_level_one_shot_broadcast), where
        its host's step runs on the board (or this rank is alone on its host) and its column's steps
        in one row."""
        return self._runs(algorithm, data) and in_one_row(data.nbytes, self._chunk_bytes)

    def _casting(self, p: _Prepared, root: int) -> _Prepared:
        """p as _cast runs a broadcast from root: the root's place on the host's board (none: on
        another host), and the column's steps across hosts with their row."""
        board = self._host_board
        if board is not None:
            p = p._replace(source=board.board_source(root if root in self._host else None))
        if self._column is None:
            return p
        steps = cast_steps(self._column, self._t.rank, self._host_of[root])
        return p._replace(cast_row=(steps, self._t.prepare_row(steps)))

    def _cast(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """two_level_one_shot_broadcast's frames: the host's board step, where the root's host takes
        the root's array and the other hosts' ranks only meet; the column's doubling across hosts
        in one native call (its prepared row); the leader's hand-on to ranks of no column."""
        if self._host_board is not None:
            super()._cast(flat, p, seq, start)
        tag, deadline = self._t.tag_of(seq), start + self._t.timeout
        if p.cast_row is not None:
            steps, row = p.cast_row
            if row is not None:
                self._row_across(steps, row, flat, p, tag, seq, deadline)
            else:
                self._t.exchanges(steps, tag, flat, p.code, p.meta._replace(seq=seq), deadline, ReduceKind.SUM)
        if self._handing:
            two_level.from_leader(Call(self._t, tag, p.meta._replace(seq=seq), p.code, deadline), self._host,
                                  self._host_board, flat, self._first_handed, keeps=p.meta.root)

    def _gathering(self, p: _Prepared, algorithm: Algorithm) -> _Prepared | None:
        """Among hosts of as many ranks, numbered host by host, a small all-gather runs here
        (_gather: two_level._all_gather_by_columns's frames); any other runs its algorithm
        (plans.all_gather_algorithm) over the output with this rank's block in place."""
        rows = self._gather_rows(p, algorithm)
        if rows is not None:
            return p._replace(gather_rows=rows)
        gather = all_gather_algorithm(self._group_where, algorithm)
        at, block = self._t.rank * p.meta.elements, p.meta.elements
        return p._replace(algorithm=lambda c, out: gather(c, out[at:at + block], out))

    def _gather_rows(self, p: _Prepared, algorithm: Algorithm) -> _GatherRows | None:
        """What _gather runs, where the general path would gather the host's equal blocks on its
        board (or this rank is alone on its host) in place (hosts of as many ranks, numbered host by
        host), and its column's Bruck steps fit native calls; else None."""
        hosts, k, block_bytes = self._hosts, len(self._host), p.meta.elements * p.storage.itemsize
        n = len(hosts)
        if (algorithm != Algorithm.TWO_LEVEL or hosts != tuple(tuple(range(h * k, (h + 1) * k)) for h in range(n))
                or gather_across_hosts(n * k * block_bytes) != Algorithm.TWO_LEVEL_ONE_SHOT
                or n // 2 * k * block_bytes > SWAP_MAX_BYTES
                or (n > 2 and n * k * block_bytes > ROTATED_GATHER_BYTES)
                or (self._host_board is not None and block_bytes > self._host_board.capacity)):
            return None
        position, span = self._host_of[self._t.rank], k * p.meta.elements
        steps = self._bruck_steps(p, position, span) if self._column is not None else ()
        if steps is None:
            return None
        return _GatherRows(slice(position * span, (position + 1) * span), steps)

    def _bruck_steps(self, p: _Prepared, position: int, span: int) -> tuple[_BruckStep, ...] | None:
        """This rank's steps of Bruck's all-gather in its column (bruck.bruck_all_gather's frames:
        in step k, the first min(2^k, n - 2^k) hosts' blocks from this host on, out to the host 2^k
        before, as many in from the host 2^k after), each with its row; None where the transport
        runs no rows."""
        column = self._column
        assert column is not None
        steps = []
        for distance, count, to_at, src_at in bruck_schedule(len(column), position):
            to, src = column[to_at], column[src_at]
            row = self._t.prepare_row(((to, Way.SWAP),) if to == src else ((to, Way.GIVE), (src, Way.TAKE)))
            if row is None:
                return None
            header = frame.pack(DATA, self._t.rank, 0, p.meta, p.code, (count * span,),
                                count * span * p.storage.itemsize)
            steps.append(_BruckStep(to, src, distance, count, header, row))
        return tuple(steps)

    def _gather(self, flat: np.ndarray, p: _Prepared, seq: int, start: float) -> None:
        """two_level._all_gather_by_columns's frames: the host's blocks on its board in one compiled
        step; in a crossing column, Bruck's steps, each one native call, over the hosts' blocks
        rotated to start at this host's (so what goes and comes is one range); the leader's hand-on
        to ranks of no column. flat: the whole output, this rank's block in place."""
        g = p.gather_rows
        assert g is not None
        if self._host_board is not None:
            super()._gather(flat[g.mine], p, seq, start)
        tag, deadline, at = self._t.tag_of(seq), start + self._t.timeout, g.mine.start
        if len(g.steps) == 1:  # two hosts: the other host's blocks straight into place
            theirs = flat[:at] if at else flat[g.mine.stop:]
            self._bruck_step(g.steps[0], flat[g.mine], theirs, p, tag, seq, deadline)
        elif g.steps:
            span = g.mine.stop - at
            rotated = np.empty_like(flat)
            rotated[:span] = flat[g.mine]
            for s in g.steps:
                self._bruck_step(s, rotated[:s.hosts * span], rotated[s.distance * span:(s.distance + s.hosts) * span],
                                 p, tag, seq, deadline)
            flat[at:], flat[:at] = rotated[:len(flat) - at], rotated[len(flat) - at:]
        if self._handing:
            two_level.from_leader(Call(self._t, tag, p.meta._replace(seq=seq), p.code, deadline), self._host,
                                  self._host_board, flat, self._first_handed)

    def _bruck_step(self, s: _BruckStep, out: np.ndarray, into: np.ndarray, p: _Prepared, tag: int, seq: int,
                    deadline: float) -> None:
        """One step's frames in its native call; where the row stops (a peer's frame not there
        within its wait), the rest as the general path would: the send, then the receive."""
        swapped, done = self._swap_row(s.row, s.header, tag, seq, out, p.code, ReduceKind.SUM, deadline, into)
        if swapped == len(s.row.peers):
            return
        meta = p.meta._replace(seq=seq)
        if swapped == 0 and done == NOT_STARTED:
            self._t.send(s.to, tag, out, p.code, meta, deadline)
        self._t.recv_into(s.src, tag, into, p.code, deadline, meta)

    def _row_across(self, steps: Sequence[PeerStep], row: SwapRow, flat: np.ndarray, p: _Prepared, tag: int,
                    seq: int, deadline: float) -> None:
        """The column's exchanges across hosts in one native call, from the board's header (the
        call's tag and sequence number written in); where the row stops, exchanges() goes on."""
        swapped, done = self._swap_row(row, p.header, tag, seq, flat, p.code, p.fold, deadline)
        if swapped == len(steps):
            return
        meta = p.meta._replace(seq=seq)
        steps = self._t.exchanges_after(steps, swapped, done, tag, flat, p.code, meta, deadline, p.fold)
        self._t.exchanges(steps, tag, flat, p.code, meta, deadline, p.fold)

    def _across(self, column: tuple[int, ...], flat: np.ndarray, p: _Prepared, tag: int, seq: int,
                deadline: float) -> None:
        """The column's step across hosts where no prepared row runs it: an all-reduce's (or small
        reduce's) exchanges in a row where they are all its algorithm does (a sub-group's transport
        runs its own native calls), else a barrier's or two_level.py's own."""
        meta = p.meta._replace(seq=seq)
        if self._steps is not None and meta.coll != Collective.BARRIER:
            self._t.exchanges(self._steps, tag, flat, p.code, meta, deadline, p.fold)
            return
        c = Call(self._t, tag, meta, p.code, deadline)
        if meta.coll == Collective.BARRIER:
            doubling_barrier(c, column)
        else:
            self._reduce_across(c, flat, p.fold, column)
