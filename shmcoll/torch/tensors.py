"""CPU tensors as the flat numpy arrays shmcoll's collectives take, and results back into them.

Two kinds of view:
- `owned_view`: a numpy array whose base holds the tensor, so the array keeps it alive. Every
  Operand holds one: a call queued on the worker, or a contiguous copy made for one call, must
  not outlive its memory (torch lets a caller drop the tensors of an async call).
- `native_view`: built once from the data pointer and cached per tensor object, for the small
  all_reduce that runs before the method returns (a training loop passes the same tensors every
  step): a hit costs a dict lookup and a few attribute tests instead of an export. It holds no
  reference to the tensor, so the cache never keeps one alive (a weak reference drops the entry
  when the tensor goes); only a caller that holds the tensor for the whole call may use it.

Non-contiguous tensors travel through a contiguous copy and are written back; integer and bool
types the kernels do not reduce travel widened to int64 (SUM and PRODUCT wrap as torch's own
arithmetic does; bool SUM/MAX is OR, PRODUCT/MIN is AND).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidArgument
from ..types import BF16, ReduceKind

_NUMPY_OF: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64), torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_), torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128), torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32), torch.uint64: np.dtype(np.uint64),
    torch.bfloat16: BF16.array_dtype,  # imports ml_dtypes: only jobs that use the torch adapter pay for it
}
_NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64}
_WIDENED = {torch.int8, torch.int16, torch.uint8, torch.uint16, torch.uint32, torch.bool}
_COMPLEX = {torch.complex64, torch.complex128}

_OPS = {dist.ReduceOp.SUM.value: ReduceKind.SUM, dist.ReduceOp.AVG.value: ReduceKind.AVG,
        dist.ReduceOp.PRODUCT.value: ReduceKind.PROD, dist.ReduceOp.MIN.value: ReduceKind.MIN,
        dist.ReduceOp.MAX.value: ReduceKind.MAX}  # by RedOpType's int value: hashing the enum costs more


_SUM = dist.ReduceOp.SUM
_PREMUL_SUM = dist.ReduceOp.PREMUL_SUM.value


class _Entry(NamedTuple):
    ref: weakref.ref
    data_ptr: int
    numel: int
    dtype: torch.dtype
    array: np.ndarray


_views: dict[int, _Entry] = {}


def native_view(t: torch.Tensor) -> np.ndarray | None:
    """The 1-D numpy array over t's elements when shmcoll reduces t as it is (a contiguous CPU
    tensor of a native dtype), else None. Only such views are cached, so a hit needs no dtype test."""
    entry = _views.get(id(t))
    if (entry is not None and entry.ref() is t and entry.data_ptr == t.data_ptr() and entry.numel == t.numel()
            and entry.dtype is t.dtype and t.is_contiguous()):
        return entry.array
    if t.dtype not in _NATIVE or not t.is_contiguous():
        return None
    if t.device.type != "cpu":
        raise InvalidArgument(f"shmcoll takes CPU tensors, not {t.device} ones")
    array = _from_pointer(t)
    key = id(t)
    _views[key] = _Entry(weakref.ref(t, lambda ref: _forget(key, ref)), t.data_ptr(), t.numel(), t.dtype, array)
    return array


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _views.get(key)
    if entry is not None and entry.ref is ref:
        del _views[key]


class _Memory:
    """Lends a tensor's memory to numpy through __array_interface__, holding the tensor when told
    to. Unlike Tensor.numpy(), this leaves the storage resizable: FSDP frees a flat parameter by
    resizing its storage to 0, which a .numpy() view forbids."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, keep: bool):
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.nbytes,), "typestr": "|u1",
                                    "version": 3}
        self.tensor = t if keep else None


def _from_pointer(t: torch.Tensor, keep: bool = False) -> np.ndarray:
    dtype = _NUMPY_OF.get(t.dtype, np.dtype(np.uint8))
    if t.nbytes == 0:
        return np.empty(0, dtype)
    return np.asarray(_Memory(t, keep)).view(dtype)


def owned_view(t: torch.Tensor) -> np.ndarray:
    """The 1-D numpy array over a contiguous CPU tensor's elements (bytes for dtypes numpy lacks),
    keeping the tensor alive."""
    if t.device.type != "cpu":
        raise InvalidArgument(f"shmcoll takes CPU tensors, not {t.device} ones")
    return _from_pointer(t, keep=True)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous tensor, for calls that only move data (any dtype moves)."""
    return owned_view(t).view(np.uint8)


class Operand(NamedTuple):
    """What a collective works on for one tensor (an owned view: it keeps its memory alive), and
    how its result gets back into the tensor."""

    array: np.ndarray
    write_back: Callable[[], None] | None = None

    def finish(self) -> None:
        if self.write_back is not None:
            self.write_back()


def contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """t itself when contiguous; else a contiguous copy and the step that copies it back."""
    if t.is_contiguous():
        return t, None
    staged = t.detach().contiguous()
    return staged, _copier(staged, t)


def _copier(source: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    """The step that copies source into target (detached: target may be a leaf that requires grad)."""
    def copy() -> None:
        target.detach().copy_(source)
    return copy


def bytes_operand(t: torch.Tensor) -> Operand:
    staged, back = contiguous(t)
    return Operand(byte_view(staged), back)


def reduce_operand(t: torch.Tensor, kind: ReduceKind, factor: float | None = None) -> Operand:
    """The array to reduce for t: a view, or a copy (contiguous, widened, or multiplied by
    PREMUL_SUM's factor) written back after."""
    if factor is not None:
        if not t.dtype.is_floating_point:
            raise InvalidArgument(f"PREMUL_SUM takes floating-point tensors, not {t.dtype}")
        scaled = t.detach().mul(factor).contiguous()
        return Operand(owned_view(scaled), _copier(scaled, t))
    if t.dtype in _NATIVE:
        staged, back = contiguous(t)
        return Operand(owned_view(staged), back)
    if t.dtype in _WIDENED:
        if kind is ReduceKind.AVG:
            raise InvalidArgument(f"AVG is not defined for {t.dtype}; integers take SUM, PRODUCT, MIN, MAX")
        wide = t.detach().to(torch.int64)
        return Operand(owned_view(wide), _copier(wide, t))
    if t.dtype in _COMPLEX and kind in (ReduceKind.SUM, ReduceKind.AVG):
        staged, back = contiguous(t)
        return Operand(owned_view(torch.view_as_real(staged)), back)
    raise InvalidArgument(f"shmcoll cannot reduce {t.dtype} tensors with {kind.name}")


def reduce_op(op) -> tuple[ReduceKind, float | None]:
    """torch's ReduceOp as a ReduceKind, with PREMUL_SUM's factor (a SUM of inputs multiplied by
    it first; None for every other op). InvalidArgument for the ops shmcoll has no kernel for."""
    if op == _SUM:  # the common op, and ReduceOp's cheapest test
        return ReduceKind.SUM, None
    op_type = getattr(op, "op", op)
    value = getattr(op_type, "value", None)
    if value == _PREMUL_SUM:
        return ReduceKind.SUM, float(op.factor)
    kind = _OPS.get(value)
    if kind is None:
        raise InvalidArgument(f"shmcoll does not implement {getattr(op_type, 'name', op)}: it reduces with SUM, "
                              f"AVG, PRODUCT, MIN, MAX and PREMUL_SUM")
    return kind, None
