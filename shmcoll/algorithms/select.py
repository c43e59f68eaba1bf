"""Which algorithm runs a collective call: one pure function of the call and where the group runs.

Every rank of a group must run the same algorithm, or ranks would wait for frames that never come.
So the choice depends only on facts every rank shares: the collective, its per-rank byte count
(equal on every rank for the calls that use it), the hosts the group spans, whether its transport
has a shared-memory board and how large a board entry is, and the tuning knobs (config.Tuning:
SHMCOLL_ONE_SHOT_BYTES, SHMCOLL_SINGLE_COPY), which must be alike on every rank. No I/O: the table
below is unit-tested alone.

| call | one host, small | one host, large | across hosts |
|---|---|---|---|
| all_reduce | BOARD, else ONE_SHOT up to one_shot_bytes | SINGLE_COPY | TWO_LEVEL_ONE_SHOT, else TWO_LEVEL |
| reduce_scatter | as all_reduce (the one-step result, each rank keeps its part) | SINGLE_COPY | TWO_LEVEL |
| reduce | as all_reduce | RING | TWO_LEVEL |
| all_gather | BOARD | SINGLE_COPY | TWO_LEVEL (TWO_LEVEL_ONE_SHOT's form up to SMALL_GATHER_BYTES in all) |
| broadcast | BOARD | SINGLE_COPY | TWO_LEVEL_LEADERS up to SMALL_BROADCAST_BYTES, else TWO_LEVEL |
| barrier | BOARD | DISSEMINATION | TWO_LEVEL |
| gather | BOARD | DIRECT | TWO_LEVEL_ONE_SHOT up to GATHER_EVERYTHING_BYTES in all, else TWO_LEVEL_DIRECT |
| scatter | DIRECT | DIRECT | TWO_LEVEL_DIRECT (a small broadcast first, with the blocks where they fit) |
| all_to_all | BOARD | PAIRWISE | TWO_LEVEL_ONE_SHOT up to GATHER_EVERYTHING_BYTES in all, else PAIRWISE |
| all_gather_v | BOARD_OR_RING (decided on the board) | BOARD_OR_RING | TWO_LEVEL (heads first, small pieces in them) |
| federated_average | DEADLINE | DEADLINE | DEADLINE |

"One host, small" means the call fits a board entry (BOARD) or one_shot_bytes (ONE_SHOT). A large
call on a board reads peers' arrays directly (SINGLE_COPY: at most three waits at any rank count).
Where the host forbids that, the ranks agree to run `without_single_copy` instead (which
SHMCOLL_SINGLE_COPY=0 picks at once): RING, CHAIN for broadcast, and for all-reduce from
SPLIT_HOST_AT ranks NEIGHBOURHOODS. A ring through n ranks takes 2(n-1) steps one after another,
and with many ranks on few cores each step waits for processes to be scheduled; so NEIGHBOURHOODS
runs TWO_LEVEL's phases over neighbourhoods of about NEIGHBOURHOOD consecutive ranks instead of
hosts (at 32 ranks: 20 steps, not 62). TWO_LEVEL all-reduce reads peers' arrays inside each
host as SINGLE_COPY does, where the host allows it (each host agrees for itself: only its own ranks
meet there), else it takes the host's ring. Inside TWO_LEVEL all-reduce, each slice crosses hosts in
one step (by recursive doubling among more than ONE_SHOT_MAX_HOSTS hosts), or around a ring (by
halving and doubling from HALVING_FROM_HOSTS hosts) (`across_hosts`); TWO_LEVEL_ONE_SHOT reduces
in each host on the host's board (one-shot where the array outgrows an entry), then crosses by
column (local rank j of every host) or, among more than COLUMNS_UP_TO_HOSTS hosts, through the
leaders alone (`crossing_columns`), each choosing as a small slice does (`small_across_hosts`).
TWO_LEVEL all-gather takes TWO_LEVEL_ONE_SHOT's form once its total is known
(`gather_across_hosts`): each host gathers its blocks on its board, the crossing columns gather
every host's by Bruck (ceil(log2 hosts) steps), the leader hands on. TWO_LEVEL_LEADERS hands a
broadcast's data to each host's leader, the leaders double among them, and hand it back. A small
gather or all_to_all across hosts is TWO_LEVEL_ONE_SHOT's all-gather of every rank's array, of
which each rank keeps what the call gives it (the root everything, an all_to_all's rank its blocks):
a few compiled steps, where a message to each peer through Python took 3-5 times as long. TWO_LEVEL reduce
folds each slice into the root's host down a binomial tree, or, large among many hosts, by
halving (`reduce_across_hosts`).
A group with no board (TCP only, or a sub-group) takes the large column's algorithm, SINGLE_COPY's
fallback where it says so, except all_reduce's ONE_SHOT, and for small calls DOUBLING (broadcast)
and BRUCK (all_gather), which take ceil(log2 n) steps where the chain and the ring take n - 1.
all_gather_v's pieces differ in size, so no rank can choose by size alone: on a board every rank
publishes a head saying whether its piece fits, and all decide alike from the heads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ..types import Collective
from .board_v import HEAD_BYTES
from .single_copy import DESCRIPTOR_BYTES

#: Ranks of a group on one host's shared memory from which a large all-reduce that may not read
#: peers' memory runs NEIGHBOURHOODS.
SPLIT_HOST_AT = 16
#: Ranks per neighbourhood, about (Topology.neighbourhoods).
NEIGHBOURHOOD = 8
#: Hosts among which a small all-reduce across hosts still finishes in one step, each host's rank
#: sending its array to every other; among more, RECURSIVE_DOUBLING sends log2 as many. Between 2
#: hosts the step is one exchange in a row of C calls; among 3 its sends and receives go through
#: Python, and doubling took a third less at 8 B (118-127 us against 185-189, 3 hosts of one rank on
#: 2 cores) and half at 64 KiB (160-163 against 292-297) even with the third host's array there and
#: back through Python; its hand-offs now run in the row of C calls too. At 4 hosts doubling's 2
#: messages per rank beat one step's 3 already when every message went through Python
#: (bench/cost_model.py).
ONE_SHOT_MAX_HOSTS = 2
#: Hosts from which a large slice crosses by HALVING_DOUBLING rather than around a ring: the same
#: bytes, in 2 log2(hosts) steps instead of 2 (hosts - 1).
HALVING_FROM_HOSTS = 4
#: Slice bytes from which a large reduce among HALVING_FROM_HOSTS hosts or more reduce-scatters by
#: halving and sends each finished segment to the target, which takes in 2(H-1)/H of the slice,
#: rather than down a binomial tree, where it takes in ceil(log2 H) slices: the halving moves a
#: quarter more bytes in all at 4 hosts, and takes one step more. 4 hosts of one rank, links of
#: 1 Gbit/s (`bench/hosts_compare.py --layout 4x1 --collective reduce --link-rate 1gbit`), ms,
#: halving / tree / every slice straight to the target: 16 MiB 211 / 280 / 427 (OpenMPI 431),
#: 1 MiB 13.2 / 17.5 / 26.3 (OpenMPI 26.3), 512 KiB 6.6-7.0 / 8.8. Between namespaces without a
#: rate limit, where the 2 cores bound every call, all three were within the noise (512 KiB
#: 2.7-3.4, 1 MiB 2.8-3.9, 16 MiB 27-39).
REDUCE_HALVING_FROM_BYTES = 512 << 10
#: Hosts up to which a small all-reduce or barrier crosses by column (local rank j of every host,
#: every j < K at once), not only through each host's leader. Between 2 hosts both send K messages
#: per host, and columns save the leader's hand-on to its ranks. Among H > 2 hosts a host's columns
#: send K(H-1) messages, against (H-1) + (K-1) through its leader. Simulated hosts on 2 cores,
#: alternating runs: 2x2, 8 B: 275-292 us by column, 307-340 by leaders; 4x2, 8 B: even (1.46-1.47
#: against 1.28-1.51 ms), 64 KiB: 2.24-2.42 against 1.71-1.93 ms.
COLUMNS_UP_TO_HOSTS = 2
#: Largest root array a broadcast without a board sends by doubling (DOUBLING, or across hosts
#: TWO_LEVEL_ONE_SHOT and TWO_LEVEL_LEADERS: ceil(log2 n) steps, the whole array in each) rather
#: than down a pipelined chain (one step per rank, in chunks of call.DEFAULT_CHUNK_BYTES, so no
#: faster for an array of one chunk), or across hosts in one slice per column (TWO_LEVEL: 2 + 2
#: ranks on 2 cores, loopback, 1 MiB 1442-1615 us through the leaders against 2147-2315 in slices,
#: 512 KiB 962-1340 against 1794-1850).
SMALL_BROADCAST_BYTES = 1 << 20
#: Largest gathered array (every rank's block together) an all-gather without a board collects by
#: Bruck (BRUCK, or across hosts in TWO_LEVEL_ONE_SHOT's form: ceil(log2 n) steps) rather than
#: around rings.
SMALL_GATHER_BYTES = 1 << 20
#: Largest gathered array (every rank's input together) a gather or all_to_all across hosts
#: collects on every rank by TWO_LEVEL_ONE_SHOT's all-gather, each rank keeping what the call gives
#: it, rather than by messages to the root or to each rank through Python (TWO_LEVEL_DIRECT,
#: PAIRWISE). The all-gather carries every block to every rank, so it pays only while small.
#: Between namespace hosts on 2 cores (bench/hosts_compare.py, us per call, this way / the direct
#: way): 2 x 2, gather of 32 B in all 386 / 765, 64 KiB 443 / 784; all_to_all of 32 B per rank
#: 390 / 1031, 64 KiB 577 / 1183; 4 x 1, gather of 32 B 485 / 804, all_to_all of 64 KiB 782 / 1388.
#: On simulated hosts (2 + 2), at 1 MiB gathered an all-gather of an all_to_all's inputs alone
#: took 1109-1323 against pairwise's 1200-1348, and a gather this way 1547 against 1190.
GATHER_EVERYTHING_BYTES = 256 << 10


class Algorithm(enum.Enum):
    """The algorithms, by the module that holds them."""

    BOARD = "board"  # board.py: every rank publishes once on the shared-memory board, every rank reads all
    BOARD_OR_RING = "board or ring"  # board_v.py: one board step if every piece fits its entry, else RING
    ONE_SHOT = "one-shot"  # ring.py: every rank sends its whole input to every other, all fold alike
    RING = "ring"  # ring.py: reduce-scatter and all-gather around a ring, bandwidth-optimal
    DOUBLING = "doubling"  # doubling_broadcast.py: a small broadcast in log2 n exchange steps
    BRUCK = "bruck"  # bruck.py: a small all-gather in log2 n steps
    DOUBLING_GATHER = "doubling all-gather"  # doubling_gather.py: owned blocks swapped in log2 n steps
    RECURSIVE_DOUBLING = "recursive doubling"  # doubling.py: log2 n exchanges of the whole array
    HALVING_DOUBLING = "halving-doubling"  # halving.py: a ring's bytes in 2 log2 n steps (Rabenseifner)
    BINOMIAL = "binomial"  # binomial.py: a reduce in log2 n steps, each rank sending once
    SINGLE_COPY = "single copy"  # single_copy.py: each rank reads what it needs straight from its peers' arrays
    CHAIN = "chain"  # broadcast.py: pipelined chain from the root
    DISSEMINATION = "dissemination"  # barrier.py: ceil(log2 n) rounds of signals
    DIRECT = "direct"  # direct.py: an agreement step, then each block straight to its destination
    PAIRWISE = "pairwise"  # direct.py: all_to_all's exchange, every rank with every rank
    DEADLINE = "deadline"  # federated.py: rank 0 averages what arrives before the deadline
    TWO_LEVEL_ONE_SHOT = "two-level one-shot"  # two_level*.py: one step in each host, one across, hand on
    TWO_LEVEL_LEADERS = "two-level via leaders"  # two_level*.py: to the leader, log2 steps among leaders, back
    TWO_LEVEL = "two-level"  # two_level*.py: inside each host, across hosts, inside again
    NEIGHBOURHOODS = "neighbourhoods"  # two_level.py's all-reduce, over runs of ranks of one host
    TWO_LEVEL_DIRECT = "two-level direct"  # DIRECT after a two-level agreement step (scatter's: its broadcast head)


@dataclass(frozen=True)
class Setting:
    """Everything besides the call that decides, alike on every rank of a group."""

    hosts: int = 1  # hosts the group spans (a group over TCP alone counts as one: it has no shared memory)
    board_bytes: int | None = None  # payload bytes of one board entry; None without a board
    one_shot_bytes: int = 16 << 10  # config.one_shot_bytes_for (SHMCOLL_ONE_SHOT_BYTES)
    size: int = 1  # ranks in the group
    single_copy: bool = True  # config.Tuning.single_copy

    def fits_board(self, nbytes: int) -> bool:
        return self.board_bytes is not None and nbytes <= self.board_bytes


def select(coll: Collective, nbytes: int, where: Setting) -> Algorithm:
    """The algorithm for one call of `coll` with `nbytes` per rank (the whole input of a reduction,
    a gather's block, the root's array of a broadcast; ignored by barrier, scatter, all_gather_v
    and federated_average)."""
    if coll in _SMALL_REDUCTIONS:
        small = _one_step_all_reduce(nbytes, where)
        if small is not None:
            return small
    return _CHOOSERS[coll](nbytes, where)


def across_hosts(slice_bytes: int, one_shot_bytes: int, hosts: int) -> Algorithm:
    """TWO_LEVEL all-reduce's middle phase: each column of ranks (local rank j of every host)
    all-reduces its slice across hosts: as small_across_hosts while the slice is small, else around
    a ring, or by halving and doubling from HALVING_FROM_HOSTS hosts. Every rank of a column holds
    the same slice, so the column decides alike."""
    if slice_bytes <= one_shot_bytes:
        return small_across_hosts(hosts)
    return Algorithm.HALVING_DOUBLING if hosts >= HALVING_FROM_HOSTS else Algorithm.RING


def reduce_across_hosts(slice_bytes: int, hosts: int) -> Algorithm:
    """TWO_LEVEL reduce's middle phase: each column of ranks folds its slice into the root's host:
    down a binomial tree, or from HALVING_FROM_HOSTS hosts and REDUCE_HALVING_FROM_BYTES by
    halving.py's reduce (the halving steps, then each finished segment to the target)."""
    if hosts >= HALVING_FROM_HOSTS and slice_bytes >= REDUCE_HALVING_FROM_BYTES:
        return Algorithm.HALVING_DOUBLING
    return Algorithm.BINOMIAL


