"""A PyTorch CPU model trained with plain DistributedDataParallel, its gradients averaged by the "shmcoll"
torch.distributed backend (or by gloo, for comparison).

What it shows: `import shmcoll.torch` registers the backend; from there it is ordinary torch:
`dist.init_process_group("shmcoll")` (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
`DistributedDataParallel(model)`, whose bucketed all-reduces run on shmcoll while autograd goes on. Every
rank trains on its shard of each global batch, and the result is single-process training on the whole
global batch: rank 0 then trains the same model that way and prints both loss curves and the largest
difference in the final parameters.

Run it:
  shmcoll-run -n 2 python examples/torch_ddp.py
  torchrun --nproc-per-node 2 examples/torch_ddp.py --backend gloo
  python examples/torch_ddp.py                               # 1 rank, no launcher needed

Needs torch (CPU build is enough: pip install torch --index-url https://download.pytorch.org/whl/cpu);
without it, it says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["shmcoll", "gloo"], default="shmcoll")
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


def train_distributed(torch, dist, args):
    """Every rank: its shard of each global batch; DDP averages the gradients during backward."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(make_model(torch, args))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    shard = args.batch // n
    losses, times = [], []
    for x, y in batches(torch, args):
        t = time.perf_counter()
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP's bucketed all-reduces run as autograd goes, last layer first
        opt.step()
        mean = loss.detach().to(torch.float64).reshape(1)
        dist.all_reduce(mean)  # the global batch's loss, for the printout (SUM: gloo has no AVG)
        losses.append(float(mean) / n)
        times.append(time.perf_counter() - t)
    return model.module, losses, times


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


def alone_without_launcher() -> None:
    """env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: torchrun sets them, and importing
    shmcoll.torch fills them in under shmcoll-run, mpirun or srun. Without a launcher: a group of one
    on a free port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def report(torch, args, n, model, losses, times) -> None:
    """Rank 0: single-process training on the global batches, and how far the distributed run is from it."""
    ref, ref_losses = train_single(torch, args)
    print(f" step  loss, {n} rank(s)        loss, 1 process        |difference|")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if (i + 1) % args.log_every == 0 or i + 1 == len(losses):
            print(f"{i + 1:5d}  {a:.15f}  {b:.15f}  {abs(a - b):.1e}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    print(f"max |loss difference| over {len(losses)} steps: {loss_diff:.1e}; "
          f"max |parameter difference| after training: {param_diff:.1e} ({args.dtype})")
    print(f"median {1e3 * sorted(times)[len(times) // 2]:.1f} ms/step with {n} rank(s)")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("torch is not installed: pip install torch --index-url https://download.pytorch.org/whl/cpu "
              "(this example needs it; the others do not)")
        return 0
    import shmcoll.torch  # noqa: F401 (registers the backend "shmcoll"; gloo runs get the launcher's variables)

    torch.set_num_threads(1)  # one core per rank, as in dp_train.py: N ranks then use N cores
    alone_without_launcher()
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        if args.batch % n:
            raise SystemExit(f"--batch {args.batch} must be divisible by the {n} ranks")
        if rank == 0:
            print(f"torch_ddp: {n} rank(s), backend {args.backend}, torch {torch.__version__}, global batch "
                  f"{args.batch} ({args.batch // n} per rank), {args.dtype}, DistributedDataParallel", flush=True)
        model, losses, times = train_distributed(torch, dist, args)
    finally:
        gc.collect()  # frees the DDP wrapper (its reducer is in reference cycles) while the group still lives
        dist.destroy_process_group()
    if rank == 0:
        report(torch, args, n, model, losses, times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
