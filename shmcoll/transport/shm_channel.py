"""One direction of one pair of local ranks: its slots and the two counts of its control block.

The pair's slots are in its lane until the writer moves it to a channel block (shm_layout.py), for
good. The writer fills slot number `written`, then stores written + 1 with release order
(kernels.store_and_wake); the reader loads the count with acquire order before it reads a slot, so
a slot it sees counted is whole. The reader stores its `consumed` count the same way after it has
read a slot, and the writer waits until the slot that last used a ring position is consumed before
it writes there again. Moving to a block is one plain store of the control block's C_BLOCK word,
made before the release of the block's first slot: a reader that has loaded that count sees it.

Waiting spins briefly on the count (yielding the core to other processes, which matters when ranks
outnumber cores), then sleeps on a futex of the word in slices, between which the caller notices
aborts, dead peers and its deadline. Every wait and store is kernels.py's: no named semaphore.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from .. import kernels
from ..errors import CollectiveTimeout
from .shm_layout import (
    BLOCK_FROM_SHIFT,
    C_BLOCK,
    C_CONSUMED,
    C_CONSUMED_SLEEPERS,
    C_WRITTEN,
    C_WRITTEN_SLEEPERS,
    Layout,
    Ring,
)

#: Longest single sleep before the waiter looks at aborts, dead peers and the deadline.
WAIT_SLICE = 0.02


class Channel:
    def __init__(self, mem: np.ndarray, layout: Layout, src: int, dst: int):
        self._mem, self._words, self._layout = mem, mem.view(np.uint64), layout
        self.count = 0  # slots this process has written (writer side) or consumed (reader side)
        self.lock = threading.Lock()  # one thread at a time per side: a message's slots stay together
        at = layout.control_offset(src, dst)
        self._written, self._written_sleepers = (at + C_WRITTEN) // 8, (at + C_WRITTEN_SLEEPERS) // 4
        self._consumed, self._consumed_sleepers = (at + C_CONSUMED) // 8, (at + C_CONSUMED_SLEEPERS) // 4
        self._block_word = (at + C_BLOCK) // 8
        self._lane = layout.lane(src, dst)
        self._block: Ring | None = None
        self._block_from = 0  # the first slot number in the block, once there is one

    @property
    def in_block(self) -> bool:
        return self._block is not None

    def _ring(self) -> Ring:
        """The ring slot number `count` is in."""
        if self._block is not None and self.count >= self._block_from:
            return self._block
        return self._lane

    def offset(self) -> int:
        """Byte offset of the slot this side uses next."""
        if self._block is not None and self.count >= self._block_from:
            return self._block.slot_offset(self.count - self._block_from)
        return self._lane.slot_offset(self.count)

    @property
    def slot_bytes(self) -> int:
        """Payload bytes of the slot this side uses next."""
        return self._ring().slot_bytes

    # ---- the writer's side ----
    def move_to_block(self, index: int) -> None:
        """From the next slot on, this pair's slots are in channel block `index` (a global index)."""
        self._block, self._block_from = self._layout.block(index), self.count
        self._words[self._block_word] = self.count << BLOCK_FROM_SHIFT | (index + 1)

    def wait_space(self, deadline: float, spin_ns: int, check: Callable[[], None], what: str) -> None:
        """Until the slot this side writes next is free: its ring position's last slot is consumed."""
        wait_count(self._mem, self._consumed, self.count - self._ring().n_slots + 1, self._consumed_sleepers,
                   deadline, spin_ns, check, what)

    def advance_writer(self) -> None:
        self.count += 1
        kernels.store_and_wake(self._mem, self._written, self.count, self._written_sleepers)

    # ---- the reader's side ----
    def wait_data(self, deadline: float, spin_ns: int, check: Callable[[], None], what: str) -> None:
        """Until the slot this side reads next is filled; then offset() says where it is."""
        wait_count(self._mem, self._written, self.count + 1, self._written_sleepers, deadline, spin_ns, check, what)
        if self._block is None:
            self._follow_writer()

    def _follow_writer(self) -> None:
        word = int(self._words[self._block_word])
        if word:
            self._block_from = word >> BLOCK_FROM_SHIFT
            self._block = self._layout.block((word & ((1 << BLOCK_FROM_SHIFT) - 1)) - 1)

    def filled(self) -> int:
        """Slots filled and not yet consumed (a hint: wait_data gives the ordering before a read)."""
        return int(self._words[self._written]) - self.count

    def has_data(self) -> bool:
        return self.filled() > 0

    def wait_briefly(self, seconds: float) -> None:
        """Until a filled slot waits or `seconds` pass, whichever comes first; takes nothing."""
        kernels.wait_word(self._mem, self._written, self.count + 1, True, self._written_sleepers, 0,
                          int(seconds * 1e9))

    def advance_reader(self) -> None:
        self.count += 1
        kernels.store_and_wake(self._mem, self._consumed, self.count, self._consumed_sleepers)


def wait_count(mem: np.ndarray, word: int, target: int, sleepers: int, deadline: float, spin_ns: int,
               check: Callable[[], None], what: str) -> None:
    """Until u64 word `word` of mem reaches target: spin up to spin_ns, then sleep in slices of at
    most WAIT_SLICE; check() runs between them and raises on abort or death."""
    if target <= 0 or kernels.wait_word(mem, word, target, True, sleepers, spin_ns, spin_ns):
        return
    while True:
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(f"{what} before the deadline")
        if kernels.wait_word(mem, word, target, True, sleepers, 0, int(min(left, WAIT_SLICE) * 1e9)):
            return
