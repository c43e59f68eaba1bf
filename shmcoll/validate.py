"""Argument checks for the public calls: everything wrong is an InvalidArgument before a byte moves.

Also turns what users pass (numpy arrays, ml_dtypes bfloat16 arrays, CPU torch tensors through
DLPack, writable byte buffers) into the 1-D *storage* view the algorithms work on, without copying,
so in-place results show through the caller's own object.
"""

from __future__ import annotations

import datetime
import math
import numbers

import numpy as np

from .errors import InvalidArgument
from .types import TAG_RESERVED_BASE, DType, ReduceKind, WireType, wire_type_of

_INT_OPS = (ReduceKind.SUM, ReduceKind.PROD, ReduceKind.MIN, ReduceKind.MAX)


def as_array(data, what: str, *, writable: bool) -> np.ndarray:
    """A zero-copy numpy view of `data`; InvalidArgument if that is impossible."""
    arr = _view(data, what)
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous; pass np.ascontiguousarray(...) (and copy the result back)")
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"{what} is read-only but the result is written into it in place; pass a writable array")
    return arr


def _view(data, what: str) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    if hasattr(data, "__dlpack__"):
        return _from_dlpack(data, what)
    try:
        arr = np.asarray(memoryview(data))
    except TypeError:
        raise InvalidArgument(
            f"{what} must be a numpy array or an object numpy can view without copying, not {type(data).__name__}"
        ) from None
    return arr


def _from_dlpack(tensor, what: str) -> np.ndarray:
    """CPU tensors (torch and friends) as numpy views sharing their memory."""
    if getattr(tensor, "dtype", None) is not None and str(tensor.dtype) == "torch.bfloat16":
        from .types import BF16  # numpy has no bfloat16: go through the 16-bit pattern

        bits = tensor.view(__import__("torch").int16)
        return _from_dlpack(bits, what).view(BF16.array_dtype)
    try:
        arr = np.from_dlpack(tensor)
    except (RuntimeError, TypeError, ValueError, BufferError) as exc:
        raise InvalidArgument(f"{what} cannot be viewed as a numpy array (CPU tensors only): {exc}") from None
    if not arr.flags.writeable and hasattr(tensor, "numpy"):
        arr = tensor.numpy()  # older DLPack exports come back read-only; torch's own view is writable
    return arr


def wire_of(arr: np.ndarray, what: str) -> WireType:
    wire = wire_type_of(arr.dtype)
    if wire is None:
        raise InvalidArgument(f"{what} has dtype {arr.dtype}, which cannot be sent; "
                              "use a fixed-size numeric or bool dtype")
    return wire


def reducible_wire(arr: np.ndarray, op, what: str) -> tuple[WireType, ReduceKind]:
    wire = wire_of(arr, what)
    kind = reduce_kind(op)
    if not wire.reducible:
        raise InvalidArgument(
            f"{what} has dtype {arr.dtype}; reductions take float16, bfloat16, float32, float64, int32, int64")
    if not wire.is_float and kind not in _INT_OPS:
        raise InvalidArgument(f"{kind.name} is not defined for {arr.dtype}; integers take SUM, PROD, MIN, MAX")
    return wire, kind


def reduce_kind(op) -> ReduceKind:
    if isinstance(op, ReduceKind):
        return op
    if isinstance(op, str) and op.upper() in ReduceKind.__members__:
        return ReduceKind[op.upper()]
    if isinstance(op, int) and not isinstance(op, bool) and op in {k.value for k in ReduceKind}:
        return ReduceKind(op)
    raise InvalidArgument(f"op must be a shmcoll.ReduceKind (SUM, PROD, MIN, MAX, AVG), not {op!r}")


def storage_view(arr: np.ndarray, wire: WireType) -> np.ndarray:
    """The flat array the algorithms see (float16/bfloat16 as uint16 bit patterns)."""
    return arr.reshape(-1).view(wire.storage)


def typed_buffer(buf, dtype) -> tuple[np.ndarray, WireType]:
    """all_reduce_typed's raw little-endian bytes as a storage array of `dtype`."""
    if not isinstance(dtype, DType):
        raise InvalidArgument(f"dtype must be a shmcoll.DType (F16, BF16, F32, F64), not {dtype!r}")
    if isinstance(buf, np.ndarray) and buf.dtype != np.uint8:
        raise InvalidArgument(f"buf must hold raw bytes (a uint8 array, bytearray or memoryview), not {buf.dtype}")
    try:
        raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    except BufferError:
        raise InvalidArgument("buf must be C-contiguous; pass a contiguous bytearray or uint8 array") from None
    except (TypeError, ValueError):
        raise InvalidArgument(f"buf must be a bytearray, writable memoryview or uint8 array, "
                              f"not {type(buf).__name__}") from None
    if isinstance(buf, np.ndarray) and not buf.flags.c_contiguous:
        raise InvalidArgument("buf must be C-contiguous")
    if not raw.flags.writeable:
        raise InvalidArgument("buf is read-only; all_reduce_typed writes the result in place (use a bytearray)")
    if len(raw) % dtype.itemsize:
        raise InvalidArgument(f"len(buf) = {len(raw)} is not a multiple of {dtype.name}'s element size "
                              f"{dtype.itemsize}")
    return raw.view(dtype.wire.storage), dtype.wire


def rank_arg(value, world_size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{what} must be an int rank, not {value!r}")
    if not 0 <= int(value) < world_size:
        raise InvalidArgument(f"{what} = {value} is not a rank of this group (0 <= {what} < {world_size})")
    return int(value)


def tag_arg(tag) -> int:
    if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or not 0 <= int(tag) < TAG_RESERVED_BASE:
        raise InvalidArgument(f"tag must be an int with 0 <= tag < TAG_RESERVED_BASE ({TAG_RESERVED_BASE}), "
                              f"not {tag!r}")
    return int(tag)


def seconds_arg(value, what: str) -> float:
    """Seconds as a finite, non-negative float (a datetime.timedelta is accepted too)."""
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    try:
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value) \
            and float(value) >= 0
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        raise InvalidArgument(f"{what} must be a finite number of seconds >= 0 or a datetime.timedelta, not {value!r}")
    return float(value)


def equal_blocks(arr: np.ndarray, parts: int, what: str, call: str) -> int:
    """Rows per block when axis 0 of arr splits into `parts` equal blocks; InvalidArgument otherwise."""
    if arr.ndim == 0:
        raise InvalidArgument(f"{call} splits {what} along axis 0, but it is 0-d; pass at least a 1-D array")
    if arr.shape[0] % parts:
        raise InvalidArgument(
            f"{call}: len({what}) = {arr.shape[0]} (axis 0) is not divisible by the world size {parts}; "
            f"pad {what} to a multiple of {parts} rows")
    return arr.shape[0] // parts


def gathered_like(arr: np.ndarray, parts: int) -> np.ndarray:
    """A new array for `parts` ranks' arr concatenated along axis 0 (what all_gather and gather
    return); a 0-d arr counts as one row."""
    shape = arr.shape if arr.ndim else (1,)
    return np.empty((parts * shape[0], *shape[1:]), dtype=arr.dtype)
