"""The descriptor type of `shmcoll-bench`: what the benchmark must know about one collective.

A Collective (one subclass per collective, all in collectives.py) holds, as nccl-tests keeps one
file per collective: its name; what a requested size means (its Sizing: this rank's input length,
the reported count and bytes); what it moves (its Payload); whether it is in place, reduces (takes
--op) or is rooted at ROOT; its bus bandwidth factor; its check (known inputs written into a
buffer, and the wrong elements of the result); and how each library runs it: shmcoll, OpenMPI
(mpi4py, adapters.MpiGroup) and torch gloo (adapters.GlooGroup) each build one zero-argument call
per buffer, what the library needs (outputs, tensors) prepared outside the timed loop. The same
calls serve the check (measure.check_once), so a check looks at exactly what was timed.

A call returns the collective's result as shmcoll's ProcessGroup method does (an output array;
None on a non-root of gather; (array, lengths) for all_gather_v; the received object), except an
in-place collective's, whose result the check reads from its buffer. A peer that cannot run a
collective, or one of its dtypes or ops, returns the reason from unsupported(); that peer's builder
is then never called (it raises NotImplementedError).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum, auto
from typing import Any, ClassVar

import numpy as np

from shmcoll import ProcessGroup
from shmcoll.types import ReduceKind

from .adapters import GLOO, OPENMPI, GlooGroup, MpiGroup
from .inputs import DTYPE_NAMES, v_lengths

ROOT = 0  # the root of every rooted collective
SIXTEEN_BIT = ("f16", "bf16")

Call = Callable[..., object]  # called with no arguments (a lambda may bind its own as defaults)


class Sizing(Enum):
    """What a requested size (bytes) measures, hence this rank's input length and the reported count."""

    NOTHING = auto()        # no data (barrier): one row of size 0
    BUFFER = auto()         # the buffer: count = size / itemsize
    OUTPUT_BLOCKS = auto()  # all ranks' output: each rank sends size / n / itemsize elements
    INPUT_BLOCKS = auto()   # one rank's input: n blocks of size / n / itemsize elements
    UNEVEN_BLOCKS = auto()  # all ranks' output as OUTPUT_BLOCKS, but rank r sends v_lengths(count, n)[r]

    def layout(self, size: int, n: int, itemsize: int, rank: int = 0) -> tuple[int, int, int]:
        """(elements in rank `rank`'s input, reported count, reported bytes); at least one element a rank."""
        if self is Sizing.NOTHING:
            return 0, 0, 0
        if self is Sizing.BUFFER:
            count = max(1, size // itemsize)
            return count, count, count * itemsize
        per_rank = max(1, size // (n * itemsize))
        total = per_rank * n
        if self is Sizing.UNEVEN_BLOCKS:
            return v_lengths(total, n)[rank], total, total * itemsize
        return (per_rank if self is Sizing.OUTPUT_BLOCKS else total), total, total * itemsize

    @property
    def axis(self) -> str:
        """What the plot's size axis counts."""
        if self in (Sizing.OUTPUT_BLOCKS, Sizing.UNEVEN_BLOCKS):
            return "bytes, all ranks' output"
        return "bytes, one rank's input" if self is Sizing.INPUT_BLOCKS else "bytes"


class Payload(Enum):
    """What a collective moves: nothing, a typed array of --dtype, or a pickled bytes object."""

    NOTHING = "-"
    ARRAY = "array"
    BYTES = "bytes"  # built from a uint8 buffer before the timed loop; --dtype is ignored

    def type_column(self, dtype_name: str) -> str:
        """The table's type column: nccl-tests' name of the dtype, 'bytes' or '-'."""
        return DTYPE_NAMES[dtype_name] if self is Payload.ARRAY else self.value


class Collective(ABC):
    """One collective as the bench sees it. A subclass sets name, in_place and sizing (payload, reduces
    and rooted where the defaults do not hold) and writes the methods; in them `rank` is this rank,
    `n` the world size, `op` the reduction (ignored unless it reduces) and `bufs` the buffers the
    timed loop rotates through, each holding this rank's input (layout()'s element count)."""

    name: ClassVar[str]
    in_place: ClassVar[str]          # "yes", "no" or "n/a" (the header's and the JSON's in_place)
    sizing: ClassVar[Sizing]
    payload: ClassVar[Payload] = Payload.ARRAY
    reduces: ClassVar[bool] = False  # takes --op
    rooted: ClassVar[bool] = False   # rooted at ROOT

    def layout(self, size: int, n: int, itemsize: int, rank: int = 0) -> tuple[int, int, int]:
        return self.sizing.layout(size, n, itemsize, rank)

    @abstractmethod
    def bus_factor(self, n: int) -> float | None:
        """nccl-tests' busbw / algbw at world size n; None where there is no bandwidth."""

    @abstractmethod
    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        """Write rank `rank`'s known input into buf (the element count layout() gave this rank)."""

    @abstractmethod
    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        """Elements (or bytes) of this rank's result that differ from the exact reference; `count`
        is layout()'s reported count."""

    @abstractmethod
    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """shmcoll's calls, one per buffer."""

    @abstractmethod
    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """OpenMPI's calls (mpi4py's buffer interface on numpy arrays), one per buffer."""

    @abstractmethod
    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """torch gloo's calls (on tensors sharing the buffers' memory), one per buffer."""

    def unsupported(self, peer: str, dtype: str, op: str) -> str | None:
        """Why `peer` cannot run this collective with this dtype and op (its 'skipped' reason), or None."""
        if peer == OPENMPI and self.reduces:
            if dtype in SIXTEEN_BIT:
                return f"OpenMPI has no {dtype} datatype to reduce (MPI_ERR_TYPE); it moves 16-bit data only as bytes"
            if op == "avg":
                return "MPI has no average reduction (no MPI_Op for avg)"
        return None

    def calls(self, library: str, group: Any, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """`library`'s calls of this collective on `group` (a shmcoll ProcessGroup or the library's adapter),
        one per buffer; a collective without data (barrier) gets no buffers and returns one call."""
        if library == OPENMPI:
            return self.openmpi(group, bufs, op)
        if library == GLOO:
            return self.gloo(group, bufs, op)
        return self.shmcoll(group, bufs, op)


def share(n: int) -> float:
    """(n-1)/n: the part of the data that crosses the bus in all_gather-like collectives."""
    return (n - 1) / n


def returning(result: object, fn: Callable[..., object], *args: object) -> Call:
    """fn(*args) as a zero-argument call returning `result` (the output fn writes into); the closure
    has fixed arity, so the timed call pays no argument packing."""
    if len(args) == 2:
        a, b = args

        def call2() -> object:
            fn(a, b)
            return result
        return call2
    a, b, c = args

    def call3() -> object:
        fn(a, b, c)
        return result
    return call3


def block_bounds(length: int, n: int) -> list[int]:
    """The bounds of n consecutive blocks of `length` elements each."""
    return [r * length for r in range(n + 1)]
