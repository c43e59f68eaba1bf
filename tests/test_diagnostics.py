"""Diagnostics: a failed call's error says who was heard from and what completed before it (the
flight recorder), and SHMCOLL_DEBUG=1 logs every collective's start and end with its time."""

from __future__ import annotations

import re
import subprocess
import textwrap

import numpy as np
import pytest

from shmcoll.recorder import FlightRecorder, heard_from
from shmcoll.transport.frame import Meta
from shmcoll.types import Collective

from bounds import RUN_HANG_S, WAIT_HANG_S
from harness import CTX, attempt, launcher_cmd, run_ranks, subprocess_env

SHORT = 2.0  # group timeout of the timeout scenario


def _history(pg):
    """Collectives #0 and #1, which every rank completes."""
    pg.all_reduce(np.ones(4, np.float32))
    pg.barrier()


def _one_rank_skips(pg, skipped):
    """Rank 2 never calls collective #2 (but stays alive until the others have failed)."""
    _history(pg)
    if pg.rank == 2:
        skipped.wait(timeout=WAIT_HANG_S)
        return None
    out = attempt(lambda: pg.all_reduce(np.ones(8, np.float64)))
    skipped.set()
    return out


@pytest.mark.multiprocess
def test_a_timeout_says_who_was_heard_from_and_what_completed(transport):
    results = run_ranks(3, _one_rank_skips, CTX.Event(), group_timeout=SHORT)
    for rank in (0, 1):
        out = results[rank]
        assert out["kind"] == "CollectiveTimeout", out
        msg = out["msg"]
        assert "all_reduce (sequence number 2)" in msg, msg
        heard = re.search(r"ranks heard from during this call: \[([0-9, ]*)\]", msg)
        assert heard is not None, msg
        assert "2" in heard.group(1).split(", "), msg  # alive (heartbeats, a live pid) though silent
        assert re.search(rf"last collectives completed on rank {rank}: #0 all_reduce\(dtype=f32, count=4, "
                         r"op=SUM, root=0\) in \d+(\.\d+)? [um]s, #1 barrier\(", msg), msg


def _disagree_on_op(pg):
    _history(pg)
    op = "MAX" if pg.rank == 1 else "SUM"
    import shmcoll

    return attempt(lambda: pg.all_reduce(np.ones(4, np.float32), getattr(shmcoll.ReduceKind, op)))


@pytest.mark.multiprocess
def test_a_mismatch_names_both_calls_and_the_history(transport):
    results = run_ranks(2, _disagree_on_op)
    for rank, out in enumerate(results):
        assert out["kind"] == "CollectiveMismatch", out
        assert "op=MAX" in out["msg"] and "op=SUM" in out["msg"], out["msg"]
        assert f"last collectives completed on rank {rank}: #0 all_reduce" in out["msg"], out["msg"]


def test_the_recorder_keeps_the_last_few_in_order():
    rec = FlightRecorder(size=2)
    assert rec.recent() == "none"
    for seq, coll in enumerate((Collective.ALL_REDUCE, Collective.BARRIER, Collective.ALL_REDUCE)):
        rec.completed(Meta(seq=seq, coll=coll, dtype=3, elements=seq), 2e-6 * (seq + 1))
    assert re.fullmatch(r"#1 barrier\(.*\) in 4 us, #2 all_reduce\(.*count=2.*\) in 6 us", rec.recent())


def test_heard_from_leaves_out_this_rank_and_the_silent():
    assert heard_from([5.0, 9.0, 1.0, 7.0], me=3, since=4.0) == [0, 1]


DEBUG_PROGRAM = textwrap.dedent("""
    import numpy as np, shmcoll
    with shmcoll.init() as pg:
        pg.all_reduce(np.ones(4, np.float32))
        pg.barrier()
        pg.broadcast(0, np.ones(3, np.float64))
""")


def _launch(prog, **env: str) -> subprocess.CompletedProcess:
    """The program on 2 ranks under shmcoll-run, with `env` on top of a clean environment."""
    return subprocess.run(launcher_cmd("-n", "2", "--timeout", str(WAIT_HANG_S), str(prog)),
                          env={**subprocess_env(), **env}, capture_output=True, text=True, timeout=RUN_HANG_S)


@pytest.mark.multiprocess
def test_debug_logs_each_collective_start_and_end_with_its_time(tmp_path, transport):
    prog = tmp_path / "prog.py"
    prog.write_text(DEBUG_PROGRAM)
    run = _launch(prog, SHMCOLL_DEBUG="1", SHMCOLL_TRANSPORT=transport)
    assert run.returncode == 0, run.stderr
    for rank in (0, 1):
        for seq, name, count in ((0, "all_reduce", 4), (1, "barrier", 0), (2, "broadcast", 3)):
            start = f"[shmcoll rank {rank}] start {name} seq={seq} count={count}"
            assert start in run.stderr, run.stderr
            assert re.search(re.escape(f"[shmcoll rank {rank}] end {name} seq={seq} count={count} in ") + r"\d+\.\d us",
                             run.stderr), run.stderr


@pytest.mark.multiprocess
def test_no_debug_output_by_default(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(DEBUG_PROGRAM)
    run = _launch(prog)
    assert run.returncode == 0, run.stderr
    assert "[shmcoll rank" not in run.stderr
