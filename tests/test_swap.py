"""Pairwise exchanges across hosts in one native call (kernels.swap_row, NetTransport.swap_row).

Over real TCP connections on loopback: both ends fold in one order; a row of steps (recursive
doubling among four ends) gives every end the same bits; anything but the peer's frame of the same
call stays in the socket for the reader thread; a peer that is not there in time stops the row
there, and a socket that takes only part of the frame and a failed send are each reported, never
waited out; a row sent from a header kept per kind of call sends the call's own frame. Then in
ranks on simulated hosts: the small all-reduce across two hosts and the doubling among four take
this path, as do the small broadcast's doubling steps (the array one way, an empty frame the other,
in rows of their own ways), and a late peer falls back to the receive that waits for it.
"""

from __future__ import annotations

import errno
import select
import socket
import threading
import time

import numpy as np
import pytest

from shmcoll import kernels
from shmcoll.transport import frame
from shmcoll.transport.base import NOT_STARTED, Way
from shmcoll.transport.frame import DATA, HEADER_SIZE, HEARTBEAT, Meta
from shmcoll.transport.tcp import INBOUNDS_KEPT, NetTransport
from shmcoll.types import F16, F32, F64, I64, U8, Collective, ReduceKind

import bounds
from harness import connected_pair, read_exactly, run_ranks

TAG = 7
WAIT_NS = 5 * 10**9  # long enough for the other end's thread on a loaded machine; the tests do not wait it out
CODES = {t.user: t.code for t in (F16, F32, F64, I64)}


def _meta(data: np.ndarray, op: ReduceKind, seq: int = 3) -> Meta:
    return Meta(seq=seq, coll=int(Collective.ALL_REDUCE), dtype=CODES[data.dtype], elements=data.size,
                op=int(op))


def _header(src: int, data: np.ndarray, op: ReduceKind, seq: int = 3, tag: int = TAG) -> bytes:
    return frame.pack(DATA, src, tag, _meta(data, op, seq), CODES[data.dtype], data.shape, data.nbytes)


def _swap(sock, rank: int, peer: int, data: np.ndarray, op: ReduceKind, own_first: bool,
          wait_ns: int = WAIT_NS) -> tuple[int, int]:
    """A row of one step: (status, bytes sent of its frame)."""
    status, done, sent = _row([sock], rank, [peer], data, op, bytes([own_first]), wait_ns)
    assert done == (status == kernels.SWAP_DONE)
    return status, sent


def _row(socks, rank: int, peers: list[int], data: np.ndarray, op: ReduceKind, ways: bytes,
         wait_ns: int = WAIT_NS) -> tuple[int, int, int]:
    """The row from a header kept per kind of call (tag and sequence number 0: the row writes in TAG
    and 3, and its peers here send and expect what frame.pack makes of those)."""
    storage = data.view(np.uint16) if data.dtype == np.float16 else data
    return kernels.swap_row([s.fileno() for s in socks], peers, ways, _header(rank, data, op, seq=0, tag=0),
                            TAG, 3, storage, storage, np.empty(HEADER_SIZE + data.nbytes, np.uint8), CODES[data.dtype],
                            int(op), 0, wait_ns, len(peers) * wait_ns)


def _both_ends(pair, lower: np.ndarray, higher: np.ndarray, op: ReduceKind) -> list[tuple[int, int]]:
    """Rank 0 (own_first) and rank 1 swap at once; their statuses."""
    statuses: list = [None, None]

    def end(i: int) -> None:
        statuses[i] = _swap(pair[i], i, 1 - i, (lower, higher)[i], op, own_first=i == 0)
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=30)
    return statuses


@pytest.mark.parametrize("dtype, op", [(np.float32, ReduceKind.SUM), (np.float16, ReduceKind.AVG),
                                       (np.float64, ReduceKind.MIN), (np.int64, ReduceKind.MAX),
                                       (np.float64, ReduceKind.PROD)])
def test_both_ends_fold_the_lower_rank_first(pair, dtype, op):
    """Each end sends its array and folds the other's in: lower op higher on both, bit for bit (the
    signed zeros and the NaN tell an order of MIN's operands from the other)."""
    rng = np.random.default_rng(5)
    lower = np.concatenate([[0.0, -0.0, np.nan] if dtype != np.int64 else [0, 1, 2], rng.normal(size=61) * 50])
    higher = np.concatenate([[-0.0, 0.0, 1.0] if dtype != np.int64 else [3, 0, 2], rng.normal(size=61) * 50])
    lower, higher = lower.astype(dtype), higher.astype(dtype)
    expected = lower.copy()
    storage = (lambda a: a.view(np.uint16)) if dtype == np.float16 else (lambda a: a)
    kernels.reduce_into(storage(expected), storage(higher), CODES[np.dtype(dtype)], int(op))
    ends = [lower.copy(), higher.copy()]
    statuses = _both_ends(pair, ends[0], ends[1], op)
    assert statuses == [(kernels.SWAP_DONE, HEADER_SIZE + lower.nbytes)] * 2
    assert ends[0].tobytes() == expected.tobytes() and ends[1].tobytes() == expected.tobytes()


