"""Ranks of one job running different installs (hosts not upgraded together): every rank fails at
init with one CollectiveMismatch naming the ranks and both releases, before a segment or a
connection exists. A rank runs "another install" by changing, in its own forked process, the
version or the frame format that bootstrap.release() reports."""

from __future__ import annotations

import os

import pytest

import shmcoll
import shmcoll.bootstrap
import shmcoll.transport.frame

from bounds import SETUP_FAILURE_S
from harness import ShmCreations, attempt, run_ranks, shm_creator

pytestmark = pytest.mark.multiprocess


def _other_version() -> None:
    shmcoll.__version__ = "0.0.1"


def _other_frame_format() -> None:
    shmcoll.transport.frame.VERSION += 1


def _init_as(rank, n, port, odd_rank, odd_install):
    if rank == odd_rank:
        odd_install()
    out = attempt(lambda: shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port,
                                       timeout=30.0))
    return out | {"release": shmcoll.bootstrap.release(), "pid": os.getpid()}


@pytest.mark.parametrize("odd_install, differs", [(_other_version, "shmcoll 0.0.1"),
                                                  (_other_frame_format, "frame format 2")],
                         ids=["version", "frame-format"])
def test_ranks_with_different_installs_fail_at_init(transport, odd_install, differs):
    n, odd = 3, 1
    watch = ShmCreations()
    outs = run_ranks(n, _init_as, odd, odd_install, init=False)
    usual = outs[0]["release"]
    assert outs[odd]["release"] != usual and differs in outs[odd]["release"]
    for out in outs:
        assert out["kind"] == "CollectiveMismatch", out
        assert f"ranks [0, 2] run {usual}" in out["msg"] and f"ranks [1] run {outs[odd]['release']}" in out["msg"], out
        assert out["call_s"] < SETUP_FAILURE_S, out
    made = [name for name in watch.read() if shm_creator(name) in {str(out["pid"]) for out in outs}]
    assert made == []  # no segment and no semaphore was ever created