def gather_in_columns(hosts: int) -> Algorithm:
    """TWO_LEVEL large all-gather's middle phase among hosts of as many ranks: each column gathers
    its members' blocks across hosts by recursive doubling among a power of two of hosts, else
    around a ring (the same bytes; doubling_gather.py says what the ring's chain of steps costs)."""
    return Algorithm.DOUBLING_GATHER if hosts & (hosts - 1) == 0 else Algorithm.RING


def gather_across_hosts(total_bytes: int) -> Algorithm:
    """TWO_LEVEL all-gather(_v)'s form, once every rank knows every block's size (so all choose
    alike): the small all-reduce's (each host's board, Bruck in each crossing column, the leader's
    hand-on) for a small gathered array, else the large form (two_level_all_gather_v: columns
    across hosts and the host peers' arrays read, or the host and leader rings). Between 2 hosts
    every column carries its host's blocks, where through the leaders only theirs did and each
    leader then handed the whole array on over the rings: 2 + 2 simulated hosts on 2 cores,
    alternating, us per call by column against through the leaders: 256 KiB in all 790 against
    1171, 1 MiB 1496 against 1977."""
    return Algorithm.TWO_LEVEL_ONE_SHOT if total_bytes <= SMALL_GATHER_BYTES else Algorithm.TWO_LEVEL