def test_empty_frames_only_meet(pair):
    """A barrier's step: two empty frames of a byte type that has no reduction, each end's header
    read, nothing folded."""
    empty = np.empty(0, np.uint8)
    headers = [frame.pack(DATA, r, TAG, Meta(seq=1, coll=int(Collective.BARRIER), dtype=U8.code), U8.code, (0,), 0)
               for r in (0, 1)]
    statuses: list = [None, None]

    def end(i: int) -> None:
        statuses[i] = kernels.swap_row([pair[i].fileno()], [1 - i], bytes([i == 0]), headers[i], TAG, 1, empty, empty,
                                       np.empty(HEADER_SIZE, np.uint8), U8.code, 0, 0, WAIT_NS, WAIT_NS)
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=30)
    assert statuses == [(kernels.SWAP_DONE, 1, HEADER_SIZE)] * 2


def test_another_frame_first_is_left_in_the_socket(pair):
    """A heartbeat ahead of the peer's array: the call returns SWAP_SENT having read nothing, so the
    reader thread gets the heartbeat and then the array, in order."""
    a, b = pair
    mine, theirs = np.arange(4, dtype=np.float32), np.full(4, 10, dtype=np.float32)
    heartbeat = frame.pack(HEARTBEAT, 1, 0, Meta(), 0, (), 0)
    b.sendall(heartbeat + _header(1, theirs, ReduceKind.SUM) + theirs.tobytes())
    status, _ = _swap(a, 0, 1, mine, ReduceKind.SUM, own_first=True)
    assert status == kernels.SWAP_SENT
    assert np.array_equal(mine, np.arange(4, dtype=np.float32))
    waiting = len(heartbeat) + HEADER_SIZE + theirs.nbytes
    assert read_exactly(a, waiting) == heartbeat + _header(1, theirs, ReduceKind.SUM) + theirs.tobytes()


def test_the_peer_frame_of_another_call_is_not_taken(pair):
    """A peer in another call (another sequence number) sends a frame whose header differs: it
    stays in the socket for the general receive, which reports the mismatch."""
    a, b = pair
    mine = np.ones(3, dtype=np.float64)
    other_call = _header(1, mine, ReduceKind.SUM, seq=4) + mine.tobytes()
    b.sendall(other_call)
    assert _swap(a, 0, 1, mine, ReduceKind.SUM, own_first=True)[0] == kernels.SWAP_SENT
    assert np.array_equal(mine, np.ones(3)) and read_exactly(a, len(other_call)) == other_call


def test_a_peer_that_does_not_answer_in_time_leaves_the_frame_sent(pair):
    """No frame from the peer within wait_ns: SWAP_SENT once it passed (not before), and the peer
    got this end's whole frame."""
    a, b = pair
    mine = np.arange(5, dtype=np.float32)
    start = time.monotonic()
    status, sent = _swap(a, 0, 1, mine, ReduceKind.SUM, own_first=True, wait_ns=30_000_000)
    assert (status, sent) == (kernels.SWAP_SENT, HEADER_SIZE + mine.nbytes)
    assert time.monotonic() - start >= 0.03
    assert read_exactly(b, sent) == _header(0, mine, ReduceKind.SUM) + mine.tobytes()


def test_a_socket_that_takes_part_of_the_frame_says_how_much(pair):
    """A peer that reads nothing: the socket's buffers take part of a large frame, and the call
    returns SWAP_PARTIAL with the bytes sent once the wait passed, for the caller to send the rest."""
    a, _ = pair
    big = np.zeros(8 << 20, dtype=np.float32)
    status, sent = _swap(a, 0, 1, big, ReduceKind.SUM, own_first=True, wait_ns=50_000_000)
    assert status == kernels.SWAP_PARTIAL and 0 < sent < HEADER_SIZE + big.nbytes


def test_a_failed_send_is_its_errno(pair):
    """A connection this end shut for writing: the send fails with EPIPE, returned as -EPIPE."""
    a, _ = pair
    a.shutdown(socket.SHUT_WR)
    status, _ = _swap(a, 0, 1, np.ones(2, dtype=np.float32), ReduceKind.SUM, own_first=True)
    assert status == -errno.EPIPE


