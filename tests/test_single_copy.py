"""Large collectives that read peers' arrays directly (algorithms/single_copy.py).

In one process: the native reads and the rank-order fold, with "peers" that are other arrays of
this process (a process may read itself through the same system call), and moving arrays that
come back onto huge pages. Across real ranks over
shared memory: exact results and bitwise-identical ranks for every reducible type, the other
calls that read peers (reduce_scatter, all_gather, broadcast), the agreement that makes every rank
fall back together when one cannot be read, mismatched calls, and a rank killed inside each step,
on one host and inside the hosts of a group across simulated hosts (its byte counts: test_hierarchy.py).

The board is shrunk to 64 KiB (SMALL_BOARD) so that arrays of a few hundred KiB are "large".
"""

from __future__ import annotations

import errno
import mmap
import os
import signal

import numpy as np
import pytest

from shmcoll import ReduceKind, kernels
from shmcoll.algorithms import single_copy, two_level
from shmcoll.algorithms.call import segment_bounds
from shmcoll.transport.shm_board import Board
from shmcoll.types import wire_type_of

from faults import assert_survivors, call_after_failure, cannot_be_read, close_group
from harness import CTX, attempt, finish_together, run_ranks

SMALL_BOARD = {"SHMCOLL_TRANSPORT": "shm", "SHMCOLL_SHM_BOARD_BYTES": str(64 << 10)}
ELEMENTS = 100_003  # past the small board for every type, and uneven over 2, 3 and 4 ranks
NO_SUCH_PID = 0x7FFFFFFF  # above any pid_max Linux allows

CASES = [(np.float32, ReduceKind.SUM), (np.float32, ReduceKind.AVG), (np.float64, ReduceKind.PROD),
         (np.float16, ReduceKind.SUM), (np.float16, ReduceKind.MAX), (np.int32, ReduceKind.MIN),
         (np.int64, ReduceKind.SUM)]


def _inputs(rank: int, dtype, n: int = ELEMENTS) -> np.ndarray:
    """Rank `rank`'s input: values whose float sums depend on the order they are added in."""
    values = np.random.default_rng(rank).standard_normal(n) * 10.0 ** (rank % 3)
    return values.astype(dtype) if np.dtype(dtype).kind == "f" else (values * 1000).astype(dtype)


