"""Board stress: small all-reduces back to back, new values every round, every rank checking every result.

    shmcoll-run -n 4 python bench/board_stress.py --rounds 1000000 [--delay-every 64] [--seed 1]

What it exercises: the shared-memory board's compiled step (kernels.board_all_reduce) and its
protocol without locks: an entry reused every other round, the done words that say when it may be,
futex sleeps and wake-ups, and the ordering between payload and published word. Round r alternates
an int64 SUM and a float64 MAX, at one of a few sizes from 8 bytes to 64 KiB (the board's default
entry holds 256 KiB), the same on every rank. Each rank builds its input from (r, rank), so it knows the exact
result and compares every element. Every --delay-every rounds on average a rank is held back (by a
busy wait, or by a sleep that gives its core away, drawn from (seed, r, rank)), so ranks arrive in
every order and waiters both spin and sleep. Each rank prints its rounds, time per round and count
of wrong results; exit status 1 on any wrong result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import shmcoll
from shmcoll import ReduceKind

#: elements (8 bytes each) of the rounds, in turn: from one word to 64 KiB
COUNTS = (1, 2, 16, 1000, 8192)
_STEP = 1_000_003  # how much a rank's SUM input grows per round (so no round repeats the last)
_MAX_DELAY_US = 300


def held_back(seed: int, r: int, rank: int, every: int) -> float:
    """Microseconds this rank waits before round r (0: none); negative means sleep, not spin."""
    h = ((seed + 1) * 0x9E3779B1 + r * 2654435761 + rank * 40503) & 0xFFFFFFFF
    if every <= 0 or h % every:
        return 0.0
    us = float((h >> 12) % _MAX_DELAY_US)
    return -us if h & 0x800 else us


def delay(us: float) -> None:
    if us < 0:
        time.sleep(-us * 1e-6)
        return
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def run(pg, rounds: range, every: int, seed: int) -> int:
    """Every round checked on this rank; the number of rounds with a wrong element."""
    n, rank = pg.world_size, pg.rank
    sums = {c: np.arange(c, dtype=np.int64) for c in COUNTS}
    maxes = {c: np.arange(c, dtype=np.float64) for c in COUNTS}
    wrong = 0
    for r in rounds:
        count = COUNTS[r // 2 % len(COUNTS)]
        us = held_back(seed, r, rank, every)
        if us:
            delay(us)
        if r % 2 == 0:
            total = sums[count] + (r * _STEP + rank)
            pg.all_reduce(total, ReduceKind.SUM)
            wrong += bool(np.any(total - n * sums[count] != n * r * _STEP + n * (n - 1) // 2))
        else:
            top = maxes[count] + float(r + (r + rank) % n)
            pg.all_reduce(top, ReduceKind.MAX)
            wrong += bool(np.any(top - maxes[count] != float(r + n - 1)))
    return wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1_000_000)
    parser.add_argument("--delay-every", type=int, default=64,
                        help="hold a rank back about once in so many rounds (0: never)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    pg = shmcoll.init()
    warm = min(args.rounds, 2 * len(COUNTS))  # the first call of each size loads the compiled step
    wrong = run(pg, range(warm), args.delay_every, args.seed)
    start = time.perf_counter()
    wrong += run(pg, range(warm, args.rounds), args.delay_every, args.seed)
    took = time.perf_counter() - start
    per_round = 1e6 * took / max(1, args.rounds - warm)
    os.write(1, (f"board_stress: rank {pg.rank} of {pg.world_size} over {pg.transport.name}: {args.rounds} rounds "
                 f"in {took:.1f} s ({per_round:.1f} us per round after the first {warm}), wrong results {wrong}\n"
                 ).encode())  # one write: the ranks' lines must not interleave
    pg.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
