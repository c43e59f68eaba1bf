"""What the tests share besides their bounds (bounds.py) and parameters (params.py): bounded
waiting, the multiprocess marker enforced, launched jobs, and one test body on N real processes.

Ranks are forked (fast: they start with the parent's imports). Every wait has a deadline: a hung
run is stopped, each rank first dumping every thread's stack to stderr (pytest shows it with the
failure), so a hang fails one test quickly instead of the CI run.

Tests that start processes (run_ranks, subprocess, a launcher, a fork) carry the `multiprocess`
marker, which makes them `slow` too; `pytest -m "not slow"` is the quick tier. While a test without
the marker runs, conftest.py has `refusing_processes` make every way of starting a process fail it.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import ctypes
import faulthandler
import importlib.util
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

import shmcoll

from bounds import FINISH_TOGETHER_S, LAUNCH_S, NEVER_S, REAP_S, RUN_HANG_S, WAIT_HANG_S

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# waiting
# ---------------------------------------------------------------------------------------------

class WaitTimedOut(AssertionError):
    """wait_until's failure: what it waited for did not happen in time."""


def wait_until(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll predicate() until it returns something true, and return that; after `timeout` seconds
    raise WaitTimedOut naming `what` was awaited. interval=0 yields the processor between polls
    instead of sleeping (a wait of microseconds, among more ranks than cores)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimedOut(f"gave up after {timeout:g} s waiting for {what}")
        if interval:
            time.sleep(interval)
        else:
            os.sched_yield()


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """The next n bytes from a blocking socket (or one with a timeout); fails if it closes first."""
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "connection closed early"
        got += chunk
    return got


# ---------------------------------------------------------------------------------------------
# the multiprocess marker, enforced
# ---------------------------------------------------------------------------------------------

_refusing: str | None = None  # the test (not marked multiprocess) now running, if any


def _not_marked(test: str, how: str) -> str:
    return (f"{test} starts a process ({how}) but is not marked multiprocess: mark it "
            f"@pytest.mark.multiprocess, or the module pytestmark = pytest.mark.multiprocess, so that the "
            f"quick tier (pytest -m 'not slow') leaves it out")


def _refused(how: str):
    def refuse(*args, **kwargs):
        pytest.fail(_not_marked(_refusing, how))
    return refuse


#: Every way a process starts: forks (multiprocessing's "fork" start method, os.spawn*, pty), the
#: fork+exec of subprocess and of multiprocessing's spawn/forkserver, posix_spawn, os.system.
_STARTERS = [(os, "fork"), (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
             (_posixsubprocess, "fork_exec"), (subprocess.Popen, "__init__")]


@contextlib.contextmanager
def refusing_processes(test: str):
    """While active, any process start fails `test` (which is not marked multiprocess), naming how."""
    global _refusing
    saved = [(owner, name, owner.__dict__[name]) for owner, name in _STARTERS if name in owner.__dict__]
    _refusing = test
    try:
        for owner, name, _ in saved:
            setattr(owner, name, _refused(f"{owner.__name__}.{name}"))
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)
        _refusing = None


def _may_start(how: str) -> None:
    if _refusing is not None:
        pytest.fail(_not_marked(_refusing, how))


# ---------------------------------------------------------------------------------------------
# launched jobs: the environment of a child interpreter, and checks that processes are gone
# ---------------------------------------------------------------------------------------------

def load_bench_script(name: str):
    """bench/<name>.py as a module (bench/ holds scripts, not a package), registered in sys.modules
    first: dataclasses look their module up while the class is built."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def subprocess_env() -> dict[str, str]:
    """This environment minus any SHMCOLL_* it has, with this checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMCOLL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def launcher_cmd(*args: str) -> list[str]:
    """shmcoll-run (as the module, so the test needs no installed console script)."""
    return [sys.executable, "-m", "shmcoll.launch.run_cli", *args]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    from shmcoll.transport.shm_segment import pid_alive

    return pid_alive(pid)


def assert_all_gone(pids: list[int], timeout: float = REAP_S) -> None:
    """Every pid is dead; orphans killed by a launcher get a moment for the kernel to finish them."""
    assert pids
    wait_until(lambda: not [p for p in pids if alive(p)], timeout, f"every one of the processes {pids} to be gone")


#: Helpers every rank program of a launched job imports (conftest's `job` writes it beside them).
RANKLIB = '''
import os, select, signal, socket, subprocess, sys, time
from pathlib import Path

D = Path(sys.argv[1])
RANK = int(os.environ["SHMCOLL_RANK"])
WORLD = int(os.environ["SHMCOLL_WORLD_SIZE"])

def note(name, text):
    tmp = D / (name + ".tmp")
    tmp.write_text(text)
    tmp.rename(D / name)

def started():
    """Record this rank's pid, so the test can check it is gone afterwards."""
    note(f"rank{RANK}.pid", str(os.getpid()))

def all_started(timeout=__LAUNCH__):
    """Wait (bounded) until every rank has recorded its pid: the job is really up."""
    deadline = time.monotonic() + timeout
    while not all((D / f"rank{i}.pid").exists() for i in range(WORLD)):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.01)

def block(seconds):
    """Wait on a channel nobody writes to, with a long deadline; returning at all is a test failure."""
    a, b = socket.socketpair()
    select.select([a], [], [], seconds)
    note(f"rank{RANK}.survived", "1")

def spawn_helper():
    """A grandchild that would outlive the rank unless the launcher stops the rank's whole group."""
    code = "import select, socket; a, b = socket.socketpair(); select.select([a], [], [], __NEVER__)"
    p = subprocess.Popen([sys.executable, "-c", code])
    note(f"helper{RANK}.pid", str(p.pid))
'''.replace("__NEVER__", repr(NEVER_S)).replace("__LAUNCH__", repr(LAUNCH_S))


# ---------------------------------------------------------------------------------------------
# ranks: one test body on N forked processes
# ---------------------------------------------------------------------------------------------

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


def run_ranks(n: int, body, *args, timeout: float = RUN_HANG_S, group_timeout: float = WAIT_HANG_S,
              env: dict[str, str] | None = None, may_die: set[int] = frozenset(), init: bool = True) -> list:
    """body(pg, *args) on ranks 0..n-1 (body(rank, n, port, *args) when init=False); returns results by rank.
    `timeout` is the run's hang guard, `group_timeout` each rank's group timeout."""
    _may_start(f"run_ranks({n}, {getattr(body, '__name__', body)})")
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
    "pairs": lambda rank, n: f"p{rank // 2}",                         # 2+2+2
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
                procs[rank].join(REAP_S)
                results[rank] = Died(procs[rank].exitcode)
            del waiting[rank]
    return results


def _dump_stacks(procs) -> None:
    """SIGABRT makes faulthandler print every thread's stack before the process dies; wait for that."""
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGABRT)
    for proc in procs:
        proc.join(timeout=REAP_S)


