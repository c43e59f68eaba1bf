"""Every timing bound the tests use, defined once and scaled from one place.

Each kind of bound is a name that says what it bounds, in seconds, multiplied by TIME_SCALE: a slow
or loaded machine stretches every bound and hang guard at once (SHMCOLL_TEST_TIME_SCALE=3 python -m
pytest). What a test measures (a group timeout under test, a deadline it passes, a lower bound such
as "not before the timeout") is the test's own input and is not scaled.
"""

from __future__ import annotations

import math
import os


def _time_scale() -> float:
    text = os.environ.get("SHMCOLL_TEST_TIME_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale >= 1):
        raise ValueError(f"SHMCOLL_TEST_TIME_SCALE={text!r}: give a number >= 1 (how much slower this machine is)")
    return scale


#: How much to stretch every bound below (SHMCOLL_TEST_TIME_SCALE, default 1).
TIME_SCALE = _time_scale()

# -- hang guards: past one, the test fails (with the stacks of hung ranks) instead of hanging
#: A whole test (pytest-timeout; conftest.py gives it to every test that names no other).
TEST_HANG_S = 120.0 * TIME_SCALE
#: One run of ranks (run_ranks' deadline) or one launched job, from start to exit.
RUN_HANG_S = 60.0 * TIME_SCALE
#: One wait for something that should come soon: an event, a thread, a spawned call's handle, a peer
#: process getting to some point. Well inside RUN_HANG_S.
WAIT_HANG_S = 30.0 * TIME_SCALE
#: A group timeout (or how long a blocked rank waits on its own) that a test must never see run out:
#: a rank that waits it out has outlived its run's hang guard, and fails the test.
NEVER_S = RUN_HANG_S

# -- how promptly ranks learn of trouble (measured in the ranks, from the fault or their own call)
#: A peer killed, stopped or gone, or a mismatched call, reaches every rank of the faulted call.
FAULT_NOTICE_S = 2.0 * TIME_SCALE
#: A mismatched call fails every rank, from its own call, where every transport and simulated host
#: layout is run (test_reduce_gather_scatter_all_to_all.py, test_hierarchy.py); test_failures.py holds
#: its mismatches, one per run, to FAULT_NOTICE_S.
MISMATCH_NOTICE_S = 5.0 * TIME_SCALE
#: The next call on a group that failed raises (saying it is broken) at once.
BROKEN_CALL_S = 0.5 * TIME_SCALE
#: close() returns, after a failure too.
CLOSE_S = 2.0 * TIME_SCALE
#: A rank holding the wrong SHMCOLL_SECRET is turned away at the rendezvous.
SECRET_REFUSAL_S = 1.0 * TIME_SCALE
#: A group or rendezvous timeout fires at most this long after it ran out.
TIMEOUT_LATE_S = 1.0 * TIME_SCALE
#: A start-up that cannot work (too little /dev/shm, shm across hosts) fails every rank, far sooner
#: than the group timeout.
SETUP_FAILURE_S = 10.0 * TIME_SCALE
#: Starting (or stopping, after a failure or a signal) a launched job of a few ranks, interpreter
#: start-ups included, on a loaded 2-core machine.
LAUNCH_S = 15.0 * TIME_SCALE
#: From the last hostile connection in place to every rank holding its group (test_hostile).
FORM_UNDER_ATTACK_S = 5.0 * TIME_SCALE
#: From opening a hostile connection to the job closing it (test_hostile).
HOSTILE_CLOSE_S = 10.0 * TIME_SCALE

# -- in one process: sockets, the gate, the store, the mailbox
#: The deadline (or socket timeout) of a call that should end on its own long before it: a handshake, a
#: store request, the thread running one.
CALL_DEADLINE_S = 5.0 * TIME_SCALE
#: A call with nothing left to wait for (its input ended, its peer is gone, its deadline already
#: passed, nobody is left) returns, or a genuine client is served, far before any deadline it has.
NO_WAIT_S = 1.0 * TIME_SCALE
#: A genuine client gets through (a mesh forms, the store answers) past a flood of hostile connections.
THROUGH_FLOOD_S = 3.0 * TIME_SCALE
#: The gate closes a connection it sheds (too many pending, close(), out of descriptors).
SHED_S = 3.0 * TIME_SCALE
#: The gate drops an unproven connection at most this long after its handshake budget ran out.
DROP_LATE_S = 1.5 * TIME_SCALE
#: A wait that ends at its deadline returns at most this long after it.
LATE_S = 2.5 * TIME_SCALE

# -- cleaning up
#: Every live rank of a scenario is done within this of the others (harness.finish_together).
FINISH_TOGETHER_S = 10.0 * TIME_SCALE
#: A process that was killed, or whose parent was, is gone (reaped, or finished by the kernel).
REAP_S = 5.0 * TIME_SCALE
