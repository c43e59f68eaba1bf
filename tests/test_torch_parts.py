"""The torch backend's parts, in one process: tensor views and their cache, op mapping, Work
objects, the Completer, and torch's store seen as a rendezvous store. (Whole groups over real
processes: test_torch_backend.py and test_torch_training.py.)"""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from shmcoll.errors import CollectiveTimeout, InvalidArgument
from shmcoll.rendezvous.store import ABORT_KEY, StoreAbort
from shmcoll.types import ReduceKind
from shmcoll.worker import OrderedWorker

from bounds import WAIT_HANG_S

torch = dist = tv = work = store_mod = launch_env = None  # bound by _import_torch


@pytest.fixture(autouse=True, scope="module")
def _import_torch():
    """torch is imported when the first test here runs, not at collection: the pytest process
    forks every multi-process test's ranks, which should not carry torch (nor an OpenMP thread
    pool: one thread, so torch starts none)."""
    global torch, dist, tv, work, store_mod, launch_env
    torch = pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import shmcoll.torch.launch_env as launch_env
    import shmcoll.torch.store as store_mod
    import shmcoll.torch.tensors as tv
    import shmcoll.torch.work as work


# ---- tensor views ----
def test_native_view_shares_the_tensors_memory():
    t = torch.zeros(2, 3, dtype=torch.float32)
    view = tv.native_view(t)
    view[4] = 7
    assert view.shape == (6,) and t[1, 1].item() == 7


def test_native_view_is_cached_per_tensor_and_rebuilt_when_storage_moves():
    t = torch.arange(4.0)
    first = tv.native_view(t)
    assert tv.native_view(t) is first
    t.resize_(1000)  # new storage: the cached view would point at freed memory
    second = tv.native_view(t)
    assert second is not first and second.size == 1000


def test_native_view_follows_a_tensor_whose_dtype_or_layout_changes_in_place():
    t = torch.arange(6.0).reshape(2, 3)
    assert tv.native_view(t).dtype == np.float32
    t.data = t.data.view(torch.int32)  # same memory, same element count, another dtype
    assert tv.native_view(t).dtype == np.int32
    t.t_()  # same memory, transposed in place: no longer contiguous
    assert tv.native_view(t) is None


def test_native_view_is_none_for_what_shmcoll_does_not_reduce_as_it_is():
    assert tv.native_view(torch.ones(4, dtype=torch.int8)) is None
    assert tv.native_view(torch.ones(4, 4)[:, 1]) is None


def test_the_cache_never_keeps_a_tensor_alive():
    t = torch.ones(8)
    tv.native_view(t)
    key = id(t)
    assert key in tv._views
    del t
    gc.collect()
    assert key not in tv._views


@pytest.mark.parametrize("dtype, expected", [("bfloat16", 2), ("float16", 2), ("float64", 8), ("bool", 1),
                                             ("complex64", 8), ("float8_e4m3fn", 1)])
def test_byte_view_covers_every_byte(dtype, expected):
    t = torch.zeros(5, dtype=getattr(torch, dtype))
    assert tv.byte_view(t).nbytes == 5 * expected


def test_reduce_operand_stages_non_contiguous_tensors_and_writes_back():
    base = torch.zeros(4, 4)
    column = base[:, 1]
    operand = tv.reduce_operand(column, ReduceKind.SUM)
    operand.array[:] = [1, 2, 3, 4]
    assert base[:, 1].tolist() == [0, 0, 0, 0]
    operand.finish()
    assert base[:, 1].tolist() == [1, 2, 3, 4]


def test_reduce_operand_widens_small_integers_and_wraps_back():
    t = torch.tensor([100, -100], dtype=torch.int8)
    operand = tv.reduce_operand(t, ReduceKind.SUM)
    assert operand.array.dtype == np.int64
    operand.array[:] = [200, -200]  # as a sum over two ranks would give
    operand.finish()
    assert t.tolist() == [-56, 56]


def test_reduce_operand_writes_into_a_non_contiguous_leaf_that_requires_grad():
    leaf = torch.ones(2, 3, requires_grad=True)
    operand = tv.reduce_operand(leaf.t(), ReduceKind.SUM)
    operand.array[:] = np.arange(6)
    operand.finish()
    assert leaf.detach().t().reshape(-1).tolist() == list(range(6))