@pytest.mark.parametrize("change", ["short inbound", "short header", "no loop", "negative wait", "fewer srcs",
                                    "too many steps", "tag past 32 bits", "negative seq", "no such way",
                                    "no such flag", "an empty frame folded", "an empty frame never sent",
                                    "an empty frame of a 2-D call", "folded into another array",
                                    "into of another length", "fewer ways"])
def test_arguments_that_do_not_describe_exchanges_are_refused(pair, change):
    data = np.ones(4, dtype=np.float32)
    header = _header(0, data, ReduceKind.SUM)
    args = [[pair[0].fileno()], [1], bytes([Way.OWN_FIRST]), header, TAG, 3, data, data,
            np.empty(HEADER_SIZE + data.nbytes, np.uint8), F32.code, int(ReduceKind.SUM), 0, WAIT_NS, WAIT_NS]
    index, value = {"short inbound": (8, np.empty(HEADER_SIZE, np.uint8)), "short header": (3, header[:35]),
                    "no loop": (9, 99), "negative wait": (12, -1), "fewer srcs": (1, []),
                    "folded into another array": (7, np.ones(4, dtype=np.float32)),
                    "into of another length": (7, np.ones(5, dtype=np.float32)),
                    "too many steps": (0, [pair[0].fileno()] * 65), "tag past 32 bits": (4, 1 << 32),
                    "negative seq": (5, -1), "no such way": (2, bytes([kernels.WAY_SWAP + 1])),
                    "no such flag": (2, bytes([kernels.WAY_SWAP | 32])),
                    "an empty frame folded": (2, bytes([Way.OWN_FIRST | kernels.WAY_THEIRS_EMPTY])),
                    "an empty frame never sent": (2, bytes([Way.TAKE | kernels.WAY_OURS_EMPTY])),
                    "an empty frame of a 2-D call": (3, _header(0, data.reshape(2, 2), ReduceKind.SUM)),
                    "fewer ways": (2, b"")}[change]
    if change == "an empty frame of a 2-D call":
        args[2] = bytes([Way.CAST_OUT])
    args[index] = value
    with pytest.raises(ValueError, match="do not describe exchanges|more than 64 steps"):
        kernels.swap_row(*args)


def _four_ends():
    """Loopback connections for recursive doubling among ends 0-3: socks[i][d] is end i's to i ^ d."""
    socks = [dict() for _ in range(4)]
    for i, j in [(0, 1), (2, 3), (0, 2), (1, 3)]:
        socks[i][i ^ j], socks[j][i ^ j] = connected_pair()
    return socks


def test_a_row_of_doubling_steps_gives_every_end_the_same_bits():
    """Four ends, two steps each in one call (partners at distance 1, then 2; the lower end's value
    first): every end holds (x0 + x1) + (x2 + x3), bit for bit the same, and both steps finished."""
    socks = _four_ends()
    rng = np.random.default_rng(11)
    arrays = [(rng.normal(size=37) * 10.0 ** rng.integers(-3, 4, 37)).astype(np.float32) for _ in range(4)]
    pairs = [arrays[0].copy(), arrays[2].copy()]
    for low, high in zip(pairs, (arrays[1], arrays[3])):
        kernels.reduce_into(low, high, F32.code, int(ReduceKind.SUM))
    expected = pairs[0].copy()
    kernels.reduce_into(expected, pairs[1], F32.code, int(ReduceKind.SUM))
    ends = [a.copy() for a in arrays]
    results: list = [None] * 4

    def end(i: int) -> None:
        ways = bytes([not i & 1, not i & 2])  # OWN_FIRST where i is the lower end
        results[i] = _row([socks[i][1], socks[i][2]], i, [i ^ 1, i ^ 2], ends[i], ReduceKind.SUM, ways)
    threads = [threading.Thread(target=end, args=(i,)) for i in range(1, 4)]
    for t in threads:
        t.start()
    end(0)
    for t in threads:
        t.join(timeout=30)
    assert results == [(kernels.SWAP_DONE, 2, HEADER_SIZE + expected.nbytes)] * 4
    assert all(e.tobytes() == expected.tobytes() for e in ends)
    for s in (s for d in socks for s in d.values()):
        s.close()


def _ends_at_once(count: int, end) -> list:
    """end(i) for ends 0 .. count - 1 at once, each on a thread of its own but end 0; their results."""
    results: list = [None] * count

    def run(i: int) -> None:
        results[i] = end(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, count)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join(timeout=30)
    return results