def crossing_columns(hosts: int, min_local: int) -> int:
    """How many columns of ranks (local rank j < this of every host) cross hosts in a small
    all-reduce or barrier: every one of the K = min_local, or only the leaders' (1)."""
    return min_local if hosts <= COLUMNS_UP_TO_HOSTS else 1


def small_across_hosts(hosts: int) -> Algorithm:
    """A small all-reduce among one rank per host (a column of TWO_LEVEL_ONE_SHOT or TWO_LEVEL): one
    step of hosts-1 messages per rank, or log2(hosts) steps of one message each."""
    return Algorithm.ONE_SHOT if hosts <= ONE_SHOT_MAX_HOSTS else Algorithm.RECURSIVE_DOUBLING


def _one_step_all_reduce(nbytes: int, where: Setting) -> Algorithm | None:
    """The all-reduce that finishes in one step for a small array, or None when the array is large."""
    if where.hosts > 1:
        return Algorithm.TWO_LEVEL_ONE_SHOT if nbytes <= where.one_shot_bytes else None
    if where.fits_board(nbytes):
        return Algorithm.BOARD
    return Algorithm.ONE_SHOT if nbytes <= where.one_shot_bytes else None


def _flat(large: Algorithm, small: Algorithm | None = Algorithm.BOARD, across: Algorithm = Algorithm.TWO_LEVEL):
    """A chooser: `across` when the group spans hosts, `small` when the call fits the board, else `large`."""
    def choose(nbytes: int, where: Setting) -> Algorithm:
        if where.hosts > 1:
            return across
        return small if small is not None and where.fits_board(nbytes) else large
    return choose