@pytest.mark.parametrize("op, kind", [("SUM", ReduceKind.SUM), ("AVG", ReduceKind.AVG), ("PRODUCT", ReduceKind.PROD),
                                      ("MIN", ReduceKind.MIN), ("MAX", ReduceKind.MAX)])
def test_reduce_op_maps_torchs_ops(op, kind):
    options = dist.AllreduceOptions()
    options.reduceOp = getattr(dist.ReduceOp, op)
    assert tv.reduce_op(options.reduceOp) == (kind, None)
    assert tv.reduce_op(getattr(dist.ReduceOp, op)) == (kind, None)


def test_premul_sum_is_a_sum_of_scaled_copies():
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist._make_nccl_premul_sum(0.25)
    kind, factor = tv.reduce_op(options.reduceOp)
    assert (kind, factor) == (ReduceKind.SUM, 0.25)
    t = torch.full((3,), 8.0)
    operand = tv.reduce_operand(t, kind, factor)
    assert operand.array.tolist() == [2, 2, 2] and t.tolist() == [8, 8, 8]
    with pytest.raises(InvalidArgument, match="floating-point"):
        tv.reduce_operand(torch.ones(2, dtype=torch.int32), kind, factor)


@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_ops_without_a_kernel_are_invalid_arguments(op):
    with pytest.raises(InvalidArgument, match="does not implement"):
        tv.reduce_op(getattr(dist.ReduceOp, op))


def test_avg_of_integers_and_max_of_complex_are_refused():
    with pytest.raises(InvalidArgument, match="AVG"):
        tv.reduce_operand(torch.ones(2, dtype=torch.int16), ReduceKind.AVG)
    with pytest.raises(InvalidArgument, match="complex"):
        tv.reduce_operand(torch.ones(2, dtype=torch.complex64), ReduceKind.MAX)


# ---- Work objects ----
def _pending(job, finish=lambda result: [result]):
    worker, completer = OrderedWorker(), work.Completer()
    return work.PendingWork(worker.submit("test", job), finish, completer), worker, completer


def test_pending_work_wait_returns_with_outputs_and_future_done():
    release = threading.Event()
    w, worker, completer = _pending(lambda: release.wait(WAIT_HANG_S) and torch.ones(2))
    assert not w.is_completed()
    release.set()
    assert w.wait() is True
    assert w.get_future().done() and w.get_future().value()[0].tolist() == [1, 1]
    worker.stop(WAIT_HANG_S)
    completer.stop(WAIT_HANG_S)


def test_pending_work_reraises_the_collectives_error_from_wait_and_future():
    def fail():
        raise CollectiveTimeout("stuck peer")
    w, worker, completer = _pending(fail)
    with pytest.raises(CollectiveTimeout, match="stuck peer"):
        w.wait()
    with pytest.raises(RuntimeError, match="CollectiveTimeout: stuck peer") as failed:
        w.get_future().wait()
    assert type(failed.value) is RuntimeError  # failed for C++ waiters too, not a value Python unwraps
    assert w.is_completed() and not w.is_success()
    worker.stop(WAIT_HANG_S)
    completer.stop(WAIT_HANG_S)


def test_wait_with_a_timeout_raises_while_the_call_runs():
    release = threading.Event()
    w, worker, completer = _pending(lambda: release.wait(WAIT_HANG_S))
    with pytest.raises(CollectiveTimeout, match="still running"):
        w.wait(0.01)
    release.set()
    assert w.wait()
    worker.stop(WAIT_HANG_S)
    completer.stop(WAIT_HANG_S)


def test_a_callback_that_waits_on_a_later_collective_does_not_deadlock():
    """PowerSGD's shape: a `then` callback issues another collective and waits for it."""
    worker, completer = OrderedWorker(), work.Completer()
    first = work.PendingWork(worker.submit("first", lambda: 1), lambda r: [torch.tensor(r)], completer)

    def chained(fut):
        second = work.PendingWork(worker.submit("second", lambda: 2), lambda r: [torch.tensor(r)], completer)
        return fut.value()[0].item() + second.get_future().wait()[0].item()
    assert first.get_future().then(chained).wait() == 3
    worker.stop(WAIT_HANG_S)
    completer.stop(WAIT_HANG_S)


