"""The pairwise exchange across hosts in one native call (kernels.swap_frames, NetTransport._swap).

Over real TCP connections on loopback: both ends fold in one order; anything but the peer's frame
of the same call stays in the socket for the reader thread; a peer that is not there in time, a
socket that takes only part of the frame and a failed send are each reported, never waited out.
Then in ranks on simulated hosts: the small all-reduce across two hosts and the doubling among
four take this path, and a late peer falls back to the receive that waits for it.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import numpy as np
import pytest

from shmcoll import kernels
from shmcoll.transport import frame
from shmcoll.transport.frame import DATA, HEADER_SIZE, HEARTBEAT, Meta
from shmcoll.types import F16, F32, F64, I64, U8, Collective, ReduceKind

from harness import read_exactly, run_ranks

TAG = 7
WAIT_NS = 5 * 10**9  # long enough for the other end's thread on a loaded machine; the tests do not wait it out
CODES = {t.user: t.code for t in (F16, F32, F64, I64)}


def _meta(data: np.ndarray, op: ReduceKind, seq: int = 3) -> Meta:
    return Meta(seq=seq, coll=int(Collective.ALL_REDUCE), dtype=CODES[data.dtype], elements=data.size,
                op=int(op))


def _header(src: int, data: np.ndarray, op: ReduceKind, seq: int = 3) -> bytes:
    return frame.pack(DATA, src, TAG, _meta(data, op, seq), CODES[data.dtype], data.shape, data.nbytes)


def _swap(sock, rank: int, peer: int, data: np.ndarray, op: ReduceKind, own_first: bool,
          wait_ns: int = WAIT_NS, expect: bytes | None = None) -> tuple[int, int]:
    storage = data.view(np.uint16) if data.dtype == np.float16 else data
    return kernels.swap_frames(sock.fileno(), _header(rank, data, op), storage,
                               expect if expect is not None else _header(peer, data, op),
                               np.empty(HEADER_SIZE + data.nbytes, np.uint8), CODES[data.dtype], int(op),
                               own_first, 0, wait_ns)


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
        statuses[i] = kernels.swap_frames(pair[i].fileno(), headers[i], empty, headers[1 - i],
                                          np.empty(HEADER_SIZE, np.uint8), U8.code, 0, i == 0, 0, WAIT_NS)
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=30)
    assert statuses == [(kernels.SWAP_DONE, HEADER_SIZE)] * 2


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


@pytest.mark.parametrize("change", ["short inbound", "other header length", "no loop", "negative wait"])
def test_arguments_that_do_not_describe_an_exchange_are_refused(pair, change):
    data = np.ones(4, dtype=np.float32)
    header = _header(0, data, ReduceKind.SUM)
    args = [pair[0].fileno(), header, data, _header(1, data, ReduceKind.SUM),
            np.empty(HEADER_SIZE + data.nbytes, np.uint8), F32.code, int(ReduceKind.SUM), True, 0, WAIT_NS]
    index, value = {"short inbound": (4, np.empty(HEADER_SIZE, np.uint8)), "other header length": (3, header[:-1]),
                    "no loop": (5, 99), "negative wait": (9, -1)}[change]
    args[index] = value
    with pytest.raises(ValueError, match="do not describe an exchange"):
        kernels.swap_frames(*args)


def _count_statuses() -> list[int]:
    """From now on in this rank, each swap_frames call's status, appended to the list returned
    (the real call runs)."""
    statuses: list[int] = []
    swap = kernels.swap_frames

    def counted(*args):
        result = swap(*args)
        statuses.append(result[0])
        return result
    kernels.swap_frames = counted
    return statuses


def _count_swaps(pg, late_rank: int | None) -> dict:
    """Small all-reduces, each swap_frames status counted; late_rank starts its last call 0.2 s
    after the others, past the native wait, so its partners fall back to the general receive."""
    statuses = _count_statuses()
    results = []
    for i in range(6):
        if i == 5 and pg.rank == late_rank:
            time.sleep(0.2)
        x = np.arange(3, dtype=np.float32) + pg.rank + i
        pg.all_reduce(x)
        results.append(x.tolist())
    return {"statuses": statuses, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, crossings", [("halves", 4, 1), ("each", 4, 2)])
def test_small_all_reduces_across_hosts_swap_in_one_call(layout, n, crossings, monkeypatch):
    """2+2 ranks: local rank j of each host swaps the host's sum with its column peer; 4 hosts of one
    rank: recursive doubling, two swaps per call. Each such step is one native call (or none, where
    the peer's frame was read into the mailbox before the call began), and the sums are right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    out = run_ranks(n, _count_swaps, None)
    for rank in range(n):
        assert 0 < len(out[rank]["statuses"]) <= 6 * crossings
        assert out[rank]["results"] == [(np.arange(3) * n + sum(range(n)) + n * i).tolist() for i in range(6)]
    assert any(s == kernels.SWAP_DONE for o in out for s in o["statuses"])


def _barrier_swaps(pg) -> list[int]:
    statuses = _count_statuses()
    for _ in range(4):
        pg.barrier()
    return statuses


@pytest.mark.multiprocess
def test_a_barrier_between_two_hosts_meets_in_one_call(monkeypatch):
    """2+2 ranks: after the host's board, each column's two ranks meet in one native call per
    barrier (or none, where the peer's frame was in the mailbox first)."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    out = run_ranks(4, _barrier_swaps)
    assert all(0 < len(statuses) <= 4 for statuses in out)
    assert any(s == kernels.SWAP_DONE for statuses in out for s in statuses)


@pytest.mark.multiprocess
def test_a_late_peer_is_waited_for_by_the_general_receive(monkeypatch):
    """Rank 2 (the other host's first rank) comes 0.2 s late to the last call: rank 0's native wait
    ends first with its frame sent, the general receive takes rank 2's frame when it comes, and
    every rank's sum is right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    out = run_ranks(4, _count_swaps, 2)
    assert out[0]["statuses"][-1] == kernels.SWAP_SENT
    for rank in range(4):
        assert out[rank]["results"][-1] == (np.arange(3) * 4 + 6 + 20).tolist()
