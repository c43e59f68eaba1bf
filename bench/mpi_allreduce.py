"""OpenMPI's float32 SUM all-reduce through mpi4py, timed like shmcoll-bench (peer_timing.py).

Each call is `comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)` on a C-contiguous numpy float32 array
(in place, the buffer-based call: no pickling). Run it under mpirun, one process per rank:

    mpirun --allow-run-as-root --oversubscribe -n 2 python bench/mpi_allreduce.py --sizes 8,1K,64K

Rank 0 prints a line per size and, with --json, writes {library, rows}. Exit status 3 (and one
line on stderr) when mpi4py cannot be imported, so bench/compare.py can say what it skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works uninstalled too

from peer_timing import add_policy_args, run_sizes  # noqa: E402

EXIT_MISSING = 3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="mpi4py (OpenMPI) in-place float32 SUM Allreduce timings")
    add_policy_args(p)
    args = p.parse_args(argv)
    try:
        import numpy as np
        from mpi4py import MPI
    except ImportError as e:
        print(f"mpi_allreduce: mpi4py is not importable ({e}); pip install mpi4py", file=sys.stderr)
        return EXIT_MISSING
    comm = MPI.COMM_WORLD

    def make_call(elems: int):
        buf = np.ones(elems, np.float32)
        return lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def max_over_ranks(value: float) -> float:
        return float(comm.allreduce(value, op=MPI.MAX))

    import mpi4py
    library = f"{MPI.Get_library_version().splitlines()[0].split(',')[0].strip()} via mpi4py {mpi4py.__version__}"
    run_sizes(args, make_call, max_over_ranks, comm.Barrier, comm.Get_size(), comm.Get_rank(),
              "mpi", library)
    return 0


if __name__ == "__main__":
    sys.exit(main())
