"""Shared-memory segment layout (shmcoll/transport/shm_layout.py): pure arithmetic, no I/O.

Every board entry, control block, lane slot and channel-block slot must land on its own 64-byte
aligned, non-overlapping bytes inside the segment, and together they must tile everything after the
host header (total_bytes pays for no hidden gap; the only unused bytes are the control blocks of the
diagonal pairs, which exist so that a pair's control block is found by plain arithmetic). A control
block keeps the writer's words and the reader's words on separate cache lines, so the two sides of a
pair do not bounce one line between their cores. Pairs, lanes and channel blocks are numbered
densely and reject what does not exist; a slot number (which counts up forever) wraps around its
ring. The segment must grow linearly with the local ranks, apart from the small per-pair lanes and
control blocks: that is what lets 32 ranks share one segment of at most 256 MiB while each still
streams through full-size channel blocks. fit_layout must shrink a geometry that does not fit (fewer
slots first, then smaller slots, then fewer blocks) without ever exceeding the budget. The host
header's fields must fit its fixed size, and C_BLOCK's packing must hold every block index.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcoll.transport import shm_layout as ring
from shmcoll.transport.frame import HEADER_SIZE
from shmcoll.transport.shm_layout import (
    ABORT_TEXT_BYTES,
    ABORT_TEXT_OFFSET,
    BLOCK_FROM_SHIFT,
    BLOCKS_BUDGET,
    BOARD_HEADER_OFFSET,
    BOARD_READ_BUDGET,
    BOARD_SLEEPERS_OFFSET,
    BUDGET_PER_RANK,
    C_BLOCK,
    C_CONSUMED,
    C_CONSUMED_SLEEPERS,
    C_WRITTEN,
    C_WRITTEN_SLEEPERS,
    CONTROL_BYTES,
    HOST_HEADER_BYTES,
    LANE_BYTES,
    LANE_SLOTS,
    MAX_BOARD_BYTES,
    MAX_LOCAL,
    MIN_BLOCKS_PER_RANK,
    MIN_BOARD_BYTES,
    SLOT_HEADER_BYTES,
    Layout,
    Ring,
    blocks_per_rank,
    board_bytes_for,
    fit_layout,
    shm_budget,
)

KIB, MIB = 1 << 10, 1 << 20
MIN_SLOT = 64 * KIB  # fit_layout shrinks slots no further than this (unless asked for smaller)
DEFAULT_SLOT, DEFAULT_N_SLOTS, DEFAULT_BOARD = 256 * KIB, 8, 64 * KIB  # the default geometry
LANE_STRIDE = SLOT_HEADER_BYTES + LANE_BYTES
LANE_PAIR_BYTES = LANE_SLOTS * LANE_STRIDE  # one pair's lane
Span = tuple[int, int]  # [start, stop) in bytes from the segment's start


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _pairs(n: int) -> Iterator[tuple[int, int]]:
    return itertools.permutations(range(n), 2)


def _ring_spans(r: Ring) -> list[Span]:
    """[start, stop) of every slot of a ring, in slot order."""
    return [(r.slot_offset(k), r.slot_offset(k) + r.stride) for k in range(r.n_slots)]


def _board_spans(layout: Layout) -> list[Span]:
    """Both board entries of every local rank."""
    return [(layout.board_offset(local, parity), layout.board_offset(local, parity) + layout.board_stride)
            for local in range(layout.n_local) for parity in (0, 1)]


def _control_spans(layout: Layout) -> list[Span]:
    """The control block of every ordered pair of distinct local ranks."""
    offsets = [layout.control_offset(s, d) for s, d in _pairs(layout.n_local)]
    return [(at, at + CONTROL_BYTES) for at in offsets]


def _diagonal_spans(layout: Layout) -> list[Span]:
    """Where the control block of pair (i, i) would be: reserved, never addressed."""
    n = layout.n_local
    return [(layout.controls_offset + i * (n + 1) * CONTROL_BYTES,
             layout.controls_offset + (i * (n + 1) + 1) * CONTROL_BYTES) for i in range(n)]


def _lane_spans(layout: Layout) -> list[Span]:
    return [span for s, d in _pairs(layout.n_local) for span in _ring_spans(layout.lane(s, d))]


def _block_spans(layout: Layout) -> list[Span]:
    return [span for i in range(layout.n_local * layout.blocks) for span in _ring_spans(layout.block(i))]


def _check_geometry(layout: Layout) -> None:
    """Board entries, control blocks, lane slots and block slots: 64-byte aligned (a slot's payload
    too), each kind inside its own region in the documented order, pairwise disjoint, and together
    with the n unused diagonal control blocks tiling everything after the host header exactly."""
    n = layout.n_local
    regions = {  # kind -> (spans, its region, how many there must be)
        "board": (_board_spans(layout), (HOST_HEADER_BYTES, layout.controls_offset), 2 * n),
        "control": (_control_spans(layout), (layout.controls_offset, layout.lanes_offset), n * (n - 1)),
        "lane": (_lane_spans(layout), (layout.lanes_offset, layout.blocks_offset), n * (n - 1) * LANE_SLOTS),
        "block": (_block_spans(layout), (layout.blocks_offset, layout.total_bytes), n * layout.blocks * layout.n_slots),
    }
    for kind, (spans, (low, high), count) in regions.items():
        assert len(set(spans)) == len(spans) == count, (layout, kind)
        for start, stop in spans:
            assert start % 64 == 0 and stop % 64 == 0, (layout, kind, start, stop)
            assert low <= start < stop <= high, (layout, kind, start, stop)
            if kind != "control":  # a 128-byte header, then the payload on its own 64-byte boundary
                assert (start + SLOT_HEADER_BYTES) % 64 == 0 and start + SLOT_HEADER_BYTES <= stop
    used = sorted(span for spans, _, _ in regions.values() for span in spans)
    for (_, stop), (start, _) in zip(used, used[1:]):
        assert stop <= start, (layout, stop, start)
    # what the addressed spans leave uncovered is exactly the diagonal's control blocks
    everything = sorted(used + _diagonal_spans(layout))
    assert everything[0][0] == HOST_HEADER_BYTES and everything[-1][1] == layout.total_bytes
    for (_, stop), (start, _) in zip(everything, everything[1:]):
        assert stop == start, (layout, stop, start)
    uncovered = layout.total_bytes - HOST_HEADER_BYTES - sum(b - a for a, b in used)
    assert uncovered == n * CONTROL_BYTES


def _smallest(n_local: int, slot_bytes: int, board_bytes: int = DEFAULT_BOARD) -> Layout:
    """What fit_layout may shrink a request down to at most: no blocks, 2 slots of min(request,
    64 KiB), board entries of min(request, MIN_BOARD_BYTES)."""
    return Layout(n_local, min(slot_bytes, MIN_SLOT), 2, min(board_bytes, MIN_BOARD_BYTES), 0)


def _request(n_local: int, slot_bytes: int, n_slots: int, board_bytes: int = DEFAULT_BOARD) -> Layout:
    """The geometry as requested, with the count of blocks blocks_per_rank gives it."""
    return Layout(n_local, slot_bytes, n_slots, board_bytes,
                  blocks_per_rank(n_local, n_slots * (SLOT_HEADER_BYTES + slot_bytes)))


def _shrink_path(request: Layout) -> Iterator[Layout]:
    """The documented order of shrinking: halve board entries over MIN_BOARD_BYTES down to it, then
    the slot count down to 2, then the slot size (in multiples of 64) down to 64 KiB, then drop
    blocks one at a time down to none."""
    layout = request
    yield layout
    while layout.board_bytes > MIN_BOARD_BYTES:
        layout = dataclasses.replace(layout, board_bytes=max(MIN_BOARD_BYTES, layout.board_bytes // 2 // 64 * 64))
        yield layout
    while layout.n_slots > 2:
        layout = dataclasses.replace(layout, n_slots=max(2, layout.n_slots // 2))
        yield layout
    while layout.slot_bytes > MIN_SLOT:
        layout = dataclasses.replace(layout, slot_bytes=max(MIN_SLOT, layout.slot_bytes // 2 // 64 * 64))
        yield layout
    while layout.blocks > 0:
        layout = dataclasses.replace(layout, blocks_per_rank=layout.blocks - 1)
        yield layout


# ---------------------------------------------------------------------------------------------
# pairs: pair_index, control blocks, lanes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 17, MAX_LOCAL])
def test_pair_index_is_a_bijection_onto_dense_range(n):
    layout = Layout(n, 64, 2)
    indices = [layout.pair_index(s, d) for s, d in _pairs(n)]
    assert sorted(indices) == list(range(n * (n - 1)))


@pytest.mark.parametrize("n", [1, 2, 4, 9])
def test_pairs_reject_self_and_out_of_range(n):
    layout = Layout(n, 64, 2)
    bad = [(r, r) for r in range(n)] + [(-1, 0), (0, -1), (n, 0), (0, n), (n, n), (n + 5, 1), (-n, 0)]
    for src, dst in bad:
        for lookup in (layout.pair_index, layout.control_offset, layout.lane):
            with pytest.raises(ValueError):
                lookup(src, dst)


def test_both_directions_of_a_pair_are_different():
    layout = Layout(4, 128, 3)
    for a, b in itertools.combinations(range(4), 2):
        assert layout.pair_index(a, b) != layout.pair_index(b, a)
        assert layout.control_offset(a, b) != layout.control_offset(b, a)
        assert layout.lane(a, b) != layout.lane(b, a)


def test_lanes_are_small_rings_of_their_own_geometry():
    layout = Layout(3, 256 * KIB, 8)
    for s, d in _pairs(3):
        lane = layout.lane(s, d)
        assert (lane.stride, lane.n_slots, lane.slot_bytes) == (LANE_STRIDE, LANE_SLOTS, LANE_BYTES)
        assert lane.base == layout.lanes_offset + layout.pair_index(s, d) * LANE_PAIR_BYTES


# ---------------------------------------------------------------------------------------------
# control block fields
# ---------------------------------------------------------------------------------------------

U64, U32 = 8, 4
WRITER_FIELDS = {C_WRITTEN: U64, C_WRITTEN_SLEEPERS: U32, C_BLOCK: U64}
READER_FIELDS = {C_CONSUMED: U64, C_CONSUMED_SLEEPERS: U32}


def test_control_block_fields_are_aligned_disjoint_and_inside():
    fields = sorted({**WRITER_FIELDS, **READER_FIELDS}.items())
    assert len(fields) == len(WRITER_FIELDS) + len(READER_FIELDS)
    for offset, size in fields:
        assert offset % size == 0, offset  # futex words are u32, counts u64: both naturally aligned
        assert 0 <= offset and offset + size <= CONTROL_BYTES
    for (a, a_size), (b, _) in zip(fields, fields[1:]):
        assert a + a_size <= b


def test_writer_and_reader_words_sit_on_different_cache_lines():
    assert CONTROL_BYTES % 64 == 0
    writer_lines = {(offset // 64, (offset + size - 1) // 64) for offset, size in WRITER_FIELDS.items()}
    reader_lines = {(offset // 64, (offset + size - 1) // 64) for offset, size in READER_FIELDS.items()}
    assert len(writer_lines) == len(reader_lines) == 1  # each side's words share one line, none straddles
    (w_first, w_last), (r_first, r_last) = writer_lines.pop(), reader_lines.pop()
    assert w_first == w_last and r_first == r_last and w_first != r_first
    layout = Layout(5, 64, 2)
    for s, d in _pairs(5):  # and in the segment: every control block starts on a line of its own
        at = layout.control_offset(s, d)
        assert at % 64 == 0
        assert (at + C_WRITTEN) // 64 != (at + C_CONSUMED) // 64
        assert (at + C_WRITTEN_SLEEPERS) % U32 == 0 and (at + C_CONSUMED_SLEEPERS) % U32 == 0
        assert (at + C_WRITTEN) % U64 == 0 and (at + C_CONSUMED) % U64 == 0 and (at + C_BLOCK) % U64 == 0


def test_block_word_packing_holds_every_block_index():
    # the most blocks a segment can have: MAX_LOCAL ranks, one per peer
    layout = Layout(MAX_LOCAL, 64, 2, 0, MAX_LOCAL)
    assert layout.blocks == MAX_LOCAL - 1
    last = layout.block_index(MAX_LOCAL - 1, MAX_LOCAL - 2)
    assert last == MAX_LOCAL * (MAX_LOCAL - 1) - 1
    mask = (1 << BLOCK_FROM_SHIFT) - 1
    assert 1 + last <= mask  # C_BLOCK stores 1 + the index: 0 means "on the lane"
    for first in (0, 1, 2**32 + 7, 2 ** (64 - BLOCK_FROM_SHIFT) - 1):  # a first slot number, packed and unpacked
        for index in (0, 1, last):
            word = first << BLOCK_FROM_SHIFT | (1 + index)
            assert 0 < word < 1 << 64
            assert word >> BLOCK_FROM_SHIFT == first and (word & mask) - 1 == index


# ---------------------------------------------------------------------------------------------
# rings: slot offsets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base, stride, n_slots", [(0, 192, 2), (8192, LANE_STRIDE, LANE_SLOTS), (1 << 20, 4224, 3),
                                                   (64, SLOT_HEADER_BYTES + 256 * KIB, 8)])
def test_ring_slot_numbers_wrap_modulo_n_slots(base, stride, n_slots):
    r = Ring(base, stride, n_slots)
    first_lap = [r.slot_offset(k) for k in range(n_slots)]
    assert first_lap[0] == base and len(set(first_lap)) == n_slots
    for k in range(5 * n_slots):
        assert r.slot_offset(k) == first_lap[k % n_slots]
    # slot numbers count up forever: far past 2**32 and 2**63 they still wrap
    for big in (2**32 + 7, 2**63 + 3, 10**30):
        assert r.slot_offset(big) == first_lap[big % n_slots]
    # consecutive slots of one ring are adjacent, one stride apart
    assert [b - a for a, b in zip(first_lap, first_lap[1:])] == [stride] * (n_slots - 1)
    assert r.slot_bytes == stride - SLOT_HEADER_BYTES


@pytest.mark.parametrize("n, slot_bytes, n_slots, blocks", [
    (1, 64, 2, 1), (2, 64, 2, 1), (2, 4096, 2, 0), (3, 192, 5, 2), (4, 256 * KIB, 8, 3), (5, 64, 3, 9), (8, 640, 4, 2),
    (17, 64, 2, 2),
])
def test_everything_is_aligned_disjoint_and_tiles_the_segment(n, slot_bytes, n_slots, blocks):
    _check_geometry(Layout(n, slot_bytes, n_slots, blocks_per_rank=blocks))


def test_sizes_add_up():
    layout = Layout(3, 4096, 4, 1024, 2)
    assert layout.slot_stride == SLOT_HEADER_BYTES + 4096
    assert layout.channel_bytes == 4 * layout.slot_stride
    assert layout.board_stride == SLOT_HEADER_BYTES + 1024
    assert layout.controls_offset == HOST_HEADER_BYTES + 2 * 3 * layout.board_stride
    assert layout.lanes_offset == layout.controls_offset + 3 * 3 * CONTROL_BYTES  # the diagonal too
    assert layout.blocks_offset == layout.lanes_offset + 6 * LANE_PAIR_BYTES
    assert layout.total_bytes == layout.blocks_offset + 3 * 2 * layout.channel_bytes
    # one rank: a header, its two (empty) board entries and its own (unused) control block
    one = Layout(1, 64, 2, 0)
    assert one.blocks == 0
    assert one.total_bytes == HOST_HEADER_BYTES + 2 * SLOT_HEADER_BYTES + CONTROL_BYTES


# ---------------------------------------------------------------------------------------------
# channel blocks
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, per_rank", [(1, 0), (1, 3), (2, 1), (3, 2), (4, 1), (5, 4), (6, 2), (9, 30)])
def test_block_index_is_a_bijection_and_blocks_are_rings(n, per_rank):
    layout = Layout(n, 320, 3, blocks_per_rank=per_rank)
    assert layout.blocks == min(per_rank, n - 1)
    indices = [layout.block_index(owner, k) for owner in range(n) for k in range(layout.blocks)]
    assert sorted(indices) == list(range(n * layout.blocks))
    for index in indices:
        block = layout.block(index)
        assert (block.stride, block.n_slots, block.slot_bytes) == (layout.slot_stride, 3, 320)
        assert block.base == layout.blocks_offset + index * layout.channel_bytes


@pytest.mark.parametrize("n, per_rank", [(1, 0), (1, 2), (2, 1), (4, 2), (4, 7)])
def test_blocks_reject_out_of_range(n, per_rank):
    layout = Layout(n, 64, 2, blocks_per_rank=per_rank)
    blocks = layout.blocks
    for owner, number in [(-1, 0), (n, 0), (n + 3, 0), (0, -1), (0, blocks), (0, per_rank), (n - 1, blocks + 1)]:
        with pytest.raises(ValueError):
            layout.block_index(owner, number)
    for index in (-1, n * blocks, n * blocks + 1, n * per_rank, 10**6):
        with pytest.raises(ValueError):
            layout.block(index)


def test_more_blocks_than_peers_are_not_allocated():
    layout = Layout(4, 4096, 2, blocks_per_rank=10)
    assert layout.blocks == 3
    assert layout.total_bytes == dataclasses.replace(layout, blocks_per_rank=3).total_bytes
    assert layout.total_bytes - layout.blocks_offset == 4 * 3 * layout.channel_bytes
    lonely = Layout(1, 4096, 2, blocks_per_rank=10)
    assert lonely.blocks == 0 and lonely.total_bytes == lonely.blocks_offset


@pytest.mark.parametrize("n, want", [(1, 0), (2, 1), (3, 2), (4, 3), (8, 7), (11, 10), (16, 7), (32, 3),
                                     (64, 2), (MAX_LOCAL, 2)])
def test_blocks_per_rank_at_the_default_geometry(n, want):
    channel = DEFAULT_N_SLOTS * (SLOT_HEADER_BYTES + DEFAULT_SLOT)
    assert blocks_per_rank(n, channel) == want


@settings(max_examples=200, deadline=None, database=None)
@given(n=st.integers(1, MAX_LOCAL), channel_bytes=st.integers(1, 1 << 32))
def test_property_blocks_per_rank_stays_linear(n, channel_bytes):
    got = blocks_per_rank(n, channel_bytes)
    assert min(n - 1, MIN_BLOCKS_PER_RANK) <= got <= n - 1  # never more than one per peer
    # all ranks' blocks together: within BLOCKS_BUDGET, or the minimum per rank (linear either way)
    assert n * got * channel_bytes <= max(BLOCKS_BUDGET, n * MIN_BLOCKS_PER_RANK * channel_bytes)


# ---------------------------------------------------------------------------------------------
# board entries
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, board_bytes", [(1, 0), (2, 64), (3, 64 * KIB), (5, 640)])
def test_board_entries_alternate_by_sequence_number(n, board_bytes):
    layout = Layout(n, 4096, 2, board_bytes)
    for local in range(n):
        even, odd = layout.board_offset(local, 0), layout.board_offset(local, 1)
        assert even != odd
        for seq in (2, 4, 1000, 2**62, 2**64 + 2):
            assert layout.board_offset(local, seq) == even
            assert layout.board_offset(local, seq + 1) == odd
        assert (even + BOARD_HEADER_OFFSET) % 8 == 0  # the published word and the header are aligned
        assert (even + BOARD_SLEEPERS_OFFSET) % 4 == 0  # the sleepers' futex word too
    owners = {layout.board_offset(local, seq) for local in range(n) for seq in (0, 1)}
    assert len(owners) == 2 * n


@pytest.mark.parametrize("local", [-1, 3, 4, 100])
def test_board_offset_rejects_unknown_local_rank(local):
    with pytest.raises(ValueError):
        Layout(3, 64, 2).board_offset(local, 0)


def test_board_header_fits_before_the_payload():
    assert BOARD_HEADER_OFFSET >= 8 and BOARD_HEADER_OFFSET + HEADER_SIZE <= SLOT_HEADER_BYTES
    assert BOARD_SLEEPERS_OFFSET >= BOARD_HEADER_OFFSET + HEADER_SIZE
    assert BOARD_SLEEPERS_OFFSET + 4 <= SLOT_HEADER_BYTES


# ---------------------------------------------------------------------------------------------
# host header
# ---------------------------------------------------------------------------------------------

def test_host_header_fields_fit_and_do_not_overlap():
    scalar_words = [ring.W_MAGIC, ring.W_N_LOCAL, ring.W_SLOT_BYTES, ring.W_N_SLOTS, ring.W_ABORT, ring.W_ABORT_LEN,
                    ring.W_DONE_SLEEPERS, ring.W_BLOCKS]
    assert len(set(scalar_words)) == len(scalar_words)
    assert min(scalar_words) >= 0 and max(scalar_words) < ring.W_PIDS
    # pids, states and done marks: MAX_LOCAL words each, one after the other
    assert ring.W_PIDS + MAX_LOCAL <= ring.W_STATES
    assert ring.W_STATES + MAX_LOCAL <= ring.W_DONE
    assert 8 * (ring.W_DONE + MAX_LOCAL) <= ABORT_TEXT_OFFSET
    assert ABORT_TEXT_OFFSET % 8 == 0
    assert ABORT_TEXT_BYTES >= 1024  # room for a useful reason
    assert ABORT_TEXT_OFFSET + ABORT_TEXT_BYTES <= HOST_HEADER_BYTES
    assert HOST_HEADER_BYTES % 64 == 0
    assert ring.STATE_ATTACHED != ring.STATE_DEPARTED and 0 not in (ring.STATE_ATTACHED, ring.STATE_DEPARTED)


def test_slot_header_holds_frame_header_and_chunk():
    assert HEADER_SIZE + ring.CHUNK.size <= SLOT_HEADER_BYTES
    assert SLOT_HEADER_BYTES % 64 == 0 and LANE_BYTES % 64 == 0 and LANE_SLOTS >= 2


# ---------------------------------------------------------------------------------------------
# Layout validation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, slot_bytes, n_slots", [
    (0, 64, 2), (-1, 64, 2), (MAX_LOCAL + 1, 64, 2),  # rank counts
    (2, 0, 2), (2, -64, 2), (2, 32, 2), (2, 63, 2), (2, 65, 2), (2, 100, 2), (2, 4097, 2),  # slot sizes
    (2, 64, 1), (2, 64, 0), (2, 64, -3),  # slot counts
])
def test_layout_rejects_bad_geometry(n, slot_bytes, n_slots):
    with pytest.raises(ValueError):
        Layout(n, slot_bytes, n_slots)


@pytest.mark.parametrize("board_bytes", [-64, -1, 1, 63, 65, 100])
def test_layout_rejects_bad_board_size(board_bytes):
    with pytest.raises(ValueError):
        Layout(2, 64, 2, board_bytes)


@pytest.mark.parametrize("per_rank", [-1, -2, -100])
def test_layout_rejects_negative_block_count(per_rank):
    with pytest.raises(ValueError):
        Layout(2, 64, 2, blocks_per_rank=per_rank)


@pytest.mark.parametrize("n, slot_bytes, n_slots, per_rank", [
    (1, 64, 2, 0), (MAX_LOCAL, 64, 2, MAX_LOCAL), (2, 1 << 30, 2, 1), (2, 64, 1000, 0), (3, 64, 2, 10**6),
])
def test_layout_accepts_edge_geometry(n, slot_bytes, n_slots, per_rank):
    layout = Layout(n, slot_bytes, n_slots, blocks_per_rank=per_rank)
    assert (layout.n_local, layout.slot_bytes, layout.n_slots) == (n, slot_bytes, n_slots)
    assert layout.blocks == min(per_rank, n - 1)


# ---------------------------------------------------------------------------------------------
# fit_layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, slot_bytes, n_slots", [
    (1, DEFAULT_SLOT, 8), (2, DEFAULT_SLOT, 8), (4, 4096, 2), (3, 64, 3), (8, MIN_SLOT, 4), (8, DEFAULT_SLOT, 8),
])
def test_fit_layout_returns_the_request_when_it_fits(n, slot_bytes, n_slots):
    want = _request(n, slot_bytes, n_slots)
    assert want.blocks_per_rank == want.blocks  # blocks_per_rank never gives more than one per peer
    for budget in (want.total_bytes, want.total_bytes + 1, 1 << 40):
        assert fit_layout(n, slot_bytes, n_slots, budget) == want


def test_fit_layout_shrinks_slot_count_then_slot_size_then_blocks():
    n = 4
    request = _request(n, DEFAULT_SLOT, 8)
    assert request.blocks == 3
    steps = [
        request,
        dataclasses.replace(request, n_slots=4),
        dataclasses.replace(request, n_slots=2),
        dataclasses.replace(request, n_slots=2, slot_bytes=128 * KIB),
        dataclasses.replace(request, n_slots=2, slot_bytes=MIN_SLOT),
        dataclasses.replace(request, n_slots=2, slot_bytes=MIN_SLOT, blocks_per_rank=2),
        dataclasses.replace(request, n_slots=2, slot_bytes=MIN_SLOT, blocks_per_rank=1),
        _smallest(n, DEFAULT_SLOT),
    ]
    assert steps == list(_shrink_path(request))
    sizes = [s.total_bytes for s in steps]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    for step, smaller in zip(steps, steps[1:]):
        assert fit_layout(n, DEFAULT_SLOT, 8, step.total_bytes) == step
        assert fit_layout(n, DEFAULT_SLOT, 8, step.total_bytes - 1) == smaller
    with pytest.raises(ValueError, match="local ranks need"):
        fit_layout(n, DEFAULT_SLOT, 8, steps[-1].total_bytes - 1)


@pytest.mark.parametrize("n, slot_bytes, n_slots", [
    (2, DEFAULT_SLOT, 8), (32, DEFAULT_SLOT, 8), (MAX_LOCAL, DEFAULT_SLOT, 8), (4, 4096, 2), (1, DEFAULT_SLOT, 8),
])
def test_fit_layout_raises_when_nothing_fits(n, slot_bytes, n_slots):
    smallest = _smallest(n, slot_bytes)
    assert fit_layout(n, slot_bytes, n_slots, smallest.total_bytes).total_bytes == smallest.total_bytes
    for budget in (0, 1, HOST_HEADER_BYTES, smallest.total_bytes - 1):
        with pytest.raises(ValueError, match="local ranks need"):
            fit_layout(n, slot_bytes, n_slots, budget)


def test_fit_layout_one_rank_needs_only_the_header_its_board_and_its_control_block():
    need = Layout(1, DEFAULT_SLOT, 8).total_bytes
    assert need == HOST_HEADER_BYTES + 2 * (SLOT_HEADER_BYTES + DEFAULT_BOARD) + CONTROL_BYTES
    assert fit_layout(1, DEFAULT_SLOT, 8, need) == Layout(1, DEFAULT_SLOT, 8, blocks_per_rank=0)
    with pytest.raises(ValueError):
        fit_layout(1, DEFAULT_SLOT, 8, need - 1)


def test_board_entries_hold_what_a_rank_reads_and_the_boards_share_near_a_budget():
    assert [board_bytes_for(n) >> 10 for n in (1, 2, 4, 8, 16, 32, 64, MAX_LOCAL)] == \
        [4096, 4096, 2048, 1024, 512, 256, 256, 256]
    for n in range(2, MAX_LOCAL + 1):
        entry = board_bytes_for(n)
        assert entry % 64 == 0 and MIN_BOARD_BYTES <= entry <= MAX_BOARD_BYTES
        assert (n - 1) * entry <= BOARD_READ_BUDGET or entry == MIN_BOARD_BYTES
        assert board_bytes_for(n + 1) <= entry  # more ranks never get larger entries


def test_fit_layout_shrinks_a_large_board_before_the_channels():
    n = 4
    request = _request(n, DEFAULT_SLOT, 8, MAX_BOARD_BYTES)
    boards = [MAX_BOARD_BYTES >> k for k in range(5)]
    assert boards[-1] == MIN_BOARD_BYTES
    steps = [dataclasses.replace(request, board_bytes=b) for b in boards]
    half, least = steps[1], steps[-1]
    assert list(_shrink_path(request))[:5] == steps
    assert fit_layout(n, DEFAULT_SLOT, 8, request.total_bytes - 1, MAX_BOARD_BYTES) == half
    assert fit_layout(n, DEFAULT_SLOT, 8, least.total_bytes, MAX_BOARD_BYTES) == least
    assert fit_layout(n, DEFAULT_SLOT, 8, least.total_bytes - 1, MAX_BOARD_BYTES).n_slots == 4


def test_fit_layout_keeps_a_board_of_at_most_the_minimum():
    for board in (0, 64, 4 * KIB, 64 * KIB, MIN_BOARD_BYTES):
        smallest = _smallest(4, DEFAULT_SLOT, board)
        assert fit_layout(4, DEFAULT_SLOT, 8, smallest.total_bytes, board) == smallest
        assert fit_layout(4, DEFAULT_SLOT, 8, 1 << 40, board).board_bytes == board


def test_fit_layout_rejects_bad_geometry_in_the_request():
    for args in [(0, 4096, 2), (2, 100, 2), (2, 4096, 1)]:
        with pytest.raises(ValueError):
            fit_layout(*args, budget=1 << 40)


@pytest.mark.parametrize("n_slots", [3, 6, 7, 12])
def test_fit_layout_shrinks_an_odd_slot_count_to_two(n_slots):
    two = dataclasses.replace(_request(2, MIN_SLOT, n_slots), n_slots=2)
    assert fit_layout(2, MIN_SLOT, n_slots, two.total_bytes) == two


# ---------------------------------------------------------------------------------------------
# memory per rank
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_up_to_8_ranks_every_peer_gets_a_block(n):
    got = fit_layout(n, DEFAULT_SLOT, DEFAULT_N_SLOTS, shm_budget(n, free=1 << 40))
    assert got == _request(n, DEFAULT_SLOT, DEFAULT_N_SLOTS)
    assert got.blocks == n - 1


@pytest.mark.parametrize("n", [16, 32, 64, 128])
def test_the_segment_grows_linearly_with_the_ranks(n):
    budget = shm_budget(n, free=1 << 40)  # a roomy /dev/shm: only the per-rank bound counts
    assert budget == n * BUDGET_PER_RANK
    got = fit_layout(n, DEFAULT_SLOT, DEFAULT_N_SLOTS, budget)
    assert got.total_bytes <= budget
    # every rank keeps MIN_BLOCKS_PER_RANK blocks of the full geometry: rings stream at full bandwidth
    assert (got.n_slots, got.slot_bytes, got.board_bytes) == (DEFAULT_N_SLOTS, DEFAULT_SLOT, DEFAULT_BOARD)
    assert got.blocks >= MIN_BLOCKS_PER_RANK
    # a constant, a part per rank (its board entries, its diagonal control block, the minimum of
    # blocks) and a small part per pair (its lane and its control block): nothing else
    channel = DEFAULT_N_SLOTS * (SLOT_HEADER_BYTES + DEFAULT_SLOT)
    constant = HOST_HEADER_BYTES + BLOCKS_BUDGET
    per_rank = 2 * (SLOT_HEADER_BYTES + DEFAULT_BOARD) + CONTROL_BYTES + MIN_BLOCKS_PER_RANK * channel
    per_pair = LANE_PAIR_BYTES + CONTROL_BYTES
    assert got.total_bytes <= constant + n * per_rank + n * (n - 1) * per_pair
    if n == 32:
        assert got.total_bytes <= 256 * MIB


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

geometry = dict(
    n_local=st.integers(1, 12),
    slot_bytes=st.integers(1, 8 * KIB).map(lambda k: 64 * k),  # 64 B .. 512 KiB
    n_slots=st.integers(2, 40),
    board_bytes=st.one_of(st.sampled_from([0, 64, 64 * KIB, MIN_BOARD_BYTES, MAX_BOARD_BYTES]),
                          st.integers(0, 2 * KIB).map(lambda k: 64 * k),
                          st.integers(MIN_BOARD_BYTES // 64, MAX_BOARD_BYTES // 64).map(lambda k: 64 * k)),
)


@settings(max_examples=150, deadline=None, database=None)
@given(**geometry, per_rank=st.integers(0, 14))
def test_property_layout_geometry(n_local, slot_bytes, n_slots, board_bytes, per_rank):
    layout = Layout(n_local, slot_bytes, n_slots, board_bytes, per_rank)
    _check_geometry(layout)


@settings(max_examples=400, deadline=None, database=None)
@given(**geometry, data=st.data())
def test_property_fit_layout(n_local, slot_bytes, n_slots, board_bytes, data):
    request = _request(n_local, slot_bytes, n_slots, board_bytes)
    smallest = _smallest(n_local, slot_bytes, board_bytes)
    path = list(_shrink_path(request))
    budget = data.draw(st.one_of(
        st.integers(0, 2 * request.total_bytes),
        st.sampled_from([s.total_bytes - d for s in path for d in (0, 1)]),
    ), label="budget")
    try:
        got = fit_layout(n_local, slot_bytes, n_slots, budget, board_bytes)
    except ValueError:
        assert smallest.total_bytes > budget, "raised although no blocks and 2 slots of min(request, 64 KiB) fit"
        return
    assert got.total_bytes <= budget
    assert got.n_local == n_local and min(board_bytes, MIN_BOARD_BYTES) <= got.board_bytes <= board_bytes
    assert 2 <= got.n_slots <= n_slots
    assert got.slot_bytes % 64 == 0 and min(slot_bytes, MIN_SLOT) <= got.slot_bytes <= slot_bytes
    assert 0 <= got.blocks <= request.blocks
    if request.total_bytes <= budget:
        assert got == request
    if got.n_slots < n_slots:  # the channels shrink only once the board is down to its minimum
        assert got.board_bytes == min(board_bytes, MIN_BOARD_BYTES)
    if got.slot_bytes < slot_bytes:  # slot size shrinks only once the slot count is down to two
        assert got.n_slots == 2
    if got.blocks < request.blocks:  # blocks go only once slots are as few and as small as they get
        assert got.n_slots == 2 and got.slot_bytes == min(slot_bytes, MIN_SLOT)
    # the first step of the documented order that fits: nothing was shrunk further than needed
    assert got == next(s for s in path if s.total_bytes <= budget)
    _check_geometry(got)


def test_the_budget_is_half_of_a_small_dev_shm():
    assert shm_budget(8, free=100 << 20) == 50 << 20
    assert shm_budget(8, free=1 << 40) == 8 * BUDGET_PER_RANK