def test_a_row_among_three_gives_and_takes_back_the_third_ends_array():
    """Three ends, recursive doubling with one past the power of two: end 2 gives its array to end 0
    and takes the result back; end 0 folds it in first, exchanges with end 1, and gives the result
    to end 2 last, its two steps with end 2 on one connection. Each end's steps in one call; every
    end holds (x0 + x2) + x1, bit for bit the same; end 1 never hears from end 2."""
    (s01, s10), (s02, s20) = connected_pair(), connected_pair()
    rng = np.random.default_rng(3)
    arrays = [(rng.normal(size=29) * 10.0 ** rng.integers(-3, 4, 29)).astype(np.float32) for _ in range(3)]
    expected = arrays[0].copy()
    kernels.reduce_into(expected, arrays[2], F32.code, int(ReduceKind.SUM))
    kernels.reduce_into(expected, arrays[1], F32.code, int(ReduceKind.SUM))
    ends = [a.copy() for a in arrays]
    rows = {0: ([s02, s01, s02], [2, 1, 2], [Way.FOLD_IN, Way.OWN_FIRST, Way.GIVE]),
            1: ([s10], [0], [Way.THEIRS_FIRST]), 2: ([s20, s20], [0, 0], [Way.GIVE, Way.TAKE])}
    results = _ends_at_once(3, lambda i: _row(rows[i][0], i, rows[i][1], ends[i], ReduceKind.SUM,
                                              bytes(rows[i][2]))[:2])
    assert results == [(kernels.SWAP_DONE, 3), (kernels.SWAP_DONE, 1), (kernels.SWAP_DONE, 2)]
    assert all(e.tobytes() == expected.tobytes() for e in ends)
    for s in (s01, s10, s02, s20):
        s.close()


def _cast_row(socks, rank: int, peers: list[int], data: np.ndarray, ways: list[Way]) -> tuple[int, int, int]:
    """A broadcast's row (a 1-D float32 array) from a header kept per kind of call."""
    meta = Meta(seq=0, coll=int(Collective.BROADCAST), dtype=F32.code, elements=data.size)
    header = frame.pack(DATA, rank, 0, meta, F32.code, data.shape, data.nbytes)
    return kernels.swap_row([s.fileno() for s in socks], peers, bytes(ways), header, TAG, 3, data, data,
                            np.empty(HEADER_SIZE + data.nbytes, np.uint8), F32.code, 0, 0, WAIT_NS,
                            len(peers) * WAIT_NS)


def test_a_broadcasts_row_sends_the_array_one_way_and_an_empty_frame_the_other():
    """Doubling from end 2 among three (end 2 past the power of two): end 2 gives its array to end 0
    and hears back an empty frame; end 0 takes it, passes it on to end 1 (whose frame back is
    empty) and gives end 2 an empty frame last. Every end holds end 2's array, which is read-only
    (a row that places nothing into its array may); on the wire each empty frame is the array's
    header with no bytes, as frame.pack writes an array of none."""
    (s01, s10), (s02, s20) = connected_pair(), connected_pair()
    source = np.arange(5, dtype=np.float32) * 1.5
    ends = [np.zeros(5, np.float32), np.full(5, -1, np.float32), source.copy()]
    ends[2].flags.writeable = False
    with pytest.raises(ValueError, match="writable"):  # a row that takes the array needs to write it
        _cast_row([s20], 2, [0], ends[2], [Way.CAST_IN])
    rows = {0: ([s02, s01, s02], [2, 1, 2], [Way.TAKE, Way.CAST_OUT, Way.GIVE_EMPTY]),
            1: ([s10], [0], [Way.CAST_IN]), 2: ([s20, s20], [0, 0], [Way.GIVE, Way.TAKE_EMPTY])}
    results = _ends_at_once(3, lambda i: _cast_row(rows[i][0], i, rows[i][1], ends[i], rows[i][2]))
    assert results == [(kernels.SWAP_DONE, 3, HEADER_SIZE), (kernels.SWAP_DONE, 1, HEADER_SIZE),
                       (kernels.SWAP_DONE, 2, 0)]  # sent: the last step's (end 2's only receives)
    assert all(e.tobytes() == source.tobytes() for e in ends)
    for s in (s01, s10, s02, s20):
        s.close()