def _reap(procs) -> None:
    for proc in procs:
        proc.join(timeout=REAP_S)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=REAP_S)


def attempt(fn) -> dict:
    """Run one call in a rank; how it ended (class, message, .peer, times) as picklable data."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test inspects what was raised
        end = time.monotonic()
        return {"kind": type(exc).__name__, "collective_error": isinstance(exc, shmcoll.CollectiveError),
                "invalid": isinstance(exc, shmcoll.InvalidArgument), "timeout_error": isinstance(exc, TimeoutError),
                "connection_error": isinstance(exc, ConnectionError), "msg": str(exc),
                "peer": getattr(exc, "peer", None), "start": start, "end": end, "call_s": end - start}
    end = time.monotonic()
    return {"kind": "returned", "collective_error": False, "invalid": False, "timeout_error": False,
            "connection_error": False, "msg": "", "peer": None, "start": start, "end": end, "call_s": end - start}


def finish_together(barrier, bound: float = FINISH_TOGETHER_S) -> bool:
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
    return sorted(entry for entry in entries if shm_creator(entry) in wanted)


def shm_creator(entry: str) -> str | None:
    """The creator's pid a shmcoll entry of /dev/shm carries ("shmcoll-<pid>-...", semaphores with a
    "sem." prefix); None for anything else."""
    parts = entry.removeprefix("sem.").split("-", 2)
    return parts[1] if len(parts) == 3 and parts[0] == "shmcoll" else None


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
        others = [n for n in self.read() if shm_creator(n) not in (None, *ours)]
        return others + (["?"] if self.overflowed else [])

    def close(self) -> None:
        os.close(self._fd)


def connected_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection, set up as NetTransport sets up its sockets."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.settimeout(0.25)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b
