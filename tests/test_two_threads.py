"""Two threads calling collectives on one group at once (a user error): the second is refused with
InvalidArgument before it takes a sequence number, the first completes correctly, and the group
goes on. Ranks match calls by call order, so letting both run would pair one thread's data with
another's call on a peer."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import shmcoll

from bounds import WAIT_HANG_S
from harness import CTX, run_ranks, wait_until

pytestmark = pytest.mark.multiprocess

COUNT = 1 << 18  # a ring-sized all_reduce for the call in flight; the refused calls are board-sized


def _second_thread_is_refused(pg, peer_may_start):
    out = {}
    first = np.full(COUNT, pg.rank + 1.0, np.float32)
    if pg.rank == 0:
        inside = threading.Thread(target=pg.all_reduce, args=(first,), daemon=True)
        inside.start()  # blocks until rank 1 joins the call
        wait_until(lambda: pg._runner._calling.locked(), WAIT_HANG_S, "the first thread inside its all_reduce")
        out["refused"] = [_refusal(lambda: pg.all_reduce(np.ones(4, np.float32))),
                          _refusal(lambda: pg.spawn_all_reduce(np.ones(4, np.float32))),
                          _refusal(pg.barrier)]
        peer_may_start.set()
        inside.join(WAIT_HANG_S)
        out["first_done"] = not inside.is_alive()
    else:
        out["waited"] = peer_may_start.wait(WAIT_HANG_S)
        pg.all_reduce(first)
    out["first_ok"] = bool((first == 3.0).all())
    after = np.full(4, pg.rank + 1.0, np.float64)
    pg.all_reduce(after)  # the group is still whole: both ranks at the next sequence number
    out["after_ok"] = bool((after == 3.0).all())
    return out


def _refusal(call) -> str:
    try:
        call()
    except shmcoll.InvalidArgument as exc:
        return str(exc)
    return "not refused"


def test_a_second_thread_is_refused_and_the_group_goes_on(transport):
    outs = run_ranks(2, _second_thread_is_refused, CTX.Event())
    zero, one = outs
    assert len(zero["refused"]) == 3
    for message in zero["refused"]:
        assert "another thread is inside a collective" in message, message
    assert zero["first_done"] and one["waited"]
    assert zero["first_ok"] and one["first_ok"]
    assert zero["after_ok"] and one["after_ok"]
