"""Fault injection and the checks after a fault, shared by the tests of failures (test_failures.py)
and of signals and neighbouring jobs (test_signals_and_neighbours.py); those files' docstrings give
the conventions. `init_group`..`tracked` run inside the ranks, the rest in the test process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import posix_ipc

import shmcoll
from shmcoll import CollectiveError, kernels
from shmcoll.algorithms import single_copy
from shmcoll.algorithms.select import Algorithm, select
from shmcoll.types import Collective

from bounds import BROKEN_CALL_S, CLOSE_S, FAULT_NOTICE_S, NEVER_S, WAIT_HANG_S
from harness import CTX, WaitTimedOut, attempt, child_processes, run_ranks, shm_names_of, wait_until

BIG = 1 << 20  # float32 elements (4 MiB): many chunks per ring step with...
CHUNKS = {"SHMCOLL_CHUNK_BYTES": str(64 << 10),  # ...64 KiB frames, and on shared memory the
          "SHMCOLL_SHM_BOARD_BYTES": str(256 << 10),  # smallest default board, so BIG takes the rings,
          "SHMCOLL_SINGLE_COPY": "0"}  # not direct reads (their faults: test_single_copy.py)


# ---------------------------------------------------------------------------------------------
# helpers run inside the ranks
# ---------------------------------------------------------------------------------------------

def init_group(rank: int, n: int, port: int, timeout: float = NEVER_S):
    return shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=timeout)


def call_after_failure(pg) -> dict:
    """The next call on a group that just failed: must raise at once, same class, saying 'broken'."""
    return attempt(lambda: pg.barrier())


def cannot_be_read() -> None:
    """From now on this process publishes a token its peers do not find where it says, as a rank in
    another pid namespace would: large calls that read peers' arrays (single_copy.py) agree on their
    fallback."""
    real = single_copy._descriptor
    single_copy._descriptor = lambda address: real(address) + np.eye(1, 8, single_copy.TOKEN, dtype=np.int64)[0]


def shmcoll_threads() -> list[str]:
    """shmcoll threads alive in this process (the rendezvous store's included)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("shmcoll-"))


def leftovers() -> dict:
    return {"threads": shmcoll_threads(), "children": child_processes()}


def close_group(pg) -> dict:
    start = time.monotonic()
    pg.close()
    return {"close_s": time.monotonic() - start, **leftovers()}


def arm_signal(pg, after_sends: int, sig: int, stamps, min_items: int = 0) -> None:
    """Deliver `sig` to this rank just before its `after_sends`-th frame from now on; stamp the time.
    A frame is a transport send, the send of a pairwise exchange or of a ring's step in native calls
    over TCP (kernels.swap_row, whose row of exchanges counts as one; kernels.duplex's first call
    of a frame, before it sent anything; kernels.duplex_row's, before it sent anything, as many as
    the steps it has left: it fires before the row where the row holds that frame) or, over shared
    memory, an entry published on the board (the small collectives' way: by Board.publish, or by
    the compiled step that all_reduce, barrier, broadcast and all_gather run). With min_items,
    only sends of at least that many elements count (data frames, not the signalling frames of an
    agreement step)."""
    sent = [0]  # frames so far

    def counts(args) -> bool:
        return not min_items or (len(args) > 2 and getattr(args[2], "size", 0) >= min_items)

    def armed(real, resumed=lambda args: False, frames=lambda args: 1):
        """real, firing first at the frames it sends (frames(args) of them); resumed(args): a call
        that goes on with a frame an earlier one began, which is not another frame."""
        def fire_then_call(*args, **kwargs):
            before = sent[0]
            if not resumed(args) and counts(args):
                sent[0] += frames(args)
            if before < after_sends <= sent[0]:
                stamps[pg.rank] = time.monotonic()
                # To this thread, not the process: a process-directed SIGSTOP is taken by the main
                # thread (asleep in join() for spawn_*), and until it gets a core and stops the
                # group, this thread goes on sending (seen: a whole call finished under load).
                signal.pthread_kill(threading.get_ident(), sig)
            return real(*args, **kwargs)
        return fire_then_call

    transport = pg.transport
    transport.send = armed(transport.send)
    kernels.swap_row = armed(kernels.swap_row)
    kernels.duplex = armed(kernels.duplex, resumed=lambda args: bool(args[12][0]))  # its progress: bytes sent
    kernels.duplex_row = armed(kernels.duplex_row, resumed=lambda args: bool(args[12][0]),
                               frames=lambda args: len(args[0]) - int(args[1][0]))  # its steps left
    board = transport.board or transport.host_board  # across hosts, the in-host steps of small calls
    if board is not None:  # the board's calls: published in Python, or in one compiled step
        board.publish = armed(board.publish)
        kernels.board_all_reduce = armed(kernels.board_all_reduce)
        kernels.board_broadcast = armed(kernels.board_broadcast)
        kernels.board_all_gather = armed(kernels.board_all_gather)


def peers_inside(pg, peers, seq: int, bound: float = WAIT_HANG_S, nbytes: int = 0,
                 coll: Collective | None = None) -> bool:
    """Wait (bounded) until each of `peers` is inside collective number `seq` (of `nbytes` of data;
    `coll`, where the call is larger than a board entry): over shared memory a small call, or one
    that runs single copy (it publishes where its array is), shows as the peer's board entry
    (across hosts, that of a barrier or small all-reduce, among peers of this host); otherwise take
    the first frame each peer sends in it. Only a rank about to fail or leave may do the latter,
    since it consumes the frames its own call would have needed."""
    deadline = time.monotonic() + bound
    tag = shmcoll.TAG_RESERVED_BASE + seq
    board = pg.transport.board or pg.transport.host_board
    if (board is not None and all(p in board.host_ranks for p in peers)
            and (nbytes <= board.capacity or _single_copy(pg, coll, nbytes))):
        try:
            return wait_until(lambda: all(board.published(p, seq) for p in peers), bound,
                              f"ranks {peers} inside collective {seq}", interval=0)  # a poll of shared memory
        except WaitTimedOut:
            return False
    try:
        return all(pg.transport.recv(p, tag, deadline).header.meta.seq == seq for p in peers)
    except CollectiveError:
        return False


def _single_copy(pg, coll: Collective | None, nbytes: int) -> bool:
    """Whether a call of coll over nbytes runs single copy in pg (select.py's choice, a group on one host)."""
    return coll is not None and select(coll, nbytes, pg._where.setting) is Algorithm.SINGLE_COPY


def check_group_works(pg, ready) -> None:
    """Collective number 0, then an out-of-band barrier of every rank: nobody is still finishing call 0
    (frames of it still in flight) when the fault of call 1 happens."""
    x = np.full(8, pg.rank + 1.0, dtype=np.float64)
    pg.all_reduce(x)
    n = pg.world_size
    assert np.all(x == n * (n + 1) / 2), x
    ready.wait(timeout=WAIT_HANG_S)


def tracked(rank, n, port, pids, body, *args):
    """body(rank, n, port, *args), with this rank's pid recorded first (for the checks afterwards)."""
    pids[rank] = os.getpid()
    return body(rank, n, port, *args)


# ---------------------------------------------------------------------------------------------
# helpers run in the test process
# ---------------------------------------------------------------------------------------------

def transport_label() -> str:
    """The transport this test runs over, as the timing table names it."""
    kind = os.environ.get("SHMCOLL_TRANSPORT", "any")
    hosts = os.environ.get("SHMCOLL_TEST_HOSTS", "halves")
    return f"hier:{hosts}" if kind == "hier" and hosts != "halves" else kind


def report_timing(name: str, outs: dict, label: str | None = None) -> None:
    """One "[timing]" line per scenario: each rank's error, call time and (if known) fault-to-error time."""
    parts = []
    for rank, out in sorted(outs.items()):
        text = f"rank {rank}: {out['kind']} call {out['call_s']:.3f}s"
        if "fault_s" in out:
            text += f" fault {out['fault_s']:.3f}s"
        parts.append(text)
    print(f"\n[timing] {label or transport_label()} | {name}: " + "; ".join(parts))


class Aftermath:
    """What must hold once a scenario is over, whatever happened in it."""

    def __init__(self):
        self.children_before = {pid for pid, _ in child_processes()}
        self.pids: list[int] = []

    def check(self, pids) -> None:
        self.pids = list(pids)
        left = shm_names_of(pids)
        assert left == [], f"shared memory of this scenario left in /dev/shm: {left}"
        stray = [c for c in child_processes() if c[0] not in self.children_before]
        assert stray == [], f"processes left behind (pid, state): {stray}"
        assert multiprocessing.active_children() == []

    def clean_up(self) -> None:
        """Unlink what a failed check found, so the leak is reported once, by its own scenario."""
        for entry in shm_names_of(self.pids):
            unlink = posix_ipc.unlink_semaphore if entry.startswith("sem.") else posix_ipc.unlink_shared_memory
            try:
                unlink("/" + entry.removeprefix("sem."))
            except posix_ipc.ExistentialError:
                pass


def run_tracked(n: int, body, *args, **kwargs) -> tuple[list, list[int]]:
    """run_ranks(n, body, *args) with init=False; also returns the ranks' pids."""
    pids = CTX.RawArray("q", n)
    return run_ranks(n, tracked, pids, body, *args, init=False, **kwargs), list(pids)


def assert_lost(out: dict, victim: int) -> None:
    assert out["kind"] == "PeerLost" and out["connection_error"], out
    assert out["peer"] == victim, out
    assert f"rank {victim}" in out["msg"], out["msg"]
    assert out["call_s"] < FAULT_NOTICE_S, out
    if "fault_s" in out:
        assert out["fault_s"] < FAULT_NOTICE_S, out


def assert_broken(out: dict, kind: str, peer: int | None = None) -> None:
    broken = out["broken"]
    assert broken["kind"] == kind, broken
    assert "broken" in broken["msg"], broken
    assert broken["call_s"] < BROKEN_CALL_S, broken
    if peer is not None:
        assert broken["peer"] == peer, broken


def assert_closed_cleanly(out: dict) -> None:
    assert out["close_s"] < CLOSE_S, out
    assert_nothing_running(out)


def assert_nothing_running(out: dict) -> None:
    assert out["threads"] == [], f"shmcoll threads still running: {out['threads']}"
    assert out["children"] == [], f"child processes of a rank: {out['children']}"


def assert_survivors(outs: dict, victim: int) -> None:
    """Every survivor: PeerLost naming the victim promptly, then a broken group, then a clean close."""
    for out in outs.values():
        assert_lost(out, victim)
        assert_broken(out, "PeerLost", victim)
        assert out["finished_together"], out
        assert_closed_cleanly(out)
