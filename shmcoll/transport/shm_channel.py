"""One direction of one pair of local ranks: its slots and the two counts of its control block.

The pair's slots are in its lane until the writer moves it to a channel block (shm_layout.py); the
writer may move it back to the lane once the reader has consumed every slot, to give the block to
another peer. The writer fills slot number `written`, then stores written + 1 with release order
(kernels.store_and_wake); the reader loads the count with acquire order before it reads a slot, so
a slot it sees counted is whole. The reader stores its `consumed` count the same way after it has
read a slot, and the writer waits until the slot that last used a ring position is consumed before
it writes there again. A move is one plain store of the control block's C_BLOCK word (the first
slot number of the new ring, and which ring), made before the release of that slot: a reader that
has loaded that count sees it; slots before it are in the lane (a pair leaves a block only drained).

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
        self._map_word = (at + C_BLOCK) // 8
        self._lane = layout.lane(src, dst)
        self._seen = 0  # the map word as this side last wrote or read it
        self._ring, self._ring_from = self._lane, 0  # slots from _ring_from on are in _ring, earlier ones in the lane
        self.block: int | None = None  # the channel block the pair is on, as a global index

    @property
    def in_block(self) -> bool:
        return self.block is not None

    def _ring_of(self, slot: int) -> Ring:
        return self._ring if slot >= self._ring_from else self._lane

    def offset(self) -> int:
        """Byte offset of the slot this side uses next: a lane's positions go by the slot number
        itself, a block's from the slot the pair moved onto it."""
        if self.count >= self._ring_from and self._ring is not self._lane:
            return self._ring.slot_offset(self.count - self._ring_from)
        return self._lane.slot_offset(self.count)

    @property
    def slot_bytes(self) -> int:
        """Payload bytes of the slot this side uses next."""
        return self._ring_of(self.count).slot_bytes

    # ---- the writer's side ----
    def move_to(self, block: int | None) -> None:
        """From the next slot on, this pair's slots are in channel block `block` (a global index),
        or in its lane (None). Leaving a block needs the pair drained(): no slot the reader has yet
        to read may be in a ring the pair leaves, or in one another pair takes over."""
        self._ring = self._lane if block is None else self._layout.block(block)
        self._ring_from, self.block = self.count, block
        self._seen = self.count << BLOCK_FROM_SHIFT | (0 if block is None else block + 1)
        self._words[self._map_word] = self._seen

    def drained(self) -> bool:
        """Whether the reader has consumed every slot written (acquire: it is done reading them)."""
        return kernels.load_word(self._mem, self._consumed) == self.count

    def wait_space(self, deadline: float, spin_ns: int, check: Callable[[], None], what: str) -> None:
        """Until the slot this side writes next is free: its ring position's last slot is consumed."""
        wait_count(self._mem, self._consumed, self.count - self._ring_of(self.count).n_slots + 1,
                   self._consumed_sleepers, deadline, spin_ns, check, what)

    def advance_writer(self) -> None:
        self.count += 1
        kernels.store_and_wake(self._mem, self._written, self.count, self._written_sleepers)

    # ---- the reader's side ----
    def wait_data(self, deadline: float, spin_ns: int, check: Callable[[], None], what: str) -> None:
        """Until the slot this side reads next is filled; then offset() says where it is. The map
        word is read after the count (acquire), so it is at least as new as the writer's move that
        put this slot where it is; a later move waits for the pair to drain, so it is not newer."""
        wait_count(self._mem, self._written, self.count + 1, self._written_sleepers, deadline, spin_ns, check, what)
        word = int(self._words[self._map_word])
        if word != self._seen:
            self._follow(word)

    def _follow(self, word: int) -> None:
        self._seen, self._ring_from = word, word >> BLOCK_FROM_SHIFT
        block = (word & ((1 << BLOCK_FROM_SHIFT) - 1)) - 1
        self.block = None if block < 0 else block
        self._ring = self._lane if block < 0 else self._layout.block(block)

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
