"""The alpha-beta-gamma cost of shmcoll's all-reduce across hosts, counted as the code runs it, and its fit.

bench/cost_model.py measures each across-host algorithm (forced with hosts_rank.py --algorithm),
fits one machine's parameters here, and predicts to hosts it cannot measure. No I/O here: the
counts, the routing and the fit are unit-tested alone (tests/test_cost_model.py).

A call's time is one rank's critical path, a sum of terms with one parameter each:

  call     once per call (Python, the plan, the call's own bookkeeping)
  alpha    per message a rank sends across hosts, one after another, in a row of C calls
           (Transport.exchanges: two hosts' one-shot, recursive doubling with the hand-offs of the
           positions past a power of two, up to SWAP_MAX_BYTES); a
           message costs a syscall on both ends, paid per message rather than per step
  alpha_step  per step of a ring or a halving (Transport.send_recv_ranges: a frame's header each
           way and the wait for the peer's, all of a call's steps in one C call, duplex_row)
  alpha_py  per message sent and received through Python (one-shot among more than two hosts,
           exchanges and hand-offs past SWAP_MAX_BYTES), so ONE_SHOT's H-1
           sends count H-1 times (among 1,024 hosts no one-shot costs one latency)
  alpha_shared  per message across hosts and per other busy rank on the receiver's core: a rank
           woken by a message first waits for the ranks it shares a core with to give it up
  beta, beta_py  per byte a rank sends across hosts in C calls (rows and steps), and through
           Python (it receives as many, at the same time)
  gamma    per byte a rank folds into its result
  alpha_local, beta_local  the same as alpha and beta through a host's shared memory (K > 1 only):
           per wait on a host peer, and per byte read from a host peer's array or sent to it

Counts follow ring.py, doubling.py, halving.py and two_level.py: frames of at most chunk_bytes in a
ring step or a halving swap (ring's and halving's pieces), whole arrays in recursive doubling and
one-shot, and two extra messages of the whole array (one folded) for the positions past the
largest power of two (doubling.doubling_steps, halving.py). TWO_LEVEL's in-host phases read the host peers'
arrays and write into them (single_copy.py: two waits, and each rank reads and writes as many
bytes as a ring would send it).
Ranks that outnumber the cores share them: every phase's terms are multiplied by
max(1, ranks busy in the phase / cores) ("oversubscription"), and each message across hosts adds
alpha_shared per other busy rank on a core. So the fitted parameters but alpha_shared are those
of a rank with a core of its own, which is what a real host gives it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

import numpy as np
from hosts_rank import FORCINGS, forced

from shmcoll.algorithms.call import chunk_count
from shmcoll.algorithms.select import Algorithm, Setting, across_hosts, crossing_columns, select, small_across_hosts
from shmcoll.config import Tuning, one_shot_bytes_for
from shmcoll.transport.shm_layout import board_bytes_for
from shmcoll.transport.tcp import SWAP_MAX_BYTES
from shmcoll.types import Collective

ITEMSIZE = 4  # float32, as hosts_rank.py times
CHUNK_BYTES = Tuning.chunk_bytes
#: The across-host algorithms by their --algorithm names (hosts_rank.FORCINGS).
ALGORITHMS = {"one-shot": Algorithm.ONE_SHOT, "recursive-doubling": Algorithm.RECURSIVE_DOUBLING,
              "ring": Algorithm.RING, "halving-doubling": Algorithm.HALVING_DOUBLING}
NAMES = {a: name for name, a in ALGORITHMS.items()}
assert set(ALGORITHMS) == set(FORCINGS)


@dataclass(frozen=True)
class Steps:
    """What one rank does on a call's critical path: the multipliers of Machine's parameters, in
    TERMS order (see the module docstring for each)."""

    calls: float = 0.0
    messages: float = 0.0
    steps: float = 0.0
    py_messages: float = 0.0
    wire: float = 0.0
    py_wire: float = 0.0
    reduced: float = 0.0
    local_messages: float = 0.0
    local_bytes: float = 0.0
    shared_messages: float = 0.0

    def __add__(self, other: Steps) -> Steps:
        return Steps(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def times(self, factor: float) -> Steps:
        return Steps(*(a * factor for a in astuple(self)))

    @property
    def crossings(self) -> float:
        """Messages across hosts of every kind."""
        return self.messages + self.steps + self.py_messages


@dataclass(frozen=True)
class Machine:
    """Fitted seconds per term (seconds per byte for beta, gamma and beta_local)."""

    call: float = 0.0
    alpha: float = 0.0
    alpha_step: float = 0.0
    alpha_py: float = 0.0
    beta: float = 0.0
    beta_py: float = 0.0
    gamma: float = 0.0
    alpha_local: float = 0.0
    beta_local: float = 0.0
    alpha_shared: float = 0.0

    def seconds(self, steps: Steps) -> float:
        return float(np.dot(astuple(self), astuple(steps)))


TERMS = tuple(f.name for f in fields(Machine))


@dataclass(frozen=True)
class Point:
    """One measurement: `algorithm` forced across `hosts` hosts of `per_host` ranks, `size` bytes."""

    algorithm: str
    hosts: int
    per_host: int
    size: int
    seconds: float


# ---- counting ----

def _core(hosts: int) -> tuple[int, bool]:
    """log2 of the largest power of two <= hosts, and whether some positions fold into it."""
    core = 1 << (hosts.bit_length() - 1)
    return core.bit_length() - 1, hosts > core


def _exchanges(count: float, nbytes: int, reduced: float, native: bool) -> Steps:
    """count messages of nbytes each, as one-shot and recursive doubling send them: native where
    they run in a row of C calls (swap_row), else through Python (a send, then a receive)."""
    if native:
        return Steps(messages=count, wire=count * nbytes, reduced=reduced)
    return Steps(py_messages=count, py_wire=count * nbytes, reduced=reduced)


def _duplexes(count: float, wire: float, reduced: float) -> Steps:
    """A ring's or a halving's steps: a frame each way per step, the call's steps in one C call (duplex_row)."""
    return Steps(steps=count, wire=wire, reduced=reduced)


