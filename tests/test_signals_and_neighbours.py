"""Signals and neighbours, in real processes: a rank interrupted (SIGINT) or terminated (SIGTERM)
inside a collective, Ctrl-C on a launched job, and two jobs on one host at once.

Faults are injected as test_failures.py does (its helpers are reused: `arm_signal` signals the victim just
before its k-th frame of a collective, `peers_inside` waits until peers are inside a call, ranks that
raised stay alive until every live rank is done). Group timeouts are long wherever waiting them out
must fail the test; every wait is bounded (bounds.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import numpy as np
import pytest

import shmcoll
import shmcoll.bootstrap

from bounds import (
    CLOSE_S,
    FAULT_NOTICE_S,
    LAUNCH_S,
    NEVER_S,
    NO_WAIT_S,
    REAP_S,
    SETUP_FAILURE_S,
    WAIT_HANG_S,
)
from faults import (
    BIG,
    CHUNKS,
    arm_signal,
    assert_broken,
    assert_survivors,
    call_after_failure,
    check_group_works,
    close_group,
    init_group,
    peers_inside,
    report_timing,
    run_tracked,
)
from harness import (
    CTX,
    REPO,
    Died,
    ShmCreations,
    assert_all_gone,
    attempt,
    finish_together,
    free_port,
    launcher_cmd,
    run_ranks,
    shm_creator,
    shm_names_of,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.multiprocess


# ---------------------------------------------------------------------------------------------
# 1. SIGINT / SIGTERM to one rank inside a collective
# ---------------------------------------------------------------------------------------------
# SIGINT raises KeyboardInterrupt in the victim: the library must let it through (the program decides
# what to do) and tell every peer that this rank is gone, as a PeerLost naming it. The victim here
# catches it and stays alive until the survivors are done (a program saving a checkpoint), so what
# they see comes from the library's abort, not from the process vanishing. SIGTERM (default action)
# ends the process: the survivors see a dead peer.

N, VICTIM = 4, 2  # over hier: hosts 0,1 + 2,3, the victim leads host b


def _interrupted(rank, n, port, victim, sig, where, stamps, ready, finish):
    pg = init_group(rank, n, port)  # group timeout NEVER_S: waiting it out fails the run
    check_group_works(pg, ready)  # collective 0, then every rank meets out of band
    data = np.full(BIG, float(rank), dtype=np.float32)
    call = (lambda: pg.all_reduce(data)) if where == "all_reduce" else pg.barrier
    if rank == victim:
        if where == "barrier":
            # the others wait in barrier number 1 for us: the rank that signals us first is inside
            # it, rank 3 on either transport (our host peer; over TCP our first pair, 2 ^ 1)
            stamps[n] = float(peers_inside(pg, [3], seq=1))
        arm_signal(pg, 5 if where == "all_reduce" else 1, sig, stamps)
        try:
            call()
            out = {"kind": "returned"}
        except KeyboardInterrupt:
            out = {"kind": "KeyboardInterrupt"}
        except BaseException as exc:
            out = {"kind": type(exc).__name__, "msg": str(exc)}
        out["broken"] = call_after_failure(pg)
        out["finished_together"] = finish_together(finish)
        out.update(close_group(pg))
        return out
    out = attempt(call)
    out["fault_s"] = out["end"] - stamps[victim]
    out["broken"] = call_after_failure(pg)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


@pytest.mark.parametrize("where", ["all_reduce", "barrier"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_a_rank_inside_a_collective_is_a_lost_peer(sig, where, transport, aftermath):
    stamps = CTX.RawArray("d", N + 1)  # the victim's signal time, and whether the others were inside first
    stays = sig == signal.SIGINT  # the interrupted victim stays alive until the others are done
    results, pids = run_tracked(N, _interrupted, VICTIM, sig, where, stamps, CTX.Barrier(N),
                                CTX.Barrier(N if stays else N - 1), env=CHUNKS, may_die={VICTIM})
    victim = results[VICTIM]
    outs = {r: out for r, out in enumerate(results) if r != VICTIM}
    report_timing(f"{signal.Signals(sig).name} {where} n={N} victim={VICTIM}", outs)
    if where == "barrier":
        assert stamps[N] == 1.0, "the victim was signalled before the others were inside the barrier"
    if stays:
        # Ctrl-C is the program's to handle: raised as KeyboardInterrupt, never swallowed or converted
        assert victim["kind"] == "KeyboardInterrupt", victim
        assert_broken(victim, victim["broken"]["kind"])
        assert victim["broken"]["collective_error"], victim
        assert victim["finished_together"], victim
    else:
        assert victim == Died(-sig), victim
    got = "\n".join(f"rank {r}: {out['kind']} (peer={out['peer']}): {out['msg']}" for r, out in outs.items())
    assert all(out["kind"] == "PeerLost" and out["peer"] == VICTIM for out in outs.values()), got
    assert_survivors(outs, VICTIM)
    aftermath.check(pids)


# ---------------------------------------------------------------------------------------------
# 2. Ctrl-C on `shmcoll-run -n 3 python prog.py` while the ranks loop over collectives
# ---------------------------------------------------------------------------------------------
# tests/test_launcher.py covers SIGTERM to the launcher and SIGINT to the launcher with ranks that
# only block; here the ranks are inside real collectives (shared memory, chunked ring all_reduce and
# board barrier) with Python's default SIGINT handling, and the terminal's way is covered too: SIGINT
# to the launcher's whole process group.

LOOPING = f'''
import numpy as np, shmcoll
started()
x = np.empty(1 << 18, dtype=np.float32)  # 1 MiB: a chunked ring over shared memory
try:
    with shmcoll.init(timeout={NEVER_S!r}) as pg:
        end, i = time.monotonic() + {NEVER_S!r}, 0
        while time.monotonic() < end:
            x.fill(RANK + i)
            pg.all_reduce(x)
            if x[0] != WORLD * i + WORLD * (WORLD - 1) / 2:
                note(f"rank{{RANK}}.wrong", str(x[0]))
            pg.barrier()
            i += 1
            if i == 3:
                note(f"rank{{RANK}}.looping", "1")
        note(f"rank{{RANK}}.survived", "1")
except BaseException as exc:
    while True:  # the rank's own SIGINT may come on top of a peer's abort: the note is written anyway
        try:
            note(f"rank{{RANK}}.ended", type(exc).__name__)
            break
        except KeyboardInterrupt:
            pass
    raise
'''


@pytest.mark.parametrize("to", ["process-group", "launcher"])
def test_ctrl_c_stops_a_job_inside_collectives_and_leaves_nothing(to, job):
    prog = job.program(LOOPING)
    env = {**subprocess_env(), "SHMCOLL_CHUNK_BYTES": str(64 << 10)}
    watch = ShmCreations()
    # its own session, as a job started from a terminal is the foreground group (this test is not in it)
    launcher = subprocess.Popen(launcher_cmd("-n", "3", prog, str(job.dir)), cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        job.wait_started(3)
        wait_until(lambda: len(list(job.dir.glob("rank*.looping"))) == 3 or launcher.poll() is not None,
                   LAUNCH_S, "every rank to loop over collectives")
        assert launcher.poll() is None, launcher.communicate(timeout=REAP_S)
        t0 = time.monotonic()
        if to == "process-group":
            os.killpg(launcher.pid, signal.SIGINT)
        else:
            launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=LAUNCH_S)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=REAP_S)
        created = watch.read()
        watch.close()
    pids = job.pids()
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert took < LAUNCH_S, took
    assert "SIGINT" in err, err
    assert_all_gone(pids)
    # every rank ended by itself, from the Ctrl-C (not SIGKILLed after the launcher's grace period)
    ended = {p.name: p.read_text() for p in job.dir.glob("rank*.ended")}
    assert sorted(ended) == [f"rank{r}.ended" for r in range(3)], (ended, err)
    assert all(kind in ("KeyboardInterrupt", "PeerLost", "CollectiveError") for kind in ended.values()), ended
    assert not list(job.dir.glob("*.survived")) and not list(job.dir.glob("*.wrong"))
    ours = [name for name in created if shm_creator(name) in {str(p) for p in pids}]
    assert any(n.endswith("-mem") for n in ours), f"the job created no shared memory: {created}"
    assert shm_names_of(pids) == [], "shared memory of the job left in /dev/shm"
    assert not [n for n in ours if os.path.exists(f"/dev/shm/{n}")]


# ---------------------------------------------------------------------------------------------
# 3. Two jobs on one host at once
# ---------------------------------------------------------------------------------------------

JOB = 3  # ranks per job
COUNT = 1 << 16  # float32 elements per all_reduce: a chunked ring over shared memory
KILL_AT, AFTER_KILL = 5, 20  # job A is killed once both jobs did KILL_AT calls; B then does AFTER_KILL more
A_LIMIT_S = WAIT_HANG_S  # job A loops at most this long (it is killed well before)


def _shm_mappings() -> list[str]:
    """The shmcoll segments and semaphores this process has mapped (unlinked ones included)."""
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if p.startswith("/dev/shm/") and "shmcoll-" in p)


def _tcp_ports() -> list[int]:
    """Local ports of this process's TCP sockets (listening or connected)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _expected(i: int, n: int) -> float:
    return float(n * i + n * (n - 1) / 2)


