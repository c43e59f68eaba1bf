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


#: "hier" simulates two hosts (ranks split in halves, see harness.HOST_LAYOUTS) on this machine.
TRANSPORTS = ["tcp", "shm", "hier"]
#: The hierarchy over every simulated host layout: uneven, one rank per host, interleaved.
LAYOUTS = TRANSPORTS + ["hier:first-alone", "hier:each", "hier:interleaved"]


def _use(monkeypatch, name: str) -> str:
    """Forked ranks inherit SHMCOLL_TRANSPORT (init() reads it) and SHMCOLL_TEST_HOSTS (the harness)."""
    kind, _, layout = name.partition(":")
    monkeypatch.setenv("SHMCOLL_TRANSPORT", kind)
    if kind == "hier":
        monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout or "halves")
    return kind


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """Run the test once per transport."""
    return _use(monkeypatch, request.param)


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    """Run the test once per transport and once per simulated multi-host layout."""
    return _use(monkeypatch, request.param)
