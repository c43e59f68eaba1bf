"""CPU torch tensors go through DLPack without copies: in-place results show in the tensor itself."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (.ci/run installs it)")

from harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.usefixtures("transport")  # every test runs over tcp and over shm



def _torch_calls(pg):
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
    handle.join(timeout=30)
    return grads.numpy().copy(), half.float().numpy().copy(), weights.numpy().copy(), spawned.float().numpy().copy(), gathered


@pytest.mark.parametrize("n", [1, 3])
def test_torch_tensors_reduce_in_place(n):
    for grads, half, weights, spawned, gathered in run_ranks(n, _torch_calls):
        np.testing.assert_array_equal(grads, sum(np.arange(10) + r for r in range(n)))
        np.testing.assert_array_equal(half, np.full((4, 3), sum(range(1, n + 1))))
        np.testing.assert_array_equal(weights, torch.linspace(0, 1, 6, dtype=torch.float64).numpy())
        np.testing.assert_array_equal(spawned, np.full(1000, n))
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n), 2))
