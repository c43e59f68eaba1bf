"""shmcoll as a torch.distributed backend: `import shmcoll.torch`, then
`dist.init_process_group("shmcoll")` (see API.md, "torch.distributed backend").

Importing registers the backend "shmcoll" for CPU tensors (again is harmless), and fills in the
env:// variables torch reads from the ones mpirun, srun or shmcoll-run set (launch_env.py). torch calls
`create_group` for the default group and for every `new_group`: the ranks meet through the store
torch hands over (store.py), group by host as `shmcoll.init()` does, and get their own shmcoll
group, wrapped as a torch ProcessGroup (backend.py).
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from ..bootstrap import alone, join_over_store
from ..config import framework_config
from .backend import ShmcollProcessGroup
from .launch_env import fill_torch_env
from .store import TorchStore, agree_job_id

BACKEND = "shmcoll"

__all__ = ["BACKEND", "ShmcollProcessGroup", "create_group"]


def create_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> ShmcollProcessGroup:
    """torch's backend constructor: the group of `world_size` ranks that share `store`."""
    seconds = timeout.total_seconds()
    if world_size == 1:
        return ShmcollProcessGroup(alone(framework_config(0, 1, seconds, "solo", "127.0.0.1")))
    deadline = time.monotonic() + seconds
    rendezvous = TorchStore(store)
    job_id = agree_job_id(rendezvous, rank, deadline)
    cfg = framework_config(rank, world_size, seconds, job_id, rendezvous.local_address)
    return ShmcollProcessGroup(join_over_store(cfg, rendezvous, deadline))


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create_group, devices=["cpu"])


_register()
fill_torch_env()