def without_single_copy(coll: Collective, where: Setting) -> Algorithm:
    """What a large call on one host's board runs where its ranks may not read each other's memory."""
    if coll is Collective.ALL_REDUCE and where.size >= SPLIT_HOST_AT:
        return Algorithm.NEIGHBOURHOODS
    return _streamed(coll)


def _streamed(coll: Collective) -> Algorithm:
    return Algorithm.CHAIN if coll is Collective.BROADCAST else Algorithm.RING


def _single_copy_or_else(coll: Collective) -> Callable[[int, Setting], Algorithm]:
    """A chooser for a call that, too large for the board, reads peers' memory where it may."""
    def choose(nbytes: int, where: Setting) -> Algorithm:
        if where.hosts > 1:
            return Algorithm.TWO_LEVEL
        if where.board_bytes is None:
            return _streamed(coll)
        if where.fits_board(nbytes):
            return Algorithm.BOARD
        may_read = where.single_copy and where.board_bytes >= DESCRIPTOR_BYTES
        return Algorithm.SINGLE_COPY if may_read else without_single_copy(coll, where)
    return choose


def _broadcast(nbytes: int, where: Setting) -> Algorithm:
    """Across hosts, an array up to one_shot_bytes goes the small all-reduce's way
    (TWO_LEVEL_ONE_SHOT: a compiled step on each host's board, then every crossing column), which
    takes no Python hand-offs inside the hosts: 2 + 2 ranks on 2 cores, loopback, 8 B 279-316 us
    against 462-532 through the leaders, 256 KiB 387-396 against 527-594. It carries the array
    across once per column, so up to SMALL_BROADCAST_BYTES only the leaders cross."""
    if nbytes <= SMALL_BROADCAST_BYTES:
        if where.hosts > 1:
            return Algorithm.TWO_LEVEL_ONE_SHOT if nbytes <= where.one_shot_bytes else Algorithm.TWO_LEVEL_LEADERS
        if where.board_bytes is None:
            return Algorithm.DOUBLING
    return _single_copy_or_else(Collective.BROADCAST)(nbytes, where)


