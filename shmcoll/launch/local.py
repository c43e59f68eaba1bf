"""Start N ranks on this host and supervise them until all succeed or one fails.

The supervisor's promise is that it never hangs and never leaves processes behind: every wait is a
poll against a deadline, a failing rank takes the whole job down (SIGTERM, then SIGKILL after a
grace period), and the launcher reaps every child it started. Each rank runs in its own session so
the launcher is the only receiver of terminal signals (it forwards them exactly once) and so a
rank's helper processes can be stopped together with it.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shmcoll.errors import InvalidArgument

LOCAL_ADDR = "127.0.0.1"
GRACE_S = 3.0          # between SIGTERM and SIGKILL when stopping ranks
POLL_S = 0.02          # supervision poll interval: the latency of noticing a dead rank
REAP_S = 5.0           # how long to wait for a SIGKILLed process before giving up on it
EXIT_TIMEOUT = 124     # like coreutils timeout(1)
EXIT_NOT_FOUND = 127   # like a shell: command not found
EXIT_NOT_EXEC = 126    # like a shell: found but not executable
FORWARDED = (signal.SIGINT, signal.SIGTERM)
PREFIX = "shmcoll-run:"


def _say(msg: str) -> None:
    """One line on stderr, prefixed so it stands out among the ranks' own output."""
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def free_port(host: str = LOCAL_ADDR) -> int:
    """A port the kernel just reported free; rank 0 binds it moments later (a small, accepted race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def program_argv(argv: Sequence[str]) -> list[str]:
    """A `.py` program runs under this interpreter, so it needs neither a shebang nor an exec bit."""
    argv = list(argv)
    if argv and argv[0].endswith(".py"):
        return [sys.executable, *argv]
    return argv


def job_env(n: int, port: int, base: Mapping[str, str]) -> dict[str, str]:
    """What every rank of one job shares: world size, rendezvous endpoint, a fresh secret and job id."""
    env = dict(base)
    env.update(
        SHMCOLL_WORLD_SIZE=str(n),
        SHMCOLL_LOCAL_WORLD_SIZE=str(n),
        SHMCOLL_MASTER_ADDR=LOCAL_ADDR,
        SHMCOLL_MASTER_PORT=str(port),
        SHMCOLL_SECRET=secrets.token_hex(16),
        SHMCOLL_JOB_ID="r" + secrets.token_hex(8),
    )
    return env


def rank_env(shared: Mapping[str, str], rank: int, local_rank: int) -> dict[str, str]:
    """One rank's environment: the job's plus its own rank numbers."""
    env = dict(shared)
    env.update(SHMCOLL_RANK=str(rank), SHMCOLL_LOCAL_RANK=str(local_rank))
    return env


def describe_status(rc: int) -> str:
    """'exited with status 3' or 'was killed by signal 9 (SIGKILL)' from a Popen returncode."""
    if rc >= 0:
        return f"exited with status {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = "unknown"
    return f"was killed by signal {-rc} ({name})"


def shell_status(rc: int) -> int:
    """A Popen returncode as a shell reports it: a signal death becomes 128 + signum."""
    return 128 - rc if rc < 0 else rc


def _death_signal_hook():
    """preexec_fn asking Linux to SIGKILL the rank if the launcher itself dies (even by SIGKILL).

    Returns None where prctl is unavailable; the launcher's own cleanup still covers every other exit.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


