"""The parent side of `shmcoll-bench --compare` (and of bench/compare.py): run each peer as its own
job, after shmcoll's and one after the other, and set its rows beside shmcoll's.

A peer is launched as a whole job with a timeout (its process group is killed past it) and reports
through a JSON file written by its rank 0 (peers.py). It ends as one PeerRun: "ok" with rows,
"skipped" with the reason (library or mpirun missing, or the collective/dtype/op unsupported, as
its descriptor says), or "failed" with the tail of its stderr. Nothing here prints; the ratio math
is pure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmcoll.rendezvous.launchers import LOCAL_RANK_VARS, RANK_VARS, WORLD_SIZE_VARS

from .adapters import GLOO, OPENMPI
from .collectives import COLLECTIVES
from .peers import MISSING

GRACE_S = 5.0  # between SIGTERM and SIGKILL of a peer job past its timeout
EXIT_TIMEOUT = 124


@dataclass
class PeerRun:
    """One peer's outcome: status ok / skipped / failed, why, and its rows (shmcoll-bench's JSON form)."""

    name: str
    status: str = "ok"
    reason: str = ""
    library: str = ""
    rows: list[dict[str, Any]] = field(default_factory=list)
    command: str = ""

    @property
    def wrong(self) -> int:
        return sum(r.get("wrong") or 0 for r in self.rows)

    def describe(self) -> dict[str, str]:
        return dict(status=self.status, reason=self.reason, library=self.library, command=self.command)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's rank variables, so each peer starts a job of its own."""
    drop = set(RANK_VARS) | set(WORLD_SIZE_VARS) | set(LOCAL_RANK_VARS)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra or {})
    return env


def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(status, stdout, stderr); past the timeout the whole process group is stopped and status is 124."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env() if env is None else env, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        out, err = _stop_group(proc)
        return EXIT_TIMEOUT, out, err + f"\n(killed after the {timeout:g} s timeout)"
    except BaseException:  # Ctrl-C: the job is in a session of its own, so the terminal did not stop it
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM the command's process group, SIGKILL it after GRACE_S; what it wrote meanwhile."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=GRACE_S)
            return out or "", err or ""
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def tail(text: str, lines: int = 3) -> str:
    """The last non-empty lines of a tool's output, joined on one line."""
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " | ".join(kept[-lines:]) or "(no output)"


def missing_reason(peer: str, mpirun: str = "mpirun") -> str | None:
    """Why a peer cannot start at all on this machine (checked without importing it), or None."""
    if peer == OPENMPI:
        if shutil.which(mpirun) is None:
            return f"{mpirun!r} not found on PATH (apt-get install -y openmpi-bin libopenmpi-dev)"
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed for {sys.executable} (pip install mpi4py)"
    elif importlib.util.find_spec("torch") is None:
        return f"torch is not installed for {sys.executable} (pip install torch)"
    return None


def peer_command(peer: str, n: int, sweep: list[str], rows_to: Path, timeout: float, mpirun: str = "mpirun",
                 mpirun_args: str = "") -> list[str]:
    """The command line of one peer job: mpirun for OpenMPI, shmcoll-run's launcher for gloo."""
    rank = [sys.executable, "-m", "shmcoll.bench.peers", peer, *sweep, "--rows-to", str(rows_to)]
    if peer == OPENMPI:
        return [shutil.which(mpirun) or mpirun, "--allow-run-as-root", "--oversubscribe", *shlex.split(mpirun_args),
                "-n", str(n), *rank]
    return [sys.executable, "-m", "shmcoll.launch.run_cli", "-n", str(n), "--timeout", f"{timeout:g}", *rank,
            "--timeout", f"{timeout:g}"]


def run_peer(peer: str, n: int, sweep: list[str], collective: str, dtype: str, op: str, workdir: Path,
             timeout: float, mpirun: str = "mpirun", mpirun_args: str = "") -> PeerRun:
    """One peer job over the sweep `sweep` (peers.py's options); never raises for a peer's failure."""
    res = PeerRun(peer)
    why = COLLECTIVES[collective].unsupported(peer, dtype, op) or missing_reason(peer, mpirun)
    if why:
        res.status, res.reason = "skipped", why
        return res
    out = workdir / f"{peer}.json"
    cmd = peer_command(peer, n, sweep, out, timeout, mpirun, mpirun_args)
    res.command = shlex.join(cmd)
    env = child_env({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if peer == GLOO else None)
    rc, _, err = run_command(cmd, timeout + GRACE_S, env)
    if MISSING in err:
        res.status, res.reason = "skipped", err.split(MISSING, 1)[1].splitlines()[0].strip()
        return res
    if out.exists():
        doc = json.loads(out.read_text())
        res.library, res.rows = doc["library"], doc["rows"]
    if rc in (0, 1) and res.rows:  # 1: ran, with wrong elements under --check (counted in the rows)
        return res
    res.status = "failed"
    res.reason = ("it timed out: " if rc == EXIT_TIMEOUT else f"exit {rc}: ") + tail(err)
    return res


# ---- beside shmcoll's rows (pure) ----

def ratios(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[int, float | None]:
    """size -> shmcoll's time / the peer's time (below 1: shmcoll is faster); None where either lacks it."""
    peer_time = {r["size"]: r["time_us"] for r in theirs}
    out: dict[int, float | None] = {}
    for r in mine:
        t = peer_time.get(r["size"])
        out[r["size"]] = r["time_us"] / t if t and r["time_us"] is not None else None
    return out


def with_ratios(mine: list[dict[str, Any]], peer: PeerRun) -> list[dict[str, Any]]:
    """The peer's rows, each with shmcoll_over_peer (shmcoll's time / this row's time at its size)."""
    r = ratios(mine, peer.rows)
    return [dict(row, peer=peer.name, shmcoll_over_peer=r.get(row["size"])) for row in peer.rows]


def compare_doc(mine: list[dict[str, Any]], peers: list[PeerRun]) -> dict[str, Any]:
    """--json with --compare: every row (shmcoll's and the peers'), and each peer's status."""
    rows = [dict(r, peer="shmcoll") for r in mine]
    for p in peers:
        rows += with_ratios(mine, p)
    return {"rows": rows, "peers": {p.name: p.describe() for p in peers}}
