"""A rank that forks (a worker pool, a checkpoint writer, user code) keeps its group: the child never
acts on the group it inherited (runner.py's fork hook), whichever way it ends, and a collective
in the child is refused with an error that says why. Real launched jobs, because the exit paths
that used to break the parent's job run the interpreter's own shutdown (atexit), which a test
harness that ends its processes with os._exit would skip."""

from __future__ import annotations

import json
import subprocess

import pytest

from bounds import RUN_HANG_S, WAIT_HANG_S
from harness import REPO, launcher_cmd, subprocess_env

pytestmark = pytest.mark.multiprocess

#: How the forked child of rank 1 ends, one child per round.
EXITS = ["sys.exit", "exception", "close then sys.exit", "os._exit", "end of program"]

PROGRAM = '''
import json
import numpy as np
import shmcoll

EXITS = __EXITS__
if os.environ.get("SIMULATED_HOSTS"):
    os.environ["SHMCOLL_HOST_ID"] = f"host{RANK % 2}"  # ranks 1 and 3 share a host, 0 and 2 the other
started()
pg = shmcoll.init()


def check(round):
    """A ring-sized and a board-sized all_reduce and a barrier, each result checked."""
    for count in (1 << 18, 4):
        x = np.full(count, pg.rank + round, np.float32)
        pg.all_reduce(x)
        assert (x == sum(r + round for r in range(WORLD))).all(), (round, x[:4])
    pg.barrier()


def in_child(how):
    """What the child does with its parent's group: try a call, then end as `how` says."""
    try:
        pg.all_reduce(np.ones(4, np.float32))
        note(f"child-{EXITS.index(how)}", json.dumps(["ran", ""]))
    except shmcoll.CollectiveError as exc:
        note(f"child-{EXITS.index(how)}", json.dumps([type(exc).__name__, str(exc)]))
    if how == "sys.exit":
        sys.exit(0)
    if how == "exception":
        raise RuntimeError("the child fails")
    if how == "close then sys.exit":
        pg.close()
        sys.exit(0)
    if how == "os._exit":
        os._exit(0)
    # "end of program": return, and the interpreter ends normally below


def reap(pid):
    """Wait (bounded) for the child to end."""
    fd = os.pidfd_open(pid)
    ready, _, _ = select.select([fd], [], [], __WAIT__)
    os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        sys.exit("the forked child did not end")
    os.waitpid(pid, 0)


check(0)
for round, how in enumerate(EXITS, 1):
    if RANK == 1:
        pid = os.fork()
        if pid == 0:
            in_child(how)
            break  # only "end of program" returns
        reap(pid)
    check(round)
else:
    pg.close()
    note(f"rank{RANK}.done", "1")
'''.replace("__EXITS__", repr(EXITS)).replace("__WAIT__", repr(WAIT_HANG_S))


@pytest.mark.parametrize("transport, n", [("shm", 3), ("tcp", 3), ("hier", 4)])
def test_forked_child_never_breaks_its_parents_group(job, transport, n):
    env = subprocess_env() | {"SHMCOLL_TRANSPORT": transport}
    if transport == "hier":
        env["SIMULATED_HOSTS"] = "1"
    run = subprocess.run(launcher_cmd("-n", str(n), job.program(PROGRAM), str(job.dir)), cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=RUN_HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert all((job.dir / f"rank{r}.done").exists() for r in range(n)), run.stderr
    for i, how in enumerate(EXITS):
        kind, message = json.loads((job.dir / f"child-{i}").read_text())
        assert kind == "InvalidArgument", (how, kind, message)
        assert "forked" in message and "shmcoll.init()" in message, message
    assert "RuntimeError: the child fails" in run.stderr  # the failing child really raised
