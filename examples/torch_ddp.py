"""A PyTorch CPU model whose gradients shmcoll averages across ranks, in place, during backward.

What it shows: shmcoll takes CPU torch tensors directly (through DLPack, no copies): each
parameter's gradient is handed to `pg.spawn_all_reduce(p.grad, ReduceKind.AVG)` from a
post-accumulate-grad hook the moment autograd has finished it, so the averaging of the last layers
runs while autograd computes the first ones; the handles are joined before `optimizer.step()`.
Every rank trains on its shard of each global batch, and the result is single-process training on
the whole global batch: rank 0 then trains the same model that way and prints both loss curves
and the largest difference in the final parameters.

Run it:
  shmcoll-run -n 2 examples/torch_ddp.py
  python examples/torch_ddp.py                 # 1 rank, no launcher needed

Needs torch (CPU build is enough: pip install torch --index-url https://download.pytorch.org/whl/cpu);
without it, it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=256, help="GLOBAL batch size (split across ranks)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a tiny run (what the tests use)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.hidden, args.log_every = 8, 64, 1
    return args


INPUTS, CLASSES = 32, 10


def make_model(torch, args):
    torch.manual_seed(0)  # the same initial weights on every rank, and in the reference run
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, CLASSES)).to(getattr(torch, args.dtype))


def batches(torch, args):
    """Generated data, the same on every rank: inputs labelled by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(INPUTS, CLASSES, generator=g, dtype=torch.float64)
    for _ in range(args.steps):
        x = torch.randn(args.batch, INPUTS, generator=g, dtype=torch.float64)
        yield x.to(getattr(torch, args.dtype)), (x @ teacher).argmax(dim=1)


def train_distributed(pg, torch, args):
    """Every rank: its shard of each global batch, gradients averaged with shmcoll during backward."""
    from shmcoll import ReduceKind

    model = make_model(torch, args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    handles = []

    def average(param):  # called by autograd once param.grad holds this rank's whole gradient
        handles.append(pg.spawn_all_reduce(param.grad, ReduceKind.AVG))  # in place, through DLPack

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    shard = args.batch // pg.world_size
    losses, times = [], []
    for x, y in batches(torch, args):
        t = time.perf_counter()
        x, y = x[pg.rank * shard:(pg.rank + 1) * shard], y[pg.rank * shard:(pg.rank + 1) * shard]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # the hooks start the all-reduces as autograd goes, last layer first
        for h in handles:
            h.join()
        handles.clear()
        opt.step()
        mean = loss.detach().to(torch.float64).reshape(1)
        pg.all_reduce(mean, ReduceKind.AVG)  # the global batch's loss, for the printout
        losses.append(float(mean))
        times.append(time.perf_counter() - t)
    return model, losses, times


def train_single(torch, args):
    """The reference: one process, the whole global batch at once, no shmcoll."""
    model = make_model(torch, args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    for x, y in batches(torch, args):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed: pip install torch --index-url https://download.pytorch.org/whl/cpu "
              "(this example needs it; the others do not)")
        return 0
    import shmcoll

    torch.set_num_threads(1)  # one core per rank, as in dp_train.py: N ranks then use N cores
    launched = any(v in os.environ for v in ("SHMCOLL_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                             "SLURM_PROCID"))
    with (shmcoll.init() if launched else shmcoll.init(rank=0, world_size=1)) as pg:
        if args.batch % pg.world_size:
            raise SystemExit(f"--batch {args.batch} must be divisible by the {pg.world_size} ranks")
        if pg.rank == 0:
            print(f"torch_ddp: {pg.world_size} rank(s), torch {torch.__version__}, global batch {args.batch} "
                  f"({args.batch // pg.world_size} per rank), {args.dtype}, gradients averaged by shmcoll "
                  f"during backward", flush=True)
        model, losses, times = train_distributed(pg, torch, args)
    if pg.rank != 0:
        return 0
    ref, ref_losses = train_single(torch, args)
    n = pg.world_size
    print(f" step  loss, {n} rank(s)        loss, 1 process        |difference|")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if (i + 1) % args.log_every == 0 or i + 1 == len(losses):
            print(f"{i + 1:5d}  {a:.15f}  {b:.15f}  {abs(a - b):.1e}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    print(f"max |loss difference| over {len(losses)} steps: {loss_diff:.1e}; "
          f"max |parameter difference| after training: {param_diff:.1e} ({args.dtype})")
    print(f"median {1e3 * sorted(times)[len(times) // 2]:.1f} ms/step with {n} rank(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