def test_done_work_is_complete_and_builds_its_future_on_demand():
    outputs = [torch.ones(1)]
    w = work.DoneWork(outputs)
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert w.get_future().value()[0] is outputs[0]


# ---- torch's store as the rendezvous store ----
def test_torch_store_sets_gets_and_waits():
    s = store_mod.TorchStore(dist.HashStore())
    s.set("a", "1", time.monotonic() + 1)
    assert s.get("a", 0) == "1" and s.get("b", 0) is None
    values, missing = s.wait(["a", "b"], time.monotonic() + 0.05)
    assert values == {"a": "1"} and missing == ["b"]


def test_torch_store_wait_ends_on_a_published_failure():
    s = store_mod.TorchStore(dist.HashStore())
    threading.Timer(0.05, lambda: s.set(ABORT_KEY, "rank 1 failed", time.monotonic() + 1)).start()
    started = time.monotonic()
    with pytest.raises(StoreAbort, match="rank 1 failed"):
        s.wait(["never"], started + WAIT_HANG_S)
    assert time.monotonic() - started < WAIT_HANG_S / 2


def test_each_group_gets_a_fresh_job_id():
    first = store_mod.agree_job_id(store_mod.TorchStore(dist.HashStore()), 0, time.monotonic() + 1)
    second = store_mod.agree_job_id(store_mod.TorchStore(dist.HashStore()), 0, time.monotonic() + 1)
    assert first != second and first.isalnum()


def test_the_store_host_is_found_through_prefix_stores():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    assert store_mod.store_host(dist.PrefixStore("g/", dist.PrefixStore("h/", server))) == "127.0.0.1"
    assert store_mod.address_toward("127.0.0.1") == "127.0.0.1"
    seen = store_mod.TorchStore(server)
    assert (seen.local_address, seen.store_address) == ("127.0.0.1", "127.0.0.1")


def test_operands_keep_their_memory_alive():
    """A call queued on the worker may outlive every other reference to its input (an async call
    on a temporary) or to the copy made for it: the operand's array must keep the memory."""
    operand = tv.reduce_operand(torch.arange(1 << 16, dtype=torch.float32).t(), ReduceKind.SUM)
    staged = tv.reduce_operand(torch.arange(1 << 16, dtype=torch.float64)[::2], ReduceKind.SUM)
    garbage = [torch.full((1 << 16,), -1.0) for _ in range(8)]
    assert operand.array[-1] == (1 << 16) - 1 and staged.array[-1] == (1 << 16) - 2 and garbage


def test_views_leave_the_storage_resizable():
    """FSDP frees a flat parameter by resizing its storage to 0 (a .numpy() view forbids that)."""
    t = torch.ones(16)
    tv.owned_view(t)
    tv.native_view(t)
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().size() == 0


# ---- env:// from the launchers' variables ----

@pytest.mark.parametrize("given, filled", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, {"RANK": "3", "WORLD_SIZE": "4"}),
    ({"SHMCOLL_RANK": "0", "SHMCOLL_WORLD_SIZE": "2", "SHMCOLL_MASTER_ADDR": "10.0.0.1",
      "SHMCOLL_MASTER_PORT": "29500"},
     {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}),
])
def test_env_gets_what_the_launcher_said_under_torchs_names(given, filled):
    env = dict(given)
    launch_env.fill_torch_env(env)
    assert env == {**given, **filled}


@pytest.mark.parametrize("given", [
    {},  # no launcher: torch's own error says what env:// lacks
    {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"},  # torchrun's: left alone
    {"OMPI_COMM_WORLD_RANK": "1", "SLURM_NTASKS": "4"},  # mixed launchers: init() refuses, so no guess
])
def test_env_is_left_alone_without_a_launcher_or_when_set(given):
    env = dict(given)
    launch_env.fill_torch_env(env)
    assert env == given
