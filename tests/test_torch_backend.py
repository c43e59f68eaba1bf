"""shmcoll as a torch.distributed backend (API.md, "torch.distributed backend"), with torch's own
semantics: every call of the contract at world sizes 1-4 over tcp, shm and two simulated hosts,
every dtype that reduces, non-contiguous tensors and tensors that require grad, async Work, the
errors, and a second init after destroy_process_group. Expected values are computed here in numpy.

Every launch of ranks costs seconds, so one launch per (transport, world size) runs every call in
sequence (`_every_call`) and returns what each call left; each test below asserts on one call's
part of it. Errors with re-initialisation (2 ranks), async Work (3 ranks) and async calls whose
caller drops the inputs (3 ranks: a crash there must not take the rest) have a launch of their own per
transport: 21 launches in all.

torch is imported only inside the tests and the ranks: the quick tier collects this file without
it, and the parent runs no torch compute before forking (OpenMP is not fork-safe).
"""

from __future__ import annotations

import datetime
import functools
import os

import numpy as np
import pytest

from bounds import WAIT_HANG_S
from harness import CTX, attempt, free_port, run_ranks, shm_names_of
from params import WORLD_SIZES

# every test runs over tcp, shm and hier (the `transport` fixture sets the environment ranks inherit)
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("transport")]

#: Elements of most tensors: odd, so no world size above 1 divides it.
COUNT = 13
#: float32 elements of the large tensors: 512 KiB, past the backend's inline limit (256 KiB), so
#: their calls run on its ordered worker rather than on the caller's thread.
LARGE = 1 << 17
#: World sizes where point-to-point has a peer (torch refuses to send to oneself).
P2P_SIZES = [2, 3, 4]

FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8"]
DTYPES = [*FLOAT_DTYPES, *INT_DTYPES, "bool"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
#: Integer inputs are scaled near the dtype's limit, so SUM and PRODUCT over two ranks or more wrap.
INT_SCALE = {"int8": 40, "uint8": 80, "int16": 10_000, "int32": 700_000_000, "int64": 3_000_000_000_000_000_000}
#: AVG's tolerance: two units in the last place (the mean of small integers is rarely exact).
AVG_RTOL = {"float16": 2 * 2.0**-10, "bfloat16": 2 * 2.0**-7, "float32": 2 * 2.0**-23, "float64": 2 * 2.0**-52}


def _torch():
    """torch, or a skip where it is not installed (imported by the test, not at collection)."""
    return pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")


# ---------------------------------------------------------------------------------------------
# inputs: the same functions make a rank's tensors and the parent's expected values
# ---------------------------------------------------------------------------------------------

def _ints(rank: int, count: int, salt: int = 0) -> np.ndarray:
    """Integers in -3..3, different per rank, element and salt: sums and products over four ranks
    are exact in every float dtype, and MIN/MAX pick a different rank at different elements."""
    i = np.arange(count)
    return (i * (rank + 2) + 3 * rank + 5 * salt) % 7 - 3


def _factors(rank: int, count: int) -> np.ndarray:
    """Nonzero integers in -2..2 for PRODUCT: a zero would hide every other rank's contribution."""
    return np.array([-2, -1, 1, 2])[(np.arange(count) + rank * 3) % 4]


def _reduce_input(rank: int, dtype: str, op: str) -> np.ndarray:
    """What `rank` reduces with `op` as `dtype`, as exact Python integers (an object array).
    Integers are scaled near the dtype's limit (so SUM and PRODUCT wrap, as torch's integer
    arithmetic does); uint8 takes magnitudes; bool is whether the integer is positive."""
    base = _factors(rank, COUNT) if op == "PRODUCT" else _ints(rank, COUNT)
    if dtype == "bool":
        return (base > 0).astype(int).astype(object)
    if dtype == "uint8":
        base = np.abs(base)
    return base.astype(object) * INT_SCALE.get(dtype, 1)


def _wrapped(exact: np.ndarray, dtype: str) -> np.ndarray:
    """Exact integers as `dtype` holds them: modulo 2**bits, two's complement."""
    bits = np.dtype(dtype).itemsize * 8
    return np.array([int(v) % (1 << bits) for v in exact], dtype=f"uint{bits}").view(dtype)


def _message(src: int, dst: int, salt: int = 0) -> np.ndarray:
    """What rank src sends rank dst: different for every pair and salt, so a mix-up shows."""
    return np.arange(COUNT, dtype=np.float64) + 1000 * src + 100 * dst + 10 * salt


def _object(rank: int, salt: int) -> dict:
    """A picklable object of a size that varies with rank and salt (the object calls pad to the largest)."""
    return {"rank": rank, "salt": salt, "text": "x" * (7 * rank + salt), "items": list(range(rank))}


def _uneven_splits(n: int) -> list[list[int]]:
    """splits[src][dst]: rows src sends dst in all_to_all_single, zero for some pairs."""
    return [[(src + 2 * dst + 1) % 3 for dst in range(n)] for src in range(n)]


def _rows(src: int, dst: int, count: int) -> np.ndarray:
    """The rows (two columns) src sends dst in all_to_all_single: each names its sender and receiver."""
    first = 1000 * src + 10 * dst + np.arange(count)
    return np.stack([first, -first], axis=1).astype(np.float32)


def _members(n: int) -> list[int]:
    """new_group's members: every other rank, so at 3 and 4 ranks a gap ([0, 2])."""
    return list(range(0, n, 2))


def _subgroup_size(n: int) -> int:
    """new_subgroups' group size: 2 where it divides the world, else 1."""
    return 2 if n % 2 == 0 else 1


# ---------------------------------------------------------------------------------------------
# in the ranks
# ---------------------------------------------------------------------------------------------

def _init(rank: int, n: int, port: int):
    """The default group on backend "shmcoll", met through a TCPStore at `port`."""
    import torch
    import torch.distributed as dist

    import shmcoll.torch  # noqa: F401 -- registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("shmcoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=WAIT_HANG_S))
    return torch, dist


def _numpy(t) -> np.ndarray:
    """A tensor's values as a numpy copy (bfloat16 as float32, which holds every bfloat16)."""
    import torch

    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _tensor(values: np.ndarray, dtype: str):
    """A tensor of `dtype` holding exact integers (wrapped into integer dtypes, as they fit anyway)."""
    import torch

    if dtype in INT_DTYPES:
        return torch.from_numpy(_wrapped(values, dtype))
    if dtype == "bool":
        return torch.from_numpy(values.astype(bool))
    return torch.from_numpy(values.astype(np.float64)).to(getattr(torch, dtype))


def _ops_of(dtype: str) -> list[str]:
    """AVG is for floating dtypes only."""
    return OPS if dtype in FLOAT_DTYPES else [op for op in OPS if op != "AVG"]


def _all_reduce_every_dtype(rank, n):
    """all_reduce of every dtype with every op it takes (the widened integer types included)."""
    import torch.distributed as dist

    results = {}
    for dtype in DTYPES:
        for op in _ops_of(dtype):
            t = _tensor(_reduce_input(rank, dtype, op), dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            results[dtype, op] = _numpy(t)
    return results


def _all_reduce_large(rank, n):
    """A tensor past the inline limit: the call runs on the backend's worker, the caller waits for it."""
    import torch
    import torch.distributed as dist

    t = torch.from_numpy(_ints(rank, LARGE).astype(np.float32))
    dist.all_reduce(t)
    return _numpy(t)


def _non_contiguous(rank, n):
    """Transposed slices as inputs and outputs: results must reach the tensor's storage, and inputs
    must be read through their strides."""
    import torch
    import torch.distributed as dist

    def grid(salt):
        return torch.from_numpy(_ints(rank, 24, salt).astype(np.float32)).reshape(4, 6)

    reduced, broadcast, reduced_to_root = grid(0), grid(1), grid(2)
    dist.all_reduce(reduced.t()[1:4])
    dist.broadcast(broadcast.t()[::2], src=n - 1)
    dist.reduce(reduced_to_root.t()[1:4], dst=0)
    all_gathered = [torch.zeros(4, 3).t() for _ in range(n)]
    dist.all_gather(all_gathered, grid(3).t()[1:4])
    gathered = [torch.zeros(3, 4) for _ in range(n)] if rank == 0 else None
    dist.gather(grid(4).t()[1:4], gathered, dst=0)
    scattered = torch.zeros(3, 4)
    dist.scatter(scattered, [grid(5 + dst).t()[1:4] for dst in range(n)] if rank == n - 1 else None, src=n - 1)
    reduce_scattered = torch.zeros(3, 4)
    dist.reduce_scatter(reduce_scattered, [grid(10 + dst).t()[1:4] for dst in range(n)])
    return {"all_reduce": _numpy(reduced), "broadcast": _numpy(broadcast), "reduce": _numpy(reduced_to_root),
            "all_gather": [_numpy(t) for t in all_gathered],
            "gather": None if gathered is None else [_numpy(t) for t in gathered],
            "scatter": _numpy(scattered), "reduce_scatter": _numpy(reduce_scattered)}


def _requires_grad(rank, n):
    """Leaf tensors that require grad, as DDP's parameters are: accepted, results written through."""
    import torch
    import torch.distributed as dist

    def leaf(salt):
        return torch.tensor(_ints(rank, COUNT, salt), dtype=torch.float32, requires_grad=True)

    reduced, broadcast, gathered_from = leaf(0), leaf(1), leaf(2)
    dist.all_reduce(reduced)
    dist.broadcast(broadcast, src=0)
    gathered = [torch.empty(COUNT) for _ in range(n)]
    dist.all_gather(gathered, gathered_from)
    return {"all_reduce": _numpy(reduced), "broadcast": _numpy(broadcast), "all_gather": [_numpy(t) for t in gathered],
            "still_requires_grad": reduced.requires_grad and broadcast.requires_grad}


def _broadcast_every_root(rank, n):
    """int16, a dtype shmcoll does not reduce, still moves (any dtype moves)."""
    import torch
    import torch.distributed as dist

    results = []
    for root in range(n):
        t = torch.from_numpy(_ints(rank, COUNT, salt=root).astype(np.int16))
        dist.broadcast(t, src=root)
        results.append(_numpy(t))
    return results


def _reduce_every_root(rank, n):
    """Every root; non-roots keep their input (the backend promises not to touch it)."""
    import torch
    import torch.distributed as dist

    results = []
    for root in range(n):
        t = torch.from_numpy(_ints(rank, COUNT, salt=root).astype(np.float32))
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        results.append(_numpy(t))
    return results


def _all_gather(rank, n):
    """float16 pieces into a list whose old contents must all be overwritten."""
    import torch
    import torch.distributed as dist

    outputs = [torch.full((COUNT,), -99.0, dtype=torch.float16) for _ in range(n)]
    dist.all_gather(outputs, torch.from_numpy(_ints(rank, COUNT).astype(np.float16)))
    return [_numpy(t) for t in outputs]


def _all_gather_into_tensor(rank, n):
    """Both output forms torch documents: the concatenation (n*k) and the stack (n, k)."""
    import torch
    import torch.distributed as dist

    flat, stacked = torch.zeros(n * COUNT, dtype=torch.int32), torch.zeros(n, COUNT, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(flat, torch.from_numpy(_ints(rank, COUNT).astype(np.int32)))
    dist.all_gather_into_tensor(stacked, torch.from_numpy(_ints(rank, COUNT, 1).astype(np.float32)).bfloat16())
    return {"flat": _numpy(flat), "stacked": _numpy(stacked)}


def _reduce_scatter(rank, n):
    """One input tensor per destination rank, summed into the output of that rank."""
    import torch
    import torch.distributed as dist

    inputs = [torch.from_numpy(_ints(rank, COUNT, salt=dst).astype(np.float64)) for dst in range(n)]
    output = torch.zeros(COUNT, dtype=torch.float64)
    dist.reduce_scatter(output, inputs, op=dist.ReduceOp.SUM)
    return _numpy(output)


def _reduce_scatter_tensor(rank, n):
    """MAX, so the test tells which rank each element came from."""
    import torch
    import torch.distributed as dist

    output = torch.zeros(COUNT, dtype=torch.float32)
    dist.reduce_scatter_tensor(output, torch.from_numpy(_ints(rank, n * COUNT).astype(np.float32)),
                               op=dist.ReduceOp.MAX)
    return _numpy(output)


def _all_to_all(rank, n):
    """Blocks of different lengths per pair (rank src sends dst src + dst + 1 elements)."""
    import torch
    import torch.distributed as dist

    inputs = [torch.from_numpy(_message(rank, dst)[:rank + dst + 1].copy()) for dst in range(n)]
    outputs = [torch.zeros(src + rank + 1, dtype=torch.float64) for src in range(n)]
    dist.all_to_all(outputs, inputs)
    return [_numpy(t) for t in outputs]


def _all_to_all_single(rank, n):
    """Equal blocks, then uneven splits of 2-column rows (zero rows for some pairs)."""
    import torch
    import torch.distributed as dist

    equal_out = torch.zeros(n * COUNT, dtype=torch.int64)
    dist.all_to_all_single(equal_out, torch.from_numpy((_ints(rank, n * COUNT) + 10 * rank).astype(np.int64)))
    splits = _uneven_splits(n)
    sent = np.concatenate([_rows(rank, dst, splits[rank][dst]) for dst in range(n)])
    received = torch.zeros(sum(splits[src][rank] for src in range(n)), 2)
    dist.all_to_all_single(received, torch.from_numpy(sent), output_split_sizes=[splits[src][rank] for src in range(n)],
                           input_split_sizes=splits[rank])
    return {"equal": _numpy(equal_out), "uneven": _numpy(received)}


def _gather_every_root(rank, n):
    """Every root; only the root passes a gather list."""
    import torch
    import torch.distributed as dist

    results = []
    for root in range(n):
        outputs = [torch.zeros(COUNT, dtype=torch.int64) for _ in range(n)] if rank == root else None
        dist.gather(torch.from_numpy(_ints(rank, COUNT, root).astype(np.int64)), outputs, dst=root)
        results.append(None if outputs is None else [_numpy(t) for t in outputs])
    return results


def _scatter_every_root(rank, n):
    """Every root; only the root passes a scatter list."""
    import torch
    import torch.distributed as dist

    results = []
    for root in range(n):
        inputs = [torch.from_numpy(_ints(dst, COUNT, root).astype(np.float32)) for dst in range(n)] if rank == root \
            else None
        output = torch.zeros(COUNT)
        dist.scatter(output, inputs, src=root)
        results.append(_numpy(output))
    return results


def _barrier(rank, n, arrived):
    """Count in on a shared counter, then pass the barrier: nobody may leave before all came."""
    import torch.distributed as dist

    with arrived.get_lock():
        arrived.value += 1
    dist.barrier()
    return arrived.value


def _send_recv(rank, n):
    """Around the ring: blocking send/recv (even ranks send first, so it holds even where a send
    waits for its receive), irecv posted before a blocking send on every rank, isend/irecv, and
    two tags received in the opposite order to their sending."""
    import torch
    import torch.distributed as dist

    if n == 1:
        return None
    after, before = (rank + 1) % n, (rank - 1) % n
    got = {name: torch.zeros(COUNT, dtype=torch.float64) for name in ("blocking", "posted", "async", "tag1", "tag2")}
    if rank % 2 == 0:
        dist.send(torch.from_numpy(_message(rank, after, 0)), dst=after, tag=3)
        dist.recv(got["blocking"], src=before, tag=3)
    else:
        dist.recv(got["blocking"], src=before, tag=3)
        dist.send(torch.from_numpy(_message(rank, after, 0)), dst=after, tag=3)
    posted = dist.irecv(got["posted"], src=before, tag=4)
    dist.send(torch.from_numpy(_message(rank, after, 1)), dst=after, tag=4)
    posted.wait()
    receiving = dist.irecv(got["async"], src=before, tag=5)
    sending = dist.isend(torch.from_numpy(_message(rank, after, 2)), dst=after, tag=5)
    sending.wait()
    receiving.wait()
    second_tag, first_tag = dist.irecv(got["tag2"], src=before, tag=2), dist.irecv(got["tag1"], src=before, tag=1)
    dist.send(torch.from_numpy(_message(rank, after, 11)), dst=after, tag=1)
    dist.send(torch.from_numpy(_message(rank, after, 12)), dst=after, tag=2)
    second_tag.wait()
    first_tag.wait()
    return {name: _numpy(t) for name, t in got.items()}


def _batch_isend_irecv(rank, n):
    """Each rank sends both ways round the ring in one batch (receives listed first)."""
    import torch
    import torch.distributed as dist

    if n == 1:
        return None
    after, before = (rank + 1) % n, (rank - 1) % n
    from_before, from_after = torch.zeros(COUNT, dtype=torch.float64), torch.zeros(COUNT, dtype=torch.float64)
    ops = [dist.P2POp(dist.irecv, from_before, before, tag=0), dist.P2POp(dist.irecv, from_after, after, tag=1),
           dist.P2POp(dist.isend, torch.from_numpy(_message(rank, after, 0)), after, tag=0),
           dist.P2POp(dist.isend, torch.from_numpy(_message(rank, before, 1)), before, tag=1)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"from_before": _numpy(from_before), "from_after": _numpy(from_after)}


def _object_collectives(rank, n):
    """Objects of different pickled sizes through every object call (each pads to the largest)."""
    import torch.distributed as dist

    broadcast = []
    for root in range(n):
        objects = [_object(rank, root), "r" * rank] if rank == root else [None, None]
        dist.broadcast_object_list(objects, src=root)
        broadcast.append(objects)
    everyone = [None] * n
    dist.all_gather_object(everyone, _object(rank, 1))
    gathered = [None] * n if rank == n - 1 else None
    dist.gather_object(_object(rank, 2), gathered, dst=n - 1)
    scattered = [None]
    dist.scatter_object_list(scattered, [_object(dst, 3) for dst in range(n)] if rank == 0 else None, src=0)
    return {"broadcast": broadcast, "all_gather": everyone, "gather": gathered, "scatter": scattered[0]}


def _new_group(rank, n):
    """A sub-group of _members(n): every rank creates it, only members call on it; the default
    group works alongside."""
    import torch
    import torch.distributed as dist

    members = _members(n)
    sub = dist.new_group(members)
    if rank not in members:
        return {"non_member": sub == dist.GroupMember.NON_GROUP_MEMBER}
    reduced = torch.from_numpy(_ints(rank, COUNT).astype(np.float32))
    dist.all_reduce(reduced, group=sub)
    broadcast = torch.from_numpy(_ints(rank, COUNT, 1).astype(np.float32))
    dist.broadcast(broadcast, src=members[-1], group=sub)
    gathered = [torch.zeros(COUNT, dtype=torch.int64) for _ in members]
    dist.all_gather(gathered, torch.from_numpy(_ints(rank, COUNT, 2).astype(np.int64)), group=sub)
    return {"rank": dist.get_rank(sub), "size": dist.get_world_size(sub), "all_reduce": _numpy(reduced),
            "broadcast": _numpy(broadcast), "all_gather": [_numpy(t) for t in gathered]}


def _new_subgroups(rank, n):
    """Blocks of _subgroup_size(n) consecutive ranks, each reducing on its own."""
    import torch
    import torch.distributed as dist

    mine, _ = dist.new_subgroups(group_size=_subgroup_size(n))
    reduced = torch.from_numpy(_ints(rank, COUNT).astype(np.float64))
    dist.all_reduce(reduced, group=mine)
    return {"rank": dist.get_rank(mine), "size": dist.get_world_size(mine), "all_reduce": _numpy(reduced)}


#: Every call of `_every_call`, in the order the ranks run them; each result is filed under the name.
CALLS = [_all_reduce_every_dtype, _all_reduce_large, _non_contiguous, _requires_grad, _broadcast_every_root,
         _reduce_every_root, _all_gather, _all_gather_into_tensor, _reduce_scatter, _reduce_scatter_tensor,
         _all_to_all, _all_to_all_single, _gather_every_root, _scatter_every_root, _send_recv, _batch_isend_irecv,
         _object_collectives, _new_group, _new_subgroups]


def _every_call(rank, n, port, arrived):
    """One rank of the main launch: every call in CALLS, then the barrier, then destroy."""
    _, dist = _init(rank, n, port)
    results = {call.__name__: call(rank, n) for call in CALLS}
    results["_barrier"] = _barrier(rank, n, arrived)
    dist.destroy_process_group()
    results["pid"] = os.getpid()
    return results


def _errors_then_reinit(rank, n, port, second_port):
    """Calls shmcoll refuses, each followed by one that must still work; then destroy and a
    second init_process_group in the same process."""
    torch, dist = _init(rank, n, port)
    results = {"pid": os.getpid()}
    for op in ("BAND", "BOR", "BXOR"):
        t = torch.from_numpy(_ints(rank, COUNT).astype(np.int32))
        results[op] = attempt(functools.partial(dist.all_reduce, t, op=getattr(dist.ReduceOp, op)))
        results[op + " left"] = _numpy(t)
        dist.all_reduce(t)
        results[op + " then SUM"] = _numpy(t)
    flat = torch.zeros(n * COUNT + 1)
    results["all_gather_into_tensor"] = attempt(lambda: dist.all_gather_into_tensor(flat, torch.ones(COUNT)))
    results["reduce_scatter_tensor"] = attempt(
        lambda: dist.reduce_scatter_tensor(torch.zeros(COUNT), torch.ones(n * COUNT + 1)))
    results["all_to_all_single"] = attempt(lambda: dist.all_to_all_single(
        torch.zeros(n + 1), torch.ones(n + 1), output_split_sizes=[1] * n, input_split_sizes=[1] * n))
    after_errors = torch.from_numpy(_ints(rank, COUNT, 1).astype(np.float32))
    dist.all_reduce(after_errors)
    results["after errors"] = _numpy(after_errors)
    dist.destroy_process_group()
    results["initialized after destroy"] = dist.is_initialized()
    _init(rank, n, second_port)
    again = torch.from_numpy(_ints(rank, COUNT, 2).astype(np.float32))
    dist.all_reduce(again)
    results["second group"] = _numpy(again)
    dist.destroy_process_group()
    return results


def _large(rank: int, salt: int):
    """A float32 tensor of LARGE elements: its calls run on the backend's worker."""
    import torch

    return torch.from_numpy(_ints(rank, LARGE, salt).astype(np.float32))


def _in_flight(rank, n, keep_inputs: bool):
    """Six large calls in flight at once, waited last first. Unless `keep_inputs`, the caller holds
    no reference to their inputs (made in the call, as `dist.all_gather_into_tensor(out, x * 2,
    async_op=True)` does): only the Work can keep them alive until the call has read them."""
    import torch
    import torch.distributed as dist

    share = LARGE // n
    inputs = {"all_gather_into_tensor": _large(rank, 4), "reduce_scatter_tensor": _large(rank, 5)[:n * share],
              "all_to_all_single": _large(rank, 6)[:n * share],
              "reduce_scatter": [_large(rank, 7 + dst)[:share] for dst in range(n)]}
    reduced, broadcast = _large(rank, 2), _large(rank, 3)
    outputs = {"all_reduce": reduced, "broadcast": broadcast, "all_gather_into_tensor": torch.zeros(n * LARGE),
               "reduce_scatter_tensor": torch.zeros(share), "all_to_all_single": torch.zeros(n * share),
               "reduce_scatter": torch.zeros(share)}
    kept = list(inputs.values()) if keep_inputs else []  # the caller's own references, or none
    works = [dist.all_reduce(reduced, async_op=True), dist.broadcast(broadcast, src=n - 1, async_op=True)]
    for call in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "reduce_scatter"):
        works.append(getattr(dist, call)(outputs[call], inputs.pop(call), async_op=True))
    waits = [w.wait() for w in reversed(works)]
    del kept  # held until every call finished
    return {call: _numpy(t) for call, t in outputs.items()}, waits


def _async_work(rank, n, port):
    """async_op=True: Work.wait/is_completed, futures (value, then), several calls in flight waited in
    reverse order, and an irecv that nobody can have answered yet."""
    torch, dist = _init(rank, n, port)
    results = {}

    def large(salt):
        return _large(rank, salt)

    waited = large(0)
    work = dist.all_reduce(waited, async_op=True)
    results["is_work"] = isinstance(work, dist.Work)
    results["wait"] = work.wait()
    results["completed after wait"] = work.is_completed()
    results["waited"] = _numpy(waited)

    via_future = large(1)
    future = dist.all_reduce(via_future, op=dist.ReduceOp.MAX, async_op=True).get_future()
    value = future.wait()
    results["future value"] = [_numpy(t) for t in value]
    results["future value is the tensor"] = value[0].data_ptr() == via_future.data_ptr()
    results["future value()"] = _numpy(future.value()[0])
    results["future done"] = future.done()
    results["then"] = future.then(lambda f: float(f.value()[0].double().sum())).wait()

    results["in flight"], results["in flight waits"] = _in_flight(rank, n, keep_inputs=True)

    first, behind = large(10), large(11)
    pending = dist.all_reduce(first, async_op=True)
    dist.all_reduce(behind)  # waited for by its caller, yet queued behind `first`
    results["blocking call returned after the queued one"] = pending.is_completed()
    pending.wait()
    results["queued, blocking"] = [_numpy(first), _numpy(behind)]

    small = torch.from_numpy(_ints(rank, COUNT).astype(np.float64))
    small_work = dist.all_reduce(small, async_op=True)
    results["small wait"] = small_work.wait()
    results["small completed"] = small_work.is_completed()
    results["small future"] = _numpy(small_work.get_future().wait()[0])

    waited_by_caller = torch.from_numpy(_ints(rank, COUNT).astype(np.float64))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # what torch's own functions pass when async_op=False
    results["sync call returns None"] = dist.group.WORLD.allreduce([waited_by_caller], opts) is None
    results["sync call result"] = _numpy(waited_by_caller)

    after, before = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(COUNT, dtype=torch.float64)
    receiving = dist.irecv(got, src=before, tag=9)
    results["irecv completed before any send"] = receiving.is_completed()
    dist.barrier()  # every rank has looked before any rank sends
    dist.send(torch.from_numpy(_message(rank, after)), dst=after, tag=9)
    results["irecv wait"] = receiving.wait()
    results["irecv completed"] = receiving.is_completed()
    results["irecv got"] = _numpy(got)
    dist.destroy_process_group()
    results["pid"] = os.getpid()
    return results


def _async_inputs_dropped(rank, n, port):
    """_in_flight with the caller keeping no input (a crash here must not take the other async tests)."""
    _, dist = _init(rank, n, port)
    results = _in_flight(rank, n, keep_inputs=False)
    dist.destroy_process_group()
    return results


# ---------------------------------------------------------------------------------------------
# launches, once each (the tests share them)
# ---------------------------------------------------------------------------------------------

_LAUNCHED: dict[tuple, tuple[object, BaseException | None]] = {}


def _once(key: tuple, launch):
    """launch()'s result the first time `key` is asked for, the same result (or failure) later: a
    broken call fails its tests at once instead of launching the ranks again for each of them."""
    if key not in _LAUNCHED:
        try:
            _LAUNCHED[key] = (launch(), None)
        except Exception as exc:  # replayed to every test that shares this launch
            _LAUNCHED[key] = (None, exc)
    results, failure = _LAUNCHED[key]
    if failure is not None:
        raise AssertionError(f"the launch {key} failed:\n{failure}") from failure
    return results


def _results(transport: str, n: int, call: str) -> list:
    """Each rank's result of `call` in the main launch for (transport, n)."""
    _torch()
    ranks = _once(("every call", transport, n), lambda: run_ranks(n, _every_call, CTX.Value("i", 0), init=False))
    return [r[call] for r in ranks]


def _errors(transport: str) -> list[dict]:
    """Each rank's _errors_then_reinit on 2 ranks (the second init at another port)."""
    _torch()
    return _once(("errors", transport), lambda: run_ranks(2, _errors_then_reinit, free_port(), init=False))


ASYNC_N = 3


def _async_dropped(transport: str) -> list:
    """Each rank's _async_inputs_dropped on ASYNC_N ranks."""
    _torch()
    return _once(("async, inputs dropped", transport), lambda: run_ranks(ASYNC_N, _async_inputs_dropped, init=False))


def _async(transport: str) -> list[dict]:
    """Each rank's _async_work on ASYNC_N ranks: an odd size, so no split is even by accident."""
    _torch()
    return _once(("async", transport), lambda: run_ranks(ASYNC_N, _async_work, init=False))


# ---------------------------------------------------------------------------------------------
# expected values
# ---------------------------------------------------------------------------------------------

def _exact_reduce(op: str, stack: np.ndarray):
    """op over the ranks (axis 0) of exact values (Python integers or float64); AVG is SUM / n."""
    if op == "AVG":
        return stack.astype(np.float64).sum(axis=0) / len(stack)
    return {"SUM": stack.sum, "PRODUCT": stack.prod, "MIN": stack.min, "MAX": stack.max}[op](axis=0)


def _expected_all_reduce(n: int, dtype: str, op: str) -> np.ndarray:
    """What torch leaves after all_reduce: exact for floats (small integers), wrapped for integers,
    OR (SUM, MAX) or AND (PRODUCT, MIN) for bool."""
    exact = _exact_reduce(op, np.array([_reduce_input(r, dtype, op) for r in range(n)], dtype=object))
    if dtype == "bool":
        return exact != 0
    if dtype in INT_DTYPES:
        return _wrapped(exact, dtype)
    return exact.astype(np.float64)


def _floats(n: int, count: int, salt: int = 0) -> np.ndarray:
    """Every rank's _ints, stacked as float64."""
    return np.array([_ints(r, count, salt) for r in range(n)], dtype=np.float64)


def _grids(n: int, salt: int) -> np.ndarray:
    """Every rank's 4x6 grid of _non_contiguous."""
    return _floats(n, 24, salt).reshape(n, 4, 6)


# ---------------------------------------------------------------------------------------------
# the main launch's calls, one test each
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_every_op(transport, n, dtype):
    """Exact for floats (AVG within two ulps), wrapped for integers, OR/AND for bool."""
    for rank, results in enumerate(_results(transport, n, "_all_reduce_every_dtype")):
        for op in _ops_of(dtype):
            got, want = results[dtype, op], _expected_all_reduce(n, dtype, op)
            where = f"rank {rank}: all_reduce {op} of {dtype}"
            if op == "AVG":
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=AVG_RTOL[dtype], atol=0, err_msg=where)
            else:
                assert got.dtype == want.dtype or dtype in FLOAT_DTYPES, where
                np.testing.assert_array_equal(got, want, err_msg=where)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_reduce_large_on_the_worker(transport, n):
    want = _floats(n, LARGE).sum(axis=0)
    for got in _results(transport, n, "_all_reduce_large"):
        np.testing.assert_array_equal(got, want)


def _expected_non_contiguous(call: str, n: int, rank: int):
    """What _non_contiguous's `call` leaves on `rank`: only the viewed elements of an output change."""
    grids = {salt: _grids(n, salt) for salt in (0, 1, 2, 3, 4, *range(5, 5 + n), *range(10, 10 + n))}
    if call == "all_reduce":
        want = grids[0][rank]
        want.T[1:4] = grids[0].sum(axis=0).T[1:4]
    elif call == "broadcast":
        want = grids[1][rank]
        want.T[::2] = grids[1][n - 1].T[::2]
    elif call == "reduce":
        want = grids[2][rank]
        if rank == 0:
            want.T[1:4] = grids[2].sum(axis=0).T[1:4]
    elif call == "all_gather":
        want = [grids[3][src].T[1:4] for src in range(n)]
    elif call == "gather":
        want = [grids[4][src].T[1:4] for src in range(n)] if rank == 0 else None
    elif call == "scatter":
        want = grids[5 + rank][n - 1].T[1:4]
    else:
        want = grids[10 + rank].sum(axis=0).T[1:4]
    return want


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                                  "reduce_scatter"])
def test_non_contiguous(transport, n, call):
    for rank, got in enumerate(_results(transport, n, "_non_contiguous")):
        want = _expected_non_contiguous(call, n, rank)
        if want is None:
            assert got[call] is None
        else:
            np.testing.assert_array_equal(np.array(got[call]), np.array(want), err_msg=f"rank {rank}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_requires_grad_accepted_and_written_through(transport, n):
    for got in _results(transport, n, "_requires_grad"):
        np.testing.assert_array_equal(got["all_reduce"], _floats(n, COUNT, 0).sum(axis=0))
        np.testing.assert_array_equal(got["broadcast"], _ints(0, COUNT, 1))
        for src, piece in enumerate(got["all_gather"]):
            np.testing.assert_array_equal(piece, _ints(src, COUNT, 2))
        assert got["still_requires_grad"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_from_every_root(transport, n):
    for rank, by_root in enumerate(_results(transport, n, "_broadcast_every_root")):
        for root, got in enumerate(by_root):
            assert got.dtype == np.int16
            np.testing.assert_array_equal(got, _ints(root, COUNT, root), err_msg=f"rank {rank}, root {root}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_to_every_root_leaves_others_unchanged(transport, n):
    for rank, by_root in enumerate(_results(transport, n, "_reduce_every_root")):
        for root, got in enumerate(by_root):
            want = _floats(n, COUNT, root).sum(axis=0) if rank == root else _ints(rank, COUNT, root)
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, root {root}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather(transport, n):
    for got in _results(transport, n, "_all_gather"):
        assert len(got) == n
        for src, piece in enumerate(got):
            assert piece.dtype == np.float16
            np.testing.assert_array_equal(piece, _ints(src, COUNT))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather_into_tensor_flat_and_stacked(transport, n):
    for got in _results(transport, n, "_all_gather_into_tensor"):
        np.testing.assert_array_equal(got["flat"], np.concatenate([_ints(src, COUNT) for src in range(n)]))
        np.testing.assert_array_equal(got["stacked"], _floats(n, COUNT, 1))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter(transport, n):
    for rank, got in enumerate(_results(transport, n, "_reduce_scatter")):
        np.testing.assert_array_equal(got, _floats(n, COUNT, rank).sum(axis=0))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_reduce_scatter_tensor_max(transport, n):
    for rank, got in enumerate(_results(transport, n, "_reduce_scatter_tensor")):
        np.testing.assert_array_equal(got, _floats(n, n * COUNT).max(axis=0)[rank * COUNT:(rank + 1) * COUNT])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_blocks_of_different_lengths(transport, n):
    for rank, got in enumerate(_results(transport, n, "_all_to_all")):
        assert len(got) == n
        for src, piece in enumerate(got):
            np.testing.assert_array_equal(piece, _message(src, rank)[:src + rank + 1], err_msg=f"{src} -> {rank}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_single_equal_and_uneven_splits(transport, n):
    splits = _uneven_splits(n)
    for rank, got in enumerate(_results(transport, n, "_all_to_all_single")):
        sent = [_ints(src, n * COUNT) + 10 * src for src in range(n)]
        np.testing.assert_array_equal(got["equal"], np.concatenate([s[rank * COUNT:(rank + 1) * COUNT] for s in sent]))
        want = np.concatenate([_rows(src, rank, splits[src][rank]) for src in range(n)])
        np.testing.assert_array_equal(got["uneven"], want)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gather_to_every_root(transport, n):
    for rank, by_root in enumerate(_results(transport, n, "_gather_every_root")):
        for root, got in enumerate(by_root):
            if rank != root:
                assert got is None
                continue
            assert len(got) == n
            for src, piece in enumerate(got):
                np.testing.assert_array_equal(piece, _ints(src, COUNT, root), err_msg=f"root {root}, from {src}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_scatter_from_every_root(transport, n):
    for rank, by_root in enumerate(_results(transport, n, "_scatter_every_root")):
        for root, got in enumerate(by_root):
            np.testing.assert_array_equal(got, _ints(rank, COUNT, root), err_msg=f"rank {rank}, root {root}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_barrier_waits_for_every_rank(transport, n):
    """Every rank counted itself in before its barrier, so after it every rank sees all n."""
    assert _results(transport, n, "_barrier") == [n] * n


@pytest.mark.parametrize("n", P2P_SIZES)
def test_send_recv_isend_irecv(transport, n):
    """Each message came from the rank before, through the right call and tag."""
    for rank, got in enumerate(_results(transport, n, "_send_recv")):
        before = (rank - 1) % n
        for name, salt in (("blocking", 0), ("posted", 1), ("async", 2), ("tag1", 11), ("tag2", 12)):
            np.testing.assert_array_equal(got[name], _message(before, rank, salt), err_msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("n", P2P_SIZES)
def test_batch_isend_irecv_both_ways_round_the_ring(transport, n):
    for rank, got in enumerate(_results(transport, n, "_batch_isend_irecv")):
        before, after = (rank - 1) % n, (rank + 1) % n
        np.testing.assert_array_equal(got["from_before"], _message(before, rank, 0))
        np.testing.assert_array_equal(got["from_after"], _message(after, rank, 1))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_object_collectives(transport, n):
    for rank, got in enumerate(_results(transport, n, "_object_collectives")):
        assert got["broadcast"] == [[_object(root, root), "r" * root] for root in range(n)]
        assert got["all_gather"] == [_object(src, 1) for src in range(n)]
        assert got["gather"] == ([_object(src, 2) for src in range(n)] if rank == n - 1 else None)
        assert got["scatter"] == _object(rank, 3)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_new_group_results_only_over_members(transport, n):
    """Members reduce over the members only; non-members get no group."""
    members = _members(n)
    for rank, got in enumerate(_results(transport, n, "_new_group")):
        if rank not in members:
            assert got == {"non_member": True}
            continue
        assert (got["rank"], got["size"]) == (members.index(rank), len(members))
        np.testing.assert_array_equal(got["all_reduce"], _floats(n, COUNT)[members].sum(axis=0))
        np.testing.assert_array_equal(got["broadcast"], _ints(members[-1], COUNT, 1))
        for piece, src in zip(got["all_gather"], members, strict=True):
            np.testing.assert_array_equal(piece, _ints(src, COUNT, 2))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_new_subgroups(transport, n):
    size = _subgroup_size(n)
    for rank, got in enumerate(_results(transport, n, "_new_subgroups")):
        block = list(range(rank // size * size, (rank // size + 1) * size))
        assert (got["rank"], got["size"]) == (rank % size, size)
        np.testing.assert_array_equal(got["all_reduce"], _floats(n, COUNT)[block].sum(axis=0))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_destroy_leaves_no_shared_memory(transport, n):
    """The ranks exited without cleanup of their own (os._exit): only destroy_process_group released it."""
    pids = _results(transport, n, "pid")
    assert len(set(pids)) == n
    assert shm_names_of(pids) == []


# ---------------------------------------------------------------------------------------------
# errors, and a second group after destroy_process_group (2 ranks)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["BAND", "BOR", "BXOR"])
def test_unsupported_op_raises_at_the_call_and_group_stays_usable(transport, op):
    for rank, got in enumerate(_errors(transport)):
        assert got[op]["invalid"], f"rank {rank}: {op} gave {got[op]['kind']}: {got[op]['msg']}"
        np.testing.assert_array_equal(got[op + " left"], _ints(rank, COUNT))
        np.testing.assert_array_equal(got[op + " then SUM"], _floats(2, COUNT).sum(axis=0))


@pytest.mark.parametrize("call", ["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"])
def test_wrong_sizes_raise_invalid_argument(transport, call):
    for rank, got in enumerate(_errors(transport)):
        assert got[call]["invalid"], f"rank {rank}: {call} gave {got[call]['kind']}: {got[call]['msg']}"
        np.testing.assert_array_equal(got["after errors"], _floats(2, COUNT, 1).sum(axis=0))


def test_second_init_after_destroy(transport):
    results = _errors(transport)
    for got in results:
        assert got["initialized after destroy"] is False
        np.testing.assert_array_equal(got["second group"], _floats(2, COUNT, 2).sum(axis=0))
    assert shm_names_of([got["pid"] for got in results]) == []


# ---------------------------------------------------------------------------------------------
# async_op=True: Work and futures (3 ranks)
# ---------------------------------------------------------------------------------------------

def test_async_work_wait_and_is_completed(transport):
    for got in _async(transport):
        assert got["is_work"] and got["wait"] is True and got["completed after wait"] is True
        np.testing.assert_array_equal(got["waited"], _floats(ASYNC_N, LARGE).sum(axis=0))


def test_async_future_value_and_then(transport):
    want = _floats(ASYNC_N, LARGE, 1).max(axis=0)
    for got in _async(transport):
        assert len(got["future value"]) == 1 and got["future value is the tensor"]
        np.testing.assert_array_equal(got["future value"][0], want)
        np.testing.assert_array_equal(got["future value()"], want)
        assert got["future done"] is True
        assert got["then"] == want.sum()


def _expected_in_flight(call: str, rank: int) -> np.ndarray:
    """What _async_work's call `call` (one of several in flight) leaves on `rank`."""
    n, share = ASYNC_N, LARGE // ASYNC_N
    mine = slice(rank * share, (rank + 1) * share)
    if call == "all_reduce":
        return _floats(n, LARGE, 2).sum(axis=0)
    if call == "broadcast":
        return _ints(n - 1, LARGE, 3)
    if call == "all_gather_into_tensor":
        return _floats(n, LARGE, 4).reshape(-1)
    if call == "reduce_scatter_tensor":
        return _floats(n, LARGE, 5).sum(axis=0)[mine]
    if call == "reduce_scatter":
        return _floats(n, LARGE, 7 + rank).sum(axis=0)[:share]
    return np.concatenate([_ints(src, LARGE, 6)[mine] for src in range(n)])


def test_async_calls_in_flight_all_waited(transport):
    for got in _async(transport):
        assert got["in flight waits"] == [True] * len(IN_FLIGHT)


IN_FLIGHT = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
             "reduce_scatter"]


@pytest.mark.parametrize("call", IN_FLIGHT)
def test_async_calls_in_flight_waited_in_reverse(transport, call):
    for rank, got in enumerate(_async(transport)):
        np.testing.assert_array_equal(got["in flight"][call], _expected_in_flight(call, rank), err_msg=f"rank {rank}")


@pytest.mark.parametrize("call", IN_FLIGHT)
def test_async_inputs_the_caller_drops_kept_alive_by_the_work(transport, call):
    for rank, (outputs, waits) in enumerate(_async_dropped(transport)):
        assert waits == [True] * len(IN_FLIGHT)
        np.testing.assert_array_equal(outputs[call], _expected_in_flight(call, rank), err_msg=f"rank {rank}")


def test_async_small_call(transport):
    want = _floats(ASYNC_N, COUNT).sum(axis=0)
    for got in _async(transport):
        assert got["small wait"] is True and got["small completed"] is True
        np.testing.assert_array_equal(got["small future"], want)


def test_a_blocking_call_waits_behind_the_async_ones_before_it(transport):
    for got in _async(transport):
        assert got["blocking call returned after the queued one"] is True
        for salt, value in zip((10, 11), got["queued, blocking"]):
            np.testing.assert_array_equal(value, _floats(ASYNC_N, LARGE, salt).sum(axis=0))


def test_a_small_call_the_caller_waits_for_returns_no_work(transport):
    """asyncOp=False: torch's functions take None for "already done", and the sum is in place."""
    want = _floats(ASYNC_N, COUNT).sum(axis=0)
    for got in _async(transport):
        assert got["sync call returns None"] is True
        np.testing.assert_array_equal(got["sync call result"], want)


def test_async_leaves_no_shared_memory(transport):
    pids = [got["pid"] for got in _async(transport)]
    assert len(set(pids)) == ASYNC_N
    assert shm_names_of(pids) == []


def test_irecv_pending_until_sent(transport):
    """Nobody had sent when the rank looked, so the irecv could not be complete yet."""
    for rank, got in enumerate(_async(transport)):
        assert got["irecv completed before any send"] is False
        assert got["irecv wait"] is True and got["irecv completed"] is True
        np.testing.assert_array_equal(got["irecv got"], _message((rank - 1) % ASYNC_N, rank))
