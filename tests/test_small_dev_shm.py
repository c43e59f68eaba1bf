"""A container's small /dev/shm, for real: each job runs in a private mount namespace whose /dev/shm
is a 48 MiB tmpfs (`unshare -m`; CI runs as root). The segment is reserved at init
(shm_segment.reserve), so a /dev/shm that fills up afterwards (DataLoader workers pass batches
through it) cannot kill a rank with SIGBUS in the middle of a collective; a reservation that does
not fit is an error at init that says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from bounds import RUN_HANG_S
from harness import REPO, launcher_cmd, subprocess_env

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare(1) to mount a private /dev/shm (CI has both)"),
]

SHM_MIB = 48


def in_small_dev_shm(*command: str) -> subprocess.CompletedProcess:
    """Run command in a mount namespace of its own whose /dev/shm is a SHM_MIB tmpfs."""
    mount = f'mount -t tmpfs -o size={SHM_MIB}m shmcoll-test /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *command],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=RUN_HANG_S)


FILL_AFTER_INIT = '''
import errno
import numpy as np
import shmcoll

def fill_dev_shm():
    """Write a file into /dev/shm until it is full; returns the bytes left free."""
    with open("/dev/shm/filler", "wb", buffering=0) as f:
        for block in (1 << 20, 4096):
            try:
                while True:
                    f.write(bytes(block))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize

pg = shmcoll.init()
pg.all_reduce(np.ones(4, np.float32))
if RANK == 0:
    note("free-after-fill", str(fill_dev_shm()))
pg.barrier()
big = np.full(16 << 20, RANK + 1.0, np.float32)  # 64 MiB: every slot of every ring is touched
pg.all_reduce(big)
assert (big == sum(range(1, WORLD + 1))).all()
pg.close()
note(f"rank{RANK}.done", "1")
'''


def test_dev_shm_filling_up_after_init_does_not_kill_a_rank(job):
    n = 2
    run = in_small_dev_shm(*launcher_cmd("-n", str(n), job.program(FILL_AFTER_INIT), str(job.dir)))
    assert run.returncode == 0, run.stdout + run.stderr  # not -7 (SIGBUS)
    assert int((job.dir / "free-after-fill").read_text()) < 1 << 20  # /dev/shm really was full
    assert all((job.dir / f"rank{r}.done").exists() for r in range(n))


RESERVE_TOO_MUCH = f'''
import posix_ipc
from shmcoll.errors import ShmSetupError
from shmcoll.transport.shm_layout import Layout
from shmcoll.transport.shm_segment import reserve

layout = Layout(2, 1 << 20, {2 * SHM_MIB}, 0)  # far more than the {SHM_MIB} MiB mounted
shm = posix_ipc.SharedMemory("/shmcoll-reserve-test", posix_ipc.O_CREX, size=layout.total_bytes)  # sparse: fits
try:
    reserve(shm.fd, layout)
except ShmSetupError as exc:
    print("refused:", exc)
finally:
    shm.close_fd()
    shm.unlink()
'''


def test_a_reservation_that_does_not_fit_says_what_to_do():
    run = in_small_dev_shm(sys.executable, "-c", RESERVE_TOO_MUCH)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("refused: cannot reserve"), run.stdout
    assert "--shm-size" in run.stdout and "transport='tcp'" in run.stdout, run.stdout