def _fold_in_rank_order(arrays: list[np.ndarray], op: ReduceKind) -> np.ndarray:
    """The reference: rank 0's array, then each next rank's folded in by the kernels; AVG divided last."""
    code = wire_type_of(arrays[0].dtype).code
    storage = wire_type_of(arrays[0].dtype).storage
    result = arrays[0].copy()
    for other in arrays[1:]:
        kernels.reduce_into(result.view(storage), other.view(storage), code, int(op))
    if op is ReduceKind.AVG:
        kernels.scale_into(result.view(storage), code, len(arrays))
    return result


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _peers(arrays, pid: int | None = None) -> np.ndarray:
    """The peers the kernels take: one published descriptor per array, its pid and address first
    (the rest of each row, what the kernels do not read, zero)."""
    peers = np.zeros((len(arrays), kernels.PEER_BYTES // 8), np.int64)
    peers[:, 0] = os.getpid() if pid is None else pid
    peers[:, 1] = [_address(a) for a in arrays]
    return peers


# ---------------------------------------------------------------------------------------------
# in one process
# ---------------------------------------------------------------------------------------------

def test_read_peer_copies_another_address_space_range():
    source = np.arange(1000, dtype=np.int64)
    out = np.zeros(1000, dtype=np.int64)
    assert kernels.read_peer(out, os.getpid(), _address(source)) == 0
    assert np.array_equal(out, source)


def test_address_of_is_where_a_contiguous_array_starts():
    """What a rank publishes for its peers: a slice's own first byte; a strided view has none."""
    base = np.arange(1000, dtype=np.int64)
    assert kernels.address_of(base) == _address(base)
    assert kernels.address_of(base[10:]) == _address(base) + 80
    with pytest.raises(ValueError, match="contiguous"):
        kernels.address_of(base[::2])


def test_read_peer_reports_unmapped_memory_and_missing_processes():
    out = np.zeros(8, dtype=np.uint8)
    assert kernels.read_peer(out, os.getpid(), 8) == errno.EFAULT
    assert kernels.read_peer(out, NO_SUCH_PID, _address(out)) == errno.ESRCH
    assert not out.any()


@pytest.mark.parametrize("dtype, op", CASES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_each_rank_folds_its_range_of_every_array_in_rank_order(dtype, op, ranks):
    """Every "rank" of this process reduces its own range, through a scratch of two 40-byte pieces
    (so ranges span many pieces, some short); the ranges together are the reference, the rest of
    each array is left alone."""
    arrays = [_inputs(r, dtype, 1001) for r in range(ranks)]
    reference = _fold_in_rank_order(arrays, ReduceKind.SUM if op is ReduceKind.AVG else op)
    wire, itemsize = wire_type_of(np.dtype(dtype)), np.dtype(dtype).itemsize
    peers = _peers(arrays)
    scratch = np.empty(80 + itemsize - 1, dtype=np.uint8)  # two pieces, rounded down to whole elements
    for me, (lo, hi) in enumerate(segment_bounds(1001, ranks)):
        mine = arrays[me].copy()  # the others keep reading the untouched inputs
        peers[me, 1] = _address(mine)
        failed = kernels.reduce_from_peers(mine.view(np.uint8), peers, me, lo * itemsize, hi * itemsize,
                                           wire.code, int(op), scratch, 0)
        peers[me, 1] = _address(arrays[me])
        assert failed is None
        assert np.array_equal(mine[:lo], arrays[me][:lo]) and np.array_equal(mine[hi:], arrays[me][hi:])
        assert mine[lo:hi].tobytes() == reference[lo:hi].tobytes(), (me, lo, hi)


@pytest.mark.parametrize("dtype, op", CASES)
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_rank_delivers_its_folded_range_into_every_array(dtype, op, ranks):
    """As above, but each "rank" also divides each finished piece (AVG) and writes it into every
    other array, one rank after another: a rank's range of the others is still their input when it
    folds, since only the rank that owns a range writes it. At the end every array is the result."""
    arrays = [_inputs(r, dtype, 1001) for r in range(ranks)]
    reference = _fold_in_rank_order(arrays, op)
    wire, itemsize = wire_type_of(np.dtype(dtype)), np.dtype(dtype).itemsize
    peers = _peers(arrays)
    scratch = np.empty(80 + itemsize - 1, dtype=np.uint8)
    divisor = ranks if op is ReduceKind.AVG else 1
    for me, (lo, hi) in enumerate(segment_bounds(1001, ranks)):
        failed = kernels.reduce_from_peers(arrays[me].view(np.uint8), peers, me, lo * itemsize, hi * itemsize,
                                           wire.code, int(op), scratch, divisor)
        assert failed is None
    for me, array in enumerate(arrays):
        assert array.tobytes() == reference.tobytes(), me


def test_a_failed_read_names_the_rank_it_was_reading():
    arrays = [np.ones(64, dtype=np.float32) for _ in range(3)]
    peers = _peers(arrays)
    peers[2, :2] = (NO_SUCH_PID, _address(arrays[2]))
    scratch = np.empty(1024, dtype=np.uint8)
    code = wire_type_of(np.dtype(np.float32)).code
    assert kernels.reduce_from_peers(arrays[0].view(np.uint8), peers, 0, 0, 256, code, 0, scratch, 0) == \
        (2, errno.ESRCH)
    peers[2, :2] = (os.getpid(), 8)
    assert kernels.reduce_from_peers(arrays[1].view(np.uint8), peers, 1, 0, 256, code, 0, scratch, 0) == \
        (2, errno.EFAULT)


def test_a_failed_write_names_the_rank_it_was_writing_to():
    """Rank 2's array can be read but not written (a read-only mapping): the fold succeeds, the
    delivery to rank 2 fails, after rank 1's has gone through."""
    arrays = [np.full(64, r + 1.0, dtype=np.float32) for r in range(2)]
    read_only = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    third = np.frombuffer(read_only, dtype=np.float32, count=64)
    peers = _peers((*arrays, third))
    code = wire_type_of(np.dtype(np.float32)).code
    failed = kernels.reduce_from_peers(arrays[0].view(np.uint8), peers, 0, 0, 256, code, 0,
                                       np.empty(1024, dtype=np.uint8), 1)
    assert failed == (2, errno.EFAULT)
    assert np.array_equal(arrays[0], np.full(64, 3.0)) and np.array_equal(arrays[1], arrays[0])
    assert not third.any()


@pytest.mark.parametrize("me, lo, hi, code, scratch_bytes", [
    (3, 0, 64, 3, 64),      # no rank 3 among 3
    (0, 64, 0, 3, 64),      # an empty range backwards
    (0, 0, 260, 3, 64),     # past the array's end
    (0, 2, 64, 3, 64),      # not on an element boundary
    (0, 0, 64, 3, 4),       # scratch too small for one element per piece
    (0, 0, 64, 99, 64),     # no such type
])
def test_reduce_from_peers_refuses_arguments_that_describe_no_reduction(me, lo, hi, code, scratch_bytes):
    arrays = [np.ones(64, dtype=np.float32) for _ in range(3)]
    peers = _peers(arrays)
    with pytest.raises(ValueError, match="do not describe"):
        kernels.reduce_from_peers(arrays[0].view(np.uint8), peers, me, lo, hi, code, 0,
                                  np.empty(scratch_bytes, dtype=np.uint8), 0)


@pytest.mark.parametrize("dtype, deliver", [(np.float32, -1), (np.int64, 2)])
def test_reduce_from_peers_refuses_a_delivery_it_cannot_make(dtype, deliver):
    """A negative delivery, or a division (AVG) of integers: refused before anything is read."""
    arrays = [np.ones(64, dtype=dtype) for _ in range(2)]
    peers = _peers(arrays)
    code = wire_type_of(np.dtype(dtype)).code
    with pytest.raises(ValueError, match="do not describe"):
        kernels.reduce_from_peers(arrays[0].view(np.uint8), peers, 0, 0, 64, code, 0,
                                  np.empty(1024, dtype=np.uint8), deliver)


def test_write_to_peers_writes_a_range_into_every_other_array():
    """Rank 1 of 3 writes bytes [40, 200) of its array into ranks 2's and 0's at the same bytes;
    nothing else of theirs changes, and its own array is only read."""
    arrays = [np.full(64, r + 1.0, dtype=np.float32) for r in range(3)]
    arrays[1][:] = np.arange(64)
    peers = _peers(arrays)
    assert kernels.write_to_peers(arrays[1].view(np.uint8), peers, 1, 40, 200) is None
    for r in (0, 2):
        assert np.array_equal(arrays[r][10:50], np.arange(10, 50))
        assert np.all(arrays[r][:10] == r + 1.0) and np.all(arrays[r][50:] == r + 1.0)
    assert np.array_equal(arrays[1], np.arange(64))


def test_a_failed_write_to_peers_names_the_rank():
    """The next rank's write goes through first; a read-only peer, or a gone one, is named."""
    arrays = [np.ones(64, dtype=np.float32), np.full(64, 2.0, dtype=np.float32)]
    read_only = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    third = np.frombuffer(read_only, dtype=np.float32, count=64)
    peers = _peers((*arrays, third))
    assert kernels.write_to_peers(arrays[0].view(np.uint8), peers, 0, 0, 256) == (2, errno.EFAULT)
    assert np.all(arrays[1] == 1.0) and not third.any()
    peers[2, :2] = (NO_SUCH_PID, _address(arrays[1]))
    assert kernels.write_to_peers(arrays[0].view(np.uint8), peers, 0, 0, 256) == (2, errno.ESRCH)


@pytest.mark.parametrize("me, lo, hi, peers_bytes", [
    (3, 0, 64, 3 * kernels.PEER_BYTES),      # no rank 3 among 3
    (-1, 0, 64, 3 * kernels.PEER_BYTES),     # nor rank -1
    (0, 64, 0, 3 * kernels.PEER_BYTES),      # an empty range backwards
    (0, 0, 260, 3 * kernels.PEER_BYTES),     # past the array's end
    (0, 0, 64, 3 * kernels.PEER_BYTES - 4),  # peers that are not whole descriptors
    (0, 0, 64, 48),                          # three (pid, address) pairs: not descriptors either
])
def test_write_to_peers_refuses_arguments_that_describe_no_range(me, lo, hi, peers_bytes):
    arrays = [np.ones(64, dtype=np.float32) for _ in range(3)]
    peers = _peers(arrays).reshape(-1).view(np.uint8)[:peers_bytes]
    with pytest.raises(ValueError, match="do not describe"):
        kernels.write_to_peers(arrays[0].view(np.uint8), peers, me, lo, hi)
    assert np.all(arrays[1] == 1.0) and np.all(arrays[2] == 1.0)


def test_a_rank_may_read_a_peer_only_where_the_peers_token_is_found():
    mine = single_copy._descriptor(_address(np.zeros(4)))
    assert single_copy.can_read(mine)
    wrong_token = mine.copy()
    wrong_token[single_copy.TOKEN] += 1
    assert not single_copy.can_read(wrong_token)
    elsewhere = mine.copy()
    elsewhere[single_copy.PID] = NO_SUCH_PID
    assert not single_copy.can_read(elsewhere)


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in KiB."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_collapsing_to_huge_pages_keeps_the_contents():
    """On 4 KiB pages, as torch allocates; where the kernel collapses (Linux 6.1+, THP not off),
    the whole 2 MiB pages inside become huge pages."""
    region = mmap.mmap(-1, 9 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc maps large blocks
    values = np.frombuffer(region, dtype=np.int64)
    values[:] = np.arange(values.size)
    error = kernels.collapse_to_huge_pages(values)
    assert np.array_equal(values, np.arange(values.size))
    if error == 0:
        assert _anon_huge_kib(_address(values)) >= 6 << 10  # at least 3 whole 2 MiB pages of 9 MiB
    else:
        assert error in (errno.EINVAL, errno.EAGAIN, errno.ENOMEM, errno.EPERM), os.strerror(error)
    assert kernels.collapse_to_huge_pages(bytes(16)) in (0, errno.EINVAL)  # read-only, and no whole page: nothing
    del values
    region.close()


def test_only_large_arrays_that_come_back_move_to_huge_pages(monkeypatch):
    moved = []
    monkeypatch.setattr(kernels, "collapse_to_huge_pages", lambda a: moved.append(_address(a)) or 0)
    monkeypatch.setattr(single_copy, "_seen_arrays", {})
    big = np.zeros(single_copy.HUGE_PAGES_FROM_BYTES, dtype=np.uint8)
    small = np.zeros(single_copy.HUGE_PAGES_FROM_BYTES - 1, dtype=np.uint8)
    for _ in range(3):
        single_copy._prefer_huge_pages(big, _address(big))
        single_copy._prefer_huge_pages(small, _address(small))
    assert moved == [_address(big)]  # the second time only, and never the small one
    others = [np.zeros(single_copy.HUGE_PAGES_FROM_BYTES + 64 * k, dtype=np.uint8)
              for k in range(1, single_copy.ARRAYS_REMEMBERED + 2)]
    for other in others:
        single_copy._prefer_huge_pages(other, _address(other))
    assert len(single_copy._seen_arrays) == single_copy.ARRAYS_REMEMBERED  # the oldest forgotten


# ---------------------------------------------------------------------------------------------
# across ranks
# ---------------------------------------------------------------------------------------------

def _all_cases(pg):
    """Every case, checked against the reference fold; this rank's results, for the bitwise check."""
    out = []
    for dtype, op in CASES:
        data = _inputs(pg.rank, dtype)
        pg.all_reduce(data, op)
        want = _fold_in_rank_order([_inputs(r, dtype) for r in range(pg.world_size)], op)
        assert data.tobytes() == want.tobytes(), (dtype, op)
        out.append(data.tobytes())
    return pg.transport.board.single_copy_agreed, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3, 4])
def test_large_all_reduces_read_peers_directly_exactly_and_alike(n):
    results = run_ranks(n, _all_cases, env=SMALL_BOARD)
    assert all(agreed is True for agreed, _ in results)  # they took the direct path
    assert all(out == results[0][1] for _, out in results)


def _bytes_moved(pg):
    pg.all_reduce(_inputs(pg.rank, np.float32))
    board = pg.transport.board
    return list(board.bytes_read_from), list(board.bytes_written_to), list(pg.transport.bytes_to)


@pytest.mark.multiprocess
def test_a_large_all_reduce_reads_and_writes_each_owned_range_once_per_peer():
    """Each rank reads its own (uneven) range of every peer's array and writes the finished range
    back into it: exactly the range's bytes each way per peer, and nothing through the rings."""
    n = 3
    results = run_ranks(n, _bytes_moved, env=SMALL_BOARD)
    for rank, (read, written, sent) in enumerate(results):
        lo, hi = segment_bounds(ELEMENTS, n)[rank]
        owned = [0 if peer == rank else (hi - lo) * 4 for peer in range(n)]
        assert (read, written, sent) == (owned, owned, [0] * n), rank


def _moves(pg):
    """reduce_scatter, all_gather and broadcast of arrays past the board, checked exactly."""
    n, me = pg.world_size, pg.rank
    rows = ELEMENTS // n * n
    got = pg.reduce_scatter(_inputs(me, np.float32, rows), ReduceKind.SUM)
    want = _fold_in_rank_order([_inputs(r, np.float32, rows) for r in range(n)], ReduceKind.SUM)
    assert got.tobytes() == want[me * (rows // n):(me + 1) * (rows // n)].tobytes()
    gathered = pg.all_gather(_inputs(me, np.int64))
    assert np.array_equal(gathered, np.concatenate([_inputs(r, np.int64) for r in range(n)]))
    root = n - 1
    data = _inputs(me, np.float64)
    pg.broadcast(root, data)
    assert np.array_equal(data, _inputs(root, np.float64))
    return pg.transport.board.single_copy_agreed


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_large_reduce_scatter_all_gather_and_broadcast_read_peers_directly(n):
    assert run_ranks(n, _moves, env=SMALL_BOARD) == [True] * n


def _one_rank_cannot_be_read(pg):
    if pg.rank == 1:
        cannot_be_read()
    data = np.arange(ELEMENTS, dtype=np.int64) * (pg.rank + 1)
    for _ in range(2):  # the agreement's call, then a call that knows the answer
        data[:] = np.arange(ELEMENTS) * (pg.rank + 1)
        pg.all_reduce(data)
        assert np.array_equal(data, np.arange(ELEMENTS) * (pg.world_size * (pg.world_size + 1) // 2))
    return pg.transport.board.single_copy_agreed


@pytest.mark.multiprocess
def test_one_rank_that_cannot_be_read_makes_every_rank_take_the_fallback():
    assert run_ranks(3, _one_rank_cannot_be_read, env=SMALL_BOARD) == [False, False, False]


def _mismatched(pg):
    return attempt(lambda: pg.all_reduce(np.ones(ELEMENTS + 64 * pg.rank, dtype=np.float32)))


@pytest.mark.multiprocess
def test_ranks_that_reduce_different_lengths_fail_alike():
    for out in run_ranks(3, _mismatched, env=SMALL_BOARD):
        assert out["kind"] == "CollectiveMismatch", out


def _mismatched_once_agreed(pg):
    pg.all_reduce(np.ones(ELEMENTS, dtype=np.float32))  # the agreement: later calls publish in one compiled step
    return attempt(lambda: pg.all_reduce(np.ones(ELEMENTS + 64 * pg.rank, dtype=np.float32)))


@pytest.mark.multiprocess
def test_ranks_that_agreed_and_then_reduce_different_lengths_fail_alike():
    """Once the ranks agreed, a call publishes and reads every rank's descriptor in one compiled
    step (Board.gather_open), which compares the calls as the entries' reads do."""
    for out in run_ranks(3, _mismatched_once_agreed, env=SMALL_BOARD):
        assert out["kind"] == "CollectiveMismatch", out


def _killed_in_step(pg, victim: int, call: str, step: str | None, agreed, finish, elements: int = ELEMENTS):
    """The victim dies as it would call single_copy.<step> (or where a step of its own kills it:
    step None) in the call after the agreement; the others' outcome."""
    data = np.ones(elements, dtype=np.float32)
    pg.all_reduce(data)  # the agreement, so the fault hits a call that reads peers
    # Every rank done with the agreement first: a victim that finished it early and died in the next
    # call would fail a peer still waiting inside the agreement, outside the call under test.
    assert finish_together(agreed)
    run = (lambda: pg.all_reduce(data)) if call == "all_reduce" else (lambda: pg.broadcast(victim, data))
    if pg.rank == victim:
        if step is not None:
            setattr(single_copy, step, lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL))
        run()
        return None
    out = attempt(run)
    out["broken"] = call_after_failure(pg)
    out["finished_together"] = finish_together(finish)
    out.update(close_group(pg))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("call, step", [("all_reduce", "_reduce_range"), ("all_reduce", "_finish"),
                                        ("broadcast", "_finish")])
def test_a_rank_killed_inside_a_step_is_lost_to_every_other(call, step):
    """Killed once it has published (its peers read it and write into it), once it has delivered
    its range (its peers wait for everyone to finish), or as a broadcast's root whose array its
    peers are reading."""
    victim, n = 1, 3
    results = run_ranks(n, _killed_in_step, victim, call, step, CTX.Barrier(n), CTX.Barrier(n - 1), env=SMALL_BOARD,
                        may_die={victim})
    assert_survivors({r: out for r, out in enumerate(results) if r != victim}, victim)


ACROSS_HOSTS = {"SHMCOLL_TRANSPORT": "hier", "SHMCOLL_TEST_HOSTS": "halves", "SHMCOLL_SHM_BOARD_BYTES": str(64 << 10)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim, step, losers", [(1, "_reduce_range", {0, 2, 3}), (2, "_deliver", {3})])
def test_a_rank_killed_inside_a_step_across_hosts_is_lost_to_those_that_need_it(victim, step, losers):
    """Hosts (0, 1) and (2, 3) read inside each host and cross between them by column. Killed
    while its host peer reads its array and its column peer waits for its slice: every survivor
    loses it. Killed once the slices crossed, before it writes its range into its host peer's
    array: that peer, waiting for it to finish, loses it; the other host, which had all it needed,
    may return."""
    n = 4
    results = run_ranks(n, _killed_in_step, victim, "all_reduce", step, CTX.Barrier(n), CTX.Barrier(n - 1),
                        env=ACROSS_HOSTS, may_die={victim})
    assert_survivors({r: results[r] for r in losers}, victim)
    for rank in set(range(n)) - losers - {victim}:
        assert results[rank]["kind"] in ("returned", "PeerLost"), results[rank]


@pytest.mark.multiprocess
def _killed_once_gathered(pg, victim: int, agreed, finish):
    """_killed_in_step's victim dying once its gather has published its array, before its row
    starts (single_copy.all_reduce_in_one_row: the gather is the row's first step)."""
    if pg.rank == victim:
        gather = Board.gather_open_first

        def gathered_then_killed(*args):
            gather(*args)
            os.kill(os.getpid(), signal.SIGKILL)
        Board.gather_open_first = gathered_then_killed
    return _killed_in_step(pg, victim, "all_reduce", None, agreed, finish, 2 << 20)


def _killed_as_range(pg, victim: int, agreed, finish):
    """_killed_in_step's victim taking its range across the general way (all_reduce_among), and
    dying as it would hand it to the row (the others call as usual: the frames and board steps are
    the same either way)."""
    if pg.rank == victim:
        two_level._in_one_row = lambda *args: None
    return _killed_in_step(pg, victim, "all_reduce", "_across_as_host_range", agreed, finish, 2 << 20)


@pytest.mark.multiprocess
@pytest.mark.parametrize("gathered", [False, True], ids=["as-range", "in-one-row"])
def test_a_rank_killed_as_its_row_would_fold_its_range_is_lost_to_every_other(gathered):
    """8 MiB crossing whole (no overlap): each rank's row folds its range out of its host peer's
    array as it goes and writes it back into it (single_copy.HostRange). Rank 1 dies as its row
    would start, its array published (by the general path's gather; by its one-row call's, the
    row's first step): its host peer's row, reading or writing that array, and its column peer,
    waiting for its frames, lose it, and so does the rank that waits for theirs."""
    n, victim = 4, 1
    env = {**ACROSS_HOSTS, "SHMCOLL_OVERLAP": "0"}
    results = run_ranks(n, _killed_once_gathered if gathered else _killed_as_range, victim, CTX.Barrier(n),
                        CTX.Barrier(n - 1), env=env, may_die={victim})
    assert_survivors({r: results[r] for r in (0, 2, 3)}, victim)


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim, step, losers", [(1, "_reduce_range", {0, 2, 3}), (2, "_deliver", {3})])
def test_a_rank_killed_while_its_pieces_cross_hosts_is_lost_to_those_that_need_it(victim, step, losers):
    """As above with 8 MiB, whose ranges cross hosts in pieces on helper threads (algorithms/overlap.py):
    a survivor whose helper waits across hosts for the victim's piece, and one whose own thread
    reads the victim's array, both lose it; nobody hangs on a helper."""
    n = 4
    env = {**ACROSS_HOSTS, "SHMCOLL_OVERLAP": "1"}
    results = run_ranks(n, _killed_in_step, victim, "all_reduce", step, CTX.Barrier(n), CTX.Barrier(n - 1),
                        2 << 20, env=env, may_die={victim})
    assert_survivors({r: results[r] for r in losers}, victim)
    for rank in set(range(n)) - losers - {victim}:
        assert results[rank]["kind"] in ("returned", "PeerLost"), results[rank]