def test_a_broadcasts_row_copies_a_dtype_that_has_no_reduction(pair):
    """Bytes (no reduction loop) cast from one end to the other: a row that folds nothing takes any
    dtype, as the broadcast's general path sends it."""
    mine, theirs = np.arange(7, dtype=np.uint8), np.zeros(7, np.uint8)
    meta = Meta(seq=0, coll=int(Collective.BROADCAST), dtype=U8.code, elements=7)
    results: list = [None, None]

    def end(i: int, data: np.ndarray, way: Way) -> None:
        header = frame.pack(DATA, i, 0, meta, U8.code, data.shape, data.nbytes)
        results[i] = kernels.swap_row([pair[i].fileno()], [1 - i], bytes([way]), header, TAG, 3, data, data,
                                      np.empty(HEADER_SIZE + data.nbytes, np.uint8), U8.code, 0, 0, WAIT_NS, WAIT_NS)
    other = threading.Thread(target=end, args=(1, theirs, Way.CAST_IN))
    other.start()
    end(0, mine, Way.CAST_OUT)
    other.join(timeout=30)
    assert [r[:2] for r in results] == [(kernels.SWAP_DONE, 1)] * 2 and theirs.tolist() == list(range(7))


def test_a_swap_sends_one_range_and_takes_the_peers_into_another(pair):
    """An all-gather's step between two hosts: each end sends its half of the output and takes the
    other's into the other half (swap_row's `into`), so both hold the whole; data, which it only
    sends, may be read-only."""
    ends = [np.array([1, 2, 0, 0], np.float32), np.array([0, 0, 3, 4], np.float32)]
    halves = [(slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))]
    meta = Meta(seq=0, coll=int(Collective.ALL_GATHER), dtype=F32.code, elements=1)
    results: list = [None, None]

    def end(i: int) -> None:
        mine, theirs = ends[i][halves[i][0]], ends[i][halves[i][1]]
        out = mine.copy()
        out.flags.writeable = False
        header = frame.pack(DATA, i, 0, meta, F32.code, out.shape, out.nbytes)
        results[i] = kernels.swap_row([pair[i].fileno()], [1 - i], bytes([Way.SWAP]), header, TAG, 3, out, theirs,
                                      np.empty(HEADER_SIZE + out.nbytes, np.uint8), F32.code, 0, 0, WAIT_NS, WAIT_NS)
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=30)
    assert [r[:2] for r in results] == [(kernels.SWAP_DONE, 1)] * 2
    assert ends[0].tolist() == ends[1].tolist() == [1, 2, 3, 4]


def test_an_empty_frame_on_the_wire_is_the_calls_header_with_no_bytes(pair):
    """A step that meets (empty frames both ways): what it sends is frame.pack's header of a 1-D
    array of none, tag and sequence number written in (frame.without_payload of the call's)."""
    a, b = pair
    data = np.arange(4, dtype=np.float32)
    meta = Meta(seq=3, coll=int(Collective.BROADCAST), dtype=F32.code, elements=4)
    theirs = frame.pack(DATA, 1, TAG, meta, F32.code, (0,), 0)
    b.sendall(theirs)
    status, done, sent = _cast_row([a], 0, [1], data, [Way.MEET])
    mine = frame.pack(DATA, 0, TAG, meta, F32.code, (0,), 0)
    assert (status, done, sent) == (kernels.SWAP_DONE, 1, HEADER_SIZE)
    assert read_exactly(b, HEADER_SIZE) == mine == frame.without_payload(frame.pack(DATA, 0, TAG, meta, F32.code,
                                                                                    data.shape, data.nbytes))
    assert data.tolist() == [0, 1, 2, 3] and not select.select([a, b], [], [], 0)[0]


def test_a_step_that_only_receives_sends_nothing_while_it_waits(pair):
    """A take whose peer is silent: SWAP_SENT once the wait passed, no byte sent, data untouched."""
    a, b = pair
    mine = np.arange(4, dtype=np.float32)
    status, done, sent = _row([a], 0, [1], mine, ReduceKind.SUM, bytes([Way.TAKE]), wait_ns=30_000_000)
    assert (status, done, sent) == (kernels.SWAP_SENT, 0, 0)
    assert np.array_equal(mine, np.arange(4)) and not select.select([b], [], [], 0)[0]


def test_a_row_stops_at_the_step_whose_peer_does_not_answer(pair):
    """Step 1's peer answers, step 2's does not: the row returns SWAP_SENT with one step done, the
    first fold in place, and the frame sent to the silent peer."""
    a, b = pair
    c, d = connected_pair()
    mine, theirs = np.arange(4, dtype=np.float32), np.full(4, 10, dtype=np.float32)
    b.sendall(_header(1, theirs, ReduceKind.SUM) + theirs.tobytes())
    status, done, sent = _row([a, c], 0, [1, 2], mine, ReduceKind.SUM, bytes([Way.OWN_FIRST] * 2),
                              wait_ns=30_000_000)
    assert (status, done, sent) == (kernels.SWAP_SENT, 1, HEADER_SIZE + mine.nbytes)
    assert np.array_equal(mine, np.arange(4) + 10)
    assert read_exactly(d, sent) == _header(0, mine, ReduceKind.SUM) + mine.tobytes()
    c.close()
    d.close()


