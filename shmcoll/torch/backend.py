"""ShmcollProcessGroup: a torch.distributed ProcessGroup whose calls run on a shmcoll group.

torch hands every call a list of tensors and an options object; each method here turns that into
one shmcoll call on flat numpy views of the tensors (tensors.py), runs it, and returns a Work
(work.py). Where a call runs:

- on the caller's thread, when nothing queued before it is still running and the call is small
  (at most INLINE_BYTES) or its caller waits for it anyway (asyncOp False: torch's functions
  without async_op). The result is in place when the method returns, which returns a DoneWork,
  or None where the caller waits (torch reads None as done);
- else on the group's own ordered worker, in call order, so DDP's buckets reduce while autograd
  computes the next ones. Work.wait() waits for it; its future completes on a Completer thread.

Receives run on a worker of their own (an irecv posted before the matching send must not block
its caller); sends run inline (shmcoll's sends never deadlock on a peer that sends too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InvalidArgument
from ..group import ProcessGroup
from ..types import ReduceKind
from ..worker import CollectiveHandle, OrderedWorker
from . import tensors as tv
from .work import Completer, DoneWork, PendingWork

#: Calls moving at most this many bytes run on the caller's thread when the worker is idle: a
#: hand-off to the worker costs more than such a call saves by overlapping.
INLINE_BYTES = 256 << 10

_SUM = dist.ReduceOp.SUM

Job = Callable[[], Any]
Finish = Callable[[Any], list[torch.Tensor]]


class ShmcollProcessGroup(dist.ProcessGroup):
    """torch's view of one shmcoll ProcessGroup (see the module docstring)."""

    def __init__(self, group: ProcessGroup):
        super().__init__(group.rank, group.world_size)
        self.shmcoll_group = group
        self._n = group.world_size
        self._worker, self._receiver, self._completer = OrderedWorker(), OrderedWorker(), Completer()
        self._last: CollectiveHandle | None = None
        self._name, self._desc = "", ""
        self._closed = threading.Event()

    # ---- how a call runs ----
    def _may_inline(self, nbytes: int, opts) -> bool:
        """Nothing is queued, and the call is small or its caller waits for it anyway (asyncOp
        False): a hand-off to the worker would only add two thread switches."""
        last = self._last
        return (last is None or last.done()) and (nbytes <= INLINE_BYTES or (opts is not None and not opts.asyncOp))

    def _submit(self, nbytes: int, job: Job, finish: Finish, name: str, opts) -> dist.Work | None:
        if self._may_inline(nbytes, opts):
            return _done(finish(job()), opts)
        handle = self._worker.submit(name, job)
        self._last = handle
        return PendingWork(handle, finish, self._completer)

    def _small(self, job: Job, finish: Finish, name: str, opts) -> dist.Work | None:
        """A call that moves nothing worth overlapping (a barrier): run now, or queued behind
        what the worker still has (call order)."""
        return self._submit(0, job, finish, name, opts)

    # ---- reductions ----
    def allreduce(self, tensors, opts=None) -> dist.Work | None:
        """A small SUM over one contiguous tensor of a native dtype, with nothing queued (what a
        loop of dist.all_reduce makes) runs in as few steps as possible; the rest in _allreduce."""
        if opts is not None and len(tensors) == 1 and opts.reduceOp == _SUM:  # the common call, kept short
            view = tv.native_view(tensors[0])
            if view is not None and self._may_inline(view.nbytes, opts):
                self.shmcoll_group.all_reduce(view)
                return _done(tensors, opts)
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors, opts) -> dist.Work | None:
        t, (kind, factor), g = _only(tensors, "allreduce"), _op(opts), self.shmcoll_group
        view = tv.native_view(t) if factor is None else None
        if view is not None and self._may_inline(view.nbytes, opts):
            g.all_reduce(view, kind)
            return _done(tensors, opts)
        operand = tv.reduce_operand(t, kind, factor)
        arr = operand.array

        def finish(_):
            operand.finish()
            return tensors
        return self._submit(arr.nbytes, lambda: g.all_reduce(arr, kind), finish, "allreduce", opts)

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work | None:
        """Each tensor reduced on its own, in one call per dtype over their concatenation."""
        if not tensors:
            return DoneWork([])
        (kind, factor), jobs, finishes, nbytes = _op(opts), [], [], 0
        for same in _by_dtype(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            operand = tv.reduce_operand(flat, kind, factor)
            jobs.append(_bind(self.shmcoll_group.all_reduce, operand.array, kind))
            finishes.append(_splitter(operand, flat, same))
            nbytes += operand.array.nbytes
        return self._submit(nbytes, _all(jobs), _then_all(finishes, tensors), "allreduce_coalesced", opts)

    def reduce(self, tensors, opts=None) -> dist.Work | None:
        t, root = _only(tensors, "reduce"), _root(opts, self._n)
        kind, factor = _op(opts)
        operand = tv.reduce_operand(t, kind, factor)
        arr = operand.array if self.rank() == root else operand.array.copy()  # torch leaves non-roots alone
        g = self.shmcoll_group

        def finish(_):
            if self.rank() == root:
                operand.finish()
            return tensors
        return self._submit(arr.nbytes, lambda: g.reduce(root, arr, kind), finish, "reduce", opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> dist.Work | None:
        out, ins = _only(output_tensors, "reduce_scatter"), _only(input_tensors, "reduce_scatter")
        self._check_parts(ins, out, "reduce_scatter")
        stacked = torch.cat([x.detach().reshape(-1) for x in ins])
        return self._reduce_scatter_flat(out, stacked, _op(opts), output_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts=None) -> dist.Work | None:
        if input.numel() != self._n * output.numel():
            raise InvalidArgument(f"reduce_scatter_tensor: the input has {input.numel()} elements, not world size "
                                  f"{self._n} x the output's {output.numel()}")
        return self._reduce_scatter_flat(output, input, _op(opts), [output], opts)

    reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter_flat(self, out, flat, op: tuple[ReduceKind, float | None], outputs,
                             opts) -> dist.Work | None:
        kind, factor = op
        operand = tv.reduce_operand(flat, kind, factor)
        arr, g = operand.array, self.shmcoll_group
        return self._submit(arr.nbytes, lambda: g.reduce_scatter(arr, kind),
                            lambda piece: _write_then(out, piece, outputs), "reduce_scatter", opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work | None:
        (kind, factor), jobs, finishes, nbytes = _op(opts), [], [], 0
        for out, inp in zip(outputs, inputs):
            operand = tv.reduce_operand(inp, kind, factor)
            jobs.append(_bind(self.shmcoll_group.reduce_scatter, operand.array, kind))
            finishes.append(_bind_write(out))
            nbytes += operand.array.nbytes
        return self._submit(nbytes, _all(jobs), _then_each(finishes, outputs), "reduce_scatter_coalesced", opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- data movement ----
    def broadcast(self, tensors, opts=None) -> dist.Work | None:
        t, root = _only(tensors, "broadcast"), _root(opts, self._n)
        operand = tv.bytes_operand(t)
        arr, g = operand.array, self.shmcoll_group

        def finish(_):
            operand.finish()
            return tensors
        return self._submit(arr.nbytes, lambda: g.broadcast(root, arr), finish, "broadcast", opts)

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work | None:
        outs, t = _only(output_tensors, "allgather"), _only(input_tensors, "allgather")
        self._check_parts(outs, t, "allgather")
        arr, g = tv.bytes_operand(t).array, self.shmcoll_group
        return self._submit(arr.nbytes * self._n, lambda: g.all_gather(arr),
                            lambda gathered: _scatter_bytes(gathered, outs, output_tensors), "allgather", opts)

    def _allgather_base(self, output, input, opts=None) -> dist.Work | None:
        if output.numel() != self._n * input.numel():
            raise InvalidArgument(f"all_gather_into_tensor: the output has {output.numel()} elements, not world "
                                  f"size {self._n} x the input's {input.numel()}")
        arr, g = tv.bytes_operand(input).array, self.shmcoll_group
        return self._submit(arr.nbytes * self._n, lambda: g.all_gather(arr),
                            lambda gathered: _write_then(output, gathered, [output]), "allgather", opts)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work | None:
        """One all_gather over the inputs' concatenated bytes, cut back into every output."""
        for outs, t in zip(output_lists, input_list):
            self._check_parts(outs, t, "allgather_coalesced")
        return self._gather_concatenated(input_list, lambda k, i: output_lists[k][i], output_lists, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> dist.Work | None:
        if not all(o.is_contiguous() for o in outputs):
            raise InvalidArgument("all_gather_into_tensor (coalesced) needs contiguous outputs")
        parts = [list(o.detach().reshape(self._n, -1).unbind(0)) for o in outputs]
        return self._gather_concatenated(inputs, lambda k, i: parts[k][i], outputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _gather_concatenated(self, inputs, target, outputs, opts) -> dist.Work | None:
        sizes = [t.nbytes for t in inputs]
        arr = np.concatenate([tv.bytes_operand(t).array for t in inputs]) if inputs else np.empty(0, np.uint8)
        g, total = self.shmcoll_group, sum(sizes)

        def finish(gathered):
            for i in range(self._n):
                offset = i * total
                for k, size in enumerate(sizes):
                    _write(target(k, i), gathered[offset:offset + size])
                    offset += size
            return outputs
        return self._submit(arr.nbytes * self._n, lambda: g.all_gather(arr), finish, "allgather_coalesced", opts)

    def gather(self, output_tensors, input_tensors, opts=None) -> dist.Work | None:
        t, root = _only(input_tensors, "gather"), _root(opts, self._n)
        outs = _only(output_tensors, "gather") if self.rank() == root else []
        if self.rank() == root:
            self._check_parts(outs, t, "gather")
        arr, g = tv.bytes_operand(t).array, self.shmcoll_group
        return self._submit(arr.nbytes * self._n, lambda: g.gather(root, arr),
                            lambda gathered: _scatter_bytes(gathered, outs, output_tensors), "gather", opts)

    def scatter(self, output_tensors, input_tensors, opts=None) -> dist.Work | None:
        out, root = _only(output_tensors, "scatter"), _root(opts, self._n)
        arr = None
        if self.rank() == root:
            ins = _only(input_tensors, "scatter")
            self._check_parts(ins, out, "scatter")
            arr = np.concatenate([tv.bytes_operand(x).array for x in ins])
        g, nbytes = self.shmcoll_group, out.nbytes
        return self._submit(nbytes * self._n, lambda: g.scatter(root, arr),
                            lambda piece: _write_then(out, piece, output_tensors), "scatter", opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> dist.Work | None:
        """all_to_all_single: equal blocks go straight through; uneven splits (in rows of dim 0)
        travel padded to the largest block any rank sends, agreed first."""
        src = tv.bytes_operand(input).array
        finish = lambda data: _write_then(output, data, [output])
        if not input_split_sizes and not output_split_sizes:  # even, and so on every rank (torch's rule)
            _splits(None, input, self._n, "input")
            g = self.shmcoll_group
            return self._submit(src.nbytes, lambda: g.all_to_all(src), finish, "all_to_all_single", opts)
        row = input.numel() // input.shape[0] * input.element_size() if input.dim() and input.shape[0] else 0
        blocks_in = [k * row for k in _splits(input_split_sizes, input, self._n, "input")]
        blocks_out = [k * row for k in _splits(output_split_sizes, output, self._n, "output")]
        return self._all_to_all_padded(_cut(src, blocks_in), blocks_out, finish, "all_to_all_single", opts)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work | None:
        if len(input_tensors) != self._n or len(output_tensors) != self._n:
            raise InvalidArgument(f"all_to_all takes {self._n} input and output tensors (one per rank)")
        pieces = [tv.bytes_operand(t).array for t in input_tensors]
        sizes = [t.nbytes for t in output_tensors]

        def finish(data):
            for t, piece in zip(output_tensors, _cut(data, sizes)):
                _write(t, piece)
            return output_tensors
        return self._all_to_all_padded(pieces, sizes, finish, "all_to_all", opts)

    def _all_to_all_padded(self, pieces: list[np.ndarray], sizes_out: list[int], finish: Finish,
                           name: str, opts) -> dist.Work | None:
        """Piece j to rank j, whatever the sizes: one small all_reduce agrees on the widest piece,
        then every piece travels padded to it; sizes_out says how much of each arrival is data."""
        g, n = self.shmcoll_group, self._n

        def job():
            widest = np.array([max((p.nbytes for p in pieces), default=0)], dtype=np.int64)
            g.all_reduce(widest, ReduceKind.MAX)
            padded = np.zeros((n, int(widest[0])), np.uint8)
            for j, p in enumerate(pieces):
                padded[j, :p.nbytes] = p
            received = g.all_to_all(padded.reshape(-1)).reshape(n, -1)
            return np.concatenate([received[j, :sizes_out[j]] for j in range(n)])
        return self._submit(sum(p.nbytes for p in pieces), job, finish, name, opts)

    # ---- synchronisation and point to point ----
    def barrier(self, opts=None) -> dist.Work | None:
        g = self.shmcoll_group
        return self._small(g.barrier, lambda _: [], "barrier", opts)

    def send(self, tensors, dstRank, tag) -> dist.Work:
        t = _only(tensors, "send")
        self.shmcoll_group.send(dstRank, tag, tv.bytes_operand(t).array)
        return DoneWork(tensors)

    def recv(self, tensors, srcRank, tag) -> dist.Work:
        t = _only(tensors, "recv")
        g, nbytes = self.shmcoll_group, t.nbytes

        def finish(data):
            if data.nbytes != nbytes:
                raise InvalidArgument(f"recv: rank {srcRank} sent {data.nbytes} bytes on tag {tag}, but the tensor "
                                      f"holds {nbytes}")
            return _write_then(t, data.view(np.uint8), tensors)
        handle = self._receiver.submit("recv", lambda: g.recv(srcRank, tag))
        return PendingWork(handle, finish, self._completer)

    def recv_anysource(self, tensors, tag) -> dist.Work:
        raise InvalidArgument("shmcoll does not receive from any source: pass src to recv/irecv")

    # ---- identity and life cycle ----
    def getBackendName(self) -> str:
        return "shmcoll"

    def name(self) -> str:
        return "shmcoll"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def _get_backend(self, device) -> ShmcollProcessGroup:
        """The group's backend for a device: the group itself, for the CPU. torch asks a group for
        its backend to read optional traits off it (from torch 2.14, batch_isend_irecv asks whether
        it "supports_coalescing", which we do not, unguarded); a C++ group answers from its backends
        and raises for an unknown device, as this does."""
        kind = torch.device(device).type
        if kind != "cpu":
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    def shutdown(self) -> None:
        """destroy_process_group(): stop the workers and release the shmcoll group; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        timeout = self.shmcoll_group.transport.timeout
        self.shmcoll_group.close()  # first: a call still queued or waiting then ends at once
        self._worker.stop(timeout)
        self._receiver.stop(timeout)
        self._completer.stop(timeout)

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"ShmcollProcessGroup(rank={self.rank()}, size={self.size()}, {self.shmcoll_group!r})"

    def _check_parts(self, parts, t, call: str) -> None:
        if len(parts) != self._n:
            raise InvalidArgument(f"{call}: {len(parts)} tensors in the list, not the world size {self._n}")
        for p in parts:
            if p.numel() != t.numel() or p.dtype != t.dtype:
                raise InvalidArgument(f"{call}: every tensor in the list must match the other tensor's "
                                      f"{t.numel()} elements of {t.dtype}, not {p.numel()} of {p.dtype}")


def _only(tensors, call: str):
    if len(tensors) != 1:
        raise InvalidArgument(f"{call}: shmcoll takes exactly one tensor (one CPU device), got {len(tensors)}")
    return tensors[0]


def _done(outputs: list[torch.Tensor], opts) -> DoneWork | None:
    """What a call that finished before returning gives back: None when the caller waits anyway
    (torch's Python functions pass asyncOp=False and take None as "already done"), else a Work."""
    return DoneWork(outputs) if opts is None or opts.asyncOp else None


def _op(opts) -> tuple[ReduceKind, float | None]:
    return (ReduceKind.SUM, None) if opts is None else tv.reduce_op(opts.reduceOp)


def _root(opts, n: int) -> int:
    root = 0 if opts is None else opts.rootRank
    if not 0 <= root < n:
        raise InvalidArgument(f"root rank {root} is outside the group of {n}")
    return root


def _by_dtype(tensors) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _bind(call, *args) -> Job:
    return lambda: call(*args)


def _bind_write(out) -> Callable[[Any], None]:
    return lambda piece: _write(out, piece)


def _all(jobs: list[Job]) -> Job:
    return lambda: [job() for job in jobs]


def _then_all(finishes: list[Callable[[], None]], outputs) -> Finish:
    def finish(_):
        for f in finishes:
            f()
        return outputs
    return finish


def _then_each(finishes: list[Callable[[Any], None]], outputs) -> Finish:
    def finish(results):
        for f, r in zip(finishes, results):
            f(r)
        return outputs
    return finish


def _splitter(operand: tv.Operand, flat: torch.Tensor, same: list[torch.Tensor]) -> Callable[[], None]:
    """After a coalesced reduction: the concatenation's pieces back into their tensors."""
    def split():
        operand.finish()
        offset = 0
        for t in same:
            t.detach().copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
    return split


def _write(t: torch.Tensor, data: np.ndarray) -> None:
    """data (the tensor's elements, as bytes or in a reduction's type) into t."""
    staged, back = tv.contiguous(t)
    target = tv.owned_view(staged)
    if data.dtype == np.uint8 and target.dtype != np.uint8:
        target = target.view(np.uint8)
    elif target.dtype.kind == "c" and data.dtype.kind == "f":
        data = data.view(target.dtype)
    np.copyto(target, data.reshape(-1), casting="unsafe")
    if back is not None:
        back()


def _write_then(t: torch.Tensor, data: np.ndarray, outputs):
    _write(t, data)
    return outputs


def _scatter_bytes(gathered, outs, outputs):
    """Rank i's piece of a gathered byte array into outs[i] (gather's non-roots get None)."""
    if gathered is not None and outs:
        for t, piece in zip(outs, np.split(gathered, len(outs))):
            _write(t, piece)
    return outputs


def _splits(sizes, t: torch.Tensor, n: int, what: str) -> list[int]:
    rows = t.shape[0] if t.dim() else t.numel()
    if not sizes:
        if rows % n:
            raise InvalidArgument(f"all_to_all_single: the {what}'s {rows} rows do not split into {n} equal blocks")
        return [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows or min(sizes) < 0:
        raise InvalidArgument(f"all_to_all_single: {what} split sizes {list(sizes)} must be {n} counts "
                              f"adding up to its {rows} rows")
    return list(sizes)


def _cut(data: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(data, np.cumsum(sizes)[:-1]) if sizes else []
