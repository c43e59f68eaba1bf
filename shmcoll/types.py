"""Public enums (ReduceKind, DType), collective codes, the reserved tag base, and the wire dtype table.

Every element type that can cross the wire has a one-byte code. Reductions work on the
*storage* array of a type: float16 and bfloat16 travel and are reduced as uint16 bit patterns,
so bfloat16 works even without ml_dtypes installed.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import numpy as np


@functools.cache
def bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 numpy dtype, or None when ml_dtypes is not installed.

    Imported on first call, not with shmcoll: importing ml_dtypes costs about a second of CPU in
    every process, which a job of many ranks on few cores pays many times over at start-up, and
    most jobs never use bfloat16. Recognising a user's bfloat16 array costs nothing extra: whoever
    built one has already imported ml_dtypes.
    """
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


#: Tags at or above this value belong to collectives; user tags must be below it.
TAG_RESERVED_BASE = 1 << 30


class Collective(enum.IntEnum):
    """What a frame says its sender called (Meta.coll on the wire), so ranks can name each side's call.
    P2P (0) marks point-to-point frames, which belong to no collective."""

    P2P = 0
    BARRIER = 1
    ALL_REDUCE = 2
    ALL_GATHER = 3
    BROADCAST = 4
    FEDERATED_AVERAGE = 5
    REDUCE_SCATTER = 6
    REDUCE = 7
    ALL_TO_ALL = 8
    GATHER = 9
    SCATTER = 10
    ALL_GATHER_V = 11

    @property
    def label(self) -> str:
        """The call as the user wrote it: "all_reduce", or "send" for point-to-point."""
        return "send" if self is Collective.P2P else self.name.lower()


class ReduceKind(enum.IntEnum):
    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4


@dataclass(frozen=True)
class WireType:
    """One element type as it travels: code on the wire, name, storage dtype, reducibility."""

    code: int
    name: str
    storage: np.dtype  # what the kernels see (uint16 for f16/bf16 bit patterns)
    user: np.dtype | None  # what a user array of this type has; None for bf16, which numpy lacks (see array_dtype)
    reducible: bool
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def array_dtype(self) -> np.dtype:
        """The dtype of arrays of this type that shmcoll hands out: the user dtype; for bf16, ml_dtypes'
        bfloat16 (imported on first use) or, without ml_dtypes, the uint16 bit patterns of storage."""
        if self.user is not None:
            return self.user
        bf16 = bfloat16()
        return bf16 if bf16 is not None else self.storage


def _wt(code, name, storage, user=None, reducible=False, is_float=False):
    storage = np.dtype(storage)
    return WireType(code, name, storage, storage if user is None else user, reducible, is_float)


F16 = _wt(1, "f16", np.uint16, np.dtype(np.float16), True, True)
BF16 = WireType(2, "bf16", np.dtype(np.uint16), None, True, True)
F32 = _wt(3, "f32", np.float32, reducible=True, is_float=True)
F64 = _wt(4, "f64", np.float64, reducible=True, is_float=True)
I32 = _wt(5, "i32", np.int32, reducible=True)
I64 = _wt(6, "i64", np.int64, reducible=True)
U8 = _wt(8, "u8", np.uint8)  # raw bytes, and the empty frames of barriers and agreement steps
_MOVE_ONLY = [
    _wt(7, "i8", np.int8), U8, _wt(9, "i16", np.int16),
    _wt(10, "u16", np.uint16), _wt(11, "u32", np.uint32), _wt(12, "u64", np.uint64),
    _wt(13, "bool", np.bool_), _wt(14, "c64", np.complex64), _wt(15, "c128", np.complex128),
]
WIRE_TYPES: dict[int, WireType] = {t.code: t for t in [F16, BF16, F32, F64, I32, I64, *_MOVE_ONLY]}
_BY_USER_DTYPE: dict[np.dtype, WireType] = {t.user: t for t in WIRE_TYPES.values() if t.user is not None}


def wire_type_of(dtype: np.dtype) -> WireType | None:
    """The wire type of a numpy dtype, or None if it cannot travel (object, strings, ...)."""
    dtype = np.dtype(dtype)
    wire = _BY_USER_DTYPE.get(dtype)
    if wire is None and _is_bfloat16(dtype):
        return BF16
    return wire


def _is_bfloat16(dtype: np.dtype) -> bool:
    """Whether `dtype` is ml_dtypes' bfloat16. The name is checked first so that other dtypes
    never import ml_dtypes; one named bfloat16 comes from an ml_dtypes already imported."""
    if dtype.name != "bfloat16":
        return False
    bf16 = bfloat16()
    return bf16 is not None and dtype == bf16


class DType(enum.Enum):
    """Element types of `all_reduce_typed` buffers (raw little-endian bytes)."""

    F16 = F16
    BF16 = BF16
    F32 = F32
    F64 = F64

    @property
    def itemsize(self) -> int:
        return self.value.itemsize

    @property
    def wire(self) -> WireType:
        return self.value