def _neighbour(rank, n, port, other_port, pids, progress, stamps, reports, finish):
    """Ranks 0..2 are job A (rendezvous on `port`), ranks 3..5 job B (on `other_port`). Both loop over
    all_reduce, checking every result; B's rank 0 SIGKILLs every rank of A mid-loop."""
    job, local = divmod(rank, JOB)
    pids[rank] = os.getpid()
    pg = init_group(local, JOB, port if job == 0 else other_port)
    reports.put((rank, _shm_mappings(), _tcp_ports(), pg.transport.name))
    data = np.empty(COUNT, dtype=np.float32)
    if job == 0:
        end, i = time.monotonic() + A_LIMIT_S, 0
        while time.monotonic() < end:
            data.fill(local + i)
            pg.all_reduce(data)
            assert np.all(data == _expected(i, JOB)), (i, data[:4])
            i += 1
            progress[rank] = i
        return {"kind": "job A was never killed"}
    wrong, slowest = 0, 0.0
    for i in range(KILL_AT + AFTER_KILL):
        if i == KILL_AT and local == 0:
            wait_until(lambda: min(progress[:JOB]) >= KILL_AT, WAIT_HANG_S, "job A to loop", interval=0.001)
            stamps[0] = time.monotonic()
            for victim in pids[:JOB]:
                os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        data.fill(local + i)
        pg.all_reduce(data)
        wrong += int(np.count_nonzero(data != _expected(i, JOB)))
        if i >= KILL_AT and stamps[0]:
            slowest = max(slowest, time.monotonic() - start)
        progress[rank] = i + 1
    out = {"kind": "finished", "wrong": wrong, "slowest_after_kill": slowest, "killed_at": stamps[0],
           "finished_together": finish_together(finish)}
    out.update(close_group(pg))
    return out


