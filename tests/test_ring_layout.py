"""Shared-memory ring layout (shmcoll/transport/ring.py): pure arithmetic, no I/O.

Every board entry, every channel of a segment and every slot of a channel must land on its own
64-byte aligned, non-overlapping bytes inside the segment; the host header's fields must fit its
fixed size; and fit_layout must shrink a geometry that does not fit (fewer slots first, then
smaller slots) without ever exceeding the budget.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmcoll.transport import shm_layout as ring
from shmcoll.transport.shm_layout import (
    ABORT_TEXT_BYTES,
    ABORT_TEXT_OFFSET,
    BOARD_HEADER_OFFSET,
    BUDGET_PER_RANK,
    HOST_HEADER_BYTES,
    MAX_LOCAL,
    SLOT_HEADER_BYTES,
    Layout,
    fit_layout,
    shm_budget,
)

KIB = 1 << 10
MIN_SLOT = 64 * KIB  # fit_layout shrinks slots no further than this (unless asked for smaller)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def _spans(layout: Layout, laps: int = 1):
    """(start, stop, src, dst, slot) of every slot of every channel, `laps` times around the ring."""
    n = layout.n_local
    for src, dst in itertools.permutations(range(n), 2):
        for slot in range(layout.n_slots * laps):
            start = layout.slot_offset(src, dst, slot)
            yield start, start + layout.slot_stride, src, dst, slot


def _board_spans(layout: Layout):
    """(start, stop) of both board entries of every local rank."""
    for local in range(layout.n_local):
        for parity in (0, 1):
            start = layout.board_offset(local, parity)
            yield start, start + layout.board_stride


def _check_geometry(layout: Layout) -> None:
    """Board entries and slots: aligned, inside the segment, after the host header, pairwise disjoint,
    and together tiling everything after the header (no hidden gaps that total_bytes pays for)."""
    boards = sorted(set(_board_spans(layout)))
    slots = sorted(set((a, b) for a, b, *_ in _spans(layout)))
    assert len(boards) == 2 * layout.n_local
    assert len(slots) == layout.n_channels * layout.n_slots
    for start, stop in boards:
        assert start % 64 == 0 and (start + SLOT_HEADER_BYTES) % 64 == 0, (layout, start)
        assert HOST_HEADER_BYTES <= start and stop <= layout.channels_offset, (layout, start, stop)
    for start, stop in slots:
        assert start % 64 == 0 and (start + SLOT_HEADER_BYTES) % 64 == 0, (layout, start)
        assert layout.channels_offset <= start and stop <= layout.total_bytes, (layout, start, stop)
    spans = boards + slots
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        assert stop <= start, (layout, stop, start)
    assert spans[0][0] == HOST_HEADER_BYTES and spans[-1][1] == layout.total_bytes
    assert sum(b - a for a, b in spans) == layout.total_bytes - HOST_HEADER_BYTES


def _smallest(n_local: int, slot_bytes: int, board_bytes: int = 64 * KIB) -> Layout:
    """What fit_layout may shrink a request down to at most: 2 slots of min(request, 64 KiB)."""
    return Layout(n_local, min(slot_bytes, MIN_SLOT), 2, board_bytes)


# ---------------------------------------------------------------------------------------------
# channel_index
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 17, MAX_LOCAL])
def test_channel_index_is_a_bijection_onto_dense_range(n):
    layout = Layout(n, 64, 2)
    indices = [layout.channel_index(s, d) for s, d in itertools.permutations(range(n), 2)]
    assert sorted(indices) == list(range(n * (n - 1)))
    assert layout.n_channels == n * (n - 1)


@pytest.mark.parametrize("n", [1, 2, 4, 9])
def test_channel_index_rejects_self_and_out_of_range(n):
    layout = Layout(n, 64, 2)
    for r in range(n):
        with pytest.raises(ValueError):
            layout.channel_index(r, r)
    bad = [(-1, 0), (0, -1), (n, 0), (0, n), (n, n), (n + 5, 1), (-n, 0)]
    for src, dst in bad:
        with pytest.raises(ValueError):
            layout.channel_index(src, dst)
        with pytest.raises(ValueError):
            layout.slot_offset(src, dst, 0)


def test_both_directions_of_a_pair_are_different_channels():
    layout = Layout(4, 128, 3)
    for a, b in itertools.combinations(range(4), 2):
        assert layout.channel_index(a, b) != layout.channel_index(b, a)
        assert layout.slot_offset(a, b, 0) != layout.slot_offset(b, a, 0)


# ---------------------------------------------------------------------------------------------
# slot offsets
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, slot_bytes, n_slots", [
    (1, 64, 2), (2, 64, 2), (2, 4096, 2), (3, 192, 5), (4, 256 * KIB, 8), (5, 64, 3), (8, 640, 4),
])
def test_slots_are_aligned_disjoint_and_inside_the_segment(n, slot_bytes, n_slots):
    _check_geometry(Layout(n, slot_bytes, n_slots))


@pytest.mark.parametrize("n, slot_bytes, n_slots", [(2, 64, 2), (3, 4096, 3), (4, 320, 8)])
def test_slot_numbers_wrap_modulo_n_slots(n, slot_bytes, n_slots):
    layout = Layout(n, slot_bytes, n_slots)
    for src, dst in itertools.permutations(range(n), 2):
        first_lap = [layout.slot_offset(src, dst, k) for k in range(n_slots)]
        assert len(set(first_lap)) == n_slots
        for k in range(5 * n_slots):
            assert layout.slot_offset(src, dst, k) == first_lap[k % n_slots]
        # slot numbers count up forever: far past 2**32 and 2**63 they still wrap
        for big in (2**32 + 7, 2**63 + 3, 10**30):
            assert layout.slot_offset(src, dst, big) == first_lap[big % n_slots]
        # consecutive slots of one channel are adjacent, one stride apart
        assert [b - a for a, b in zip(first_lap, first_lap[1:])] == [layout.slot_stride] * (n_slots - 1)


def test_sizes_add_up():
    layout = Layout(3, 4096, 4, 1024)
    assert layout.slot_stride == SLOT_HEADER_BYTES + 4096
    assert layout.channel_bytes == 4 * layout.slot_stride
    assert layout.board_stride == SLOT_HEADER_BYTES + 1024
    assert layout.channels_offset == HOST_HEADER_BYTES + 2 * 3 * layout.board_stride
    assert layout.total_bytes == layout.channels_offset + 6 * layout.channel_bytes
    one = Layout(1, 64, 2, 0)  # one rank: a header and its two (empty) board entries, no channels
    assert one.total_bytes == HOST_HEADER_BYTES + 2 * SLOT_HEADER_BYTES


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
    owners = {layout.board_offset(local, seq) for local in range(n) for seq in (0, 1)}
    assert len(owners) == 2 * n


@pytest.mark.parametrize("local", [-1, 3, 4, 100])
def test_board_offset_rejects_unknown_local_rank(local):
    with pytest.raises(ValueError):
        Layout(3, 64, 2).board_offset(local, 0)


def test_board_header_fits_before_the_payload():
    from shmcoll.transport.frame import HEADER_SIZE
    assert BOARD_HEADER_OFFSET >= 8 and BOARD_HEADER_OFFSET + HEADER_SIZE <= SLOT_HEADER_BYTES


# ---------------------------------------------------------------------------------------------
# host header
# ---------------------------------------------------------------------------------------------

def test_host_header_fields_fit_and_do_not_overlap():
    scalar_words = [ring.W_MAGIC, ring.W_N_LOCAL, ring.W_SLOT_BYTES, ring.W_N_SLOTS, ring.W_ABORT, ring.W_ABORT_LEN]
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
    from shmcoll.transport.frame import HEADER_SIZE
    assert HEADER_SIZE + ring.CHUNK.size <= SLOT_HEADER_BYTES
    assert SLOT_HEADER_BYTES % 64 == 0


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


@pytest.mark.parametrize("n, slot_bytes, n_slots", [(1, 64, 2), (MAX_LOCAL, 64, 2), (2, 1 << 30, 2), (2, 64, 1000)])
def test_layout_accepts_edge_geometry(n, slot_bytes, n_slots):
    layout = Layout(n, slot_bytes, n_slots)
    assert (layout.n_local, layout.slot_bytes, layout.n_slots) == (n, slot_bytes, n_slots)


# ---------------------------------------------------------------------------------------------
# fit_layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, slot_bytes, n_slots", [(2, 256 * KIB, 8), (4, 4096, 2), (3, 64, 3), (8, MIN_SLOT, 4)])
def test_fit_layout_returns_the_request_when_it_fits(n, slot_bytes, n_slots):
    want = Layout(n, slot_bytes, n_slots)
    for budget in (want.total_bytes, want.total_bytes + 1, 1 << 40):
        assert fit_layout(n, slot_bytes, n_slots, budget) == want


def test_fit_layout_shrinks_slot_count_before_slot_size():
    n, slot_bytes = 4, 256 * KIB
    two_slots = Layout(n, slot_bytes, 2)
    got = fit_layout(n, slot_bytes, 8, two_slots.total_bytes)
    assert got == two_slots
    four_slots = Layout(n, slot_bytes, 4)
    assert fit_layout(n, slot_bytes, 8, four_slots.total_bytes) == four_slots
    assert fit_layout(n, slot_bytes, 8, four_slots.total_bytes - 1) == two_slots


def test_fit_layout_shrinks_slot_size_down_to_64_kib_for_many_ranks():
    n = 64  # 4032 channels
    budget = 1 << 30
    got = fit_layout(n, 256 * KIB, 8, budget)
    assert got.total_bytes <= budget
    assert got.n_slots == 2 and MIN_SLOT <= got.slot_bytes < 256 * KIB and got.slot_bytes % 64 == 0
    smallest = Layout(n, MIN_SLOT, 2)
    assert fit_layout(n, 256 * KIB, 8, smallest.total_bytes) == smallest


@pytest.mark.parametrize("n, slot_bytes, n_slots", [(2, 256 * KIB, 8), (MAX_LOCAL, 256 * KIB, 8), (4, 4096, 2)])
def test_fit_layout_raises_when_nothing_fits(n, slot_bytes, n_slots):
    smallest = _smallest(n, slot_bytes)
    for budget in (0, 1, HOST_HEADER_BYTES, smallest.total_bytes - 1):
        with pytest.raises(ValueError, match="local ranks need"):
            fit_layout(n, slot_bytes, n_slots, budget)


def test_fit_layout_one_rank_needs_only_the_header_and_its_board():
    need = Layout(1, 256 * KIB, 8).total_bytes
    assert need == HOST_HEADER_BYTES + 2 * (SLOT_HEADER_BYTES + 64 * KIB)
    assert fit_layout(1, 256 * KIB, 8, need) == Layout(1, 256 * KIB, 8)
    with pytest.raises(ValueError):
        fit_layout(1, 256 * KIB, 8, need - 1)


def test_fit_layout_keeps_the_board_size():
    for board in (0, 64, 4 * KIB, 64 * KIB):
        got = fit_layout(4, 256 * KIB, 8, Layout(4, MIN_SLOT, 2, board).total_bytes, board)
        assert got == Layout(4, MIN_SLOT, 2, board)


def test_fit_layout_rejects_bad_geometry_in_the_request():
    for args in [(0, 4096, 2), (2, 100, 2), (2, 4096, 1)]:
        with pytest.raises(ValueError):
            fit_layout(*args, budget=1 << 40)


@pytest.mark.parametrize("n_slots", [3, 6, 7, 12])
def test_fit_layout_shrinks_an_odd_slot_count_to_two(n_slots):
    two = Layout(2, MIN_SLOT, 2)
    assert fit_layout(2, MIN_SLOT, n_slots, two.total_bytes) == two


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------

geometry = dict(
    n_local=st.integers(1, 12),
    slot_bytes=st.integers(1, 8 * KIB).map(lambda k: 64 * k),  # 64 B .. 512 KiB
    n_slots=st.integers(2, 40),
    board_bytes=st.one_of(st.sampled_from([0, 64, 64 * KIB]), st.integers(0, 2 * KIB).map(lambda k: 64 * k)),
)


@settings(max_examples=150, deadline=None, database=None)
@given(**geometry)
def test_property_layout_geometry(n_local, slot_bytes, n_slots, board_bytes):
    layout = Layout(n_local, slot_bytes, n_slots, board_bytes)
    _check_geometry(layout)
    for src, dst in itertools.permutations(range(n_local), 2):
        k = n_slots * 3 + 1
        assert layout.slot_offset(src, dst, k) == layout.slot_offset(src, dst, k % n_slots)


@settings(max_examples=400, deadline=None, database=None)
@given(**geometry, data=st.data())
def test_property_fit_layout(n_local, slot_bytes, n_slots, board_bytes, data):
    request = Layout(n_local, slot_bytes, n_slots, board_bytes)
    smallest = _smallest(n_local, slot_bytes, board_bytes)
    budget = data.draw(st.one_of(
        st.integers(0, 2 * request.total_bytes),
        st.sampled_from([smallest.total_bytes - 1, smallest.total_bytes, request.total_bytes - 1]),
    ), label="budget")
    try:
        got = fit_layout(n_local, slot_bytes, n_slots, budget, board_bytes)
    except ValueError:
        assert smallest.total_bytes > budget, "raised although 2 slots of min(request, 64 KiB) fit"
        return
    assert got.total_bytes <= budget
    assert got.n_local == n_local and got.board_bytes == board_bytes
    assert 2 <= got.n_slots <= n_slots and got.n_slots >= min(n_slots, 2)
    assert got.slot_bytes % 64 == 0 and min(slot_bytes, MIN_SLOT) <= got.slot_bytes <= slot_bytes
    if request.total_bytes <= budget:
        assert got == request
    if got.slot_bytes < slot_bytes:  # slot size shrinks only once the slot count is down to two
        assert got.n_slots == 2
    _check_geometry(got)


@pytest.mark.parametrize("n", [1, 2, 8, 16, 32, 64, 128])
def test_the_reserved_segment_grows_linearly_with_the_ranks(n):
    budget = shm_budget(n, free=1 << 50)  # a roomy /dev/shm: only the per-rank bound counts
    assert budget == n * BUDGET_PER_RANK
    got = fit_layout(n, 256 * KIB, 8, budget)
    assert got.total_bytes <= n * BUDGET_PER_RANK
    if n <= 16:
        assert got == Layout(n, 256 * KIB, 8)  # the default geometry, untouched, up to 16 ranks


def test_the_budget_is_half_of_a_small_dev_shm():
    assert shm_budget(8, free=100 << 20) == 50 << 20
