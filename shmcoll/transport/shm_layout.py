"""Shared-memory layout of one host's segment: where each header field, channel and slot lives.

No I/O, so the arithmetic is unit-tested alone. One segment per host holds a host header (magic,
geometry, the abort flag and reason, each local rank's pid, state and last board call read), a
board (two entries per local rank, alternating by sequence number, where small collectives publish
their whole input for every peer to read; shm_board.py) and one channel per ordered pair of local
ranks. A channel is a ring of fixed-size slots; each slot is a 128-byte header (the wire frame
header of the message, then the chunk's offset and length) followed by its payload.
Which slot is next is counted privately by the one writer and the one reader of a channel; the two
POSIX semaphores of the channel (slots filled, slots free) carry both the waiting and the ordering.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .frame import HEADER_SIZE

MAGIC = 0x53484D434F4C4C32  # "SHMCOLL2"
HOST_HEADER_BYTES = 8192
SLOT_HEADER_BYTES = 128
CHUNK = struct.Struct("<QI")  # offset of this chunk in the message, its length; after the frame header
assert HEADER_SIZE + CHUNK.size == SLOT_HEADER_BYTES
BOARD_HEADER_OFFSET = 8  # in a board entry: the published word, then the frame header,
BOARD_SLEEPERS_OFFSET = BOARD_HEADER_OFFSET + HEADER_SIZE  # then a u32: ranks asleep on the published word
assert BOARD_SLEEPERS_OFFSET + 4 <= SLOT_HEADER_BYTES
MAX_LOCAL = 256
#: Reserved memory per local rank at most: the segment is backed at init (shm_segment.reserve), and
#: the default geometry's n*(n-1) channels (116 MiB at 8 ranks, 488 MiB at 16, 8 GiB at 64) would
#: make that grow with the square of the ranks. Beyond 16 ranks the channels shrink to stay linear.
BUDGET_PER_RANK = 32 << 20

# u64 word indices in the host header
W_MAGIC, W_N_LOCAL, W_SLOT_BYTES, W_N_SLOTS, W_ABORT, W_ABORT_LEN, W_DONE_SLEEPERS = range(7)
# (W_DONE_SLEEPERS: its low u32 counts the ranks asleep on some rank's W_DONE word)
W_PIDS = 64  # MAX_LOCAL words: each local rank's pid
W_STATES = W_PIDS + MAX_LOCAL  # MAX_LOCAL words: STATE_* below
W_DONE = W_STATES + MAX_LOCAL  # MAX_LOCAL words: 1 + the sequence number of the last board call each rank finished
ABORT_TEXT_OFFSET = 8 * (W_DONE + MAX_LOCAL)
ABORT_TEXT_BYTES = HOST_HEADER_BYTES - ABORT_TEXT_OFFSET
STATE_ATTACHED, STATE_DEPARTED = 1, 2


@dataclass(frozen=True)
class Layout:
    n_local: int
    slot_bytes: int  # payload bytes per slot, a multiple of 64
    n_slots: int  # slots per channel
    board_bytes: int = 64 << 10  # payload bytes of one board entry, a multiple of 64

    def __post_init__(self):
        if not 1 <= self.n_local <= MAX_LOCAL:
            raise ValueError(f"{self.n_local} local ranks; at most {MAX_LOCAL} share one segment")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot size {self.slot_bytes} is not a positive multiple of 64")
        if self.n_slots < 2:
            raise ValueError(f"{self.n_slots} slots per channel; at least 2 are needed to overlap")
        if self.board_bytes < 0 or self.board_bytes % 64:
            raise ValueError(f"board entry size {self.board_bytes} is not a multiple of 64")

    @property
    def slot_stride(self) -> int:
        return SLOT_HEADER_BYTES + self.slot_bytes

    @property
    def channel_bytes(self) -> int:
        return self.n_slots * self.slot_stride

    @property
    def n_channels(self) -> int:
        return self.n_local * (self.n_local - 1)

    @property
    def board_stride(self) -> int:
        return SLOT_HEADER_BYTES + self.board_bytes

    @property
    def channels_offset(self) -> int:
        return HOST_HEADER_BYTES + 2 * self.n_local * self.board_stride

    @property
    def total_bytes(self) -> int:
        return self.channels_offset + self.n_channels * self.channel_bytes

    def board_offset(self, local: int, seq: int) -> int:
        """Byte offset of the board entry local rank `local` writes for sequence number `seq`: one
        word (1 + the sequence number once published), the frame header, then the payload."""
        if not 0 <= local < self.n_local:
            raise ValueError(f"no board entry for local rank {local}")
        return HOST_HEADER_BYTES + (2 * local + seq % 2) * self.board_stride

    def channel_index(self, src: int, dst: int) -> int:
        """Channels exist for src != dst only, numbered densely."""
        if src == dst or not (0 <= src < self.n_local and 0 <= dst < self.n_local):
            raise ValueError(f"no channel from local rank {src} to {dst}")
        return src * (self.n_local - 1) + (dst if dst < src else dst - 1)

    def slot_offset(self, src: int, dst: int, slot: int) -> int:
        """Byte offset of slot number `slot` (counted from 0 forever; wraps around the ring)."""
        channel = self.channels_offset + self.channel_index(src, dst) * self.channel_bytes
        return channel + (slot % self.n_slots) * self.slot_stride


def shm_budget(n_local: int, free: int) -> int:
    """Bytes a segment may reserve: half of what /dev/shm has free, and at most BUDGET_PER_RANK
    per local rank."""
    return min(free // 2, n_local * BUDGET_PER_RANK)


def fit_layout(n_local: int, slot_bytes: int, n_slots: int, budget: int, board_bytes: int = 64 << 10) -> Layout:
    """The requested geometry, or fewer/smaller slots so the segment fits in `budget` bytes.

    Many local ranks mean n*(n-1) channels; rather than failing on a small /dev/shm, shrink each
    channel down to 2 slots of 64 KiB. Raises ValueError when even that does not fit.
    """
    layout = Layout(n_local, slot_bytes, n_slots, board_bytes)
    while layout.total_bytes > budget:
        if layout.n_slots > 2:
            layout = Layout(n_local, layout.slot_bytes, max(2, layout.n_slots // 2), board_bytes)
        elif layout.slot_bytes > 64 << 10:
            layout = Layout(n_local, max(64 << 10, layout.slot_bytes // 2 // 64 * 64), layout.n_slots, board_bytes)
        else:
            raise ValueError(f"{n_local} local ranks need at least {layout.total_bytes} bytes of shared memory")
    return layout
