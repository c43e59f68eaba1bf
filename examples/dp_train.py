"""Data-parallel training of a small numpy MLP, gradients all-reduced in buckets during backward.

What it shows:
  * every rank takes its shard of each global batch, computes gradients, and averages them with
    `pg.spawn_all_reduce(bucket, ReduceKind.AVG)`: a bucket (one flat buffer holding several
    layers' gradients) starts reducing as soon as its layers' gradients exist, on shmcoll's
    background thread, while backward goes on computing the earlier layers; all handles are joined
    before the optimizer step;
  * the loss curve is the one of single-process training on the same global batch (in float64 the
    curves agree to ~1e-15: only the summation order of the batch differs);
  * the time per step, and with --compare the speedup of 2 ranks over 1.

Run it:
  python examples/dp_train.py                      # 1 rank, no launcher needed
  shmcoll-run -n 2 examples/dp_train.py            # 2 ranks on this host
  python examples/dp_train.py --compare            # both of the above, curves side by side + speedup

The data are generated (a fixed random "teacher" network labels Gaussian inputs), identical on
every rank, so nothing is downloaded. Small defaults: a few seconds per run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=8192, help="training set size")
    p.add_argument("--batch", type=int, default=512, help="GLOBAL batch size (split across ranks)")
    p.add_argument("--hidden", type=int, default=512, help="width of each hidden layer")
    p.add_argument("--layers", type=int, default=3, help="number of hidden layers")
    p.add_argument("--inputs", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--bucket-kb", type=int, default=1024, help="gradient bucket size cap (KiB)")
    p.add_argument("--no-overlap", action="store_true",
                   help="start every all-reduce only after backward has finished (for comparison)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=8, help="print the loss every N steps")
    p.add_argument("--blas-threads", type=int, default=1, help="BLAS threads per rank (see below)")
    p.add_argument("--json", help="rank 0 writes every step's loss and time here")
    p.add_argument("--quick", action="store_true", help="a tiny run (what the tests use)")
    p.add_argument("--compare", action="store_true",
                   help="run 1 rank and 2 ranks (through shmcoll-run), print both curves and the speedup")
    p.add_argument("--ranks", type=int, default=2, help="with --compare: the rank count to compare with 1")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.samples, args.batch, args.hidden, args.log_every = 2, 1024, 128, 64, 1
    return args


def limit_blas_threads(n: int) -> None:
    """Must run before numpy is imported. OpenBLAS otherwise starts one thread per core in EVERY
    rank: 2 ranks on 2 cores would run 4 busy threads and mostly slow each other down. With one
    thread per rank, N ranks use N cores, and the 1-rank baseline uses 1 core (a 1-rank run with
    --blas-threads 2 is the fair "use every core in one process" comparison; see the README)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


# ----------------------------------------------------------------------------------- data, model

def make_data(args, np):
    """Gaussian inputs labelled by a fixed random tanh network; the same on every rank."""
    rng = np.random.default_rng(1234)
    n = args.samples + 2048  # the last 2048 are held out for the test accuracy
    x = rng.standard_normal((n, args.inputs))
    w1 = rng.standard_normal((args.inputs, 64)) / np.sqrt(args.inputs)
    w2 = rng.standard_normal((64, args.classes)) / 8.0
    y = np.argmax(np.tanh(x @ w1) @ w2 + 0.1 * rng.standard_normal((n, args.classes)), axis=1)
    x = x.astype(args.dtype)
    return (x[:args.samples], y[:args.samples]), (x[args.samples:], y[args.samples:])


