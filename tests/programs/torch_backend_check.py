"""One rank of a torch program on the shmcoll backend, started by a real launcher (mpirun,
torchrun, shmcoll-run): `init_process_group("shmcoll")` with nothing but what the launcher set,
then checks an all_reduce exactly and prints `OK rank=R world=N transport=shmcoll`."""

import datetime
import os

import torch
import torch.distributed as dist

import shmcoll.torch  # noqa: F401  (registers the backend, fills env:// from the launcher's variables)

dist.init_process_group("shmcoll", timeout=datetime.timedelta(seconds=float(os.environ["SHMCOLL_TIMEOUT"])))
rank, n = dist.get_rank(), dist.get_world_size()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [n * (n + 1) / 2] * 5, t
os.write(1, f"OK rank={rank} world={n} transport={dist.get_backend()}\n".encode())  # one write: lines never interleave
dist.destroy_process_group()