def test_a_frame_from_another_source_is_not_taken(pair):
    """A frame whose header names another source rank than the step's peer (the same call
    otherwise) stays in the socket."""
    a, b = pair
    mine, theirs = np.ones(2, dtype=np.float32), np.ones(2, dtype=np.float32)
    wrong = _header(3, theirs, ReduceKind.SUM) + theirs.tobytes()
    b.sendall(wrong)
    assert _swap(a, 0, 1, mine, ReduceKind.SUM, own_first=True, wait_ns=30_000_000)[0] == kernels.SWAP_SENT
    assert np.array_equal(mine, np.ones(2)) and read_exactly(a, len(wrong)) == wrong


def test_a_prepared_row_is_the_steps_up_to_the_first_peer_out_of_reach():
    """NetTransport.prepare_row: the first steps whose peers it has a connection to, each step's
    way as a byte of ways, the steps that take their peer's connections (each peer's first) and
    which took each step's; which steps send the array (an empty frame is not counted); None where
    the first step's peer is out of reach. Asked again, it is the same row, not worked out anew."""
    pairs = [connected_pair() for _ in range(2)]
    t = NetTransport(0, 4, {1: pairs[0][0], 3: pairs[1][0]}, timeout=bounds.WAIT_HANG_S)
    try:
        row = t.prepare_row(((1, Way.FOLD_IN), (3, Way.THEIRS_FIRST), (1, Way.GIVE), (2, Way.OWN_FIRST)))
        assert row is not None and (row.peers, row.claims, row.first) == ([1, 3, 1], (0, 1), [0, 1, 0])
        assert row.ways == bytes([Way.FOLD_IN, Way.THEIRS_FIRST, Way.GIVE]) and row.sends_data == (False, True, True)
        assert row.data_peers == (3, 1)  # whose bytes_to a whole row's array counts in
        exchanges = t.prepare_row(((3, Way.OWN_FIRST), (1, Way.THEIRS_FIRST)))
        assert exchanges is not None and exchanges.sends_data == (True, True) and exchanges.claims == (0, 1)
        cast = t.prepare_row(((1, Way.TAKE_EMPTY), (3, Way.CAST_OUT), (1, Way.CAST_IN), (3, Way.MEET),
                              (1, Way.GIVE_EMPTY)))
        assert cast is not None and cast.sends_data == (False, True, False, False, False)
        assert t.prepare_row(((2, Way.OWN_FIRST), (1, Way.OWN_FIRST))) is None
        assert t.prepare_row(((3, Way.OWN_FIRST), (1, Way.THEIRS_FIRST))) is exchanges
    finally:
        t.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_a_row_from_a_kept_header_sends_the_calls_frame(pair):
    """NetTransport.swap_row from a header packed once with tag and sequence number 0 (as lean.py
    keeps it) sends the frame frame.pack makes for the call, as the general path would, then reads
    and folds the peer's frame of that call and counts the bytes it sent."""
    t = NetTransport(0, 2, {1: pair[0]}, timeout=bounds.WAIT_HANG_S)
    mine, theirs = np.array([1.5, 2.0, 3.25], np.float32), np.array([0.25, 8.0, 1.0], np.float32)
    sent_by_row: list[bytes] = []

    def peer() -> None:
        sent_by_row.append(read_exactly(pair[1], HEADER_SIZE + mine.nbytes))
        pair[1].sendall(_header(1, theirs, ReduceKind.SUM, seq=9) + theirs.tobytes())
    expected = _header(0, mine, ReduceKind.SUM, seq=9) + mine.tobytes()
    other = threading.Thread(target=peer)
    other.start()
    try:
        row = t.prepare_row(((1, Way.OWN_FIRST),))
        assert row is not None
        result = t.swap_row(row, _header(0, mine, ReduceKind.SUM, seq=0, tag=0), TAG, 9, mine, F32.code,
                            ReduceKind.SUM, time.monotonic() + bounds.WAIT_HANG_S)
    finally:
        other.join(timeout=bounds.WAIT_HANG_S)
        t.close()
    assert sent_by_row == [expected]
    assert result == (1, NOT_STARTED) and mine.tolist() == [1.75, 10.0, 4.25] and t.bytes_to == [0, 12]


