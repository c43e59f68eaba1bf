"""Federated averaging over simulated clients: one client is slow, one dies, the rounds go on.

What it shows: every round each rank trains a softmax classifier on its own data shard for a few
local SGD steps, then calls `pg.federated_average(weights, deadline)`. Rank 0 is the server: it
averages whatever arrived within the deadline (its own vector always counts, so the server trains
on a shard too) and every rank gets the average back. Rank 0 prints, per round, how many ranks took
part and the global model's loss on held-out data.

  * the slow client (default: rank N-2) sleeps past the deadline in some rounds: the server does
    not wait for it, that round averages one vector fewer, and the late vector is dropped, never
    averaged into a later round; the slow client still receives that round's average and is back in
    the next round (which waits for it the ~0.5 s it is still behind: everyone arriving ends a
    round, the deadline is only the limit);
  * the dying client (default: rank N-1) vanishes at one round without a goodbye: the server
    notices, every later round has one participant fewer, and the survivors finish the run.

Run it (4 ranks: the server, two clients, the one that dies):
  shmcoll-run -n 4 examples/federated.py
  shmcoll-run -n 4 examples/federated.py --rounds 12 --deadline 0.5 --slow-rounds 3,4,9 --die-round 6

About the death: shmcoll-run, like mpirun, ends the whole job as soon as a rank exits with a
non-zero status, so a client under the same launcher cannot crash for real without taking the job
down. The dying client therefore leaves with os._exit(0): the process is gone at once, without
closing its group or sending anything, which is exactly what the server and the other clients
see of a crash. (Clients in real federated settings are not under one launcher.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import shmcoll


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--deadline", type=float, default=1.0, help="seconds the server waits per round")
    p.add_argument("--slow-rounds", help="rounds in which the slow client misses the deadline (default 3,7)")
    p.add_argument("--slow-client", type=int, help="default: rank N-2")
    p.add_argument("--die-round", type=int, default=5, help="the round the dying client vanishes in (0: never)")
    p.add_argument("--die-client", type=int, help="default: rank N-1")
    p.add_argument("--local-steps", type=int, default=10, help="local SGD steps per round")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--quick", action="store_true", help="a short run (what the tests use)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 6
    if args.slow_rounds is None:
        args.slow_rounds = "3,7" if args.rounds > 7 else "3"
    args.slow_rounds = {int(r) for r in args.slow_rounds.split(",") if r.strip()}
    return args


# ---------------------------------------------------------------------------- data and the model

FEATURES, CLASSES, PER_CLIENT = 20, 5, 400


def make_data(world: int):
    """Gaussian clusters, one per class; shard r is client r's private data; the rest is held out."""
    rng = np.random.default_rng(7)
    centers = rng.standard_normal((CLASSES, FEATURES)) * 0.5
    n = PER_CLIENT * world + 2000
    y = rng.integers(0, CLASSES, n)
    x = centers[y] + rng.standard_normal((n, FEATURES)) * 1.5
    shards = [(x[r * PER_CLIENT:(r + 1) * PER_CLIENT], y[r * PER_CLIENT:(r + 1) * PER_CLIENT]) for r in range(world)]
    return shards, (x[PER_CLIENT * world:], y[PER_CLIENT * world:])


def loss_and_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Softmax regression; w is one flat vector (weights, then biases) so it averages in one call."""
    W, b = w[:FEATURES * CLASSES].reshape(FEATURES, CLASSES), w[FEATURES * CLASSES:]
    z = x @ W + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    return loss, np.concatenate([(x.T @ p).ravel(), p.sum(axis=0)]), z


def local_training(w: np.ndarray, shard, rnd: int, rank: int, args) -> None:
    x, y = shard
    rng = np.random.default_rng([rank, rnd])
    for _ in range(args.local_steps):
        idx = rng.integers(0, len(y), 32)
        w -= args.lr * loss_and_grad(w, x[idx], y[idx])[1]


# -------------------------------------------------------------------------------------- rounds

def say(line: str) -> None:
    """One write per line: all ranks share the terminal, and print() writes the text and the newline
    separately when Python runs unbuffered (PYTHONUNBUFFERED), so lines of two ranks could mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    with shmcoll.init() as pg:
        n, rank = pg.world_size, pg.rank
        slow = n - 2 if args.slow_client is None else args.slow_client
        dies = n - 1 if args.die_client is None else args.die_client
        if n < 3 or not (0 < slow < n and 0 < dies < n and slow != dies):
            print("federated.py needs at least 3 ranks: the server, a slow client, a client that dies "
                  "(shmcoll-run -n 4 examples/federated.py)", file=sys.stderr)
            return 2
        if args.rounds in args.slow_rounds:
            print("the slow client must not be late in the last round (nobody would wait for it)", file=sys.stderr)
            return 2
        shards, (xt, yt) = make_data(n)
        w = np.zeros(FEATURES * CLASSES + CLASSES)
        if rank == 0:
            say(f"federated: {n} ranks (rank 0 is the server), deadline {args.deadline:g} s, client {slow} "
                f"slow in rounds {sorted(args.slow_rounds)}, client {dies} dies in round {args.die_round}")
        counts = []
        for rnd in range(1, args.rounds + 1):
            if rank == dies and rnd == args.die_round:
                say(f"client {rank}: vanishing in round {rnd} without a goodbye (os._exit(0))")
                os._exit(0)
            local_training(w, shards[rank], rnd, rank, args)
            if rank == slow and rnd in args.slow_rounds:
                say(f"client {rank}: slow in round {rnd}, late by {args.deadline * 0.5:g} s")
                time.sleep(args.deadline * 1.5)  # the scenario: this client misses the deadline
            t = time.perf_counter()
            count = pg.federated_average(w, args.deadline)  # w is now the round's global model, on every rank
            if rank == 0:
                counts.append(count)
                loss, _, z = loss_and_grad(w, xt, yt)
                acc = np.mean(np.argmax(z, axis=1) == yt)
                say(f"round {rnd:3d}  participants {count}/{n}  global loss {loss:.4f}  accuracy {acc:.3f}  "
                    f"(round took {time.perf_counter() - t:.2f} s)")
        # Every survivor, the slow client included, ends with the last round's average.
        say(f"rank {rank}: finished {args.rounds} rounds, model checksum {np.sum(np.abs(w)):.12f}")
        if rank == 0:
            say(f"participants per round: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