def init_params(args, np):
    """[W1, b1, W2, b2, ...]: He-initialised, from the seed, so every rank starts identical."""
    rng = np.random.default_rng(args.seed)
    dims = [args.inputs] + [args.hidden] * args.layers + [args.classes]
    params = []
    for a, b in zip(dims[:-1], dims[1:]):
        params.append((rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(args.dtype))
        params.append(np.zeros(b, dtype=args.dtype))
    return params


def forward(params, x, np):
    """Activations of every layer (input first) and the logits."""
    acts = [x]
    for i in range(0, len(params) - 2, 2):
        acts.append(np.maximum(acts[-1] @ params[i] + params[i + 1], 0))
    return acts, acts[-1] @ params[-2] + params[-1]


def softmax_xent(logits, y, np):
    """Mean cross-entropy over the rows, and its gradient with respect to the logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    p[np.arange(len(y)), y] -= 1
    return loss, p / len(y)


# ------------------------------------------------------------------------------------- buckets

class Buckets:
    """Gradient buffers grouped, in backward order, into flat buckets of about `cap` bytes.

    Each parameter's gradient is a view into its bucket, so backward writes gradients straight into
    the buffer that gets all-reduced: no copy in, no copy out. Bucket 0 (the last layer's, ready
    first) carries one extra element: the rank's loss, averaged along with the gradients.
    """

    def __init__(self, params, cap: int, np):
        order = list(reversed(range(len(params))))  # backward produces the last layer first
        groups, size = [[]], 0
        for i in order:
            if groups[-1] and size + params[i].nbytes > cap:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += params[i].nbytes
        dtype = params[0].dtype
        self.flat, self.grads, self.owner = [], [None] * len(params), [0] * len(params)
        for b, members in enumerate(groups):
            flat = np.empty(sum(params[i].size for i in members) + (b == 0), dtype=dtype)
            at = 1 if b == 0 else 0
            for i in members:
                self.grads[i] = flat[at:at + params[i].size].reshape(params[i].shape)
                self.owner[i] = b
                at += params[i].size
            self.flat.append(flat)
        self.pending_init = [len(m) for m in groups]

    def start_step(self, loss: float):
        self.pending = list(self.pending_init)
        self.flat[0][0] = loss

    def ready(self, i: int) -> int | None:
        """Parameter i's gradient is written; the bucket number if that completed its bucket."""
        b = self.owner[i]
        self.pending[b] -= 1
        return b if self.pending[b] == 0 else None


# ------------------------------------------------------------------------------------ training

def train_step(params, bufs, moms, x, y, pg, args, np, ReduceKind):
    """One step on this rank's shard; returns (global batch loss, seconds spent waiting in join)."""
    acts, logits = forward(params, x, np)
    loss, dz = softmax_xent(logits, y, np)
    bufs.start_step(loss)
    handles, waiting = [], []
    for layer in reversed(range(len(params) // 2)):
        w, b = 2 * layer, 2 * layer + 1
        np.matmul(acts[layer].T, dz, out=bufs.grads[w])
        np.sum(dz, axis=0, out=bufs.grads[b])
        for i in (w, b):
            done = bufs.ready(i)
            if done is not None:
                waiting.append(done)
        if not args.no_overlap:  # reduce the finished buckets while backward continues below
            handles += [pg.spawn_all_reduce(bufs.flat[k], ReduceKind.AVG) for k in waiting]
            waiting = []
        if layer:
            dz = (dz @ params[w].T) * (acts[layer] > 0)
    handles += [pg.spawn_all_reduce(bufs.flat[k], ReduceKind.AVG) for k in waiting]
    t = time.perf_counter()
    for h in handles:
        h.join()
    wait = time.perf_counter() - t
    for p, g, m in zip(params, bufs.grads, moms):  # SGD with momentum, identical on every rank
        m *= args.momentum
        m += g
        p -= args.lr * m
    return float(bufs.flat[0][0]), wait


def train(pg, args, np, ReduceKind):
    (x, y), (xt, yt) = make_data(args, np)
    if args.batch % pg.world_size:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {pg.world_size} ranks")
    shard = args.batch // pg.world_size
    params = init_params(args, np)
    moms = [np.zeros_like(p) for p in params]
    bufs = Buckets(params, args.bucket_kb * 1024, np)
    steps_per_epoch = args.samples // args.batch
    say = print if pg.rank == 0 else (lambda *a, **k: None)
    dims = "-".join(str(d) for d in [args.inputs] + [args.hidden] * args.layers + [args.classes])
    say(f"dp_train: {pg.world_size} rank(s), global batch {args.batch} ({shard} per rank), MLP {dims} "
        f"{args.dtype}, {sum(p.size for p in params):,} parameters in {len(bufs.flat)} bucket(s), "
        f"overlap {'off' if args.no_overlap else 'on'}, {steps_per_epoch * args.epochs} steps", flush=True)
    losses, times, waits = [], [], []
    # Not timed: the first reduction of a dtype loads shmcoll's compiled kernels (~0.2 s, once).
    pg.spawn_all_reduce(np.zeros(8, dtype=args.dtype), ReduceKind.AVG).join()
    pg.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng([args.seed, epoch]).permutation(args.samples)  # same on every rank
        for s in range(steps_per_epoch):
            idx = order[s * args.batch:(s + 1) * args.batch][pg.rank * shard:(pg.rank + 1) * shard]
            t0 = time.perf_counter()
            loss, wait = train_step(params, bufs, moms, x[idx], y[idx], pg, args, np, ReduceKind)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            waits.append(wait)
            step = len(losses)
            if step % args.log_every == 0 or step == steps_per_epoch * args.epochs:
                say(f"step {step:4d}  epoch {epoch + 1}  loss {loss:.15f}  "
                    f"{times[-1] * 1e3:6.1f} ms/step  (waited {wait * 1e3:5.2f} ms for the all-reduce)",
                    flush=True)
    wall = time.perf_counter() - start
    acc = float(np.mean(np.argmax(forward(params, xt, np)[1], axis=1) == yt))
    steady = times[2:] or times  # the first steps warm caches up
    ms = 1e3 * float(np.median(steady))
    say(f"done: {len(losses)} steps in {wall:.2f} s, median {ms:.1f} ms/step, {1e3 * float(np.median(waits)):.2f} "
        f"ms/step waiting for all-reduces, test accuracy {acc:.3f}", flush=True)
    if pg.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world_size=pg.world_size, losses=losses, step_s=times, wait_s=waits,
                           median_ms=ms, wall_s=wall, accuracy=acc), f)


def run_training(args) -> None:
    limit_blas_threads(args.blas_threads)
    import numpy as np

    import shmcoll
    from shmcoll import ReduceKind

    launched = any(v in os.environ for v in ("SHMCOLL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                             "SLURM_PROCID"))
    # Under a launcher everything comes from the environment; run plainly, this is a 1-rank group.
    with (shmcoll.init() if launched else shmcoll.init(rank=0, world_size=1)) as pg:
        train(pg, args, np, ReduceKind)


# ------------------------------------------------------------------------------------- compare

def run_under_launcher(n: int, argv: list[str], json_path: str) -> dict:
    cmd = [sys.executable, "-m", "shmcoll.launch.run_cli", "-n", str(n), os.path.abspath(__file__),
           *argv, "--json", json_path]
    print(f"$ shmcoll-run -n {n} {os.path.relpath(__file__)} {' '.join(argv)}", flush=True)
    subprocess.run(cmd, check=True, timeout=600)
    with open(json_path) as f:
        return json.load(f)


def compare(args, argv: list[str]) -> None:
    """Train with 1 rank, then with --ranks ranks, on the same global batch; print both curves."""
    argv = [a for a in argv if a != "--compare"]
    with tempfile.TemporaryDirectory() as tmp:
        one = run_under_launcher(1, argv, os.path.join(tmp, "one.json"))
        many = run_under_launcher(args.ranks, argv, os.path.join(tmp, "many.json"))
    n = args.ranks
    print(f"\n step  loss, 1 rank          loss, {n} ranks         |difference|")
    diffs = [abs(a - b) for a, b in zip(one["losses"], many["losses"])]
    for i, (a, b) in enumerate(zip(one["losses"], many["losses"])):
        if (i + 1) % args.log_every == 0 or i + 1 == len(diffs):
            print(f"{i + 1:5d}  {a:.15f}  {b:.15f}  {diffs[i]:.1e}")
    print(f"max |loss difference| over {len(diffs)} steps: {max(diffs):.1e} ({args.dtype})")
    print(f"test accuracy: 1 rank {one['accuracy']:.3f}, {n} ranks {many['accuracy']:.3f}")
    print(f"median time per step: 1 rank {one['median_ms']:.1f} ms, {n} ranks {many['median_ms']:.1f} ms: "
          f"speedup {one['median_ms'] / many['median_ms']:.2f}x")
    print(f"whole training loop: 1 rank {one['wall_s']:.2f} s, {n} ranks {many['wall_s']:.2f} s: "
          f"speedup {one['wall_s'] / many['wall_s']:.2f}x")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compare:
        compare(args, argv)
    else:
        run_training(args)


if __name__ == "__main__":
    main()