def test_a_kept_row_keeps_room_for_a_few_sizes_of_frame(pair):
    """A row run at ever new sizes folds each one right, and keeps room for the peer's frame of at
    most INBOUNDS_KEPT sizes (a program of ever new sizes does not grow it without end)."""
    t = NetTransport(0, 2, {1: pair[0]}, timeout=bounds.WAIT_HANG_S)
    sizes = range(1, INBOUNDS_KEPT + 5)

    def peer() -> None:
        for n in sizes:
            read_exactly(pair[1], HEADER_SIZE + 4 * n)
            theirs = np.full(n, 2.0, np.float32)
            pair[1].sendall(_header(1, theirs, ReduceKind.SUM, seq=9) + theirs.tobytes())
    other = threading.Thread(target=peer)
    other.start()
    try:
        row = t.prepare_row(((1, Way.OWN_FIRST),))
        assert row is not None
        for n in sizes:
            mine = np.full(n, 1.0, np.float32)
            result = t.swap_row(row, _header(0, mine, ReduceKind.SUM, seq=0, tag=0), TAG, 9, mine, F32.code,
                                ReduceKind.SUM, time.monotonic() + bounds.WAIT_HANG_S)
            assert result == (1, NOT_STARTED) and np.all(mine == 3.0), n
            assert 0 < len(row.inbounds) <= INBOUNDS_KEPT
    finally:
        other.join(timeout=bounds.WAIT_HANG_S)
        t.close()


def _count_rows() -> list[tuple[int, int]]:
    """From now on in this rank, each swap_row call's status and steps done, appended to the list
    returned (the real call runs)."""
    rows: list[tuple[int, int]] = []
    swap = kernels.swap_row

    def counted(*args):
        result = swap(*args)
        rows.append(result[:2])
        return result
    kernels.swap_row = counted
    return rows


def _count_swaps(pg, late_rank: int | None) -> dict:
    """Small all-reduces, each swap_row counted; late_rank starts its last call 0.2 s after the
    others, past the native wait, so its partners fall back to the general receive."""
    rows = _count_rows()
    results = []
    for i in range(6):
        if i == 5 and pg.rank == late_rank:
            time.sleep(0.2)
        x = np.arange(3, dtype=np.float32) + pg.rank + i
        pg.all_reduce(x)
        results.append(x.tolist())
    return {"rows": rows, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, steps", [("halves", 4, 1), ("each", 4, 2)])
def test_small_all_reduces_across_hosts_swap_in_one_call(layout, n, steps, monkeypatch):
    """2+2 ranks: local rank j of each host swaps the host's sum with its column peer; 4 hosts of one
    rank: recursive doubling, two steps per call. A call's steps are one native call (or fewer
    steps, where a peer's frame was read into the mailbox before the call began), and the sums are
    right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    out = run_ranks(n, _count_swaps, None)
    for rank in range(n):
        assert 0 < len(out[rank]["rows"]) <= 6 * steps
        assert all(done <= steps for _, done in out[rank]["rows"])
        assert out[rank]["results"] == [(np.arange(3) * n + sum(range(n)) + n * i).tolist() for i in range(6)]
    assert any(row == (kernels.SWAP_DONE, steps) for o in out for row in o["rows"])


@pytest.mark.multiprocess
def test_three_hosts_run_each_ranks_steps_in_one_call(monkeypatch):
    """3 hosts of one rank: the third gives its array to the first and takes the result back, the
    first folds it in, exchanges with the second and gives the result back: each rank's steps (2,
    1 and 3 of them) are one native call, hand-offs included (or fewer steps, where a peer's frame
    was read into the mailbox first), and the sums are right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    out = run_ranks(3, _count_swaps, None)
    for rank, steps in enumerate((3, 1, 2)):
        assert 0 < len(out[rank]["rows"]) <= 6 * steps
        assert all(done <= steps for _, done in out[rank]["rows"])
        assert out[rank]["results"] == [(np.arange(3) * 3 + 3 + 3 * i).tolist() for i in range(6)]
    assert any((kernels.SWAP_DONE, steps) in out[rank]["rows"] for rank, steps in ((0, 3), (2, 2))), out


def _subgroup_swaps(pg) -> dict:
    """Small all-reduces in a sub-group over every rank, numbered in reverse, each swap_row counted."""
    sub = pg.split([3, 2, 1, 0])
    rows = _count_rows()
    results = []
    for i in range(6):
        x = np.arange(3, dtype=np.float32) + sub.rank + i
        sub.all_reduce(x)
        results.append(x.tolist())
    counted = list(rows)
    sub.close()
    return {"rows": counted, "results": results}


