"""The peer libraries of `shmcoll-bench --compare`, one rank each: OpenMPI (mpi4py) and torch gloo.

An adapter joins its library's job and holds what every collective needs from it: the
communicator, rank and world size, the op table, how a numpy buffer is handed over (raw bytes for
MPI's 16-bit floats, a tensor sharing the memory for gloo) and a one-line library version. How each
collective runs on it is not here but in that collective's descriptor (collectives.py), so adding a
collective never touches this file.

An adapter also offers the two calls measure.py makes for its own bookkeeping, as shmcoll's
ProcessGroup does: barrier() before the timed loop and all_gather(array) -> array to agree on the
iteration count and collect every rank's time and wrong count. Both mpi4py and torch are imported
when an adapter is built, so a missing library raises ImportError there (open_group) and this
module imports without them.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import numpy as np

from shmcoll.types import ReduceKind

SHMCOLL, OPENMPI, GLOO = "shmcoll", "openmpi", "gloo"
PEERS = (OPENMPI, GLOO)


def raw(arr: np.ndarray) -> np.ndarray:
    """A buffer MPI can describe: 16-bit floats travel as bytes (data movement only)."""
    return arr.view(np.uint8) if arr.dtype.itemsize == 2 else arr


class MpiGroup:
    """COMM_WORLD of mpi4py, buffer-based calls on numpy arrays (no pickling)."""

    def __init__(self) -> None:
        import mpi4py
        from mpi4py import MPI

        self.MPI: Any = MPI
        self.comm: Any = MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.world_size: int = self.comm.Get_size()
        self.ops = {ReduceKind.SUM: MPI.SUM, ReduceKind.PROD: MPI.PROD, ReduceKind.MIN: MPI.MIN,
                    ReduceKind.MAX: MPI.MAX}
        self.library = f"{MPI.Get_library_version().splitlines()[0].split(',')[0].strip()} via mpi4py " \
                       f"{mpi4py.__version__}"

    def all_gather(self, buf: np.ndarray) -> np.ndarray:
        out = np.empty(self.world_size * len(buf), buf.dtype)
        self.comm.Allgather(raw(buf), raw(out))
        return out

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        pass


class GlooGroup:
    """torch.distributed with the gloo backend, on CPU tensors sharing the numpy buffers' memory."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float):
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_gloo_available()):
            raise ImportError(f"torch {torch.__version__} was built without the gloo backend")
        self.torch: Any = torch
        self.dist: Any = dist
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

    def tensor(self, arr: np.ndarray) -> Any:
        """The same memory as a tensor (bfloat16 through an int16 view: torch cannot read ml_dtypes)."""
        if arr.dtype.name == "bfloat16":
            return self.torch.from_numpy(arr.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(arr)

    def all_gather(self, buf: np.ndarray) -> np.ndarray:
        out = np.empty(self.world_size * len(buf), buf.dtype)
        self.all_gather_single(self.tensor(out), self.tensor(buf))
        return out

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def open_group(peer: str, timeout_s: float) -> MpiGroup | GlooGroup:
    """The adapter for `peer`; raises ImportError when its library is missing."""
    if peer == OPENMPI:
        return MpiGroup()
    env = os.environ  # started by shmcoll-run: reuse its rank variables and its (unused) free port
    return GlooGroup(int(env["SHMCOLL_RANK"]), int(env["SHMCOLL_WORLD_SIZE"]),
                     env.get("SHMCOLL_MASTER_ADDR", "127.0.0.1"), int(env["SHMCOLL_MASTER_PORT"]), timeout_s)
