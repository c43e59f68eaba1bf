"""The peer libraries of `shmcoll-bench --compare`, one rank each: OpenMPI (mpi4py) and torch gloo.

Each peer is wrapped in an adapter with the few methods bench_core needs (rank, world_size,
all_reduce, all_gather, broadcast, barrier, reduce_scatter, reduce, all_to_all, gather, scatter,
all_gather_v, broadcast_object, all_gather_object, bench_calls), so bench_core.measure times and checks
the peers with exactly the loop, warmup, iteration cap and check that it uses for shmcoll: a ratio
then compares libraries, not benchmark loops. Run one rank per process:

    mpirun --allow-run-as-root --oversubscribe -n 2 python -m shmcoll.launch.bench_peers openmpi ARGS
    shmcoll-run -n 2 python -m shmcoll.launch.bench_peers gloo ARGS

ARGS are shmcoll-bench's sweep options (--collective, --dtype, --op, --iters, --warmup, --max-time,
--check, --cold, -b/-e/-f) plus --size-list (exact sizes) and --rows-to PATH, where rank 0 writes
{"library": ..., "rows": [...]}. A missing library prints one MISSING line on stderr and exits 3.
Which (collective, dtype, op) a peer cannot run is decided before launching (unsupported()).
torch.distributed has no all_gather_v: gloo's row pads to the longest length (GlooGroup._v_call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np

from shmcoll.types import ReduceKind

from .bench_core import IN_PLACE, REDUCING, Spec, has_dtype, measure
from .bench_objects import NEWEST

OPENMPI, GLOO = "openmpi", "gloo"
PEERS = (OPENMPI, GLOO)
MISSING = "shmcoll-bench peer missing:"  # the line a rank prints when its library is not importable
EXIT_MISSING = 3
SIXTEEN_BIT = ("f16", "bf16")


def unsupported(peer: str, collective: str, dtype: str, op: str) -> str | None:
    """Why `peer` cannot run this sweep (a reason for the 'skipped' line), or None when it can."""
    if peer == OPENMPI and collective in REDUCING:
        if dtype in SIXTEEN_BIT:
            return f"OpenMPI has no {dtype} datatype to reduce (MPI_ERR_TYPE); it moves 16-bit data only as bytes"
        if op == "avg":
            return "MPI has no average reduction (no MPI_Op for avg)"
    return None


def _raw(arr: np.ndarray) -> np.ndarray:
    """A buffer MPI can describe: 16-bit floats travel as bytes (data movement only)."""
    return arr.view(np.uint8) if arr.dtype.itemsize == 2 else arr


class MpiGroup:
    """COMM_WORLD of mpi4py, buffer-based calls on numpy arrays (no pickling)."""

    def __init__(self):
        import mpi4py
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.ops = {ReduceKind.SUM: MPI.SUM, ReduceKind.PROD: MPI.PROD, ReduceKind.MIN: MPI.MIN,
                    ReduceKind.MAX: MPI.MAX}
        self.library = f"{MPI.Get_library_version().splitlines()[0].split(',')[0].strip()} via mpi4py " \
                       f"{mpi4py.__version__}"

    def all_reduce(self, buf, op=ReduceKind.SUM):
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.ops[op])
        return buf

    def all_gather(self, buf):
        out = np.empty(self.world_size * len(buf), buf.dtype)
        self.comm.Allgather(_raw(buf), _raw(out))
        return out

    def broadcast(self, root, buf):
        self.comm.Bcast(_raw(buf), root=root)
        return buf

    def barrier(self):
        self.comm.Barrier()

    def reduce_scatter(self, buf, op=ReduceKind.SUM):
        out = np.empty(len(buf) // self.world_size, buf.dtype)
        self.comm.Reduce_scatter_block(buf, out, op=self.ops[op])
        return out

    def reduce(self, root, buf, op=ReduceKind.SUM):
        self._reduce(root, buf, self.ops[op])
        return buf

    def _reduce(self, root, buf, mop):
        if self.rank == root:
            self.comm.Reduce(self.MPI.IN_PLACE, buf, op=mop, root=root)
        else:
            self.comm.Reduce(buf, None, op=mop, root=root)

    def all_to_all(self, buf):
        out = np.empty_like(buf)
        self.comm.Alltoall(_raw(buf), _raw(out))
        return out

    def gather(self, root, buf):
        out = np.empty(self.world_size * len(buf), buf.dtype) if self.rank == root else None
        self.comm.Gather(_raw(buf), None if out is None else _raw(out), root=root)
        return out

    def scatter(self, root, buf):
        """Every rank passes a buffer of the root's size (MPI needs the receive size; only the root's is read)."""
        out = np.empty(len(buf) // self.world_size, buf.dtype)
        self.comm.Scatter(_raw(buf) if self.rank == root else None, _raw(out), root=root)
        return out

    def _lengths(self, k: int, out: np.ndarray | None = None) -> list[int]:
        """Every rank's length (Allgather of one int64): an MPI user must know them before Allgatherv,
        and shmcoll's all_gather_v exchanges them inside each call too."""
        out = np.empty(self.world_size, np.int64) if out is None else out
        self.comm.Allgather(np.array([k], np.int64), out)
        return out.tolist()

    def _allgatherv(self, buf, out, lengths):
        scale = buf.itemsize // _raw(buf).itemsize  # 16-bit floats travel as twice as many bytes
        self.comm.Allgatherv(_raw(buf), [_raw(out), [k * scale for k in lengths]])

    def all_gather_v(self, buf):
        lengths = self._lengths(len(buf))
        out = np.empty(sum(lengths), buf.dtype)
        self._allgatherv(buf, out, lengths)
        return out, lengths

    def broadcast_object(self, root, obj):
        return self.comm.bcast(obj, root=root)

    def all_gather_object(self, obj):
        return self.comm.allgather(obj)

    def _newest_calls(self, collective, bufs, root):
        """all_gather_v: the lengths' Allgather, then Allgatherv into preallocated outputs; the objects:
        mpi4py's pickling bcast / allgather of a bytes object built beforehand from each buffer."""
        if collective == "all_gather_v":
            lens = np.empty(self.world_size, np.int64)
            lengths = self._lengths(len(bufs[0]))
            outs = _outputs(bufs, 1, sum(lengths))

            def call(b, o):
                self._allgatherv(b, o, self._lengths(len(b), lens))
            return [lambda b=b, o=o: call(b, o) for b, o in zip(bufs, outs)]
        objs = [b.tobytes() for b in bufs]
        if collective == "broadcast_object":
            return [lambda o=o: self.comm.bcast(o if self.rank == root else None, root=root) for o in objs]
        return [lambda o=o: self.comm.allgather(o) for o in objs]

    def bench_calls(self, collective, bufs, op, root):
        """Allreduce(IN_PLACE) / Allgather into preallocated outputs (rotated like the inputs) / Bcast;
        Reduce_scatter_block, Reduce (IN_PLACE on the root), Alltoall, Gather, Scatter likewise."""
        comm, MPI, n = self.comm, self.MPI, self.world_size
        if collective in NEWEST:
            return self._newest_calls(collective, bufs, root)
        if collective == "all_reduce":
            mop = self.ops[op]
            return [lambda b=b: comm.Allreduce(MPI.IN_PLACE, b, op=mop) for b in bufs]
        if collective == "all_gather":
            pairs = [(_raw(b), _raw(o)) for b, o in zip(bufs, _outputs(bufs, self.world_size))]
            return [lambda b=b, o=o: comm.Allgather(b, o) for b, o in pairs]
        if collective == "reduce_scatter":
            mop = self.ops[op]
            pairs = [(b, o) for b, o in zip(bufs, _outputs(bufs, 1, len(bufs[0]) // n))]
            return [lambda b=b, o=o: comm.Reduce_scatter_block(b, o, op=mop) for b, o in pairs]
        if collective == "reduce":
            mop = self.ops[op]
            return [lambda b=b: self._reduce(root, b, mop) for b in bufs]
        if collective == "all_to_all":
            pairs = [(_raw(b), _raw(o)) for b, o in zip(bufs, _outputs(bufs, 1))]
            return [lambda b=b, o=o: comm.Alltoall(b, o) for b, o in pairs]
        if collective == "gather":
            if self.rank != root:
                return [lambda b=_raw(b): comm.Gather(b, None, root=root) for b in bufs]
            pairs = [(_raw(b), _raw(o)) for b, o in zip(bufs, _outputs(bufs, n))]
            return [lambda b=b, o=o: comm.Gather(b, o, root=root) for b, o in pairs]
        if collective == "scatter":
            outs = [_raw(o) for o in _outputs(bufs, 1, len(bufs[0]) // n)]
            if self.rank != root:
                return [lambda o=o: comm.Scatter(None, o, root=root) for o in outs]
            return [lambda b=_raw(b), o=o: comm.Scatter(b, o, root=root) for b, o in zip(bufs, outs)]
        return [lambda b=_raw(b): comm.Bcast(b, root=root) for b in bufs]

    def close(self):
        pass


class GlooGroup:
    """torch.distributed with the gloo backend, on CPU tensors sharing the numpy buffers' memory."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float):
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_gloo_available()):
            raise ImportError(f"torch {torch.__version__} was built without the gloo backend")
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = rank, world
        R = dist.ReduceOp
        self.ops = {ReduceKind.SUM: R.SUM, ReduceKind.PROD: R.PRODUCT, ReduceKind.MIN: R.MIN,
                    ReduceKind.MAX: R.MAX, ReduceKind.AVG: R.AVG}
        # all_gather_single replaces the deprecated all_gather_into_tensor in newer torch
        self.all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # likewise reduce_scatter_single (newer) / reduce_scatter_tensor; gloo has both in torch 2.x
        self.reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.library = f"torch {torch.__version__} gloo"

    def tensor(self, arr: np.ndarray):
        """The same memory as a tensor (bfloat16 through an int16 view: torch cannot read ml_dtypes)."""
        if arr.dtype.name == "bfloat16":
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def all_reduce(self, buf, op=ReduceKind.SUM):
        self.dist.all_reduce(self.tensor(buf), op=self.ops[op])
        return buf

    def all_gather(self, buf):
        out = np.empty(self.world_size * len(buf), buf.dtype)
        self.all_gather_single(self.tensor(out), self.tensor(buf))
        return out

    def broadcast(self, root, buf):
        self.dist.broadcast(self.tensor(buf), src=root)
        return buf

    def barrier(self):
        self.dist.barrier()

    def _reduce_scatter(self, out, t, rop):
        self.reduce_scatter_single(out, t, op=rop)

    def reduce_scatter(self, buf, op=ReduceKind.SUM):
        out = np.empty(len(buf) // self.world_size, buf.dtype)
        self._reduce_scatter(self.tensor(out), self.tensor(buf), self.ops[op])
        return out

    def reduce(self, root, buf, op=ReduceKind.SUM):
        self.dist.reduce(self.tensor(buf), dst=root, op=self.ops[op])
        return buf

    def all_to_all(self, buf):
        out = np.empty_like(buf)
        self.dist.all_to_all_single(self.tensor(out), self.tensor(buf))
        return out

    def _gather_call(self, root, t, out):
        """dist.gather into views of one output tensor (the root's), in rank order."""
        outs = list(out.chunk(self.world_size)) if out is not None else None
        return lambda: self.dist.gather(t, outs, dst=root)

    def gather(self, root, buf):
        out = np.empty(self.world_size * len(buf), buf.dtype) if self.rank == root else None
        self._gather_call(root, self.tensor(buf), None if out is None else self.tensor(out))()
        return out

    def _scatter_call(self, root, t, out):
        ins = list(t.chunk(self.world_size)) if self.rank == root else None
        return lambda: self.dist.scatter(out, ins, src=root)

    def scatter(self, root, buf):
        """Every rank passes a buffer of the root's size (gloo needs the receive size; only the root's is read)."""
        out = np.empty(len(buf) // self.world_size, buf.dtype)
        self._scatter_call(root, self.tensor(buf), self.tensor(out))()
        return out

    def _lengths(self, k: int) -> list[int]:
        """Every rank's length (an all_gather of one int64), as a gloo user must learn them."""
        out = self.torch.empty(self.world_size, dtype=self.torch.int64)
        self.all_gather_single(out, self.torch.tensor([k], dtype=self.torch.int64))
        return out.tolist()

    def _v_call(self, buf, pad, out, compact):
        """torch.distributed has no all_gather_v: exchange lengths, copy into a buffer of the longest
        length, all_gather those, then copy each rank's valid part into `compact` (the concatenation)."""
        lengths = self._lengths(len(buf))
        m = len(pad)
        pad[:len(buf)] = buf
        self.all_gather_single(self.tensor(out), self.tensor(pad))
        np.concatenate([out[r * m:r * m + k] for r, k in enumerate(lengths)], out=compact)
        return compact, lengths

    def _v_buffers(self, buf, lengths=None):
        """(padded input, padded output, concatenation) for `buf`; `lengths` from _lengths when not given."""
        lengths = self._lengths(len(buf)) if lengths is None else lengths
        m, dtype = max(lengths), buf.dtype
        return np.zeros(m, dtype), np.empty(m * self.world_size, dtype), np.empty(sum(lengths), dtype)

    def all_gather_v(self, buf):
        return self._v_call(buf, *self._v_buffers(buf))

    def broadcast_object(self, root, obj):
        box = [obj if self.rank == root else None]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def _newest_calls(self, collective, bufs, root):
        """all_gather_v padded to the longest length (_v_call; its buffers prepared per input buffer);
        the objects through broadcast_object_list / all_gather_object of a bytes object built beforehand."""
        if collective == "all_gather_v":
            lengths = self._lengths(len(bufs[0]))  # once: every buffer has this rank's length
            return [lambda b=b, p=self._v_buffers(b, lengths): self._v_call(b, *p) for b in bufs]
        objs = [b.tobytes() for b in bufs]
        if collective == "broadcast_object":
            return [lambda o=o: self.broadcast_object(root, o) for o in objs]
        return [lambda o=o: self.all_gather_object(o) for o in objs]

    def bench_calls(self, collective, bufs, op, root):
        """all_reduce / all_gather into preallocated outputs (rotated like the inputs) / broadcast;
        reduce_scatter, reduce, all_to_all_single, gather, scatter likewise."""
        if collective in NEWEST:
            return self._newest_calls(collective, bufs, root)
        dist, ts, n = self.dist, [self.tensor(b) for b in bufs], self.world_size
        if collective == "all_reduce":
            rop = self.ops[op]
            return [lambda t=t: dist.all_reduce(t, op=rop) for t in ts]
        if collective == "all_gather":
            outs = [self.tensor(o) for o in _outputs(bufs, self.world_size)]
            return [lambda t=t, o=o, g=self.all_gather_single: g(o, t) for t, o in zip(ts, outs)]
        if collective == "reduce_scatter":
            rop = self.ops[op]
            outs = [self.tensor(o) for o in _outputs(bufs, 1, len(bufs[0]) // n)]
            return [lambda t=t, o=o: self._reduce_scatter(o, t, rop) for t, o in zip(ts, outs)]
        if collective == "reduce":
            rop = self.ops[op]
            return [lambda t=t: dist.reduce(t, dst=root, op=rop) for t in ts]
        if collective == "all_to_all":
            outs = [self.tensor(o) for o in _outputs(bufs, 1)]
            return [lambda t=t, o=o: dist.all_to_all_single(o, t) for t, o in zip(ts, outs)]
        if collective == "gather":
            outs = [self.tensor(o) for o in _outputs(bufs, n)] if self.rank == root else [None] * len(ts)
            return [self._gather_call(root, t, o) for t, o in zip(ts, outs)]
        if collective == "scatter":
            outs = [self.tensor(o) for o in _outputs(bufs, 1, len(bufs[0]) // n)]
            return [self._scatter_call(root, t, o) for t, o in zip(ts, outs)]
        return [lambda t=t: dist.broadcast(t, src=root) for t in ts]

    def close(self):
        self.dist.destroy_process_group()


def _outputs(bufs: list[np.ndarray], n: int, elems: int | None = None) -> list[np.ndarray]:
    """One output per input buffer (n times its length, or `elems`), rotated the same way (one arena when cold)."""
    from .bench_buffers import Plan, rotating

    elems, dtype = (n * len(bufs[0]) if elems is None else elems), bufs[0].dtype
    stride = -(-elems * dtype.itemsize // 64) * 64
    return rotating(dtype, elems, Plan(len(bufs), stride), fill=0.0)


def open_group(peer: str, timeout_s: float):
    """The adapter for `peer`; raises ImportError when its library is missing."""
    if peer == OPENMPI:
        return MpiGroup()
    env = os.environ  # started by shmcoll-run: reuse its rank variables and its (unused) free port
    return GlooGroup(int(env["SHMCOLL_RANK"]), int(env["SHMCOLL_WORLD_SIZE"]),
                     env.get("SHMCOLL_MASTER_ADDR", "127.0.0.1"), int(env["SHMCOLL_MASTER_PORT"]), timeout_s)


def _size_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """shmcoll-bench's own options and checks, plus the peer's name, --size-list and --rows-to."""
    from . import bench_cli

    p = bench_cli.build_parser()
    p.prog = "python -m shmcoll.launch.bench_peers"
    p.add_argument("peer", choices=PEERS)
    p.add_argument("--size-list", dest="size_list", type=_size_list, default=None, metavar="B1,B2,...",
                   help="exactly these sizes in bytes instead of the -b/-e/-f sweep")
    p.add_argument("--timeout", type=float, default=300.0, help="gloo's own collective timeout (seconds)")
    args = bench_cli.parse_args(argv, p)
    if args.size_list is not None:
        args.sizes = args.size_list
    return args


def run(args) -> int:
    """Join the peer's job, measure every size with bench_core.measure, rank 0 writes the rows."""
    try:
        group = open_group(args.peer, args.timeout)
    except ImportError as e:
        module = getattr(e, "name", None) or ("mpi4py" if args.peer == OPENMPI else "torch")
        print(f"{MISSING} {module} is not importable ({e})", file=sys.stderr, flush=True)
        return EXIT_MISSING
    spec = Spec(args.collective, args.dtype, args.op, args.iters, args.warmup, args.check, args.max_time,
                args.cold)
    try:
        rows = [measure(group, spec, args.np_dtype, size) for size in args.sizes]
        if group.rank == 0 and args.rows_to:
            context = dict(world_size=group.world_size, collective=args.collective, transport=args.peer,
                           dtype=args.dtype if has_dtype(args.collective) else None, warmup=args.warmup,
                           in_place=IN_PLACE[args.collective], cold=args.cold, peer=args.peer)
            doc = {"library": group.library, "rows": [r.to_json(**context) for r in rows]}
            tmp = Path(args.rows_to + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(args.rows_to)
    finally:
        group.close()
    return 1 if any(r.wrong for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