@pytest.mark.multiprocess
def test_a_subgroup_across_hosts_runs_its_rows_in_the_parents_numbering(monkeypatch):
    """4 hosts of one rank, a sub-group numbered in reverse: its doubling steps go to the parent's
    connections under the parent's numbers, so the peers' frames match and both steps finish in
    one native call; the sums are right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    out = run_ranks(4, _subgroup_swaps)
    for o in out:
        assert o["results"] == [(np.arange(3) * 4 + 6 + 4 * i).tolist() for i in range(6)]
    assert any(row == (kernels.SWAP_DONE, 2) for o in out for row in o["rows"])


def _barrier_swaps(pg) -> list[tuple[int, int]]:
    rows = _count_rows()
    for _ in range(4):
        pg.barrier()
    return rows


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, steps", [("halves", [1] * 4), ("each", [2] * 4), ("each", [3, 1, 2])])
def test_a_barrier_across_hosts_meets_in_one_call(layout, steps, monkeypatch):
    """2+2 ranks: after the host's board, each column's two ranks meet in one native call per
    barrier; 4 hosts of one rank: both pairwise rounds in one call; 3: the third says it arrived to
    the first and hears back once the first met the second, each rank's steps in one call. (Or
    fewer steps, where a peer's frame was in the mailbox first.)"""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    out = run_ranks(len(steps), _barrier_swaps)
    for rows, most in zip(out, steps):
        assert 0 < len(rows) <= 4 * most and all(done <= most for _, done in rows), rows
    assert any(row == (kernels.SWAP_DONE, most) for rows, most in zip(out, steps) for row in rows)


def _broadcast_swaps(pg) -> dict:
    """Small broadcasts from every root, each swap_row counted; what each rank got."""
    rows = _count_rows()
    results = []
    for root in range(pg.world_size):
        x = np.arange(3, dtype=np.float32) + (100 * (root + 1) if pg.rank == root else -pg.rank)
        pg.broadcast(root, x)
        results.append(x.tolist())
    return {"rows": rows, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, steps", [("halves", [1] * 4), ("each", [2] * 4), ("each", [3, 1, 2])])
def test_a_small_broadcast_across_hosts_crosses_in_one_call(layout, steps, monkeypatch):
    """2+2 ranks: after the host's board each column passes the array on in one native call (one
    step: the array one way, an empty frame back); 4 hosts of one rank: both doubling steps in one
    call; 3: the third's hand-offs through the first too (doubling_broadcast.cast_steps). Each
    rank's steps in one call per broadcast (or fewer, where a peer's frame was in the mailbox
    first), from every root, and every rank holds the root's array."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    n = len(steps)
    out = run_ranks(n, _broadcast_swaps)
    for o, most in zip(out, steps):
        assert 0 < len(o["rows"]) <= n * most and all(done <= most for _, done in o["rows"]), o["rows"]
        assert o["results"] == [(np.arange(3) + 100 * (root + 1)).tolist() for root in range(n)]
    assert any(row == (kernels.SWAP_DONE, most) for o, most in zip(out, steps) for row in o["rows"])


def _all_gather_swaps(pg) -> dict:
    """Small all-gathers of every rank's (rank, i), each swap_row counted; what each rank got."""
    rows = _count_rows()
    results = []
    for i in range(4):
        results.append(pg.all_gather(np.array([pg.rank, i], np.int64)).tolist())
    return {"rows": rows, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, calls, steps", [("halves", 4, 1, 1), ("each", 2, 1, 1), ("each", 4, 2, 2),
                                                     ("each", 3, 2, 2)])
def test_a_small_all_gather_across_hosts_runs_each_bruck_step_in_one_call(layout, n, calls, steps, monkeypatch):
    """2+2 ranks and 2 hosts of one: after the host's board, each column swaps its host's blocks in
    one native call per all-gather (the other host's straight into place); 4 and 3 hosts of one:
    Bruck's two steps, each one call of two steps (this host's blocks out to the host before, the
    next host's in). Every rank holds every block in rank order."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    out = run_ranks(n, _all_gather_swaps)
    for o in out:
        assert 0 < len(o["rows"]) <= 4 * calls and all(done <= steps for _, done in o["rows"]), o["rows"]
        assert o["results"] == [[x for r in range(n) for x in (r, i)] for i in range(4)]
    assert any(row == (kernels.SWAP_DONE, steps) for o in out for row in o["rows"])


@pytest.mark.multiprocess
def test_a_late_peer_is_waited_for_by_the_general_receive(monkeypatch):
    """Rank 2 (the other host's first rank) comes 0.2 s late to the last call: rank 0's native wait
    ends first with its frame sent, the general receive takes rank 2's frame when it comes, and
    every rank's sum is right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    out = run_ranks(4, _count_swaps, 2)
    assert out[0]["rows"][-1] == (kernels.SWAP_SENT, 0)
    for rank in range(4):
        assert out[rank]["results"][-1] == (np.arange(3) * 4 + 6 + 20).tolist()
