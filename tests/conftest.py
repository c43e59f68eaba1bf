"""Shared fixtures: compiled kernels before ranks fork, and a check that nothing is left in /dev/shm."""

import os

import pytest

from shmcoll import kernels
from shmcoll.types import WIRE_TYPES, ReduceKind


@pytest.fixture(scope="session", autouse=True)
def warm_kernels():
    """Compile (or load from numba's cache) every kernel once, so forked ranks inherit them."""
    for code, wire in WIRE_TYPES.items():
        if wire.reducible:
            for op in ReduceKind:
                if wire.is_float or op is not ReduceKind.AVG:
                    kernels.warm_up(code, op)


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    """Nothing named after shmcoll may be left in /dev/shm when the suite ends."""
    before = {n for n in os.listdir("/dev/shm") if "shmcoll" in n} if os.path.isdir("/dev/shm") else set()
    yield
    if os.path.isdir("/dev/shm"):
        leaked = {n for n in os.listdir("/dev/shm") if "shmcoll" in n} - before
        assert not leaked, f"shared memory left in /dev/shm: {sorted(leaked)}"


TRANSPORTS = ["tcp", "shm"]


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """Run the test once per transport: forked ranks inherit SHMCOLL_TRANSPORT, which init() reads."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", request.param)
    return request.param
