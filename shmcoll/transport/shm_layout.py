"""Shared-memory layout of one host's segment: where each header field, channel and slot lives.

No I/O, so the arithmetic is unit-tested alone. One segment per host holds, in this order:
  * a host header: magic, geometry, the abort flag and reason, each local rank's pid, state and
    last board call read;
  * a board: two entries per local rank, alternating by sequence number, where small collectives
    publish their whole input for every peer to read (shm_board.py);
  * a control block per ordered pair of local ranks (n*n of them, the diagonal unused): the count
    of slots its writer has filled, the count its reader has consumed (each on its own cache line,
    with a count of the processes asleep on it) and which ring the pair's slots are in;
  * a lane per ordered pair: a small ring of LANE_SLOTS slots of LANE_BYTES, where every pair
    starts and where short messages stay;
  * channel blocks: rings of the configured geometry, `blocks_per_rank` owned by each rank. A
    writer moves a pair onto one of its blocks the first time it sends that peer a message longer
    than a lane slot; the block's first slot number goes in the control block, so the reader can
    tell which ring any slot number is in. Block 0 of each rank is kept for its successor in
    local order, the peer every ring and chain algorithm streams to; the others go back to the
    writer once the peer holding one has read every slot, for the next peer that needs one.
So memory grows with the ranks times the blocks (linear), plus n*(n-1) lanes of 8.25 KiB, not with
n*(n-1) full rings. The counts carry both waiting (a futex on the word) and ordering (release
stores, acquire loads; kernels.py): no named semaphore exists, only the segment itself.

A slot is a 128-byte header (the wire frame header of the message, then the chunk's offset and
length) followed by its payload.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

from .frame import HEADER_SIZE

MAGIC = 0x53484D434F4C4C33  # "SHMCOLL3"
HOST_HEADER_BYTES = 8192
SLOT_HEADER_BYTES = 128
CHUNK = struct.Struct("<QI")  # offset of this chunk in the message, its length; after the frame header
assert HEADER_SIZE + CHUNK.size == SLOT_HEADER_BYTES
BOARD_HEADER_OFFSET = 8  # in a board entry: the published word, then the frame header,
BOARD_SLEEPERS_OFFSET = BOARD_HEADER_OFFSET + HEADER_SIZE  # then a u32: ranks asleep on the published word
assert BOARD_SLEEPERS_OFFSET + 4 <= SLOT_HEADER_BYTES
#: Reserved memory per local rank at most (the segment is backed at init: shm_segment.reserve).
BUDGET_PER_RANK = 32 << 20
#: Channel blocks all ranks together may own (each rank gets between MIN_BLOCKS_PER_RANK and one per
#: peer): at the default geometry, one per peer up to 11 ranks, 7 at 16, 3 at 32, the minimum from 43.
BLOCKS_BUDGET = 256 << 20
MIN_BLOCKS_PER_RANK = 2
#: A board entry's payload bytes by default (board_bytes_for): this over the local ranks, within
#: MIN_BOARD_BYTES and MAX_BOARD_BYTES.
BOARD_READ_BUDGET = 8 << 20
MIN_BOARD_BYTES, MAX_BOARD_BYTES = 256 << 10, 4 << 20
MAX_LOCAL = 256
LANE_SLOTS, LANE_BYTES = 2, 4096  # every pair's own small ring
LANE_STRIDE = SLOT_HEADER_BYTES + LANE_BYTES

# A pair's control block: two cache lines, the writer's then the reader's.
CONTROL_BYTES = 128
C_WRITTEN = 0  # u64: slots the writer has filled
C_WRITTEN_SLEEPERS = 8  # u32: processes asleep on C_WRITTEN
C_BLOCK = 16  # u64: which ring the pair uses from which slot on (0: its lane from the start)
#: C_BLOCK: (first slot number in the ring) << BLOCK_FROM_SHIFT | (1 + the block's global index, or 0
#: for the lane), one word so that a reader never sees half of it
BLOCK_FROM_SHIFT = 16
assert MAX_LOCAL * (MAX_LOCAL - 1) < 1 << BLOCK_FROM_SHIFT
C_CONSUMED = 64  # u64: slots the reader has consumed
C_CONSUMED_SLEEPERS = 72  # u32: processes asleep on C_CONSUMED

# u64 word indices in the host header
W_MAGIC, W_N_LOCAL, W_SLOT_BYTES, W_N_SLOTS, W_ABORT, W_ABORT_LEN, W_DONE_SLEEPERS, W_BLOCKS = range(8)
# (W_DONE_SLEEPERS: its low u32 counts the ranks asleep on some rank's W_DONE word)
W_PIDS = 64  # MAX_LOCAL words: each local rank's pid
W_STATES = W_PIDS + MAX_LOCAL  # MAX_LOCAL words: STATE_* below
W_DONE = W_STATES + MAX_LOCAL  # MAX_LOCAL words: 1 + the sequence number of the last board call each rank finished
ABORT_TEXT_OFFSET = 8 * (W_DONE + MAX_LOCAL)
ABORT_TEXT_BYTES = HOST_HEADER_BYTES - ABORT_TEXT_OFFSET
STATE_ATTACHED, STATE_DEPARTED = 1, 2


@dataclass(frozen=True)
class Ring:
    """Where a ring of slots is: its first slot's byte offset, the distance between slots, how many."""

    base: int
    stride: int
    n_slots: int

    @property
    def slot_bytes(self) -> int:
        return self.stride - SLOT_HEADER_BYTES

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ring position `slot` (counted from the ring's first slot; wraps around)."""
        return self.base + (slot % self.n_slots) * self.stride


@dataclass(frozen=True)
class Layout:
    n_local: int
    slot_bytes: int  # payload bytes per slot of a channel block, a multiple of 64
    n_slots: int  # slots per channel block
    board_bytes: int = 64 << 10  # payload bytes of one board entry, a multiple of 64
    blocks_per_rank: int = 1  # channel blocks each rank owns (at most one per peer counts)

    def __post_init__(self):
        if not 1 <= self.n_local <= MAX_LOCAL:
            raise ValueError(f"{self.n_local} local ranks; at most {MAX_LOCAL} share one segment")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot size {self.slot_bytes} is not a positive multiple of 64")
        if self.n_slots < 2:
            raise ValueError(f"{self.n_slots} slots per channel; at least 2 are needed to overlap")
        if self.board_bytes < 0 or self.board_bytes % 64:
            raise ValueError(f"board entry size {self.board_bytes} is not a multiple of 64")
        if self.blocks_per_rank < 0:
            raise ValueError(f"{self.blocks_per_rank} channel blocks per rank")

    @property
    def slot_stride(self) -> int:
        return SLOT_HEADER_BYTES + self.slot_bytes

    @property
    def channel_bytes(self) -> int:
        """Bytes of one channel block."""
        return self.n_slots * self.slot_stride

    @property
    def blocks(self) -> int:
        """Channel blocks each rank really has: never more than it has peers."""
        return min(self.blocks_per_rank, self.n_local - 1)

    @property
    def board_stride(self) -> int:
        return SLOT_HEADER_BYTES + self.board_bytes

    @property
    def controls_offset(self) -> int:
        return HOST_HEADER_BYTES + 2 * self.n_local * self.board_stride

    @property
    def lanes_offset(self) -> int:
        return self.controls_offset + self.n_local * self.n_local * CONTROL_BYTES

    @property
    def blocks_offset(self) -> int:
        return self.lanes_offset + self.n_local * (self.n_local - 1) * LANE_SLOTS * LANE_STRIDE

    @property
    def total_bytes(self) -> int:
        return self.blocks_offset + self.n_local * self.blocks * self.channel_bytes

    def board_offset(self, local: int, seq: int) -> int:
        """Byte offset of the board entry local rank `local` writes for sequence number `seq`: one
        word (1 + the sequence number once published), the frame header, then the payload."""
        if not 0 <= local < self.n_local:
            raise ValueError(f"no board entry for local rank {local}")
        return HOST_HEADER_BYTES + (2 * local + seq % 2) * self.board_stride

    def pair_index(self, src: int, dst: int) -> int:
        """Lanes exist for src != dst only, numbered densely."""
        if src == dst or not (0 <= src < self.n_local and 0 <= dst < self.n_local):
            raise ValueError(f"no channel from local rank {src} to {dst}")
        return src * (self.n_local - 1) + (dst if dst < src else dst - 1)

    def control_offset(self, src: int, dst: int) -> int:
        """Byte offset of the pair's control block (C_* above are offsets inside it)."""
        self.pair_index(src, dst)
        return self.controls_offset + (src * self.n_local + dst) * CONTROL_BYTES

    def lane(self, src: int, dst: int) -> Ring:
        return Ring(self.lanes_offset + self.pair_index(src, dst) * LANE_SLOTS * LANE_STRIDE, LANE_STRIDE, LANE_SLOTS)

    def block_index(self, owner: int, number: int) -> int:
        """The global index of channel block `number` of local rank `owner` (what C_BLOCK holds, less 1)."""
        if not (0 <= owner < self.n_local and 0 <= number < self.blocks):
            raise ValueError(f"local rank {owner} has no channel block {number}")
        return owner * self.blocks + number

    def block(self, index: int) -> Ring:
        """The ring of channel block `index` (a global index, as block_index gives)."""
        if not 0 <= index < self.n_local * self.blocks:
            raise ValueError(f"no channel block {index}")
        return Ring(self.blocks_offset + index * self.channel_bytes, self.slot_stride, self.n_slots)


def blocks_per_rank(n_local: int, channel_bytes: int) -> int:
    """Channel blocks each rank gets: one per peer while BLOCKS_BUDGET allows, and never fewer than
    MIN_BLOCKS_PER_RANK (its ring successor's and one more), so that memory stays linear."""
    share = BLOCKS_BUDGET // max(1, n_local * channel_bytes)
    return min(max(n_local - 1, 0), max(MIN_BLOCKS_PER_RANK, share))


def board_bytes_for(n_local: int) -> int:
    """The board entry's default payload size: 4 MiB for 2 local ranks, 2 MiB for 4, 1 MiB for 8,
    512 KiB for 16, 256 KiB from 32. One board step (publish, then read every peer's entry) beats
    a ring's 2(n - 1) steps while a rank reads little (shmcoll-bench on 2 cores: at 2 and 4 ranks,
    512 KiB to 4 MiB all-reduces on the board took 0.2-0.9x the ring's time); what a rank reads,
    n - 1 entries, stays under BOARD_READ_BUDGET, and the board's share of the segment (2 n
    entries) near twice that."""
    share = BOARD_READ_BUDGET // max(n_local, 1) // 64 * 64
    return max(MIN_BOARD_BYTES, min(MAX_BOARD_BYTES, share))


def shm_budget(n_local: int, free: int) -> int:
    """Bytes a segment may reserve: half of what /dev/shm has free, and at most BUDGET_PER_RANK
    per local rank."""
    return min(free // 2, n_local * BUDGET_PER_RANK)


def fit_layout(n_local: int, slot_bytes: int, n_slots: int, budget: int, board_bytes: int = 64 << 10) -> Layout:
    """The requested geometry with blocks_per_rank's count of blocks, or less so that the segment
    fits in `budget` bytes: board entries over MIN_BOARD_BYTES halved (down to it), then fewer
    slots per block (down to 2), then smaller slots (down to 64 KiB), then fewer blocks (down to
    none: every pair on its lane). Raises ValueError when even that does not fit."""
    blocks = blocks_per_rank(n_local, n_slots * (SLOT_HEADER_BYTES + slot_bytes))
    layout = Layout(n_local, slot_bytes, n_slots, board_bytes, blocks)
    while layout.total_bytes > budget:
        if layout.board_bytes > MIN_BOARD_BYTES:
            layout = dataclasses.replace(layout, board_bytes=max(MIN_BOARD_BYTES, layout.board_bytes // 2 // 64 * 64))
        elif layout.n_slots > 2:
            layout = dataclasses.replace(layout, n_slots=max(2, layout.n_slots // 2))
        elif layout.slot_bytes > 64 << 10:
            layout = dataclasses.replace(layout, slot_bytes=max(64 << 10, layout.slot_bytes // 2 // 64 * 64))
        elif layout.blocks > 0:
            layout = dataclasses.replace(layout, blocks_per_rank=layout.blocks - 1)
        else:
            raise ValueError(f"{n_local} local ranks need at least {layout.total_bytes} bytes of shared memory")
    return layout

