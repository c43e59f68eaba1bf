"""The remote end of a hostfile job: a small supervisor between the rsh command and one rank.

Killing a local `ssh` client does not kill the remote command, so each remote rank runs under this
supervisor. The launcher keeps a pipe to the supervisor's stdin (through ssh, `ip netns exec` or any
other rsh command) and talks over it in lines:

    first line        the spec, one JSON object: argv, env, cwd, rank, host
    signal N          forward signal N to the program's process group (Ctrl-C at the launcher)
    stop N GRACE      send N to the group, SIGKILL it GRACE seconds later, exit
    end of file       the launcher is gone or wants the rank gone: stop SIGTERM with the default grace

SIGTERM, SIGHUP and SIGINT sent to the supervisor itself also stop the program. The program runs
in its own session so its helpers are stopped with it; the supervisor exits with the program's
status (a signal death as 128 + signal, like a shell).

This file is stdlib-only and is started as a plain script (`python .../remote.py`), so a remote
host needs neither shmcoll on its Python path nor numpy just to run the supervisor; local.py
reuses its process helpers.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

GRACE_S = 3.0          # SIGTERM -> SIGKILL, as in local.py
POLL_S = 0.02          # how often the program's exit is checked while waiting on stdin
REAP_S = 5.0           # how long to wait for a SIGKILLed program
SPEC_WAIT_S = 60.0     # the launcher writes the spec at once; waiting longer means it is gone
EXIT_SETUP = 1         # bad spec or working directory
EXIT_NOT_FOUND = 127
EXIT_NOT_EXEC = 126
STOPPING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


# --- the protocol, written by the launcher ---------------------------------------------------

def spec_line(argv: list[str], env: dict[str, str], cwd: str, rank: int, host: str) -> bytes:
    """The first line the launcher sends: everything the rank needs, none of it on a command line."""
    return (json.dumps(dict(argv=argv, env=env, cwd=cwd, rank=rank, host=host)) + "\n").encode()


def signal_line(sig: int) -> bytes:
    return f"signal {int(sig)}\n".encode()


def stop_line(sig: int, grace: float) -> bytes:
    return f"stop {int(sig)} {float(grace)!r}\n".encode()


# --- process helpers shared with local.py ------------------------------------------------------

def shell_status(rc: int) -> int:
    """A Popen returncode as a shell reports it: a signal death becomes 128 + signum."""
    return 128 - rc if rc < 0 else rc


def death_signal_hook():
    """preexec_fn asking Linux to SIGKILL the child if its parent dies (even by SIGKILL).

    Returns None where prctl is unavailable; the parent's own cleanup still covers every other exit.
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
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def signal_group(pid: int, sig: int) -> None:
    """Signal a session leader's whole process group; a group already gone is not an error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# --- the supervisor ----------------------------------------------------------------------------

class Control:
    """Lines from stdin without blocking past a deadline; None marks end of file."""

    def __init__(self, fd: int = 0):
        self.fd = fd
        self.buf = b""
        self.eof = False
        self.pending: list = []  # lines read but not yet handled

    def lines(self, timeout: float) -> list:
        if self.pending:
            lines, self.pending = self.pending, []
            return lines
        if self.eof:
            time.sleep(timeout)
            return []
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return []
        chunk = os.read(self.fd, 65536)
        if not chunk:
            self.eof = True
            return [self.buf.decode(errors="replace")] * bool(self.buf.strip()) + [None]
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return [line.decode(errors="replace") for line in done]


def _say(spec: dict, msg: str) -> None:
    print(f"shmcoll-run: rank {spec.get('rank', '?')} on {spec.get('host', '?')}: {msg}",
          file=sys.stderr, flush=True)


def read_spec(control: Control, deadline: float) -> dict | None:
    """The first line as a spec, or None if it does not come (or is not one) before the deadline."""
    while time.monotonic() < deadline:
        lines = control.lines(deadline - time.monotonic())
        if not lines:
            continue
        first, control.pending = lines[0], lines[1:]  # a control line may share the spec's read
        if first is None:
            return None
        try:
            spec = json.loads(first)
        except ValueError:
            return None
        ok = isinstance(spec, dict) and isinstance(spec.get("argv"), list) and spec["argv"]
        return spec if ok and isinstance(spec.get("env"), dict) else None
    return None


def start(spec: dict) -> subprocess.Popen | int:
    """Start the program in its own session; on failure, the exit status to report instead."""
    cwd = spec.get("cwd") or None
    if cwd is not None and not os.path.isdir(cwd):
        _say(spec, f"cannot change to directory {cwd!r}: it does not exist on this host")
        return EXIT_SETUP
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in spec["env"].items()})
    try:
        return subprocess.Popen([str(a) for a in spec["argv"]], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=death_signal_hook())
    except OSError as e:
        _say(spec, f"cannot start {spec['argv'][0]!r}: {e.strerror or e}")
        return EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else EXIT_NOT_EXEC


def stop(proc: subprocess.Popen, sig: int, grace: float) -> int:
    """Send sig to the program's group, SIGKILL it after grace, reap; the program's shell status."""
    signal_group(proc.pid, sig)
    try:
        proc.wait(timeout=max(0.0, grace))
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc.pid, signal.SIGKILL)  # also sweeps helpers of a program that did exit
    try:
        return shell_status(proc.wait(timeout=REAP_S))
    except subprocess.TimeoutExpired:
        return 128 + signal.SIGKILL


def _command(line: str) -> tuple[str, int, float]:
    """('signal'|'stop', signum, grace) from one control line; ValueError when malformed."""
    words = line.split()
    if len(words) == 2 and words[0] == "signal":
        return "signal", int(words[1]), 0.0
    if len(words) == 3 and words[0] == "stop":
        return "stop", int(words[1]), float(words[2])
    raise ValueError(line)


def supervise(proc: subprocess.Popen, control: Control, stopping: list[int]) -> int:
    """Relay control lines until the program exits or something says stop; the exit status."""
    while True:
        rc = proc.poll()
        if rc is not None:
            signal_group(proc.pid, signal.SIGKILL)  # helpers the program left behind
            return shell_status(rc)
        if stopping:
            return stop(proc, signal.SIGTERM, GRACE_S)
        for line in control.lines(POLL_S):
            if line is None:
                return stop(proc, signal.SIGTERM, GRACE_S)
            try:
                kind, sig, grace = _command(line)
            except ValueError:
                continue  # a newer launcher's message: ignore rather than kill the job
            if kind == "stop":
                return stop(proc, sig, grace)
            signal_group(proc.pid, sig)


def main() -> int:
    stopping: list[int] = []
    for sig in STOPPING:
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    control = Control(0)
    spec = read_spec(control, time.monotonic() + SPEC_WAIT_S)
    if spec is None:
        print("shmcoll-run: the remote supervisor got no valid spec on stdin", file=sys.stderr, flush=True)
        return EXIT_SETUP
    if stopping:  # stopped before the program started
        return 128 + stopping[0]
    proc = start(spec)
    if isinstance(proc, int):
        return proc
    return supervise(proc, control, stopping)


if __name__ == "__main__":
    sys.exit(main())
