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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from shmcoll.errors import InvalidArgument
from shmcoll.launch.remote import death_signal_hook, shell_status, signal_group
from shmcoll.launch.tagout import OutputMux

LOCAL_ADDR = "127.0.0.1"
GRACE_S = 3.0          # between SIGTERM and SIGKILL when stopping ranks
POLL_S = 0.02          # supervision poll interval: the latency of noticing a dead rank
REAP_S = 5.0           # how long to wait for a SIGKILLed process before giving up on it
OUTPUT_DRAIN_S = 2.0   # --tag-output: how long to wait for the last lines once every rank is reaped
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


def job_env(n: int, port: int, base: Mapping[str, str], addr: str = LOCAL_ADDR) -> dict[str, str]:
    """What every rank of one job shares: world size, rendezvous endpoint, a fresh secret and job id."""
    env = dict(base)
    env.update(
        SHMCOLL_WORLD_SIZE=str(n),
        SHMCOLL_LOCAL_WORLD_SIZE=str(n),
        SHMCOLL_MASTER_ADDR=addr,
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


@dataclass
class Rank:
    """A started rank and, once reaped, its Popen returncode.

    The supervision below only talks to ranks through these methods, so a rank started on another
    host (multihost.RemoteRank) is stopped the same way by overriding them.
    """

    rank: int
    proc: subprocess.Popen
    rc: int | None = None
    stop_margin: ClassVar[float] = 0.0  # extra time a stop may take beyond the grace period

    def poll(self) -> int | None:
        if self.rc is None:
            self.rc = self.proc.poll()
        return self.rc

    def where(self) -> str:
        return f"pid {self.proc.pid}"

    def forward(self, sig: int) -> None:
        """Pass on a signal the launcher received (Ctrl-C) to the rank's whole session."""
        signal_group(self.proc.pid, sig)

    def terminate(self, sig: int, grace: float) -> None:
        """Begin stopping: the rank gets `sig` now and is killed if still there after `grace`."""
        signal_group(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the session: also sweeps helpers left behind by a rank that did exit."""
        signal_group(self.proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Release what the launcher holds for this rank, once it is reaped."""


def popen_rank(argv: Sequence[str], env: Mapping[str, str], *, stdin, rank: int,
               mux: OutputMux | None = None) -> subprocess.Popen:
    """One process in its own session that dies with the launcher; its output through `mux` if any."""
    pipes: tuple[tuple[int, int], ...] = (os.pipe(), os.pipe()) if mux is not None else ()
    try:
        proc = subprocess.Popen(
            list(argv), env=dict(env), start_new_session=True, preexec_fn=death_signal_hook(), stdin=stdin,
            stdout=pipes[0][1] if pipes else None, stderr=pipes[1][1] if pipes else None)
    except BaseException:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        raise
    for _, w in pipes:
        os.close(w)
    if mux is not None:
        mux.add(rank, pipes[0][0], pipes[1][0])
    return proc


def start_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], mux: OutputMux | None = None) -> list[Rank]:
    """Start one process per environment; on a spawn failure, stop the ones already started."""
    ranks: list[Rank] = []
    try:
        for i, env in enumerate(envs):
            stdin = None if i == 0 else subprocess.DEVNULL  # like mpirun: stdin goes to rank 0
            ranks.append(Rank(i, popen_rank(argv, env, stdin=stdin, rank=i, mux=mux)))
    except BaseException:
        stop_ranks(ranks, grace=0.0)
        raise
    return ranks


def stop_ranks(ranks: Sequence[Rank], grace: float = GRACE_S, first: int = signal.SIGTERM) -> None:
    """Send `first` to every running rank, SIGKILL whatever is left after `grace`, reap everything."""
    for r in ranks:
        if r.poll() is None:
            r.terminate(first, grace)
    _wait_all(ranks, time.monotonic() + grace + max((r.stop_margin for r in ranks), default=0.0))
    for r in ranks:
        r.kill()
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
                r.forward(sig)

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
                _say(f"rank {r.rank} ({r.where()}) {describe_status(rc)}; stopping the other ranks")
                stop_ranks(ranks)
                return shell_status(rc)
        if all(r.rc == 0 for r in ranks):
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            _say("timeout: the job ran past its time limit; stopping every rank")
            stop_ranks(ranks)
            return EXIT_TIMEOUT
        time.sleep(POLL_S)


def run_job(start: Callable[[], list[Rank]], what: str, *, timeout: float | None = None,
            mux: OutputMux | None = None) -> int:
    """Start the ranks with `start()` and supervise them; the job's exit status as a shell would.

    `what` names the command started, for the message when it cannot be. Signal handlers are in
    place before the first rank starts, and no rank outlives this call, whatever happens.
    """
    if timeout is not None and not timeout > 0:
        raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    ranks: list[Rank] = []
    sigs = _Signals(ranks)
    old = sigs.install()
    try:
        try:
            ranks.extend(start())
        except OSError as e:
            _say(f"cannot start {what!r}: {e.strerror or e}")
            return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXEC
        if mux is not None:
            mux.start()
        return supervise(ranks, sigs, deadline)
    finally:
        if any(r.rc is None for r in ranks):  # only after an unexpected error: never leave a child
            stop_ranks(ranks, grace=0.0)
        for r in ranks:
            r.close()
        if mux is not None:
            mux.start()  # also after a failed start: drain and close the pipes of the started ranks
        if mux is not None and not mux.join(OUTPUT_DRAIN_S):
            _say("some rank output did not end (a leftover process holds its pipe); not waiting for it")
        _restore(old)


def launch_local(n: int, argv: list[str], *, env: dict | None = None, master_port: int | None = None,
                 timeout: float | None = None, tag_output: bool = False) -> int:
    """Run `argv` as ranks 0..n-1 on this host; return the job's exit status as a shell would.

    `env` replaces the parent environment as the base of every rank's (as in subprocess); the
    SHMCOLL_* variables are set on top of it. `timeout` (seconds) bounds the whole job: past it
    every rank is stopped and 124 is returned. `tag_output` prefixes each output line with `[rank] `.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgument(f"the number of ranks must be an integer >= 1, got {n!r}")
    if not argv:
        raise InvalidArgument("no program to run")
    port = free_port() if master_port is None else master_port
    shared = job_env(n, port, os.environ if env is None else env)
    mux = OutputMux(sys.stdout.buffer, sys.stderr.buffer) if tag_output else None
    envs = [rank_env(shared, i, i) for i in range(n)]
    return run_job(lambda: start_ranks(program_argv(argv), envs, mux), argv[0], timeout=timeout, mux=mux)