@dataclass
class Rank:
    """A started rank and, once reaped, its Popen returncode."""

    rank: int
    proc: subprocess.Popen
    rc: int | None = None

    def poll(self) -> int | None:
        if self.rc is None:
            self.rc = self.proc.poll()
        return self.rc

    def signal_group(self, sig: int) -> None:
        """Signal the rank's whole session (it is its group leader): helpers it spawned go too."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def start_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]]) -> list[Rank]:
    """Start one process per environment; on a spawn failure, stop the ones already started."""
    hook = _death_signal_hook()
    ranks: list[Rank] = []
    try:
        for i, env in enumerate(envs):
            proc = subprocess.Popen(
                list(argv), env=dict(env), start_new_session=True, preexec_fn=hook,
                stdin=None if i == 0 else subprocess.DEVNULL,  # like mpirun: stdin goes to rank 0
            )
            ranks.append(Rank(i, proc))
    except BaseException:
        stop_ranks(ranks, grace=0.0)
        raise
    return ranks


def stop_ranks(ranks: Sequence[Rank], grace: float = GRACE_S, first: int = signal.SIGTERM) -> None:
    """Send `first` to every running rank, SIGKILL whatever is left after `grace`, reap everything."""
    for r in ranks:
        if r.poll() is None:
            r.signal_group(first)
    _wait_all(ranks, time.monotonic() + grace)
    for r in ranks:
        r.signal_group(signal.SIGKILL)  # also sweeps helpers left behind by ranks that did exit
    _wait_all(ranks, time.monotonic() + REAP_S)


def _wait_all(ranks: Sequence[Rank], deadline: float) -> bool:
    """Poll until every rank is reaped or the deadline passes; True when all are reaped."""
    while True:
        if all(r.poll() is not None for r in ranks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


@dataclass
class _Signals:
    """SIGINT/SIGTERM received by the launcher: forwarded to the ranks, remembered for the exit code."""

    ranks: list[Rank]
    received: list[int] = field(default_factory=list)

    def handle(self, signum, _frame) -> None:
        self.received.append(signum)
        # A second signal means "now": escalate straight to SIGKILL.
        sig = signum if len(self.received) == 1 else signal.SIGKILL
        for r in self.ranks:
            if r.rc is None:
                r.signal_group(sig)

    def install(self) -> dict:
        """Install the handlers (main thread only; elsewhere the caller keeps its own handling)."""
        old = {}
        try:
            for sig in FORWARDED:
                old[sig] = signal.signal(sig, self.handle)
        except ValueError:
            pass
        return old


def _restore(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def supervise(ranks: list[Rank], sigs: _Signals, deadline: float | None) -> int:
    """Wait for the job to end; the exit status is the first failure's, else 0."""
    while True:
        if sigs.received:  # checked first: the ranks it killed are not "failures"
            name = signal.Signals(sigs.received[0]).name
            _say(f"received {name}; forwarded it to every rank, stopping them")
            stop_ranks(ranks, first=sigs.received[0])
            return 128 + sigs.received[0]
        for r in ranks:
            rc = r.poll()
            if rc is not None and rc != 0:
                _say(f"rank {r.rank} (pid {r.proc.pid}) {describe_status(rc)}; stopping the other ranks")
                stop_ranks(ranks)
                return shell_status(rc)
        if all(r.rc == 0 for r in ranks):
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            _say("timeout: the job ran past its time limit; stopping every rank")
            stop_ranks(ranks)
            return EXIT_TIMEOUT
        time.sleep(POLL_S)


def launch_local(n: int, argv: list[str], *, env: dict | None = None, master_port: int | None = None,
                 timeout: float | None = None) -> int:
    """Run `argv` as ranks 0..n-1 on this host; return the job's exit status as a shell would.

    `env` replaces the parent environment as the base of every rank's (as in subprocess); the
    SHMCOLL_* variables are set on top of it. `timeout` (seconds) bounds the whole job: past it
    every rank is stopped and 124 is returned.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"the number of ranks must be an integer >= 1, got {n!r}")
    if not argv:
        raise InvalidArgument("no program to run")
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    port = free_port() if master_port is None else master_port
    shared = job_env(n, port, os.environ if env is None else env)
    ranks: list[Rank] = []
    sigs = _Signals(ranks)
    old = sigs.install()
    try:
        try:
            ranks.extend(start_ranks(program_argv(argv), [rank_env(shared, i, i) for i in range(n)]))
        except OSError as e:
            _say(f"cannot start {argv[0]!r}: {e.strerror or e}")
            return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXEC
        return supervise(ranks, sigs, deadline)
    finally:
        if any(r.rc is None for r in ranks):  # only after an unexpected error: never leave a child
            stop_ranks(ranks, grace=0.0)
        _restore(old)
