"""Training through the torch.distributed backend equals single-process training (API.md, "torch.distributed
backend"), and a rank that dies or stops during DDP's backward fails every survivor, never hangs.

Each launch batches several trainings (one body: the DDP variants; another: FSDP1, FSDP2 and the functional
collectives) to keep the suite's time down. Models are tiny float64 MLPs, so "within rounding" is tight
(TOL); the single-process reference is computed inside rank 0 after the distributed run, never in the pytest
process (OpenMP is not fork-safe: no torch compute happens here before a fork).

Every rank returns its trained parameters as numpy arrays; the test asserts the ranks hold bitwise identical
parameters (every rank reduces to the same bits) and that rank 0's equal the reference within TOL.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bounds import (
    CLOSE_S,
    FAULT_NOTICE_S,
    LAUNCH_S,
    NEVER_S,
    REAP_S,
    RUN_HANG_S,
    TIME_SCALE,
    TIMEOUT_LATE_S,
    WAIT_HANG_S,
)
from harness import (
    CTX,
    REPO,
    Died,
    finish_together,
    free_port,
    run_ranks,
    shm_names_of,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.multiprocess

IN, HIDDEN, OUT = 8, 16, 4  # the MLP: IN -> HIDDEN -> HIDDEN -> OUT, float64
BATCH = 12  # global batch: splits evenly over 2 and 3 ranks, and in halves for no_sync's micro-batches
STEPS = 6  # PowerSGD compresses from its third step on (start_powerSGD_iter=2)
LR = 0.1
TOL = 1e-12  # float64: what reordering a handful of sums can change
SMALL_BUCKET_MB = 0.0005  # ~520 bytes: every 16x16 weight is a bucket of its own, so DDP has several buckets
MOVED = 1e-3  # training must move the parameters at least this much, or equality would prove nothing
STOP_TIMEOUT = 3.0 * TIME_SCALE  # group timeout of the SIGSTOP case (above runner.SILENT_AFTER: the rank is named)
EXACT_DDP = ["buckets", "allreduce_hook", "no_sync", "static_graph", "find_unused"]


def _torch():
    """torch, or a skip where it is not installed. Imported here (forked ranks inherit the import, no compute
    runs in this process), not at collection: the quick tier, which collects this file, does not pay for it."""
    return pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")


# ---------------------------------------------------------------------------------------------
# inside the ranks: joining, the model, the data, a training loop
# ---------------------------------------------------------------------------------------------

def _join(rank: int, n: int, port: int, seconds: float = WAIT_HANG_S):
    """init_process_group("shmcoll") over tcp://; returns (torch, dist)."""
    import torch
    import torch.distributed as dist

    import shmcoll.torch  # noqa: F401 (registers the backend)

    torch.set_num_threads(1)  # one core per rank: more ranks than cores on this machine
    dist.init_process_group("shmcoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=seconds))
    return torch, dist


def _mlp(torch, hidden: int = HIDDEN):
    """The same initial weights on every rank and in the reference (seeded)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, OUT)).double()


def _branchy(torch):
    """An MLP with a branch forward never uses: find_unused_parameters must cope with its missing gradients."""
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp(torch)
            self.unused = torch.nn.Linear(HIDDEN, OUT).double()

        def forward(self, x):
            return self.body(x)
    return Branchy()


def _data(torch, steps: int = STEPS) -> list:
    """The global batches, the same on every rank: (x, y) for a regression."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, IN, generator=g, dtype=torch.float64),
             torch.randn(BATCH, OUT, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _shard(t, rank: int, n: int):
    """This rank's rows of a global batch."""
    size = t.shape[0] // n
    return t[rank * size:(rank + 1) * size]


def _loss(torch, model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _fit(torch, params, data, step) -> list[float]:
    """SGD with momentum over the global batches; step(x, y) runs forward and backward and returns the loss."""
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        losses.append(float(step(x, y)))
        opt.step()
    return losses


def _flat(tensors) -> np.ndarray:
    """The parameters as one float64 numpy vector, from copies: .numpy() on a tensor makes its storage
    unresizable, which FSDP's resharding (freeing the unsharded storage) then refuses."""
    return np.concatenate([t.detach().reshape(-1).clone().numpy() for t in tensors])


def _reference(torch, make) -> dict:
    """Single-process training of make()'s model on the whole global batch: what the ranks must equal."""
    model = make(torch)
    init = _flat(model.parameters())

    def step(x, y):
        loss = _loss(torch, model, x, y)
        loss.backward()
        return loss
    _fit(torch, model.parameters(), _data(torch), step)
    return {"init": init, "params": _flat(model.parameters())}


def _shmcoll_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shmcoll"))


def _destroyed(dist) -> dict:
    """destroy_process_group(), timed, and what is left running after it."""
    start = time.monotonic()
    dist.destroy_process_group()
    return {"destroy_s": time.monotonic() - start, "threads": _shmcoll_threads()}


# ---------------------------------------------------------------------------------------------
# inside the ranks: DDP
# ---------------------------------------------------------------------------------------------

def _ddp_step(torch, ddp, rank, n):
    """Forward and backward on this rank's shard; DDP averages the gradients."""
    def step(x, y):
        loss = _loss(torch, ddp, _shard(x, rank, n), _shard(y, rank, n))
        loss.backward()
        return loss
    return step


def _no_sync_step(torch, ddp, rank, n):
    """This rank's shard in two micro-batches: the first under no_sync (accumulated locally), the second
    synchronised; half of each loss, so the sum is the shard's mean loss."""
    def step(x, y):
        (x0, x1), (y0, y1) = _shard(x, rank, n).chunk(2), _shard(y, rank, n).chunk(2)
        with ddp.no_sync():
            first = _loss(torch, ddp, x0, y0) / 2
            first.backward()
        second = _loss(torch, ddp, x1, y1) / 2
        second.backward()
        return first + second
    return step


def _ddp_variant(torch, dist, rank, n, name: str) -> dict:
    """One DDP training; the trained parameters and what else the test checks for this variant."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    DDP = torch.nn.parallel.DistributedDataParallel
    make = _branchy if name == "find_unused" else _mlp
    kwargs = {"buckets": {"bucket_cap_mb": SMALL_BUCKET_MB}, "static_graph": {"static_graph": True},
              "find_unused": {"find_unused_parameters": True}}.get(name, {})
    ddp = DDP(make(torch), **kwargs)
    if name == "allreduce_hook":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    step = (_no_sync_step if name == "no_sync" else _ddp_step)(torch, ddp, rank, n)
    losses = _fit(torch, ddp.parameters(), _data(torch), step)
    out = {"params": _flat(ddp.module.parameters()), "losses": losses}
    if name == "buckets":
        # the buckets from the second step on (DDP rebuilds them in gradient order after the first)
        out["buckets"] = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    return out


def _powersgd(torch, dist, rank, n) -> dict:
    """DDP with the PowerSGD hook (rank-1 approximations from the third step on): lossy, so only trained
    and identical on every rank is checked."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    ddp = torch.nn.parallel.DistributedDataParallel(_mlp(torch))
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    losses = _fit(torch, ddp.parameters(), _data(torch), _ddp_step(torch, ddp, rank, n))
    return {"params": _flat(ddp.module.parameters()), "losses": losses, "iter": state.iter}


def _ddp_variants(rank, n, port, port2) -> dict:
    """Every DDP variant in one launch, then destroy_process_group() and a second group on another port."""
    torch, dist = _join(rank, n, port)
    out = {name: _ddp_variant(torch, dist, rank, n, name) for name in EXACT_DDP}
    out["powersgd"] = _powersgd(torch, dist, rank, n)
    out["first_destroy"] = _destroyed(dist)
    _join(rank, n, port2)
    x = torch.full((5,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(x)
    out["second_group_sum"] = x.numpy().copy()
    out["second_destroy"] = _destroyed(dist)
    if rank == 0:
        out["ref"] = {"mlp": _reference(torch, _mlp), "branchy": _reference(torch, _branchy)}
    return out


# ---------------------------------------------------------------------------------------------
# inside the ranks: FSDP1, FSDP2, functional collectives
# ---------------------------------------------------------------------------------------------

def _fsdp1(torch, rank, n) -> np.ndarray:
    """FullyShardedDataParallel on CPU, one unit per Linear; the full parameters after training. torch 2.13
    refuses device_id=None without an accelerator, so the CPU is named."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(_mlp(torch), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 device_id=torch.device("cpu"),
                 use_orig_params=True)
    _fit(torch, model.parameters(), _data(torch), _plain_step(torch, model, rank, n))
    with FSDP.summon_full_params(model, writeback=False):
        return _flat(model.parameters())


def _fsdp2(torch, rank, n) -> np.ndarray:
    """fully_shard on every Linear and the root, over a CPU device mesh; the full parameters after training."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (n,))
    model = _mlp(torch)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _fit(torch, model.parameters(), _data(torch), _plain_step(torch, model, rank, n))
    return _flat(p.full_tensor() for p in model.parameters())


def _plain_step(torch, model, rank, n):
    """Forward and backward on this rank's shard; the wrapper (FSDP) reduces the gradients itself.
    FSDP averages over ranks, so the shard's mean loss gives the global batch's gradient."""
    def step(x, y):
        loss = _loss(torch, model, _shard(x, rank, n), _shard(y, rank, n))
        loss.backward()
        return loss
    return step


def _funcol_training(torch, dist, rank, n) -> np.ndarray:
    """Data parallelism by hand: after each backward, funcol.all_reduce(avg) of the flattened gradients."""
    import torch.distributed._functional_collectives as funcol

    model = _mlp(torch)
    params = list(model.parameters())

    def step(x, y):
        loss = _loss(torch, model, _shard(x, rank, n), _shard(y, rank, n))
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        avg = funcol.wait_tensor(funcol.all_reduce(grads, "avg", dist.group.WORLD))
        for p, g in zip(params, avg.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        return loss
    _fit(torch, params, _data(torch), step)
    return _flat(params)


def _funcol_values(torch, dist, rank, n) -> dict:
    """all_reduce / all_gather_tensor / reduce_scatter_tensor on small integers (exact in float64)."""
    import torch.distributed._functional_collectives as funcol

    group, f64 = dist.group.WORLD, torch.float64
    summed = funcol.all_reduce(torch.arange(4, dtype=f64) + rank, "sum", group)
    gathered = funcol.all_gather_tensor(torch.full((2, 3), float(rank), dtype=f64), 0, group)
    scattered = funcol.reduce_scatter_tensor(torch.arange(2 * n, dtype=f64) * (rank + 1), "sum", 0, group)
    return {k: funcol.wait_tensor(t).numpy().copy()
            for k, t in {"all_reduce": summed, "all_gather": gathered, "reduce_scatter": scattered}.items()}


def _sharded(rank, n, port) -> dict:
    """FSDP1, FSDP2 and the functional collectives in one launch."""
    torch, dist = _join(rank, n, port)
    out = {"fsdp1": _fsdp1(torch, rank, n), "fsdp2": _fsdp2(torch, rank, n),
           "funcol": _funcol_training(torch, dist, rank, n), "values": _funcol_values(torch, dist, rank, n)}
    out["destroy"] = _destroyed(dist)
    if rank == 0:
        out["ref"] = _reference(torch, _mlp)
    return out


# ---------------------------------------------------------------------------------------------
# the checks, in the test process (numpy only)
# ---------------------------------------------------------------------------------------------

def _assert_equals_reference(results: list, key, ref: dict) -> None:
    """Every rank bitwise identical to rank 0, rank 0 within TOL of the reference, which training moved."""
    got = [key(r) for r in results]
    for rank, params in enumerate(got):
        np.testing.assert_array_equal(params, got[0], err_msg=f"rank {rank} differs from rank 0")
    worst = float(np.max(np.abs(got[0] - ref["params"])))
    assert worst < TOL, f"{worst:.3g} from single-process training"
    assert float(np.max(np.abs(ref["params"] - ref["init"]))) > MOVED, "training did not move the parameters"


def _assert_released(out: dict) -> None:
    assert out["destroy_s"] < CLOSE_S, out
    assert out["threads"] == [], f"shmcoll threads alive after destroy_process_group(): {out['threads']}"


def _check_ddp(results: list, n: int) -> None:
    ref = results[0]["ref"]
    for name in EXACT_DDP:
        want = ref["branchy" if name == "find_unused" else "mlp"]
        _assert_equals_reference(results, lambda r, name=name: r[name]["params"], want)
    assert results[0]["buckets"]["buckets"] >= 3, results[0]["buckets"]
    _check_powersgd([r["powersgd"] for r in results], ref["mlp"])
    for r in results:
        _assert_released(r["first_destroy"])
        _assert_released(r["second_destroy"])
        np.testing.assert_array_equal(r["second_group_sum"], np.full(5, n * (n + 1) / 2))


def _check_powersgd(results: list, exact: dict) -> None:
    """Identical on every rank, the loss went down, and the compressed path really ran (it differs from
    exact averaging, PowerSGD being lossy)."""
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["params"], results[0]["params"], err_msg=f"PowerSGD: rank {rank} differs")
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["iter"] >= STEPS, r["iter"]
    assert float(np.max(np.abs(results[0]["params"] - exact["params"]))) > 1e-9, "PowerSGD never compressed"


def _check_sharded(results: list, n: int) -> None:
    ref = results[0]["ref"]
    for key in ("fsdp1", "fsdp2", "funcol"):
        _assert_equals_reference(results, lambda r, key=key: r[key], ref)
    for rank, r in enumerate(results):
        values = r["values"]
        np.testing.assert_array_equal(values["all_reduce"], n * np.arange(4) + n * (n - 1) / 2)
        np.testing.assert_array_equal(values["all_gather"], np.repeat(np.arange(n, dtype=float), 6).reshape(2 * n, 3))
        np.testing.assert_array_equal(values["reduce_scatter"], np.array([2 * rank, 2 * rank + 1]) * n * (n + 1) / 2)
        _assert_released(r["destroy"])


def _use_hier(monkeypatch) -> None:
    """Two simulated hosts (ranks 0,1 on one, 2 on the other): shared memory and TCP in one group."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")


# ---------------------------------------------------------------------------------------------
# training equivalence
# ---------------------------------------------------------------------------------------------

def test_ddp_variants_equal_single_process_training(transport):
    """Several buckets, the allreduce comm hook, no_sync, static_graph, find_unused_parameters: within
    rounding of single-process training; PowerSGD: trains, identical on both ranks. Then the group is
    destroyed (nothing left running) and a second one works."""
    _torch()
    _check_ddp(run_ranks(2, _ddp_variants, free_port(), init=False), 2)


def test_ddp_variants_on_three_ranks_over_two_hosts(monkeypatch):
    _torch()
    _use_hier(monkeypatch)
    _check_ddp(run_ranks(3, _ddp_variants, free_port(), init=False), 3)


def test_fsdp_and_functional_collectives_equal_single_process_training(transport):
    """FSDP1 and FSDP2 (sharded parameters: all_gather, reduce_scatter) and data parallelism through the
    functional collectives: within rounding of single-process training; the collectives' values exact."""
    _torch()
    _check_sharded(run_ranks(2, _sharded, init=False), 2)


def test_fsdp_and_functional_collectives_on_three_ranks_over_two_hosts(monkeypatch):
    """Three ranks: shards of uneven padding, and one rank across the simulated host boundary."""
    _torch()
    _use_hier(monkeypatch)
    _check_sharded(run_ranks(3, _sharded, init=False), 3)


# ---------------------------------------------------------------------------------------------
# faults during DDP's backward
# ---------------------------------------------------------------------------------------------

FAULT_STEP = 3  # the victim signals itself in the third step's backward
VICTIM = 1
#: hidden width whose 16x16 buckets are small enough to run on the caller's thread (the error raised from
#: the backend's method), and one whose 256x256 float64 weight (512 KiB, over backend.INLINE_BYTES) runs on
#: the backend's worker (the error delivered through the Work's future, which torch's C++ reducer waits on)
INLINE_WIDTH, WORKER_WIDTH = HIDDEN, 256


def _fault_hook(rank: int, ddp, step: list, sig: int, stamps):
    """In the victim: a gradient hook on the middle layer's weight sends `sig` to the victim on FAULT_STEP,
    halfway through backward (the last layer's buckets are already on their way)."""
    def hook(grad):
        if step[0] == FAULT_STEP:
            stamps[rank] = time.monotonic()
            os.kill(os.getpid(), sig)
        return grad
    ddp.module[2].weight.register_hook(hook)


def _error(exc: BaseException, end: float) -> dict:
    """What a survivor's training raised, as data the test can check."""
    import shmcoll

    return {"kind": type(exc).__name__, "peer_lost": isinstance(exc, shmcoll.PeerLost),
            "timeout": isinstance(exc, shmcoll.CollectiveTimeout), "runtime": isinstance(exc, RuntimeError),
            "peer": getattr(exc, "peer", None), "msg": str(exc), "end": end}


def _train_until_fault(torch, rank, n, sig: int, stamps, hidden: int = INLINE_WIDTH) -> dict:
    """DDP training with several buckets; the victim signals itself on FAULT_STEP, the others must raise
    there. Returns what a survivor raised (with when its FAULT_STEP backward began)."""
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp(torch, hidden), bucket_cap_mb=SMALL_BUCKET_MB)
    step, started = [0], {}
    if rank == VICTIM:
        _fault_hook(rank, ddp, step, sig, stamps)
    inner = _ddp_step(torch, ddp, rank, n)

    def counted(x, y):
        step[0] += 1
        started[step[0]] = time.monotonic()
        return inner(x, y)
    try:
        _fit(torch, ddp.parameters(), _data(torch), counted)
    except Exception as exc:  # the test checks what arrived
        return {**_error(exc, time.monotonic()), "step": step[0], "start": started[step[0]]}
    return {"kind": "returned", "step": step[0]}


def _killed_in_backward(rank, n, port, port2, hidden, pids, stamps, finish) -> dict:
    """The victim SIGKILLs itself in backward; the survivors raise, wait for each other, destroy the group
    (nothing left running), then form a new group of their own on port2."""
    pids[rank] = os.getpid()
    torch, dist = _join(rank, n, port, NEVER_S)  # only the fault may end the wait: a hang is the run's timeout
    out = _train_until_fault(torch, rank, n, signal.SIGKILL, stamps, hidden)
    out["fault_at"] = stamps[VICTIM]
    out["finished_together"] = finish_together(finish)
    out.update(_destroyed(dist))
    survivors = [r for r in range(n) if r != VICTIM]
    _join(survivors.index(rank), len(survivors), port2)
    x = torch.ones(3, dtype=torch.float64)
    dist.all_reduce(x)
    out["new_group_sum"] = x.numpy().copy()
    out["new_group_destroy"] = _destroyed(dist)
    return out


def _assert_lost(out: dict) -> None:
    """PeerLost naming rank 1 where the error comes from the backend's method; through torch's C++ future
    (the reducer waiting on a bucket) the best that can arrive is a RuntimeError carrying PeerLost's text.
    Promptly, on the faulted step; then destroy and a new group work."""
    assert out["step"] == FAULT_STEP, out
    if out["kind"] == "PeerLost":
        assert out["peer"] == VICTIM, out
    else:
        assert out["runtime"] and "PeerLost" in out["msg"], out
    assert f"rank {VICTIM} was lost" in out["msg"], out
    assert out["end"] - out["fault_at"] < FAULT_NOTICE_S, out
    assert out["finished_together"], out
    _assert_released(out)
    np.testing.assert_array_equal(out["new_group_sum"], np.full(3, 2.0))
    _assert_released(out["new_group_destroy"])


@pytest.mark.parametrize("kind, hidden", [("tcp", INLINE_WIDTH), ("hier", WORKER_WIDTH)],
                         ids=["tcp-inline-buckets", "hier-worker-buckets"])
def test_peer_killed_in_backward_fails_every_survivor(kind, hidden, monkeypatch):
    """SIGKILL in rank 1's backward: every survivor raises naming the lost peer, promptly (and lives: a
    survivor that crashes fails run_ranks); destroy releases everything, the survivors form a new group, and
    nothing of the job is left in /dev/shm."""
    _torch()
    monkeypatch.setenv("SHMCOLL_TRANSPORT", kind)
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    n = 3
    pids, stamps = CTX.RawArray("q", n), CTX.RawArray("d", n)
    results = run_ranks(n, _killed_in_backward, free_port(), hidden, pids, stamps, CTX.Barrier(n - 1),
                        init=False, may_die={VICTIM})
    assert results[VICTIM] == Died(-signal.SIGKILL)
    for rank, out in enumerate(results):
        if rank != VICTIM:
            _assert_lost(out)
    assert shm_names_of(list(pids)) == []


def _stop_rank_main(rank: int, n: int, port: int, directory: str) -> None:
    """One rank of the SIGSTOP job, in an interpreter of its own (python -c), so that a survivor ends the
    way a failed training script does: the exception handled, the group never destroyed, the interpreter
    exiting. The victim stops itself in backward; each survivor records what it raised, waits until every
    survivor has (so none sees another's exit instead of the timeout), and returns."""
    import json
    from pathlib import Path

    import torch.distributed  # noqa: F401 (before the meeting: the group timeout is short, imports are slow)

    here = Path(directory)
    (here / f"ready{rank}").touch()
    wait_until(lambda: all((here / f"ready{r}").exists() for r in range(n)), WAIT_HANG_S, "every rank to start")
    torch, _ = _join(rank, n, port, STOP_TIMEOUT)
    out = _train_until_fault(torch, rank, n, signal.SIGSTOP, {})
    (here / f"rank{rank}.tmp").write_text(json.dumps({**out, "pid": os.getpid()}))
    (here / f"rank{rank}.tmp").rename(here / f"rank{rank}.json")
    survivors = [r for r in range(n) if r != VICTIM]
    wait_until(lambda: all((here / f"rank{r}.json").exists() for r in survivors), WAIT_HANG_S, "every survivor")
    (here / f"leaving{rank}").write_text(repr(time.monotonic()))


def _start_stop_job(tmp_path, n: int) -> list:
    """n interpreters running _stop_rank_main over shared memory (this directory importable)."""
    env = {**subprocess_env(), "SHMCOLL_TRANSPORT": "shm"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env["PYTHONPATH"]])
    port = free_port()
    code = "import test_torch_training as t; t._stop_rank_main({}, {}, {}, {!r})"
    return [subprocess.Popen([sys.executable, "-c", code.format(r, n, port, str(tmp_path))], env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / f"stderr{r}").open("w"))
            for r in range(n)]


def _assert_timed_out(out: dict, first_start: float) -> None:
    """CollectiveTimeout at the group timeout (not before the first survivor's faulted backward began plus
    the timeout; within TIMEOUT_LATE_S of its own), naming the silent rank."""
    assert out["step"] == FAULT_STEP, out
    assert out["timeout"] or (out["runtime"] and "CollectiveTimeout" in out["msg"]), out
    assert out["end"] >= first_start + STOP_TIMEOUT - 0.05, out
    assert out["end"] - out["start"] <= STOP_TIMEOUT + TIMEOUT_LATE_S, out
    named = re.search(r"(?:silent ranks|ranks not heard from[^:]*): \[([0-9, ]*)\]", out["msg"])
    assert named and VICTIM in [int(r) for r in named.group(1).replace(" ", "").split(",") if r], out["msg"]


def test_stopped_peer_times_out_and_survivors_exit(tmp_path):
    """SIGSTOP in rank 1's backward: every survivor raises CollectiveTimeout at the init_process_group
    timeout, then its interpreter exits (group not destroyed) while the victim is still stopped: nothing
    hangs at exit, and nothing of the job is left in /dev/shm."""
    _torch()
    n, survivors = 3, [0, 2]
    procs = _start_stop_job(tmp_path, n)
    try:
        wait_until(lambda: all(procs[r].poll() is not None for r in survivors), RUN_HANG_S, "the survivors to exit")
        exited = time.monotonic()
        assert procs[VICTIM].poll() is None, "the stopped rank exited"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(REAP_S)
    errors = {r: (tmp_path / f"stderr{r}").read_text()[-3000:] for r in survivors}
    assert [procs[r].returncode for r in survivors] == [0, 0], errors
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in survivors]
    first_start = min(out["start"] for out in outs)
    for out in outs:
        _assert_timed_out(out, first_start)
    leaving = max(float((tmp_path / f"leaving{r}").read_text()) for r in survivors)
    assert exited - leaving < LAUNCH_S, "a survivor's interpreter took too long to exit"
    assert shm_names_of([p.pid for p in procs]) == []
