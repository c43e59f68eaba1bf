"""Hostfile jobs: each rank starts on its host through an rsh command and is supervised like a local one.

Every rank runs `RSH HOST PYTHON .../remote.py`; the rank's spec (program, environment, working
directory) goes over the supervisor's stdin as one JSON line, so no secret appears on a command
line and only the interpreter and script paths need quoting. Those paths are quoted for the two
kinds of rsh command there are:

- ssh and rsh join their arguments with spaces and have the remote login shell parse the result:
  the remote command is sent as one POSIX-shell-quoted string (the remote shell must be sh-like);
- everything else (`ip netns exec`, `docker exec`, `sudo -u`, a wrapper script that execs its
  arguments) runs its arguments as an argv: they are passed as they are.

Which kind is decided by the rsh program's file name (`ssh`, `rsh`, ...). The launcher keeps the
write end of each supervisor's stdin: closing it (or the launcher dying, which closes it) stops
that rank on its host, helpers included; `signal N` lines forward Ctrl-C.
"""

from __future__ import annotations

import os
import select
import shlex
import signal
import site
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from shmcoll.errors import InvalidArgument
from shmcoll.launch import remote
from shmcoll.launch.hostfile import Host, Placement, place_ranks
from shmcoll.launch.local import Rank, free_port, job_env, popen_rank, program_argv, rank_env, run_job, stop_ranks
from shmcoll.launch.remote import signal_group, signal_line, stop_line
from shmcoll.launch.tagout import OutputMux

SHELL_RSH = frozenset({"ssh", "rsh", "slogin", "autossh"})  # remote command re-parsed by a shell
FORWARDED_VARS = ("PATH", "PYTHONPATH")  # besides every SHMCOLL_* variable and -x names
REMOTE_MARGIN_S = 3.0  # beyond the grace period: the stop travels to the host and the status back
SPEC_WRITE_S = 10.0    # a spec larger than the pipe waits this long for the supervisor to read it


def rsh_is_shell(rsh: Sequence[str]) -> bool:
    """True when the rsh command hands the remote command to a shell (ssh), False when it execs argv."""
    return os.path.basename(rsh[0]) in SHELL_RSH


def rsh_argv(rsh: Sequence[str], host: str, remote_argv: Sequence[str]) -> list[str]:
    """The local command that runs remote_argv on host, quoted so it arrives as exactly that argv."""
    if rsh_is_shell(rsh):
        return [*rsh, host, shlex.join(remote_argv)]
    return [*rsh, host, *remote_argv]


def supervisor_argv(python: str = sys.executable) -> list[str]:
    """The supervisor as a plain script: same interpreter and path on every host, like mpirun's prefix."""
    return [python, str(Path(remote.__file__).resolve())]


def _package_root() -> str | None:
    """The directory holding `shmcoll` when it runs from a checkout; None when it is installed."""
    root = str(Path(remote.__file__).resolve().parents[2])
    sites = set(site.getsitepackages() + [site.getusersitepackages()])
    return None if root in sites else root


def forwarded_env(base: Mapping[str, str], export: Iterable[str] = ()) -> dict[str, str]:
    """What the launcher passes on to remote ranks: SHMCOLL_*, PATH, PYTHONPATH, and -x NAME[=VALUE]."""
    env = {k: v for k, v in base.items() if k.startswith("SHMCOLL_") or k in FORWARDED_VARS}
    for item in export:
        name, eq, value = item.partition("=")
        if eq:
            env[name] = value
        elif name in base:
            env[name] = base[name]
    root = _package_root()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root is not None and root not in paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [root])  # last: never shadows what the user set
    return env


def placement_env(shared: Mapping[str, str], p: Placement) -> dict[str, str]:
    """One remote rank's variables: the job's, its rank numbers, and its host from the hostfile."""
    env = rank_env(shared, p.rank, p.local_rank)
    env.update(SHMCOLL_LOCAL_WORLD_SIZE=str(p.local_world_size), SHMCOLL_HOST_ID=p.host)
    return env


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write data to a non-blocking pipe before the deadline; False if the reader never took it."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([], [fd], [], left)
        except OSError:
            return False
    return True


