"""One direction of one pair of local ranks: a ring of slots plus its two semaphores.

`data` counts filled slots (the writer posts, the reader takes), `space` counts free ones (the
reader posts, the writer takes). A semaphore operation is a full memory barrier, so a slot written
before `data.release()` is complete when the reader's acquire returns. Waiting spins briefly on
the semaphore's value (yielding the core to other processes, which matters when ranks outnumber
cores), then blocks in the kernel in short slices so the caller can notice aborts, dead peers and
its deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import posix_ipc

from ..errors import CollectiveTimeout
from .shm_layout import Layout

#: Longest single block in the kernel before the waiter looks at aborts, dead peers and the deadline.
WAIT_SLICE = 0.02


class Channel:
    def __init__(self, layout: Layout, src: int, dst: int, data: posix_ipc.Semaphore, space: posix_ipc.Semaphore):
        self.layout, self.src, self.dst = layout, src, dst
        self.data, self.space = data, space
        self.count = 0  # slots this process has written (writer side) or consumed (reader side)
        self.lock = threading.Lock()  # one thread at a time per side: a message's slots stay together
        self._base, self._stride, self._n = layout.slot_offset(src, dst, 0), layout.slot_stride, layout.n_slots

    def offset(self) -> int:
        """Byte offset of the slot this side uses next (what Layout.slot_offset says, precomputed)."""
        return self._base + (self.count % self._n) * self._stride

    def advance_writer(self) -> None:
        self.count += 1
        self.data.release()

    def advance_reader(self) -> None:
        self.count += 1
        self.space.release()


def take_token(sem: posix_ipc.Semaphore, deadline: float, spin_s: float, check: Callable[[], None],
               what: str) -> None:
    """Take one token: spin up to spin_s, then block in slices; check() raises on abort or death."""
    if _try_take(sem):
        return
    end_spin = time.perf_counter() + spin_s
    while time.perf_counter() < end_spin:
        os.sched_yield()  # free the core for the peer we are waiting for when ranks outnumber cores
        if _try_take(sem):
            return
    while True:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"{what} before the deadline")
        try:
            sem.acquire(min(left, WAIT_SLICE))
            return
        except posix_ipc.BusyError:
            continue


def _try_take(sem: posix_ipc.Semaphore) -> bool:
    """Take a token if one is there, without waiting (reading the value first is cheaper than failing)."""
    if sem.value > 0:
        try:
            sem.acquire(0)
            return True
        except posix_ipc.BusyError:
            pass
    return False


def has_token(sem: posix_ipc.Semaphore) -> bool:
    return sem.value > 0
