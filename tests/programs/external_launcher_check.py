"""One rank started by an external launcher (mpirun, torchrun, srun): shmcoll.init() with no
arguments, then exact checks of the basic collectives, and one line "OK rank=R world=W ..." on success.

Usage: external_launcher_check.py mpirun|torchrun|srun [--expect-port N|MASTER_PORT+K] [--expect-secret]
       [--report-rendezvous]

The launcher's own variables are the reference: the group's rank and size must equal what the
launcher assigned, so a config bug that merely yields *some* consistent numbering still fails.
Values are small integers, so float sums are exact and compared with ==, not a tolerance.
A watchdog dumps every thread's stack and exits if the rank outlives CHECK_DEADLINE seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys

import numpy as np

import shmcoll
from shmcoll.config import load_config

# launcher -> (rank, world size, local rank, local world size) variables it sets
REFERENCE = {
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "srun": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),  # Slurm has no tasks-on-this-node count
}
BIG = 3 << 20  # bytes: several ring slots and chunks, so the streaming paths run, not only the board


def expected_port(spec: str | None) -> int | None:
    """--expect-port: a number, or MASTER_PORT+K for a port the launcher picked (torchrun --standalone)."""
    if spec is None:
        return None
    if spec.startswith("MASTER_PORT+"):
        return int(os.environ["MASTER_PORT"]) + int(spec.split("+", 1)[1])
    return int(spec)


def check_config(launcher: str, expect_port: int | None, expect_secret: bool, report: bool) -> None:
    """The resolved config must match the launcher's own numbering, port rule and secret. With
    `report`, one line says this rank's pid and where it meets the others."""
    names = REFERENCE[launcher]
    want = [None if n is None else int(os.environ[n]) for n in names]
    cfg = load_config()
    got = [cfg.rank, cfg.world_size, cfg.local_rank, cfg.local_world_size]
    assert got == want, f"config {got} != launcher's {dict(zip(names, want))}"
    if expect_port is not None:
        assert cfg.master_port == expect_port, (cfg.master_port, expect_port, cfg.master_port_from)
    assert (cfg.secret is not None) == expect_secret, cfg.secret
    if report:
        line = f"PID {os.getpid()} addr={cfg.master_addr} port={cfg.master_port} from={cfg.master_port_from}\n"
        os.write(1, line.encode())


def check_group(pg, launcher: str) -> None:
    """rank/world_size of the group itself agree with the launcher's."""
    rank_var, world_var = REFERENCE[launcher][:2]
    assert pg.rank == int(os.environ[rank_var]), (pg.rank, os.environ[rank_var])
    assert pg.world_size == int(os.environ[world_var]), (pg.world_size, os.environ[world_var])


def check_all_reduce(pg, dtype, nbytes: int) -> None:
    """SUM of rank*1000 + i%1000: integers well below 2**24, so exact in float32 too."""
    n = nbytes // np.dtype(dtype).itemsize
    base = np.arange(n) % 1000
    data = (pg.rank * 1000 + base).astype(dtype)
    pg.all_reduce(data)
    w = pg.world_size
    expected = (1000 * w * (w - 1) // 2 + w * base).astype(dtype)
    assert np.array_equal(data, expected), f"all_reduce {np.dtype(dtype)} x{n}: first bad index " \
        f"{int(np.argmax(data != expected))}"


def check_all_gather(pg, n: int) -> None:
    local = (pg.rank * 10_000 + np.arange(n)).astype(np.float32)
    got = pg.all_gather(local)
    expected = np.concatenate([(r * 10_000 + np.arange(n)).astype(np.float32) for r in range(pg.world_size)])
    assert np.array_equal(got, expected), f"all_gather x{n} per rank"


def check_broadcast_every_root(pg, n: int) -> None:
    for root in range(pg.world_size):
        data = (root + 1 + np.arange(n)).astype(np.float64) if pg.rank == root else np.zeros(n)
        pg.broadcast(root, data)
        assert np.array_equal(data, (root + 1 + np.arange(n)).astype(np.float64)), f"broadcast root {root} x{n}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("launcher", choices=sorted(REFERENCE))
    ap.add_argument("--expect-port", default=None)
    ap.add_argument("--expect-secret", action="store_true")
    ap.add_argument("--report-rendezvous", action="store_true")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(float(os.environ.get("CHECK_DEADLINE", "60")), exit=True)
    check_config(args.launcher, expected_port(args.expect_port), args.expect_secret, args.report_rendezvous)
    with shmcoll.init() as pg:
        check_group(pg, args.launcher)
        pg.barrier()
        for dtype in (np.float32, np.float64):
            for nbytes in (7 * np.dtype(dtype).itemsize, BIG):
                check_all_reduce(pg, dtype, nbytes)
        check_all_gather(pg, 5)
        check_all_gather(pg, BIG // 4)
        check_broadcast_every_root(pg, 3)
        check_broadcast_every_root(pg, BIG // 8)
        pg.barrier()
        line = f"OK rank={pg.rank} world={pg.world_size} transport={type(pg.transport).__name__}\n"
        os.write(1, line.encode())  # one write: ranks share the pipe, and a line must not interleave
    return 0


if __name__ == "__main__":
    sys.exit(main())