def _all_gather(nbytes: int, where: Setting) -> Algorithm:
    if where.hosts == 1 and where.board_bytes is None and nbytes * where.size <= SMALL_GATHER_BYTES:
        return Algorithm.BRUCK
    return _single_copy_or_else(Collective.ALL_GATHER)(nbytes, where)


def _gathered_everywhere_while_small(otherwise: Callable[[int, Setting], Algorithm]):
    """A chooser for a gather or all_to_all (nbytes: what one rank gives, its block or its whole
    input): across hosts TWO_LEVEL_ONE_SHOT's all-gather while every rank's together fit
    GATHER_EVERYTHING_BYTES, else what `otherwise` chooses."""
    def choose(nbytes: int, where: Setting) -> Algorithm:
        if where.hosts > 1 and nbytes * where.size <= GATHER_EVERYTHING_BYTES:
            return Algorithm.TWO_LEVEL_ONE_SHOT
        return otherwise(nbytes, where)
    return choose


def _all_gather_v(nbytes: int, where: Setting) -> Algorithm:
    if where.hosts > 1:
        return Algorithm.TWO_LEVEL
    has_room = where.board_bytes is not None and where.board_bytes >= HEAD_BYTES
    return Algorithm.BOARD_OR_RING if has_room else Algorithm.RING


_SMALL_REDUCTIONS = (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE)
_CHOOSERS = {
    Collective.ALL_REDUCE: _single_copy_or_else(Collective.ALL_REDUCE),
    Collective.REDUCE_SCATTER: _single_copy_or_else(Collective.REDUCE_SCATTER),
    Collective.REDUCE: _flat(Algorithm.RING, small=None),
    Collective.ALL_GATHER: _all_gather,
    Collective.BROADCAST: _broadcast,
    Collective.BARRIER: _flat(Algorithm.DISSEMINATION),
    Collective.GATHER: _gathered_everywhere_while_small(_flat(Algorithm.DIRECT, across=Algorithm.TWO_LEVEL_DIRECT)),
    Collective.SCATTER: _flat(Algorithm.DIRECT, small=None, across=Algorithm.TWO_LEVEL_DIRECT),
    Collective.ALL_TO_ALL: _gathered_everywhere_while_small(_flat(Algorithm.PAIRWISE, across=Algorithm.PAIRWISE)),
    Collective.ALL_GATHER_V: _all_gather_v,
    Collective.FEDERATED_AVERAGE: lambda nbytes, where: Algorithm.DEADLINE,
}