def test_two_jobs_share_nothing_and_one_survives_the_other_being_killed(monkeypatch, aftermath):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "shm")
    n = 2 * JOB
    pids, progress, stamps = CTX.RawArray("q", n), CTX.RawArray("q", n), CTX.RawArray("d", 1)
    reports = CTX.SimpleQueue()
    other_port = free_port()
    results = run_ranks(n, _neighbour, other_port, pids, progress, stamps, reports, CTX.Barrier(JOB),
                        init=False, env=CHUNKS, may_die=set(range(JOB)))
    seen = {}
    while not reports.empty():
        rank, maps, ports, kind = reports.get()
        seen[rank] = {"maps": maps, "ports": ports, "transport": kind}
    assert sorted(seen) == list(range(n)), seen
    a, b = range(JOB), range(JOB, n)
    for r in range(n):
        assert seen[r]["transport"] == "shm", seen[r]
    # each job maps one segment and its semaphores, all named after its own leader, none of the other's
    maps_a, maps_b = (set().union(*(seen[r]["maps"] for r in job)) for job in (a, b))
    assert maps_a and maps_b, seen
    assert all(f"/shmcoll-{pids[0]}-" in p or f"/sem.shmcoll-{pids[0]}-" in p for p in maps_a), maps_a
    assert all(f"/shmcoll-{pids[JOB]}-" in p or f"/sem.shmcoll-{pids[JOB]}-" in p for p in maps_b), maps_b
    assert not maps_a & maps_b
    ports_a, ports_b = (set().union(*(seen[r]["ports"] for r in job)) for job in (a, b))
    assert not ports_a & ports_b, (ports_a, ports_b)
    # every rank of A died of the SIGKILL; B went on, correct and without stalling, and closed cleanly
    for r in a:
        assert results[r] == Died(-signal.SIGKILL), results[r]
    for r in b:
        out = results[r]
        assert out["kind"] == "finished" and out["killed_at"], out
        assert out["wrong"] == 0, out
        assert out["slowest_after_kill"] < FAULT_NOTICE_S, out
        assert out["finished_together"], out
        assert out["close_s"] < CLOSE_S and out["threads"] == [] and out["children"] == [], out
    aftermath.check(list(pids))


# A second job whose rank 0 takes the port of a first job still in its rendezvous (rank 0 of A serves
# the store there; A's rank 2 has not arrived yet). "distinct": the jobs have their own job ids and
# secrets, as shmcoll-run gives every job: B's ranks are refused at the handshake, and A must not notice.
# "same": neither sets them (init() arguments, or a launcher that does not), so both derive the same job
# id from address, port and world size and nothing tells B's ranks from A's but a rank claimed twice:
# B's rank 1 comes first (A's rank 1 is there already), then B's rank 2 (whose place A's rank 2 has not
# taken yet). B must still fail quickly saying why, and A must never form a group with B's processes:
# it forms one of its own, computing right, or fails saying why. (Were B's rank 2 first and its
# rendezvous over before B's rank 1 came, nothing could tell: that order is not tested.)

B_TIMEOUT = 3 * FAULT_NOTICE_S  # B's group timeout: its ranks must fail well before it
A_TIMEOUT = B_TIMEOUT + SETUP_FAILURE_S  # A's ranks 0 and 1 wait for rank 2 while B tries


