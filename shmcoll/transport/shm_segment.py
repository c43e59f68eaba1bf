"""One host's shared memory: one segment, the only named object a job makes on a host.

The local leader creates it (every page of the segment reserved at once, so that a /dev/shm
filling up later cannot kill a rank with SIGBUS), every local rank attaches, and then the name is
unlinked at once: the kernel frees the memory when the last process using it exits, so nothing is
left in /dev/shm even after `kill -9` of every rank. Names carry the creator's pid and the job id; a leader
also removes names left by creators that no longer exist (a crash in the short create-to-unlink
window), so even that cannot accumulate.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import posix_ipc

from ..errors import ShmSetupError
from .shm_layout import (
    HOST_HEADER_BYTES,
    MAGIC,
    STATE_ATTACHED,
    W_BLOCKS,
    W_MAGIC,
    W_N_LOCAL,
    W_N_SLOTS,
    W_PIDS,
    W_SLOT_BYTES,
    W_STATES,
    Layout,
)

SHM_DIR = "/dev/shm"
NAME_TAG = "shmcoll"
_ROOM_ADVICE = (f"Give the container more (docker run --shm-size=1g), free space in {SHM_DIR}, lower "
                f"SHMCOLL_SHM_SLOT_BYTES / SHMCOLL_SHM_SLOTS, or use transport='tcp'.")


def pid_alive(pid: int) -> bool:
    """True while process pid exists and is not a zombie (a killed rank its parent has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def name_prefix(job_id: str, pid: int | None = None) -> str:
    """Names of the segment a process (this one by default) creates for a job: the pid lets a later
    job tell a dead creator's leftovers, and lets the creator's peers name them without asking."""
    return f"/{NAME_TAG}-{os.getpid() if pid is None else pid}-{job_id}"


def segment_name(prefix: str) -> str:
    """The name of the segment under `prefix` in /dev/shm."""
    return f"{prefix}-mem"


def unlink_names(prefix: str) -> None:
    """Remove the segment's name under `prefix`, whether or not it (still) exists: what a host's
    surviving ranks do when start-up fails, since the creator may be dead."""
    try:
        posix_ipc.unlink_shared_memory(segment_name(prefix))
    except posix_ipc.ExistentialError:
        pass


def free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 1 << 62  # no /dev/shm to measure (another OS): let the create call decide
    return st.f_bavail * st.f_frsize


def reserve(fd: int, layout: Layout) -> None:
    """Back every page of the new segment now. ftruncate leaves it sparse: pages are found on first
    touch, and if /dev/shm has filled up meanwhile (a container's 64 MB, DataLoader workers passing
    batches through it) that touch kills the rank with SIGBUS in the middle of a collective. A
    reservation that fails here is an error at init that says what to do."""
    if not hasattr(os, "posix_fallocate"):
        return  # not Linux: the size check in create_segment is all there is
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
    except OSError as exc:
        raise ShmSetupError(
            f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB of shared memory for {layout.n_local} local ranks "
            f"in {SHM_DIR} ({exc.strerror}; {free_bytes() / 2**20:.1f} MiB free now). {_ROOM_ADVICE}") from exc


def sweep_stale() -> list[str]:
    """Unlink shmcoll names whose creating process is gone; returns what was removed."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed = []
    for entry in names:
        is_sem = entry.startswith("sem.")
        name = entry[4:] if is_sem else entry
        parts = name.split("-", 2)
        if len(parts) < 3 or parts[0] != NAME_TAG or not parts[1].isdigit() or pid_alive(int(parts[1])):
            continue
        try:
            (posix_ipc.unlink_semaphore if is_sem else posix_ipc.unlink_shared_memory)("/" + name)
            removed.append(entry)
        except posix_ipc.ExistentialError:
            pass
    return removed


class Segment:
    """The mapped segment (`mem`, a uint8 array; `words`, its host header as uint64)."""

    def __init__(self, prefix: str, layout: Layout, create: bool):
        self.prefix, self.layout = prefix, layout
        self._named = False  # whether unlink() still has the name to remove
        try:
            self._map(posix_ipc.O_CREX if create else 0, create)
        except BaseException:
            if create:
                self.unlink()
            self.close()
            raise

    def _map(self, flags: int, create: bool) -> None:
        name = segment_name(self.prefix)
        shm = posix_ipc.SharedMemory(name, flags, mode=0o600, size=self.layout.total_bytes if create else 0)
        self._named = True
        try:
            if create:
                reserve(shm.fd, self.layout)
            if shm.size < self.layout.total_bytes:
                raise ShmSetupError(f"segment {name} is {shm.size} bytes, expected {self.layout.total_bytes}")
            self._mmap = mmap.mmap(shm.fd, self.layout.total_bytes)
        finally:
            shm.close_fd()
        self.mem = np.frombuffer(self._mmap, dtype=np.uint8)
        self.words = self.mem[:HOST_HEADER_BYTES].view(np.uint64)
        if create:
            self.words[[W_N_LOCAL, W_SLOT_BYTES, W_N_SLOTS, W_BLOCKS]] = [
                self.layout.n_local, self.layout.slot_bytes, self.layout.n_slots, self.layout.blocks]
            self.words[W_MAGIC] = MAGIC
        elif self.words[W_MAGIC] != MAGIC:
            raise ShmSetupError(f"segment {name} is not a shmcoll segment")

    def register(self, local: int) -> None:
        """Record this process as local rank `local` (its pid lets peers notice its death)."""
        self.words[W_PIDS + local] = os.getpid()
        self.words[W_STATES + local] = STATE_ATTACHED

    def unlink(self) -> None:
        """Remove the name (idempotent); processes that attached keep using the memory."""
        if self._named:
            unlink_names(self.prefix)
            self._named = False

    def close(self) -> None:
        """Unmap the segment (set-up may have stopped before it was mapped)."""
        mapping = self.__dict__.pop("_mmap", None)
        if mapping is not None:
            for view in ("mem", "words"):  # our own views of the mapping, so that it can close
                self.__dict__.pop(view, None)
            try:
                mapping.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process


def create_segment(job_id: str, layout: Layout) -> Segment:
    """The leader's side: check space, sweep stale names, create. ShmSetupError says what to do."""
    sweep_stale()
    need, free = layout.total_bytes, free_bytes()
    if need > free:
        raise ShmSetupError(
            f"shared memory for {layout.n_local} local ranks needs {need / 2**20:.1f} MiB but {SHM_DIR} has only "
            f"{free / 2**20:.1f} MiB free. {_ROOM_ADVICE}")
    try:
        return Segment(name_prefix(job_id), layout, create=True)
    except (posix_ipc.Error, OSError) as exc:
        raise ShmSetupError(f"cannot create shared memory in {SHM_DIR}: {exc}") from exc


def attach_segment(prefix: str, layout: Layout) -> Segment:
    try:
        return Segment(prefix, layout, create=False)
    except (posix_ipc.Error, OSError) as exc:
        raise ShmSetupError(f"cannot attach to shared memory {prefix}: {exc}") from exc