def crossing(algorithm: Algorithm, hosts: int, nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> Steps:
    """One column's all-reduce of nbytes among `hosts` ranks, one per host."""
    elems = nbytes // ITEMSIZE
    if hosts < 2:
        return Steps()
    rowed = nbytes <= SWAP_MAX_BYTES  # exchanges in a row of C calls (Transport.exchanges)
    if algorithm is Algorithm.ONE_SHOT:  # two hosts exchange; among more, sends and receives
        return _exchanges(hosts - 1, nbytes, (hosts - 1) * nbytes, rowed and hosts == 2)
    rounds, fold = _core(hosts)
    folding = _exchanges(2 * fold, nbytes, fold * nbytes, rowed)  # given away and taken back, in the row
    if algorithm is Algorithm.RECURSIVE_DOUBLING:
        return _exchanges(rounds, nbytes, rounds * nbytes, rowed) + folding
    if algorithm is Algorithm.RING:
        seg = -(-elems // hosts)
        pieces = chunk_count(seg, ITEMSIZE, chunk_bytes)
        return _duplexes(2 * (hosts - 1) * pieces, 2 * (hosts - 1) * seg * ITEMSIZE, (hosts - 1) * seg * ITEMSIZE)
    if algorithm is Algorithm.HALVING_DOUBLING:
        halves = [-(-elems // (1 << k)) for k in range(1, rounds + 1)]
        pieces = sum(chunk_count(h, ITEMSIZE, chunk_bytes) for h in halves)
        moved = sum(halves) * ITEMSIZE
        return _duplexes(2 * pieces, 2 * moved, moved) + folding
    raise ValueError(f"not an across-host algorithm: {algorithm}")


def all_reduce_steps(phases: Algorithm, across: Algorithm, hosts: int, per_host: int, nbytes: int,
                     cores: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> Steps:
    """two_level.py's all-reduce over hosts of `per_host` ranks each: TWO_LEVEL_ONE_SHOT (one step
    in the host, then crossing_columns columns cross with the whole array at once, and each leader
    hands it to the ranks of no column) or TWO_LEVEL (each rank folds its slice out of its K-1 host
    peers' arrays, the K columns cross with a slice each at once, each rank writes its finished
    slice into its host peers' arrays). Each phase is on_cores(ranks busy in it)."""
    k, ranks = per_host - 1, hosts * per_host
    if phases is Algorithm.TWO_LEVEL_ONE_SHOT:
        columns = crossing_columns(hosts, per_host)
        inside = Steps(calls=1, reduced=k * nbytes, local_messages=in_host_messages(per_host, nbytes),
                       local_bytes=k * nbytes)
        handed = Steps(local_messages=per_host - columns, local_bytes=(per_host - columns) * nbytes)
        crossed = crossing(across, hosts, nbytes, chunk_bytes)
        return on_cores(inside + handed, ranks, cores) + on_cores(crossed, hosts * columns, cores)
    if phases is not Algorithm.TWO_LEVEL:
        raise ValueError(f"not a two-level all-reduce: {phases}")
    slice_bytes = -(-(nbytes // ITEMSIZE) // per_host) * ITEMSIZE
    fold = Steps(calls=1, reduced=k * slice_bytes, local_messages=SINGLE_COPY_WAITS if k else 0,
                 local_bytes=k * slice_bytes)
    write_out = Steps(local_bytes=k * slice_bytes)
    return on_cores(fold + crossing(across, hosts, slice_bytes, chunk_bytes) + write_out, ranks, cores)


#: The waits of a single-copy call on a host's board (single_copy.py: the peers' descriptors, finished).
SINGLE_COPY_WAITS = 2


def on_cores(steps: Steps, busy: int, cores: int | None) -> Steps:
    """A phase's steps where `busy` ranks run it on `cores` cores: every term share() times over,
    and each message across hosts waits for the other ranks on its receiver's core."""
    s = share(busy, cores)
    return steps.times(s) + Steps(shared_messages=steps.crossings * (s - 1))


def in_host_messages(per_host: int, nbytes: int) -> int:
    """The messages of TWO_LEVEL_ONE_SHOT's step in a host (two_level._in_host_step): one board step
    (one entry written, the others read) where the array fits a board entry, else a one-shot over
    the rings (one message to each local peer); none for a rank alone on its host."""
    if per_host == 1:
        return 0
    return 1 if nbytes <= board_bytes_for(per_host) else per_host - 1


# ---- which algorithm runs ----

def route(hosts: int, per_host: int, nbytes: int, one_shot_bytes: int | None = None) -> tuple[Algorithm, Algorithm]:
    """(phases, across): what select.py picks for a float32 all-reduce of nbytes over hosts x per_host
    ranks, asked of select itself, with its constants as they are now (one_shot_bytes: config's
    default for that many hosts, unless given)."""
    if one_shot_bytes is None:
        one_shot_bytes = one_shot_bytes_for(Tuning(), hosts)
    phases = select(Collective.ALL_REDUCE, nbytes, Setting(hosts=hosts, one_shot_bytes=one_shot_bytes,
                                                           size=hosts * per_host))
    if phases is Algorithm.TWO_LEVEL_ONE_SHOT:
        return phases, small_across_hosts(hosts)
    slice_bytes = -(-(nbytes // ITEMSIZE) // per_host) * ITEMSIZE
    return phases, across_hosts(slice_bytes, one_shot_bytes, hosts)


def forced_route(name: str, hosts: int, per_host: int, nbytes: int) -> tuple[Algorithm, Algorithm]:
    """route() as a job forced by hosts_rank.py --algorithm `name` runs it."""
    with forced(name) as forcing:
        return route(hosts, per_host, nbytes, forcing.one_shot_bytes)


def steps_of(point: Point, cores: int | None = None) -> Steps:
    """The point's steps as its forced job runs them, on `cores` cores (None: a core per rank)."""
    return all_reduce_steps(*forced_route(point.algorithm, point.hosts, point.per_host, point.size),
                            point.hosts, point.per_host, point.size, cores)


def share(ranks: int, cores: int | None) -> float:
    """How many busy ranks each core carries (1 when each has its own, or cores is None: not modelled)."""
    return 1.0 if cores is None else max(1.0, ranks / cores)


# ---- fitting ----

def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, exactly: the least-squares solution on each subset of columns,
    the best one that is non-negative (a handful of columns: 2^6 small solves)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_res = np.zeros(a.shape[1]), float(np.dot(b, b))
    for n in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), n):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.all(x >= 0):
                res = float(np.sum((a[:, cols] @ x - b) ** 2))
                if res < best_res - 1e-15:
                    best, best_res = np.zeros(a.shape[1]), res
                    best[list(cols)] = x
    return best / scale


def fit(points: Sequence[Point], cores: int | None) -> Machine:
    """The non-negative parameters that minimise the squared relative error over `points`."""
    rows = np.array([[t / p.seconds for t in astuple(steps_of(p, cores))] for p in points])
    return Machine(*nnls(rows, np.ones(len(points))).tolist())


def predict(m: Machine, point: Point, cores: int | None) -> float:
    return m.seconds(steps_of(point, cores))


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def log2_hosts(top: int) -> list[int]:
    """2, 4, ..., top."""
    return [1 << k for k in range(1, int(math.log2(top)) + 1)]