@dataclass
class RemoteRank(Rank):
    """A rank on another host: `proc` is the local rsh process, `control` the supervisor's stdin."""

    host: str = ""
    control: int | None = None
    stop_margin: ClassVar[float] = REMOTE_MARGIN_S

    def where(self) -> str:
        return f"on {self.host}, rsh pid {self.proc.pid}"

    def send(self, data: bytes, wait: float = 0.0) -> bool:
        """A control message; a gone supervisor is not an error (it is already stopping)."""
        fd = self.control
        return fd is not None and _write_all(fd, data, time.monotonic() + wait)

    def forward(self, sig: int) -> None:
        self.send(signal_line(sig))

    def terminate(self, sig: int, grace: float) -> None:
        self.send(stop_line(sig, grace))
        self.close()  # end of file: the supervisor stops the rank even if the line was lost

    def kill(self) -> None:
        self.close()
        signal_group(self.proc.pid, signal.SIGKILL)  # the local rsh process and anything it started here

    def close(self) -> None:
        fd, self.control = self.control, None  # cleared first: a signal handler may run in between
        if fd is not None:
            os.close(fd)


def start_remote(placements: Sequence[Placement], rsh: Sequence[str], specs: Sequence[bytes],
                 mux: OutputMux | None = None) -> list[Rank]:
    """Start every rank's supervisor through rsh and hand it its spec; all or none are left running."""
    ranks: list[Rank] = []
    try:
        for p, spec in zip(placements, specs):
            r, w = os.pipe()
            try:
                proc = popen_rank(rsh_argv(rsh, p.host, supervisor_argv()), os.environ, stdin=r,
                                  rank=p.rank, mux=mux)
            except BaseException:
                os.close(w)
                raise
            finally:
                os.close(r)
            os.set_blocking(w, False)  # a control write must never block the launcher
            rank = RemoteRank(p.rank, proc, host=p.host, control=w)
            ranks.append(rank)
            if not rank.send(spec, wait=SPEC_WRITE_S):
                raise OSError(f"rank {p.rank} on {p.host} did not take its spec within {SPEC_WRITE_S:g} s")
    except BaseException:
        stop_ranks(ranks, grace=0.0)
        for started in ranks:
            started.close()
        raise
    return ranks


def launch_hosts(hosts: list[Host], argv: list[str], *, n: int | None = None, rsh: str = "ssh",
                 master_addr: str | None = None, master_port: int | None = None, timeout: float | None = None,
                 tag_output: bool = False, export: Iterable[str] = (), env: Mapping[str, str] | None = None) -> int:
    """Run argv as the ranks of a hostfile job; the job's exit status as a shell would report it.

    Rendezvous on master_addr (default: rank 0's host) and master_port (default: a port free here).
    Every rank's SHMCOLL_HOST_ID is its hostfile name, so ranks on one host share memory and ranks on
    different hosts never try to, whatever the hosts' own names are.
    """
    if not argv:
        raise InvalidArgument("no program to run")
    rsh_words = shlex.split(rsh)
    if not rsh_words:
        raise InvalidArgument("--rsh must name a command (for example 'ssh' or 'ip netns exec')")
    placements = place_ranks(hosts, n)
    addr = master_addr or placements[0].host
    port = master_port or free_port()
    shared = job_env(len(placements), port, forwarded_env(os.environ if env is None else env, export), addr=addr)
    cwd = os.getcwd()
    specs = [remote.spec_line(program_argv(argv), placement_env(shared, p), cwd, p.rank, p.host)
             for p in placements]
    mux = OutputMux(sys.stdout.buffer, sys.stderr.buffer) if tag_output else None
    return run_job(lambda: start_remote(placements, rsh_words, specs, mux), rsh_words[0], timeout=timeout, mux=mux)