def _collision(rank, n, port, identity, joined, b_done, a_failed, used_port):
    job, local = divmod(rank, JOB)
    used_port.value = port  # every rank of both jobs meets on this one
    if identity == "distinct":
        os.environ["SHMCOLL_JOB_ID"] = f"job{'AB'[job]}"
        os.environ["SHMCOLL_SECRET"] = f"secret-of-{'AB'[job]}"
    if job == 1:
        return _second_job(local, port, joined, b_done)
    if local == JOB - 1:  # A's last rank comes once B is done trying, unless A has failed meanwhile
        if not all(e.wait(B_TIMEOUT + SETUP_FAILURE_S) for e in b_done):
            return {"kind": "job B never finished trying"}
        if a_failed.is_set():
            return {"kind": "not started: job A had failed"}
    else:
        real_gather = shmcoll.bootstrap._gather

        def gather(cfg, client, kind, value, deadline, *rest):
            if kind == "host":  # A's rank has joined its store: now B may come
                client.set(f"host/{cfg.rank}", value, deadline)
                joined[local].set()
            try:
                return real_gather(cfg, client, kind, value, deadline, *rest)
            except BaseException:
                a_failed.set()
                raise

        shmcoll.bootstrap._gather = gather
    groups = []
    out = attempt(lambda: groups.append(init_group(local, JOB, port, timeout=A_TIMEOUT)))
    if groups:
        x = np.full(5, local + 1.0)
        out["sum"] = attempt(lambda: groups[0].all_reduce(x))
        out["sum"]["value"] = float(x[0])
        out.update(close_group(groups[0]))
    return out


def _second_job(local, port, joined, b_done):
    try:
        if not all(e.wait(WAIT_HANG_S) for e in joined[:JOB - 1]):
            return {"kind": "job A never joined its rendezvous"}
        if local == 2 and not b_done[1].wait(WAIT_HANG_S):  # B's rank 1 first: A's rank 1 is there already
            return {"kind": "B's rank 1 never finished trying"}
        groups = []
        out = attempt(lambda: groups.append(init_group(local, JOB, port, timeout=B_TIMEOUT)))
        for g in groups:  # B's rank formed a group (with A's ranks): leave it
            out["formed"] = repr(g)
            g.close()
        return out
    finally:
        b_done[local].set()


@pytest.mark.parametrize("identity", ["distinct", "same"])
def test_second_job_on_a_busy_master_port_fails_clearly_and_leaves_the_first_alone(identity, monkeypatch,
                                                                                 aftermath):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "shm")
    joined, b_done = [CTX.Event() for _ in range(JOB)], [CTX.Event() for _ in range(JOB)]
    used_port = CTX.RawValue("i", 0)
    results, pids = run_tracked(2 * JOB, _collision, identity, joined, b_done, CTX.Event(), used_port,
                                timeout=A_TIMEOUT + WAIT_HANG_S)
    a, b = results[:JOB], results[JOB:]
    report_timing(f"second job on the first's master port ({identity} identity)", dict(enumerate(b)), label="shm")
    said = "\n".join(f"{'AB'[r // JOB]}{r % JOB}: {out['kind']}: {out.get('msg')}" for r, out in enumerate(results))
    where = f"127.0.0.1:{used_port.value}"
    # B's rank 0 cannot serve the rendezvous: says so at once, naming the port and the likely cause
    b0 = b[0]
    assert b0["kind"] == "InvalidArgument", said
    assert "cannot serve the rendezvous" in b0["msg"] and "another job" in b0["msg"], b0["msg"]
    assert where in b0["msg"], b0["msg"]
    assert b0["call_s"] < NO_WAIT_S, b0
    # B's other ranks reach A's store: they must fail too, quickly, saying why, and form nothing
    for out in b[1:]:
        assert out["collective_error"] and "formed" not in out, said
        assert "another job" in out["msg"] and where in out["msg"], said
        assert out["call_s"] < FAULT_NOTICE_S < B_TIMEOUT, out
    for out in a:
        assert out["kind"] != "job B never finished trying", said
    if identity == "distinct":  # A was not disturbed: once its last rank comes, it forms and computes right
        for out in a:
            assert out["kind"] == "returned", said
    for out in a:  # never a group with B's ranks in it: formed and right, or failed saying why
        if out["kind"] == "returned":
            assert out["sum"]["kind"] == "returned" and out["sum"]["value"] == JOB * (JOB + 1) / 2, said
            assert out["threads"] == [] and out["children"] == [], out
        elif out["kind"] != "not started: job A had failed":
            assert out["collective_error"] and "another job" in out["msg"] and where in out["msg"], said
    aftermath.check(pids)

