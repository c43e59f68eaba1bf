"""How soon every rank leaves a small all-reduce once its last rank arrives.

    shmcoll-run -n 2 python bench/straggler_wake.py [--late-ms 1] [--trials 200] [--bytes 8]

Each trial: a barrier, then one rank (a different one each trial) sleeps --late-ms before it
stamps its arrival and calls all_reduce; the others call at once, so they spin, then sleep on the
board until the late rank's entry wakes them. Every rank stamps its return. CLOCK_MONOTONIC is
system wide, so rank 0 gathers the stamps and reports, over the trials, how long after the late
rank's arrival the last rank returned: median, 90th percentile and worst, in microseconds. The
early ranks' waits are past the spin (SHMCOLL_SPIN_US, 200 us by default) when --late-ms is 1, so
this times the sleep and the wake-up, not the spinning.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import shmcoll


def trial(pg, late_rank: int, late_s: float, data: np.ndarray) -> tuple[float, float]:
    """(the late rank's arrival, this rank's return), both time.monotonic()."""
    pg.barrier()
    if pg.rank == late_rank:
        time.sleep(late_s)
    arrived = time.monotonic()
    pg.all_reduce(data)
    return arrived, time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--late-ms", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=8, help="size of the all-reduce (float32)")
    args = parser.parse_args(argv)
    pg = shmcoll.init()
    data = np.ones(max(1, args.bytes // 4), np.float32)
    for _ in range(20):
        pg.all_reduce(data)  # loads the compiled step before the first timed trial
    after_late = []
    for t in range(args.trials):
        late = t % pg.world_size
        arrived, returned = trial(pg, late, args.late_ms * 1e-3, data)
        stamps = pg.all_gather(np.array([arrived, returned]))
        after_late.append(1e6 * (stamps[1::2].max() - stamps[2 * late]))
    if pg.rank == 0:
        q = np.percentile(after_late, [50, 90, 100])
        print(f"straggler_wake: {pg.world_size} ranks over {pg.transport.name}, one rank {args.late_ms:g} ms late, "
              f"{args.trials} trials: last return after the late arrival: median {q[0]:.0f} us, "
              f"90th percentile {q[1]:.0f} us, worst {q[2]:.0f} us", flush=True)
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
