"""torch's env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which torchrun sets;
shmcoll-run, Open MPI's mpirun, MPICH and srun name a rank's place otherwise. Importing
shmcoll.torch fills in the missing ones from what `shmcoll.init()` would read (rendezvous/
launchers.py), so `init_process_group("shmcoll")` works under every launcher init() knows.
A variable already set is never changed.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from ..errors import InvalidArgument
from ..rendezvous.launchers import resolve_ranks

#: torch's name <- shmcoll's own, for the rendezvous endpoint (shmcoll-run sets shmcoll's).
_ENDPOINT = (("MASTER_ADDR", "SHMCOLL_MASTER_ADDR"), ("MASTER_PORT", "SHMCOLL_MASTER_PORT"))


def fill_torch_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT where a launcher gave them
    under another name. Without a launcher, nothing: torch then says what env:// lacks."""
    env = os.environ if environ is None else environ
    try:
        rank, world, local, source = resolve_ranks(None, None, env)
    except InvalidArgument:
        return
    if source is None:
        return
    env.setdefault("RANK", str(rank))
    env.setdefault("WORLD_SIZE", str(world))
    if local is not None:
        env.setdefault("LOCAL_RANK", str(local))
    for torch_name, ours in _ENDPOINT:
        if torch_name not in env and ours in env:
            env[torch_name] = env[ours]
