"""One rank of bench/torch_compare.py: join torch.distributed with one backend, measure, hand back.

Started by the driver (bench/torch_compare.py) as `python bench/torch_compare_rank.py SPEC`, with
torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set. SPEC is a JSON object: the
backend, the measurements to make ("jobs": "all_reduce", "ddp", in that order), the sizes, the
threads, the Policy, and the file rank 0 writes its results to. shmcoll is imported only for the
shmcoll backend, so a gloo rank is a plain torch process. What is measured, and how: the driver's
docstring. The checks of the results run outside the timed loops; a wrong result fails the rank
(WrongResult, exit status 1).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

WIDTH, BATCH = 1024, 8       # each Linear(1024, 1024) holds 4 MiB + 4 KiB of float32 parameters
ADAPTER_SIZE = 8             # bytes: the adapter's overhead is timed where it weighs most
WARMUP_BYTES = 64 << 20      # warm-up calls per size: this many bytes' worth, 2 to 20 calls
EXIT_FAILED = 1


@dataclass(frozen=True)
class Policy:
    """How long to measure and on what model: the full run's, or --quick's (a run a test can afford)."""

    rep_s: float          # aim for this many seconds per timed all_reduce loop
    reps: int             # timed loops per size; the median is reported
    max_iters: int        # calls per timed loop at most (small sizes)
    steps: int            # timed DDP steps
    ddp_warmup: int       # untimed DDP steps first (the first one builds DDP's buckets)
    layers: int           # Linear(WIDTH, WIDTH) layers of the DDP model
    timeout_s: float      # one job, start to exit; also the process group's timeout

    @property
    def grad_bytes(self) -> int:
        return self.layers * (WIDTH * WIDTH + WIDTH) * 4


class WrongResult(RuntimeError):
    """A check failed: the backend computed something other than the sum."""


# ---- all_reduce ----

def median_us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


def agreed_max(value: float) -> float:
    """The largest `value` over the ranks, so that every rank picks the same number of calls."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def warmup_calls(nbytes: int) -> int:
    """Many warm-up calls for small sizes (caches, lazy set-up), few for large ones (each is long)."""
    return max(2, min(20, WARMUP_BYTES // max(nbytes, 1)))


def loop_iters(call: Callable[[], object], nbytes: int, policy: Policy) -> int:
    """Warm up, then pick the calls per timed loop: about policy.rep_s seconds by the slowest rank's
    warm-up, between 3 and policy.max_iters."""
    call()  # the first call may set things up: not part of the estimate
    count = warmup_calls(nbytes) - 1
    t0 = time.perf_counter()
    for _ in range(count):
        call()
    per_call = agreed_max((time.perf_counter() - t0) / count)
    return max(3, min(policy.max_iters, int(policy.rep_s / max(per_call, 1e-9))))


def timed_loop(call: Callable[[], object], iters: int) -> float:
    """Seconds per call over one loop of `iters` calls, started together after a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def check_all_reduce(count: int) -> None:
    """One all_reduce of rank + 1 must give 1 + 2 + ... + N in every element."""
    n = dist.get_world_size()
    t = torch.full((count,), float(dist.get_rank() + 1), dtype=torch.float32)
    dist.all_reduce(t)
    want = n * (n + 1) / 2
    wrong = int((t != want).sum())
    if wrong:
        raise WrongResult(f"all_reduce of {count} float32 at {n} ranks: {wrong} elements differ from {want} "
                          f"(first values {t[:4].tolist()})")


def time_all_reduce(nbytes: int, policy: Policy) -> dict[str, Any]:
    """One size: the check, then the median of policy.reps timed loops of dist.all_reduce on zeros
    (zeros: a sum repeated thousands of times stays finite)."""
    count = max(1, nbytes // 4)
    check_all_reduce(count)
    t = torch.zeros(count, dtype=torch.float32)
    iters = loop_iters(lambda: dist.all_reduce(t), t.nbytes, policy)
    reps = [timed_loop(lambda: dist.all_reduce(t), iters) for _ in range(policy.reps)]
    return {"size": count * 4, "iters": iters, "median_us": median_us(reps), "reps_us": [s * 1e6 for s in reps]}


class FloorGroup(dist.ProcessGroup):
    """The least any Python backend can cost: an allreduce that only runs the shmcoll group's call on
    a fixed array and returns None. What torch's own path (dist.all_reduce, its options, the Python
    group's dispatch) costs beyond the shmcoll call is this group's time minus the direct call's."""

    def __init__(self, rank: int, size: int, call: Callable[[], object]):
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's stubs list only the C++ constructors
        self._call = call

    def allreduce(self, tensors, opts=None):  # type: ignore[override]  # the call torch really makes
        self._call()
        return None

    def getBackendName(self) -> str:
        return "floor"


def floor_group(call: Callable[[], object]) -> dist.ProcessGroup:
    """A group of every rank over FloorGroup (registered once, as torch's backends are)."""
    if "floor" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "floor", lambda store, rank, size, timeout: FloorGroup(rank, size, call), devices=["cpu"])
    group = dist.new_group(backend="floor")
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group


def adapter_overhead(policy: Policy) -> dict[str, Any]:
    """8 B through torch.distributed, through torch's path alone (FloorGroup) and on the same shmcoll
    group called directly, loop for loop in turn, so that all three see the same moments of a noisy
    machine. Both torch loops name their group, so that torch's path is the same in both."""
    world = dist.group.WORLD
    group = world.shmcoll_group  # type: ignore[union-attr]  # the shmcoll ProcessGroup torch holds
    t = torch.zeros(ADAPTER_SIZE // 4, dtype=torch.float32)
    arr = np.zeros(ADAPTER_SIZE // 4, np.float32)
    floor = floor_group(lambda: group.all_reduce(arr))
    loops = {"torch": lambda: dist.all_reduce(t, group=world), "floor": lambda: dist.all_reduce(t, group=floor),
             "direct": lambda: group.all_reduce(arr)}
    iters = loop_iters(loops["torch"], ADAPTER_SIZE, policy)
    for call in loops.values():
        for _ in range(warmup_calls(ADAPTER_SIZE)):
            call()
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(policy.reps):
        for name, call in loops.items():
            seconds[name].append(timed_loop(call, iters))
    us = {f"{name}_us": median_us(s) for name, s in seconds.items()}
    return {"size": ADAPTER_SIZE, "iters": iters, **us, "overhead_us": us["torch_us"] - us["direct_us"],
            "torch_path_us": us["floor_us"] - us["direct_us"], "own_us": us["torch_us"] - us["floor_us"]}


def all_reduce_job(spec: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """Every size, then (shmcoll only) the adapter's overhead, in the same processes."""
    out: dict[str, Any] = {"rows": [time_all_reduce(size, policy) for size in spec["sizes"]]}
    if spec["backend"] == "shmcoll":
        out["adapter"] = adapter_overhead(policy)
    return out


# ---- DDP ----

def build_model(layers: int) -> torch.nn.Sequential:
    """`layers` Linear layers with ReLU between: their parameters are the gradients DDP reduces."""
    modules: list[torch.nn.Module] = []
    for k in range(layers):
        modules.append(torch.nn.Linear(WIDTH, WIDTH))
        if k < layers - 1:
            modules.append(torch.nn.ReLU())
    return torch.nn.Sequential(*modules)


def params_agree(model: torch.nn.Module) -> bool:
    """After DDP steps every rank holds rank 0's parameters exactly, or a reduction was wrong."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    differs = torch.tensor([0.0 if torch.equal(mine, theirs) else 1.0])
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    return differs.item() == 0.0


def keep_own_gradients(state, bucket):
    """A DDP comm hook that communicates nothing: each bucket comes back as it is. (Unannotated:
    DDP refuses a hook whose bucket annotation is not the GradBucket class, and under this module's
    `from __future__ import annotations` every annotation is a string.)"""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def time_steps(ddp: DistributedDataParallel, policy: Policy) -> list[float]:
    """Untimed steps, a barrier, then each timed step on its own, in seconds."""
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank() + 1)  # each rank its own data, as in training
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    for _ in range(policy.ddp_warmup):
        step()
    dist.barrier()
    times = []
    for _ in range(policy.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def ddp_job(spec: dict[str, Any], policy: Policy) -> dict[str, Any]:
    """DDP's step as training runs it (the parameters checked after), then the same step on a fresh
    model whose comm hook communicates nothing: the difference is what communication adds."""
    torch.manual_seed(0)
    model = build_model(policy.layers)
    times = time_steps(DistributedDataParallel(model), policy)
    if not params_agree(model):
        raise WrongResult(f"after {policy.ddp_warmup + policy.steps} DDP steps the ranks' parameters differ")
    del model
    torch.manual_seed(0)
    alone = DistributedDataParallel(build_model(policy.layers))
    alone.register_comm_hook(None, keep_own_gradients)
    no_comm = time_steps(alone, policy)
    return {"steps": policy.steps, "median_ms": statistics.median(times) * 1e3,
            "steps_ms": [s * 1e3 for s in times], "no_comm_median_ms": statistics.median(no_comm) * 1e3,
            "grad_bytes": policy.grad_bytes}


JOBS: dict[str, Callable[[dict[str, Any], Policy], dict[str, Any]]] = {"all_reduce": all_reduce_job, "ddp": ddp_job}


# ---- the process ----

def exit_with_parent() -> None:
    """A rank ends itself when the driver is gone (killed past a test's timeout, say): no orphans."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(EXIT_FAILED)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run(spec: dict[str, Any]) -> int:
    """Join the group of spec's backend, run its jobs, rank 0 writes the result file."""
    exit_with_parent()
    if spec["backend"] == "shmcoll":
        import shmcoll.torch  # noqa: F401  # registers the backend "shmcoll"
    torch.set_num_threads(spec["threads"])
    policy = Policy(**spec["policy"])
    dist.init_process_group(spec["backend"], timeout=timedelta(seconds=policy.timeout_s))
    try:
        result = {name: JOBS[name](spec, policy) for name in spec["jobs"]}
        if dist.get_rank() == 0:
            Path(spec["result_file"]).write_text(json.dumps(result))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)  # at once: the other ranks see a lost peer, not a shutdown that waits for them
    gc.collect()  # frees the DDP wrappers (their reducers sit in reference cycles) while the group lives:
    # a gloo rank that freed one after destroy_process_group() was seen to abort
    dist.barrier()  # leave together
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(sys.argv[1])))
