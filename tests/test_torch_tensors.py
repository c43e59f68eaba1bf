"""CPU torch tensors go through DLPack without copies: in-place results show in the tensor itself."""

from __future__ import annotations

import numpy as np
import pytest

from bounds import WAIT_HANG_S
from harness import run_ranks

# every test runs over tcp, shm and hier
pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("transport")]


def _torch():
    """torch, or a skip where it is not installed. Imported by the tests (their forked ranks inherit
    it), not at collection: the quick tier, which collects this file, does not pay for it."""
    return pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")


def _torch_calls(pg):
    import torch

    r = pg.rank
    grads = torch.arange(10, dtype=torch.float32) + r
    pg.all_reduce(grads)
    half = torch.full((4, 3), float(r + 1), dtype=torch.bfloat16)
    pg.all_reduce(half)
    weights = torch.zeros(6, dtype=torch.float64) if r else torch.linspace(0, 1, 6, dtype=torch.float64)
    pg.broadcast(0, weights)
    spawned = torch.ones(1000, dtype=torch.float16)
    handle = pg.spawn_all_reduce(spawned)
    gathered = pg.all_gather(torch.tensor([r, r], dtype=torch.int64))
    handle.join(timeout=WAIT_HANG_S)
    return (grads.numpy().copy(), half.float().numpy().copy(), weights.numpy().copy(), spawned.float().numpy().copy(),
            gathered)


@pytest.mark.parametrize("n", [1, 3])
def test_torch_tensors_reduce_in_place(n):
    torch = _torch()
    for grads, half, weights, spawned, gathered in run_ranks(n, _torch_calls):
        np.testing.assert_array_equal(grads, sum(np.arange(10) + r for r in range(n)))
        np.testing.assert_array_equal(half, np.full((4, 3), sum(range(1, n + 1))))
        np.testing.assert_array_equal(weights, torch.linspace(0, 1, 6, dtype=torch.float64).numpy())
        np.testing.assert_array_equal(spawned, np.full(1000, n))
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n), 2))


def _torch_reduce_gather_scatter_calls(pg):
    """reduce, reduce_scatter, all_to_all, gather and all_gather_v take tensors too: reduce in place through
    the tensor, the others return numpy arrays of the tensor's dtype (bfloat16 included)."""
    import torch

    n, r = pg.world_size, pg.rank
    red = torch.full((3, 2), float(r + 1), dtype=torch.bfloat16)
    pg.reduce(0, red)
    scattered = pg.reduce_scatter(torch.arange(2 * n, dtype=torch.float32) * (r + 1))
    swapped = pg.all_to_all(torch.tensor([10 * r + j for j in range(n)], dtype=torch.int64))
    gathered = pg.gather(n - 1, torch.tensor([r], dtype=torch.float16))
    out, lengths = pg.all_gather_v(torch.full((r,), r, dtype=torch.int32))
    return (red.float().numpy().copy() if r == 0 else None, scattered, swapped, gathered, out, lengths)


@pytest.mark.parametrize("n", [1, 3])
def test_torch_tensors_through_reduce_gather_scatter_all_to_all(n):
    _torch()
    results = run_ranks(n, _torch_reduce_gather_scatter_calls)
    for r, (red, scattered, swapped, gathered, out, lengths) in enumerate(results):
        if r == 0:
            np.testing.assert_array_equal(red, np.full((3, 2), n * (n + 1) / 2))
        assert scattered.dtype == np.float32
        np.testing.assert_array_equal(scattered, np.array([2 * r, 2 * r + 1]) * n * (n + 1) / 2)
        assert swapped.tolist() == [10 * q + r for q in range(n)]
        assert (gathered is None) == (r != n - 1)
        assert gathered is None or (gathered.dtype == np.float16 and gathered.tolist() == list(range(n)))
        assert lengths == list(range(n)) and out.tolist() == [q for q in range(n) for _ in range(q)]
