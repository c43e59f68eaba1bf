"""Run one test body on N real processes, each with its own ProcessGroup, and collect the results.

Ranks are forked (fast, and they inherit the parent's compiled numba kernels). Every wait has a
deadline: a hung run is stopped, each rank first dumping every thread's stack to stderr (pytest
shows it with the failure), so a hang fails one test quickly instead of the CI run.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import struct
import threading
import time
import traceback
from dataclasses import dataclass

import shmcoll

CTX = mp.get_context("fork")


@dataclass(frozen=True)
class Died:
    """What run_ranks reports for a rank that exited without a result (killed, crashed, os._exit)."""

    exitcode: int | None


class RankFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, body, *args, timeout: float = 60.0, group_timeout: float = 30.0,
              env: dict[str, str] | None = None, may_die: set[int] = frozenset(), init: bool = True) -> list:
    """body(pg, *args) on ranks 0..n-1 (body(rank, n, port, *args) when init=False); returns results by rank."""
    port = free_port()
    pipes, procs = [], []
    for rank in range(n):
        parent_end, child_end = CTX.Pipe(duplex=False)
        proc = CTX.Process(target=_child, args=(rank, n, port, body, args, child_end, group_timeout, env or {}, init),
                           daemon=True)
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    try:
        results = _collect(pipes, procs, time.monotonic() + timeout)
    finally:
        _reap(procs)
    failures = {r: res for r, res in results.items() if isinstance(res, _Failure)}
    deaths = {r: res for r, res in results.items() if isinstance(res, Died) and r not in may_die}
    if failures or deaths:
        text = "\n".join(f"--- rank {r} raised:\n{f.text}" for r, f in sorted(failures.items()))
        text += "".join(f"\n--- rank {r} died with exit code {d.exitcode}" for r, d in sorted(deaths.items()))
        raise RankFailed(text)
    return [results[r] for r in range(n)]


@dataclass(frozen=True)
class _Failure:
    text: str


#: Simulated host layouts (SHMCOLL_TEST_HOSTS): which host each of n ranks is on.
HOST_LAYOUTS = {
    "halves": lambda rank, n: "a" if rank < (n + 1) // 2 else "b",   # 2+2, 2+1, 1+1
    "first-alone": lambda rank, n: "a" if rank == 0 else "b",         # 1+3, 1+2, 1+1
    "each": lambda rank, n: f"h{rank}",                               # 1+1+1+1
    "interleaved": lambda rank, n: "ab"[rank % 2],                    # a,b,a,b
}


def simulated_host_id(layout: str, rank: int, n: int) -> str:
    """SHMCOLL_HOST_ID for a simulated host: the ranks of one machine pretend to be on several."""
    return f"test-{HOST_LAYOUTS[layout](rank, n)}"


def _child(rank, n, port, body, args, conn, group_timeout, env, init) -> None:
    faulthandler.enable(all_threads=True)  # SIGABRT from the parent on a hang: print every stack, die
    os.environ.update(env)
    layout = os.environ.get("SHMCOLL_TEST_HOSTS")
    if layout:
        os.environ["SHMCOLL_HOST_ID"] = simulated_host_id(layout, rank, n)
    try:
        if init:
            with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port,
                              timeout=group_timeout) as pg:
                result = body(pg, *args)
        else:
            result = body(rank, n, port, *args)
        conn.send(result)
    except BaseException:
        conn.send(_Failure(traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def _collect(pipes, procs, deadline: float) -> dict:
    results: dict[int, object] = {}
    waiting = dict(enumerate(pipes))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            _dump_stacks([procs[r] for r in waiting])
            raise RankFailed(f"ranks {sorted(waiting)} did not finish in time; their stacks are in the captured stderr")
        for conn in mpc.wait(list(waiting.values()), timeout=min(left, 1.0)):
            rank = next(r for r, c in waiting.items() if c is conn)
            try:
                results[rank] = conn.recv()
            except EOFError:
                procs[rank].join(5)
                results[rank] = Died(procs[rank].exitcode)
            del waiting[rank]
    return results


def _dump_stacks(procs) -> None:
    """SIGABRT makes faulthandler print every thread's stack before the process dies; wait for that."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGABRT)
    for proc in procs:
        proc.join(timeout=5)


def _reap(procs) -> None:
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def attempt(fn) -> dict:
    """Run one call in a rank; how it ended (class, message, .peer, times) as picklable data."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        end = time.monotonic()
        return {"kind": type(exc).__name__, "collective_error": isinstance(exc, shmcoll.CollectiveError),
                "invalid": isinstance(exc, shmcoll.InvalidArgument), "timeout_error": isinstance(exc, TimeoutError),
                "connection_error": isinstance(exc, ConnectionError), "msg": str(exc),
                "peer": getattr(exc, "peer", None), "start": start, "end": end, "call_s": end - start}
    end = time.monotonic()
    return {"kind": "returned", "collective_error": False, "invalid": False, "timeout_error": False,
            "connection_error": False, "msg": "", "peer": None, "start": start, "end": end, "call_s": end - start}


def finish_together(barrier, bound: float = 10.0) -> bool:
    """Stay alive until every other live rank is done too (bounded); False if they never came."""
    try:
        barrier.wait(timeout=bound)
        return True
    except threading.BrokenBarrierError:
        return False


def shm_names_of(pids) -> list[str]:
    """Entries of /dev/shm created by any of these processes. shmcoll names every segment and
    semaphore after its creator ("shmcoll-<pid>-...", semaphores with a "sem." prefix), so a test
    can check its own ranks left nothing, whatever other jobs on the machine are doing."""
    try:
        entries = os.listdir("/dev/shm")
    except OSError:
        return []
    wanted = {str(pid) for pid in pids if pid}
    left = []
    for entry in entries:
        parts = entry.removeprefix("sem.").split("-", 2)
        if len(parts) == 3 and parts[0] == "shmcoll" and parts[1] in wanted:
            left.append(entry)
    return sorted(left)


def child_processes(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is `pid` (default: this process), zombies included."""
    parent = os.getpid() if pid is None else pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == parent:
            found.append((int(entry), fields[0].decode()))
    return sorted(found)


class ShmCreations:
    """Every name created in /dev/shm from now on (inotify), so a test can tell whether another job on
    this machine ran meanwhile: each shmcoll job sweeps the names of dead creators when it creates its
    segment (shm_segment.sweep_stale), so a leak left by a killed rank may vanish through no merit of
    the job that leaked it."""

    _IN_CREATE, _IN_Q_OVERFLOW = 0x100, 0x4000
    _EVENT = struct.Struct("iIII")

    def __init__(self, directory: str = "/dev/shm"):
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, directory.encode(), self._IN_CREATE) < 0:
            errno = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(errno, f"inotify_add_watch {directory}")
        self.names: list[str] = []
        self.overflowed = False

    def read(self) -> list[str]:
        """The names created so far (events not read yet are read now)."""
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return self.names
            at = 0
            while at < len(data):
                _, mask, _, length = self._EVENT.unpack_from(data, at)
                at += self._EVENT.size
                self.overflowed |= bool(mask & self._IN_Q_OVERFLOW)
                self.names.append(data[at:at + length].rstrip(b"\0").decode(errors="replace"))
                at += length

    def shmcoll_by_others(self, pids) -> list[str]:
        """shmcoll names created by processes other than `pids` (["?"] if events were lost)."""
        ours = {str(pid) for pid in pids if pid}
        names = self.read()
        others = [n for n in names if (p := n.removeprefix("sem.").split("-", 2))[0] == "shmcoll"
                  and len(p) == 3 and p[1] not in ours]
        return others + (["?"] if self.overflowed else [])

    def close(self) -> None:
        os.close(self._fd)
