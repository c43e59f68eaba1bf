"""The hierarchy really is one: traffic between simulated hosts goes over TCP, inside a host over
shared memory, and the two-level algorithms send fewer bytes across hosts than flat ones.

Ranks pretend to be on several hosts through SHMCOLL_HOST_ID (harness.HOST_LAYOUTS). Each rank
reports how many payload bytes it sent to every other rank on each path (the transports count
them), and the test compares those counts with what the algorithm must send, exactly.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

import shmcoll
from shmcoll.algorithms import overlap, single_copy, two_level
from shmcoll.algorithms.two_level import GATHER_V_HEAD_BYTES
from shmcoll.algorithms.two_level_broadcast import SCATTER_HEAD_BYTES
from shmcoll.transport.frame import MAX_NDIM
from shmcoll.transport.shm_board import WAIT_SLICE_NS, Board
from shmcoll.transport.topology import Topology

from bounds import MISMATCH_NOTICE_S, WAIT_HANG_S
from faults import cannot_be_read
from harness import attempt, run_ranks, simulated_host_id

S = 1 << 20  # bytes of float32 data in the bandwidth case (1 MiB: the ring, not the one-shot path)


def _hosts(layout: str, n: int) -> list[str]:
    return [simulated_host_id(layout, r, n) for r in range(n)]


def _counts(t) -> dict[str, list[int]]:
    """Bytes this rank sent to each rank, per path (a flat TCP transport has only one)."""
    if hasattr(t, "traffic"):
        return t.traffic()
    return {"tcp": list(t.bytes_to), "shm": [0] * t.world_size}


def _traffic_of(pg, action) -> dict:
    before = _counts(pg.transport)
    action(pg)
    after = _counts(pg.transport)
    return {"kind": type(pg.transport).__name__,
            **{path: [a - b for a, b in zip(after[path], before[path])] for path in after}}


def _all_reduce(pg):
    x = np.full(S // 4, pg.rank + 1.0, dtype=np.float32)
    pg.all_reduce(x)
    n = pg.world_size
    assert np.all(x == n * (n + 1) / 2)


def _broadcast(pg):
    x = np.full(S // 2, float(pg.rank), dtype=np.float32)  # 2 S: the chain, not doubling
    pg.broadcast(1, x)
    assert np.all(x == 1.0)


def _all_gather(pg):
    out = pg.all_gather(np.full(S // 4, float(pg.rank), dtype=np.float32))
    assert np.array_equal(out, np.repeat(np.arange(pg.world_size, dtype=np.float32), S // 4))


def _cross(results, hosts) -> int:
    """Bytes all ranks sent to ranks on other hosts, whatever the path."""
    return sum(out[path][peer] for rank, out in enumerate(results) for path in ("tcp", "shm")
               for peer in range(len(hosts)) if hosts[peer] != hosts[rank])


def _run(layout: str, n: int, transport: str, action, monkeypatch) -> list[dict]:
    monkeypatch.setenv("SHMCOLL_TRANSPORT", transport)
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    return run_ranks(n, _traffic_of, action)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3), ("interleaved", 4), ("each", 4)])
def test_paths_follow_the_hosts(layout, n, monkeypatch):
    """Every byte to a rank on this host goes through shared memory (or is read from its memory
    directly), every other one through TCP."""
    for action in (_all_reduce, _broadcast, _all_gather):
        _assert_paths_follow(_hosts(layout, n), _run(layout, n, "hier", action, monkeypatch), action.__name__)


def _assert_paths_follow(hosts: list[str], results: list[dict], what: str) -> None:
    """Nothing went over TCP to a rank of the same host, nor through shared memory (frames or
    reads) to a rank of another; something crossed hosts, and something moved inside a host."""
    for rank, out in enumerate(results):
        assert out["kind"] == "HierarchicalTransport"
        for peer in range(len(hosts)):
            local = hosts[peer] == hosts[rank]
            for path in ("tcp",) if local else ("shm", "read", "written"):
                assert out[path][peer] == 0, (what, rank, peer, out)
    assert _cross(results, hosts) > 0
    if len(set(hosts)) < len(hosts):
        assert sum(sum(out["shm"]) + sum(out["read"]) + sum(out["written"]) for out in results) > 0, what


# Bytes that must cross host boundaries for 1 MiB (S), two-level versus the flat TCP ring or chain.
# all_reduce, 2+2: each of the 2 column rings moves S/2 with 2 ranks: S per ring, 2S in all; the flat
# ring moves 2(n-1)/n * S = 1.5S per rank, over 2 of its 4 edges (a,a,b,b) or all 4 (a,b,a,b).
# 1+2: one column ring of 2 ranks over all of S: 2S; flat: 2 of 3 edges cross, (4/3)S each.
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, action, hier_bytes, flat_bytes", [
    ("halves", 4, _all_reduce, 2 * S, 3 * S),
    ("interleaved", 4, _all_reduce, 2 * S, 6 * S),
    ("first-alone", 3, _all_reduce, 2 * S, None),  # flat: uneven thirds, checked only as larger
    ("halves", 4, _broadcast, 2 * S, 4 * S),  # root 1: chain 1,0 | 2,3 versus 1 | 2,3 | 0
    ("interleaved", 4, _broadcast, 2 * S, 6 * S),
    ("halves", 4, _all_gather, 4 * S, 6 * S),  # each column swaps its ranks' blocks (S each way); flat: 3S over 2 edges
    ("interleaved", 4, _all_gather, 4 * S, 12 * S),
])
def test_two_level_crosses_hosts_less_than_flat(layout, n, action, hier_bytes, flat_bytes, monkeypatch):
    hosts = _hosts(layout, n)
    hier = _cross(_run(layout, n, "hier", action, monkeypatch), hosts)
    flat = _cross(_run(layout, n, "tcp", action, monkeypatch), hosts)
    assert hier == hier_bytes
    assert flat == (flat_bytes or flat)
    assert hier < flat


# ---- a large all-reduce inside each host: peers' arrays read directly, else the rings ----

def _large_all_reduce_in_hosts(pg, unreadable: int | None):
    """The bytes a 1 MiB SUM moves (checked exact by _all_reduce), then an AVG of random values and
    an int64 MAX, each checked against numpy; the AVG's result, to compare across ranks, and whether
    this rank's host read peers' arrays."""
    if pg.rank == unreadable:
        cannot_be_read()
    traffic = _traffic_of(pg, _all_reduce)
    avg = _checked_avg(pg, _random_inputs(pg.world_size, S))
    top = (np.arange(S // 8, dtype=np.int64) * (pg.rank + 3)) % 1009
    pg.all_reduce(top, shmcoll.ReduceKind.MAX)
    assert np.array_equal(top, np.max([(np.arange(S // 8) * (r + 3)) % 1009 for r in range(pg.world_size)], axis=0))
    return {**traffic, "avg": avg, "read_directly": pg.transport.host_board.single_copy_agreed}


def _random_inputs(n: int, nbytes: int) -> list[np.ndarray]:
    """Each of n ranks' float32 input of nbytes, alike in every process."""
    return [np.random.default_rng(r).standard_normal(nbytes // 4).astype(np.float32) for r in range(n)]


def _checked_avg(pg, inputs: list[np.ndarray]) -> str:
    """An AVG all-reduce of this rank's input, checked against numpy; the result's digest, to
    compare across ranks and runs."""
    avg = inputs[pg.rank].copy()
    pg.all_reduce(avg, shmcoll.ReduceKind.AVG)
    np.testing.assert_allclose(avg, np.mean(inputs, axis=0), rtol=1e-4, atol=1e-5)
    return hashlib.sha256(avg.tobytes()).hexdigest()


def _run_in_hosts(layout: str, n: int, unreadable: int | None, monkeypatch) -> list[dict]:
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    return run_ranks(n, _large_all_reduce_in_hosts, unreadable)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, read", [
    ("halves", 4, [[0, S // 2, 0, 0], [S // 2, 0, 0, 0], [0, 0, 0, S // 2], [0, 0, S // 2, 0]]),
    ("first-alone", 3, [[0, 0, 0], [0, 0, S], [0, 0, 0]]),
])
def test_large_all_reduce_moves_each_byte_inside_a_host_once(layout, n, read, monkeypatch):
    """A rank reads the half it owns of its host peer's array to fold it in, and writes the finished
    half into the peer's array (the rings would copy each byte twice: into a slot and out of it):
    it writes what it read. In 1+2, below two_level.SPREAD_FROM_BYTES, the second host's extra rank
    (2) owns nothing: the other reads its whole array and writes the result into it. Across hosts:
    exactly 2S. Results are alike bitwise everywhere."""
    hosts = _hosts(layout, n)
    results = _run_in_hosts(layout, n, None, monkeypatch)
    assert [out["read"] for out in results] == read
    assert [out["written"] for out in results] == read
    assert [out["shm"] for out in results] == [[0] * n] * n
    assert _cross(results, hosts) == 2 * S
    assert len({out["avg"] for out in results}) == 1
    assert {out["read_directly"] for out in results if sum(out["read"])} == {True}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3)])
def test_in_host_phases_read_what_the_ring_would_have_sent(layout, n, monkeypatch):
    """Inside each host, what a rank of a large all-reduce reads from each peer's array and that
    peer writes into its array is exactly what the peer sends it around the host's ring with
    SHMCOLL_SINGLE_COPY=0, and nothing goes around the ring; across hosts the same bytes go either
    way."""
    monkeypatch.setenv("SHMCOLL_SINGLE_COPY", "0")
    ring = _run(layout, n, "hier", _all_reduce, monkeypatch)
    monkeypatch.setenv("SHMCOLL_SINGLE_COPY", "1")
    reads = _run(layout, n, "hier", _all_reduce, monkeypatch)
    for rank in range(n):
        moved = [reads[rank]["read"][peer] + reads[peer]["written"][rank] for peer in range(n)]
        assert moved == [ring[peer]["shm"][rank] for peer in range(n)], (rank, reads, ring)
        assert (reads[rank]["shm"], ring[rank]["read"]) == ([0] * n, [0] * n)
        assert reads[rank]["tcp"] == ring[rank]["tcp"]
    assert sum(sum(out["read"]) for out in reads) > 0


def _large_all_gather_in_hosts(pg, unreadable: int | None):
    """_all_gather's traffic (S per rank, 4 S gathered: the large form), checked exact there."""
    if pg.rank == unreadable:  # its host goes around its ring
        cannot_be_read()
    return _traffic_of(pg, _all_gather)


def _each_to(n: int, pairs: dict[int, int], nbytes: int) -> list[list[int]]:
    """Per rank, nbytes to the rank pairs names (none where it names none)."""
    return [[nbytes if peer == pairs.get(rank) else 0 for peer in range(n)] for rank in range(n)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, unreadable, tcp, read, shm", [
    ("halves", None, {0: 2, 1: 3, 2: 0, 3: 1}, {0: 1, 1: 0, 2: 3, 3: 2}, {}),
    ("halves", 1, {0: 2, 1: 3, 2: 0, 3: 1}, {2: 3, 3: 2}, {0: 1, 1: 0}),
    ("interleaved", None, {0: 1, 1: 0, 2: 3, 3: 2}, {0: 2, 1: 3, 2: 0, 3: 1}, {}),
])
def test_a_large_all_gather_crosses_in_columns_and_reads_the_rest(layout, unreadable, tcp, read, shm, monkeypatch):
    """Among hosts of as many ranks, each rank swaps its block with its column's peer on the other
    host (S each way, nothing else across hosts), then reads the two blocks its host peer's column
    brought straight out of that peer's array (2 S); a host whose rank cannot be read passes them
    around its ring instead (2 S each way, nothing read)."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(4, _large_all_gather_in_hosts, unreadable)
    assert [out["tcp"] for out in results] == _each_to(4, tcp, S)
    assert [out["read"] for out in results] == _each_to(4, read, 2 * S)
    assert [out["shm"] for out in results] == _each_to(4, shm, 2 * S)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, sent", [
    (4, lambda rank, peer: S if peer == rank ^ 1 else 2 * S if peer == rank ^ 2 else 0),
    (3, lambda rank, peer: 2 * S if peer == (rank + 1) % 3 else 0),
], ids=["4-double", "3-ring"])
def test_a_large_all_gather_among_hosts_of_one_rank_doubles_or_goes_around(n, sent, monkeypatch):
    """Hosts of one rank each: among four, each swaps its block with its neighbour (S), then both
    blocks with the pair beyond (2 S): recursive doubling; among three, around the ring, each
    passing two blocks on to the next (2 S). Nothing else is sent; every block is everywhere."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _large_all_gather_in_hosts, None)
    assert [out["tcp"] for out in results] == [[sent(rank, peer) for peer in range(n)] for rank in range(n)]


BIG = 8 << 20  # bytes: in halves, 2 slices of 4 MiB, each crossing hosts in overlap.CROSSING_PIECES pieces where cut
HALF = BIG // 2


def _record_calls(module, name: str, note) -> None:
    """Wrap module.name (in this rank's process) so that note(args, result) sees every call."""
    real = getattr(module, name)

    def recorded(*args):
        result = real(*args)
        note(args, result)
        return result
    setattr(module, name, recorded)


def _large_all_reduce_overlapping(rank: int, n: int, port: int, unreadable: int | None, overlapping: set[int]):
    """_large_all_reduce_in_pieces where SHMCOLL_OVERLAP is 1 on the ranks in `overlapping` only."""
    os.environ["SHMCOLL_OVERLAP"] = str(int(rank in overlapping))
    with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=WAIT_HANG_S) as pg:
        return _large_all_reduce_in_pieces(pg, unreadable)


def _large_all_reduce_in_pieces(pg, unreadable: int | None):
    """A SUM of BIG bytes (its traffic) and an AVG of random values checked against numpy; both
    results' digests, to compare across ranks and runs, how many pieces this rank took across hosts
    in both calls, and the pieces of each call that overlapped."""
    if pg.rank == unreadable:  # its host takes the rings
        cannot_be_read()
    crossed, overlapped = [0], []
    for crossing in ("_across", "all_reduce_in_one_row"):  # a piece, or a range whole in one row
        _record_calls(two_level, crossing, lambda args, result: crossed.__setitem__(0, crossed[0] + 1))
    _record_calls(overlap, "_overlapped", lambda args, result: overlapped.append(len(args[0])))
    inputs = _random_inputs(pg.world_size, BIG)
    total = inputs[pg.rank].copy()
    traffic = _traffic_of(pg, lambda pg: pg.all_reduce(total))
    np.testing.assert_allclose(total, np.sum(inputs, axis=0), rtol=1e-4, atol=1e-4)
    return {**traffic, "digests": [hashlib.sha256(total.tobytes()).hexdigest(), _checked_avg(pg, inputs)],
            "crossed": crossed[0], "overlapped": overlapped}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, unreadable, read, slices, overlapping", [
    ("halves", 4, None, [[0, HALF, 0, 0], [HALF, 0, 0, 0], [0, 0, 0, HALF], [0, 0, HALF, 0]], [1, 1, 1, 1],
     [0, 1, 2, 3]),
    ("halves", 4, 1, [[0] * 4, [0] * 4, [0, 0, 0, HALF], [0, 0, HALF, 0]], [1, 1, 1, 1], [2, 3]),
    ("first-alone", 3, None, [[0, 0, 0], [0, 0, BIG], [0, 0, 0]], [1, 1, 0], [1]),
])
def test_large_slices_cross_hosts_in_pieces_where_any_rank_overlaps(layout, n, unreadable, read, slices,
                                                                    overlapping, monkeypatch):
    """Where some rank of the group overlaps (SHMCOLL_OVERLAP=1 on every rank, or on the last one
    alone), every slice crosses hosts in pieces, cut alike by all its owners: on a helper thread
    while the rank folds the next piece and writes back the last, where that rank overlaps, else on
    the calling thread. Where none does (0 everywhere), each slice crosses whole. The same bytes
    cross in all three, whatever a host does inside (reads its peers' arrays, takes its rings since
    one of its ranks cannot be read, or has a rank alone, and a rank of no slice): exactly 2 BIG
    across hosts, each byte read and written once inside a host that reads, bitwise the same
    results on every rank and in every mode. Only ranks that read their host peers overlap."""
    assert overlap.crossing_pieces((0, HALF), 4) == [(k * BIG // 8, (k + 1) * BIG // 8) for k in range(4)]
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    runs = {}
    for on in (set(range(n)), {n - 1}, set()):
        runs[tuple(on)] = results = run_ranks(n, _large_all_reduce_overlapping, unreadable, on, init=False)
        assert _cross(results, _hosts(layout, n)) == 2 * BIG
        assert [out["read"] for out in results] == read
        assert [out["written"] for out in results] == read
        pieces = overlap.CROSSING_PIECES if on else 1
        assert [out["crossed"] for out in results] == [2 * pieces * s for s in slices], on
        assert [out["overlapped"] for out in results] == [  # pieces of each of the two calls
            [pieces * s] * 2 if r in on and r in overlapping else [] for r, s in enumerate(slices)], on
    assert len({tuple(out["digests"]) for results in runs.values() for out in results}) == 1


def _large_all_reduces_in_host_ranges(rank: int, n: int, port: int):
    """SUM and MAX of BIG bytes three times each, then AVG twice, each checked against numpy (the
    SUM and MAX exact, of whole numbers), ranks not overlapping: for each call, how many pieces of
    this rank's range went across as host ranges, how many of those in one row, and how many were
    written back after their row."""
    os.environ["SHMCOLL_OVERLAP"] = "0"
    ranged, in_one_row, written_back = [0], [0], [0]
    _record_calls(single_copy, "_across_as_host_range", lambda args, result: ranged.__setitem__(0, ranged[0] + 1))
    _record_calls(two_level, "all_reduce_in_one_row", lambda args, result: (
        ranged.__setitem__(0, ranged[0] + 1), in_one_row.__setitem__(0, in_one_row[0] + 1)))
    _record_calls(single_copy, "_deliver", lambda args, result: written_back.__setitem__(0, written_back[0] + 1))
    counts = []
    inputs = [np.random.default_rng(r).integers(-1000, 1000, BIG // 4).astype(np.float32) for r in range(n)]
    with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=WAIT_HANG_S) as pg:
        for op, want in [(shmcoll.ReduceKind.SUM, np.sum(inputs, axis=0)), (shmcoll.ReduceKind.MAX,
                                                                             np.max(inputs, axis=0))] * 3:
            x = inputs[rank].copy()
            ranged[0] = in_one_row[0] = written_back[0] = 0
            pg.all_reduce(x, op)
            assert np.array_equal(x, want)
            counts.append((ranged[0], in_one_row[0], written_back[0]))
        for _ in range(2):
            ranged[0] = in_one_row[0] = written_back[0] = 0
            _checked_avg(pg, inputs)
            counts.append((ranged[0], in_one_row[0], written_back[0]))
    return counts


@pytest.mark.multiprocess
def test_a_large_range_is_folded_and_written_back_by_the_row_that_crosses_hosts(monkeypatch):
    """2 + 2 simulated hosts, each rank's range of BIG bytes crossing whole: every call takes it
    across as a host range (single_copy.HostRange), the first as all_reduce_among does, every later
    one in one row (single_copy.all_reduce_in_one_row: the host has agreed). A SUM's and a MAX's
    row writes it into the host peer as it goes, on every rank in some call at least (a call whose
    row could not take its connections writes it back after), exactly; an AVG's, divided after the
    row, always after."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    for counts in run_ranks(4, _large_all_reduces_in_host_ranges, init=False):
        assert [ranged for ranged, _, _ in counts] == [1] * 8
        assert [in_one_row for _, in_one_row, _ in counts] == [0] + [1] * 7
        assert min(back for _, _, back in counts[:6]) == 0
        assert [back for _, _, back in counts[6:]] == [1, 1]


def _late_host_peer(rank: int, n: int, port: int):
    """Large SUMs, exact, where rank 1 comes to every call after the others have waited out their
    first look at the board (kernels.board_gather_open's first wait slice): how many of this
    rank's calls finished their gather the slow way."""
    os.environ["SHMCOLL_OVERLAP"] = "0"
    slow = [0]
    _record_calls(Board, "gather_open_rest", lambda args, result: slow.__setitem__(0, slow[0] + 1))
    inputs = [np.random.default_rng(r).integers(-1000, 1000, BIG // 4).astype(np.float32) for r in range(n)]
    with shmcoll.init(rank=rank, world_size=n, master_addr="127.0.0.1", master_port=port, timeout=WAIT_HANG_S) as pg:
        for _ in range(4):
            x = inputs[rank].copy()
            pg.barrier()
            if rank == 1:
                time.sleep(20 * WAIT_SLICE_NS / 1e9)  # arrive late: the point of the test
            pg.all_reduce(x)
            assert np.array_equal(x, np.sum(inputs, axis=0))
    return slow[0]


@pytest.mark.multiprocess
def test_a_host_peer_late_to_a_call_in_one_row_lets_the_gather_finish_first(monkeypatch):
    """2 + 2 simulated hosts: where rank 1 comes late, its host peer's gather does not finish
    before the row, which then gives its connections back and runs after the gather finished the
    slow way; the results are exact all the same."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    slow = run_ranks(4, _late_host_peer, init=False)
    assert slow[0] >= 2 and slow[1] == 0  # rank 0 waited for rank 1 in its later calls; never the other way


@pytest.mark.multiprocess
def test_a_host_whose_rank_cannot_be_read_takes_its_rings_alone(monkeypatch):
    """Rank 1's host (0, 1) agrees on the rings; the other host (2, 3) still reads directly, and the
    results agree bitwise: each host chooses for itself, since only its own ranks meet there."""
    results = _run_in_hosts("halves", 4, 1, monkeypatch)
    assert [out["read_directly"] for out in results] == [False, False, True, True]
    assert [out["shm"] for out in results[:2]] == [[0, S, 0, 0], [S, 0, 0, 0]]
    assert [out["read"] for out in results[2:]] == [[0, 0, 0, S // 2], [0, 0, S // 2, 0]]
    assert [out["written"] for out in results[2:]] == [[0, 0, 0, S // 2], [0, 0, S // 2, 0]]
    assert len({out["avg"] for out in results}) == 1


UNEVEN = 6 * (256 << 10)  # bytes: 2 or 3 slices, each past the one-step size across hosts


def _uneven_all_reduce(pg, unreadable: int | None):
    """The bytes a SUM of UNEVEN moves, checked exact; an AVG of random values checked against
    numpy, and its result, to compare across ranks and runs. Slices follow the largest host from
    UNEVEN bytes here (two_level.SPREAD_FROM_BYTES)."""
    if pg.rank == unreadable:  # its host takes the rings
        cannot_be_read()
    two_level.SPREAD_FROM_BYTES = UNEVEN
    x = np.full(UNEVEN // 4, pg.rank + 1.0, dtype=np.float32)
    traffic = _traffic_of(pg, lambda pg: pg.all_reduce(x))
    n = pg.world_size
    assert np.all(x == n * (n + 1) / 2)
    return {**traffic, "avg": _checked_avg(pg, _random_inputs(n, UNEVEN))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, slices, read, tcp", [
    ("first-alone", 3, 2, [[0, 0, 0], [0, 0, 1], [0, 1, 0]], [[0, 1, 1], [1, 0, 0], [1, 0, 0]]),
    ("first-alone", 4, 3, [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 1, 0]],
     [[0, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]),
    ("halves", 5, 3, [[0, 1, 1, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 2, 0]],
     [[0, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1], [1, 0, 0, 0, 0], [0, 1, 1, 0, 0]]),
])
def test_every_rank_of_uneven_hosts_takes_slices_across(layout, n, slices, read, tcp, monkeypatch):
    """A large all-reduce from SPREAD_FROM_BYTES (lowered in the ranks to this test's array) cuts
    its array into as many slices as the largest host has ranks (read
    and tcp count them in slices); each rank of a smaller host owns a run of them, so no rank of a
    larger host idles across hosts. Each rank folds its slices out of its host peers' arrays,
    sends each whole to the slice's owner on the other host (two hosts: the ring's two halves) and
    writes it finished into its peers' arrays: in 1 + 2 and 1 + 3 the lone rank crosses a slice
    with every rank of the other host; in 3 + 2 rank 4 owns slices 1 and 2, crossing them with
    ranks 1 and 2. Where the larger host's last rank cannot be read, that host takes its rings:
    the same bytes cross. Every rank ends bitwise alike (between the two runs the fold's order
    in a host of three differs)."""
    piece, hosts = UNEVEN // slices, _hosts(layout, n)
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(n, _uneven_all_reduce, None)
    assert [out["read"] for out in results] == [[piece * k for k in row] for row in read]
    assert [out["written"] for out in results] == [[piece * k for k in row] for row in read]
    assert [out["tcp"] for out in results] == [[piece * k for k in row] for row in tcp]
    larger = max(hosts, key=hosts.count)
    on_rings = run_ranks(n, _uneven_all_reduce, max(r for r in range(n) if hosts[r] == larger))
    assert [out["read"] for out in on_rings] == [
        [0] * n if hosts[r] == larger else [piece * k for k in read[r]] for r in range(n)]
    assert [out["tcp"] for out in on_rings] == [out["tcp"] for out in results]
    assert len({out["avg"] for out in results}) == len({out["avg"] for out in on_rings}) == 1


def _uneven_reduce(pg, root):
    """_large_reduce of UNEVEN bytes, with slices following the largest host from there."""
    two_level.SPREAD_FROM_BYTES = UNEVEN
    return _large_reduce(pg, root, UNEVEN // 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, root, unit, tcp", [
    ("first-alone", 4, 1, 3, [[0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
    ("first-alone", 4, 0, 3, [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]),
    ("halves", 5, 1, 3, [[0] * 5, [0] * 5, [0] * 5, [1, 0, 0, 0, 0], [0, 1, 1, 0, 0]]),
    ("halves", 5, 4, 3, [[0, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1], [0] * 5, [0] * 5]),
    ("pairs", 7, 6, 8, [[0, 0, 1, 0, 2, 0, 1], [0, 0, 0, 1, 0, 2, 1], [1, 0, 0, 0, 0, 0, 3], [0, 1, 0, 0, 0, 0, 3],
                        [2, 0, 0, 0, 0, 0, 2], [0, 2, 0, 0, 0, 0, 2], [0, 0, 2, 2, 1, 1, 0]]),
])
def test_a_large_reduce_over_uneven_hosts_takes_the_all_reduces_slices(layout, n, root, unit, tcp, monkeypatch):
    """From SPREAD_FROM_BYTES a reduce cuts its array as the all-reduce does (tcp counts UNEVEN /
    unit): each slice crosses from its owner on every other host to its owner on the root's host.
    In 1 + 3 the lone rank sends one slice to each rank of the other host (root 1), or takes one
    from each (root 0), where below the threshold one rank carries the whole array; in 3 + 2 rank 4
    owns slices 1 and 2. In 2 + 2 + 2 + 1 each of the 2 slices (of UNEVEN / 2, past
    REDUCE_HALVING_FROM_BYTES) is halved among its 4 owners, the lone rank 6 owning both and
    taking them in turn, and each owner sends its finished quarter to rank 6, the root."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(n, _uneven_reduce, root)
    assert results == [[UNEVEN // unit * k for k in row] for row in tcp]


def _small_all_reduce(pg):
    x = np.full(2, pg.rank + 1.0, dtype=np.float32)  # 8 bytes
    pg.all_reduce(x)
    n = pg.world_size
    assert np.all(x == n * (n + 1) / 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, tcp, shm", [
    ("halves", 4, [[0, 0, 8, 0], [0, 0, 0, 8], [8, 0, 0, 0], [0, 8, 0, 0]], [[0] * 4] * 4),
    ("first-alone", 4, [[0, 8, 0, 0], [8, 0, 0, 0], [0] * 4, [0] * 4], [[0] * 4, [0, 0, 8, 8], [0] * 4, [0] * 4]),
    ("pairs", 6, [[0, 0, 8, 0, 8, 0], [0] * 6, [8, 0, 0, 0, 0, 0], [0] * 6, [8, 0, 0, 0, 0, 0], [0] * 6],
     [[0, 8, 0, 0, 0, 0], [0] * 6, [0, 0, 0, 8, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 8], [0] * 6]),
])
def test_small_all_reduce_crosses_hosts_by_column(layout, n, tcp, shm, monkeypatch):
    """8 bytes: the ranks of a host reduce on its board (nothing over the rings), then between 2
    hosts local rank j of every host swaps the host's sum with local rank j of the other, one
    message each way, so no rank waits for its leader to hand the result on. Over 1+3 there is one
    column (0, 1): the second host's extra ranks 2 and 3 get the result from their leader over the
    rings. Among 3 hosts (2+2+2) only the leaders 0, 2 and 4 cross, by recursive doubling: 4 hands
    its host's sum to 0, 0 and 2 swap theirs, 0 hands the result back to 4; and each leader hands
    it to its host's other rank."""
    results = _run(layout, n, "hier", _small_all_reduce, monkeypatch)
    assert [out["tcp"] for out in results] == tcp
    assert [out["shm"] for out in results] == shm


SMALL_CALLS = [(np.float32, shmcoll.ReduceKind.SUM), (np.float16, shmcoll.ReduceKind.AVG),
               (np.int64, shmcoll.ReduceKind.MAX), (np.float64, shmcoll.ReduceKind.PROD)]


def _general_path_counted(pg, lean_parity: int) -> list[str]:
    """Sends ranks not of lean_parity down the general path (plans, runner); the list that will
    hold the collective of every call the general path runs, so the lean ranks show they took none."""
    if pg.rank % 2 != lean_parity:
        pg._lean = None
    general: list[str] = []
    run = pg._runner.run
    pg._runner.run = lambda plan: (general.append(plan.coll.label), run(plan))[1]
    return general


def _run_by_either_path(monkeypatch, layout: str | None, n: int, body, lean_parity: int,
                        board_bytes: int | None = None) -> list:
    """run_ranks(n, body, lean_parity) on one host over shared memory (layout None) or over the
    simulated hosts of `layout`, with board entries of board_bytes where given."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier" if layout else "shm")
    if board_bytes is not None:
        monkeypatch.setenv("SHMCOLL_SHM_BOARD_BYTES", str(board_bytes))
    if layout:
        monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    return run_ranks(n, body, lean_parity)


def _assert_path_taken(out: dict, rank: int, layout: str | None, lean_parity: int, general_calls: list[str]) -> None:
    """The rank of lean_parity took the lean path (LeanAcrossHosts across hosts) and ran no call on
    the general one; any other rank ran general_calls there."""
    lean = rank % 2 == lean_parity
    assert out["path"] == (("LeanAcrossHosts" if layout else "LeanPath") if lean else "NoneType"), rank
    assert out["general"] == ([] if lean else general_calls), rank


def _small_calls_by_either_path(pg, lean_parity: int):
    """The small all-reduces and barriers of SMALL_CALLS, on the lean path (lean.py) on ranks of
    one parity and on the general one on the others."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for dtype, op in SMALL_CALLS:
        x = np.arange(1, 6, dtype=dtype) + pg.rank
        pg.all_reduce(x, op)
        pg.barrier()
        results.append(x.tolist())
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("halves", 5), ("first-alone", 3), ("each", 4), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_small_calls_across_hosts_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """Ranks of a group across hosts take the lean path for a small all-reduce and a barrier
    (LeanAcrossHosts) unless something sends them down the general one; the two send the same
    frames, so ranks on either path, crossing hosts or not (3+2, 1+2, 2+2+2), meet and get the
    same results."""
    results = _run_by_either_path(monkeypatch, layout, n, _small_calls_by_either_path, lean_parity)
    inputs = [[np.arange(1, 6, dtype=dtype) + r for r in range(n)] for dtype, _ in SMALL_CALLS]
    expected = [np.sum(inputs[0], axis=0), np.mean(inputs[1], axis=0, dtype=np.float32).astype(np.float16),
                np.max(inputs[2], axis=0), np.prod(inputs[3], axis=0)]
    for rank, out in enumerate(results):
        _assert_path_taken(out, rank, layout, lean_parity, ["all_reduce", "barrier"] * len(SMALL_CALLS))
        assert out["results"] == [e.tolist() for e in expected], rank


LARGE_CALLS = [(np.float32, shmcoll.ReduceKind.SUM), (np.float16, shmcoll.ReduceKind.AVG),
               (np.int64, shmcoll.ReduceKind.MAX)]
LARGE_COUNT = 100_003  # past the one-step size across hosts (select.py: TWO_LEVEL), and not a multiple of a host


def _large_inputs(dtype, rank: int) -> np.ndarray:
    return (np.arange(LARGE_COUNT) % 7 + rank).astype(dtype)


def _large_calls_by_either_path(pg, lean_parity: int):
    """The large all-reduces of LARGE_CALLS, twice each, on the lean path on ranks of one parity
    and on the general one on the others, as _small_calls_by_either_path."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for dtype, op in LARGE_CALLS * 2:
        x = _large_inputs(dtype, pg.rank)
        pg.all_reduce(x, op)
        results.append(x)
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [(None, 3), ("halves", 4), ("first-alone", 3), ("each", 4), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_large_calls_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """A large all-reduce of a plain array runs its algorithm from the lean path's entry too (on one
    host reading peers' arrays directly; across hosts two-level, by ring or halving-doubling
    between hosts): the same algorithm with the same Call, so ranks on either path meet, and all
    get the same results, bitwise alike."""
    results = _run_by_either_path(monkeypatch, layout, n, _large_calls_by_either_path, lean_parity)
    for rank, out in enumerate(results):
        _assert_path_taken(out, rank, layout, lean_parity, ["all_reduce"] * 2 * len(LARGE_CALLS))
        for got, theirs in zip(out["results"], results[0]["results"]):
            assert got.tobytes() == theirs.tobytes(), rank
    inputs = [np.stack([_large_inputs(np.int64, r) for r in range(n)]) for _ in LARGE_CALLS]
    expected = [inputs[0].sum(axis=0), inputs[1].mean(axis=0), inputs[2].max(axis=0)] * 2
    for got, want in zip(results[0]["results"], expected):
        assert np.allclose(got.astype(np.float64), want, rtol=1e-3), got


#: (dtype, count) of the broadcasts by either path: within a board entry (4 KiB here), past it, and
#: large (past select.SMALL_BROADCAST_BYTES)
BROADCASTS = [(np.float32, 2), (np.float16, 5000), (np.int64, 300_001)]


def _broadcasts_by_either_path(pg, lean_parity: int):
    """BROADCASTS from every root, the root's array read-only, on the lean path on ranks of one
    parity and on the general one on the others, as _small_calls_by_either_path; per call, whether
    the rank got the root's array back in place."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for root in range(pg.world_size):
        for dtype, count in BROADCASTS:
            want = (np.arange(count) % 97 + root).astype(dtype)
            data = want.copy() if pg.rank == root else np.zeros(count, dtype)
            data.flags.writeable = pg.rank != root
            results.append(pg.broadcast(root, data) is data and data.tobytes() == want.tobytes())
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [(None, 3), ("halves", 4), ("first-alone", 3), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_broadcasts_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """A broadcast of a plain array takes the lean path (lean.py): on one host a board-sized one
    runs the board's compiled step from a prepared header, any other the algorithm plans.py would
    pick, kept per kind of call. Both paths publish and send the same, so ranks on either meet,
    from every root, within a board entry, past it and large."""
    results = _run_by_either_path(monkeypatch, layout, n, _broadcasts_by_either_path, lean_parity, board_bytes=4096)
    for rank, out in enumerate(results):
        _assert_path_taken(out, rank, layout, lean_parity, ["broadcast"] * n * len(BROADCASTS))
        assert out["results"] == [True] * n * len(BROADCASTS), rank


#: (dtype, count, op) of the reduces by either path, exact in every order: within a board entry
#: (4 KiB here), past it, and large
REDUCES = [(np.float32, 2, shmcoll.ReduceKind.SUM), (np.float64, 100, shmcoll.ReduceKind.AVG),
           (np.float16, 5000, shmcoll.ReduceKind.SUM), (np.int64, 300_001, shmcoll.ReduceKind.MAX)]


def _reduce_input(dtype, count: int, rank: int) -> np.ndarray:
    return (np.arange(count) % 7 + rank).astype(dtype)


def _reduces_by_either_path(pg, lean_parity: int):
    """REDUCES to every root, on the lean path on ranks of one parity and on the general one on the
    others, as _small_calls_by_either_path; the root's results, as bytes."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for root in range(pg.world_size):
        for dtype, count, op in REDUCES:
            data = _reduce_input(dtype, count, pg.rank)
            assert pg.reduce(root, data, op) is data
            if pg.rank == root:
                results.append(data.tobytes())
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [(None, 3), ("halves", 4), ("first-alone", 3), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_reduces_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """A reduce of a plain array takes the lean path too: a small one is a one-step all-reduce
    under the reduce's description, its steps run from a prepared header (the board's, and across
    hosts the column's row of exchanges); a larger one runs the algorithm plans.py would pick. Ranks
    on either path meet, and every root gets the exact result."""
    results = _run_by_either_path(monkeypatch, layout, n, _reduces_by_either_path, lean_parity, board_bytes=4096)
    fold = {shmcoll.ReduceKind.SUM: np.sum, shmcoll.ReduceKind.MAX: np.max,
            shmcoll.ReduceKind.AVG: lambda x, axis: np.sum(x, axis=axis) / n}
    want = [fold[op](np.stack([_reduce_input(np.float64, count, r) for r in range(n)]), axis=0).astype(dtype)
            for dtype, count, op in REDUCES]
    for rank, out in enumerate(results):
        _assert_path_taken(out, rank, layout, lean_parity, ["reduce"] * n * len(REDUCES))
        assert out["results"] == [w.tobytes() for w in want], rank


#: (dtype, shape) of each rank's input to the all-gathers by either path: within a board entry
#: (4 KiB here; a 0-d input counts as one row), past it, and large (past select.SMALL_GATHER_BYTES
#: in all)
GATHERS = [(np.float32, (2,)), (np.float64, ()), (np.float16, (3, 5)), (np.int32, (3000,)), (np.int64, (70_001,))]


def _gather_input(dtype, shape: tuple[int, ...], rank: int) -> np.ndarray:
    return (np.arange(int(np.prod(shape))) % 89 + 3 * rank).astype(dtype).reshape(shape)


def _all_gathers_by_either_path(pg, lean_parity: int):
    """GATHERS, each rank's input read-only, on the lean path on ranks of one parity and on the
    general one on the others, as _small_calls_by_either_path; each result's shape and bytes."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for dtype, shape in GATHERS:
        local = _gather_input(dtype, shape, pg.rank)
        local.flags.writeable = False
        out = pg.all_gather(local)
        results.append((out.shape, out.dtype.str, out.tobytes()))
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [(None, 3), ("halves", 4), ("first-alone", 3), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_all_gathers_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """An all-gather of a plain array takes the lean path: on one host one within a board entry runs
    the board's compiled step from a prepared header (a larger one, read from the peers' arrays,
    takes the general path there too); across hosts every one runs the algorithm plans.py would
    pick. Both publish and send the same, so ranks on either meet and get every rank's input in
    rank order."""
    results = _run_by_either_path(monkeypatch, layout, n, _all_gathers_by_either_path, lean_parity, board_bytes=4096)
    fits = [np.dtype(dtype).itemsize * int(np.prod(shape)) <= 4096 for dtype, shape in GATHERS]
    general_on_lean = [] if layout else ["all_gather"] * fits.count(False)
    want = [np.concatenate([_gather_input(dtype, shape, r).reshape(-1, *shape[1:]) for r in range(n)])
            for dtype, shape in GATHERS]
    for rank, out in enumerate(results):
        lean = rank % 2 == lean_parity
        assert out["path"] == (("LeanAcrossHosts" if layout else "LeanPath") if lean else "NoneType"), rank
        assert out["general"] == (general_on_lean if lean else ["all_gather"] * len(GATHERS)), rank
        assert out["results"] == [(w.shape, w.dtype.str, w.tobytes()) for w in want], rank


#: (dtype, rows per rank, trailing shape, op) of the reduce-scatters by either path: within a board
#: entry (4 KiB here) and past it
REDUCE_SCATTERS = [(np.float32, 2, (), shmcoll.ReduceKind.SUM), (np.float16, 3, (5,), shmcoll.ReduceKind.AVG),
                   (np.int64, 10, (), shmcoll.ReduceKind.MAX), (np.float32, 3000, (), shmcoll.ReduceKind.SUM)]


def _reduce_scatter_input(dtype, rows: int, tail: tuple[int, ...], n: int, rank: int) -> np.ndarray:
    shape = (n * rows, *tail)
    return (np.arange(int(np.prod(shape))) % 13 + rank).astype(dtype).reshape(shape)


def _reduce_scatters_by_either_path(pg, lean_parity: int):
    """REDUCE_SCATTERS, each rank's input read-only, on the lean path on ranks of one parity and
    on the general one on the others, as _small_calls_by_either_path; each result's shape and bytes,
    and whether the input came back unchanged."""
    general = _general_path_counted(pg, lean_parity)
    results = []
    for dtype, rows, tail, op in REDUCE_SCATTERS:
        data = _reduce_scatter_input(dtype, rows, tail, pg.world_size, pg.rank)
        data.flags.writeable = False
        out = pg.reduce_scatter(data, op)
        kept = data.tobytes() == _reduce_scatter_input(dtype, rows, tail, pg.world_size, pg.rank).tobytes()
        results.append((out.shape, out.dtype.str, out.tobytes(), kept))
    return {"path": type(pg._lean).__name__, "general": general, "results": results}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [(None, 3), ("halves", 4), ("first-alone", 3), ("pairs", 6)])
@pytest.mark.parametrize("lean_parity", [0, 1])
def test_reduce_scatters_agree_whichever_path_each_rank_takes(layout, n, lean_parity, monkeypatch):
    """A small reduce_scatter of a plain array takes the lean path: the one-step all-reduce of a
    copy of it, from a prepared header (the board's step, and across hosts the column's row of
    exchanges), under the reduce-scatter's own description; each rank keeps its block. A larger
    one takes the general path, but on a rank alone on its host (no board step to outgrow). Ranks
    on either path meet and get exact results, their inputs unchanged."""
    results = _run_by_either_path(monkeypatch, layout, n, _reduce_scatters_by_either_path, lean_parity,
                                  board_bytes=4096)
    fits = [np.dtype(d).itemsize * n * rows * int(np.prod(tail)) <= 4096 for d, rows, tail, _ in REDUCE_SCATTERS]
    hosts = _hosts(layout, n) if layout else ["one"] * n
    want = []
    for dtype, rows, tail, op in REDUCE_SCATTERS:
        inputs = np.stack([_reduce_scatter_input(np.float64, rows, tail, n, r) for r in range(n)])
        total = inputs.max(axis=0) if op == shmcoll.ReduceKind.MAX else inputs.sum(axis=0)
        total = total / n if op == shmcoll.ReduceKind.AVG else total
        want.append([total[r * rows:(r + 1) * rows].astype(dtype) for r in range(n)])
    for rank, out in enumerate(results):
        lean = rank % 2 == lean_parity
        assert out["path"] == (("LeanAcrossHosts" if layout else "LeanPath") if lean else "NoneType"), rank
        alone = hosts.count(hosts[rank]) == 1  # no board step: any one-step call runs here
        general_calls = (0 if alone else fits.count(False)) if lean else len(REDUCE_SCATTERS)
        assert out["general"] == ["reduce_scatter"] * general_calls, rank
        assert out["results"] == [(w[rank].shape, w[rank].dtype.str, w[rank].tobytes(), True) for w in want], rank


@pytest.mark.multiprocess
def test_a_small_all_reduce_larger_than_the_board_goes_around_the_host_in_one_shot(monkeypatch):
    """Above a board entry (SHMCOLL_SHM_BOARD_BYTES) but within the one-step size, the ranks of a host
    swap their arrays over the rings instead: each sends its whole array to its local peer once,
    then its host's sum to its column peer."""
    monkeypatch.setenv("SHMCOLL_SHM_BOARD_BYTES", "4096")
    count = 4096  # 16 KiB of float32

    def small(pg):
        x = np.full(count, pg.rank + 1.0, dtype=np.float32)
        pg.all_reduce(x)
        assert np.all(x == 10.0)

    results = _run("halves", 4, "hier", small, monkeypatch)
    b = 4 * count
    assert [out["tcp"] for out in results] == [[0, 0, b, 0], [0, 0, 0, b], [b, 0, 0, 0], [0, b, 0, 0]]
    assert [out["shm"] for out in results] == [[0, b, 0, 0], [b, 0, 0, 0], [0, 0, 0, b], [0, 0, b, 0]]


@pytest.mark.parametrize("ids, hosts, columns", [
    ({0: "a", 1: "a", 2: "b", 3: "b"}, ((0, 1), (2, 3)), [(0, 2), (1, 3)]),
    ({0: "x", 1: "y", 2: "x", 3: "y"}, ((0, 2), (1, 3)), [(0, 1), (2, 3)]),
    ({0: "b", 1: "a", 2: "a"}, ((0,), (1, 2)), [(0, 1), (2,)]),
    ({0: "h", 1: "h", 2: "h"}, ((0, 1, 2),), [(0,), (1,), (2,)]),
])
def test_topology_groups_ranks_by_host(ids, hosts, columns):
    topo = Topology.from_host_ids(ids)
    assert topo.hosts == hosts
    assert [topo.column(j) for j in range(len(columns))] == columns
    assert topo.min_local == min(len(h) for h in hosts)
    assert topo.leaders() == tuple(h[0] for h in hosts)
    for rank in ids:
        assert rank in topo.local_ranks(rank) and topo.local_ranks(rank)[topo.local_index(rank)] == rank


@pytest.mark.parametrize("sizes, runs, slice_columns", [
    ((2, 2), [[[0], [1]], [[0], [1]]], [(0, 2), (1, 3)]),
    ((1, 3), [[[0, 1, 2]], [[0], [1], [2]]], [(0, 1), (0, 2), (0, 3)]),
    ((3, 2), [[[0], [1], [2]], [[0], [1, 2]]], [(0, 3), (1, 4), (2, 4)]),
    ((1, 2, 3), [[[0, 1, 2]], [[0], [1, 2]], [[0], [1], [2]]], [(0, 1, 3), (0, 2, 4), (0, 2, 5)]),
])
def test_every_rank_owns_a_run_of_the_largest_hosts_slices(sizes, runs, slice_columns):
    """Cut into as many slices as the largest host has ranks, every local index of each host owns a
    run of consecutive ones, as even as can be (runs, per host); each slice's owners, one per host,
    are its column. Cut into as many as the smallest host has, local index j owns slice j and the
    larger hosts' other ranks none: the columns. On hosts of one size both are the columns."""
    ids = {r: str(h) for h, size in enumerate(sizes) for r in range(sum(sizes[:h]), sum(sizes[:h + 1]))}
    topo = Topology.from_host_ids(ids)
    most, least = max(sizes), min(sizes)
    assert (topo.max_local, topo.min_local) == (most, least)
    assert [[list(run) for run in topo.slice_runs(most, size)] for size in sizes] == runs
    assert [topo.slice_column(s, most) for s in range(most)] == slice_columns
    assert [[list(run) for run in topo.slice_runs(least, size)] for size in sizes] == [
        [[j] if j < least else [] for j in range(size)] for size in sizes]
    assert [topo.slice_column(j, least) for j in range(least)] == [topo.column(j) for j in range(least)]
    if most == least:
        assert slice_columns == [topo.column(j) for j in range(most)]


def _disagree(pg, calls):
    """Ranks on the first simulated host make one call, the others another, at the same sequence number."""
    first_host = pg.rank < (pg.world_size + 1) // 2
    return attempt(lambda: calls[0 if first_host else 1](pg))


@pytest.mark.multiprocess
@pytest.mark.parametrize("calls", [
    (lambda pg: pg.all_reduce(np.ones(2, np.float32)), lambda pg: pg.all_reduce(np.ones(1 << 20, np.float32))),
    (lambda pg: pg.broadcast(0, np.ones(1 << 18, np.float32)), lambda pg: pg.all_gather(np.ones(1 << 16, np.float32))),
    (lambda pg: pg.barrier(), lambda pg: pg.broadcast(3, np.ones(4, np.float64))),
    (lambda pg: pg.all_reduce(np.ones(4096, np.float32)), lambda pg: pg.all_reduce(np.ones(4096, np.float64))),
    (lambda pg: pg.broadcast(0, np.ones(4, np.float32)), lambda pg: pg.broadcast(3, np.ones(4, np.float32))),
    (lambda pg: pg.broadcast(1, np.ones(4, np.float32)), lambda pg: pg.broadcast(1, np.ones(1 << 20, np.float32))),
    (lambda pg: pg.all_gather(np.ones(4, np.float32)), lambda pg: pg.all_gather(np.ones(1 << 18, np.float32))),
    (lambda pg: pg.broadcast(0, np.ones(S, np.float32)), lambda pg: pg.broadcast(3, np.ones(S, np.float32))),
    (lambda pg: pg.gather(1, np.ones(4, np.float32)), lambda pg: pg.gather(1, np.ones(1 << 18, np.float32))),
    (lambda pg: pg.all_to_all(np.ones(4, np.float32)), lambda pg: pg.all_to_all(np.ones(1 << 18, np.float32))),
], ids=["small-vs-large", "broadcast-vs-all_gather", "barrier-vs-broadcast", "f32-vs-f64", "broadcast-roots",
        "broadcast-small-vs-large", "all_gather-small-vs-large", "large-broadcast-roots", "gather-small-vs-large",
        "all_to_all-small-vs-large"])
def test_hosts_that_disagree_all_raise_mismatch(calls, monkeypatch):
    """Two hosts calling different things: every rank raises CollectiveMismatch, nobody hangs."""
    results = _run_with_timeout("halves", 4, _disagree, calls, monkeypatch)
    for rank, out in enumerate(results):
        assert out["kind"] == "CollectiveMismatch", (rank, out["msg"])
        assert out["call_s"] < MISMATCH_NOTICE_S, (rank, out)


def _disagree_inside_hosts(pg, calls):
    """Even ranks make one call, odd ranks another: over 2+2 hosts each host holds one of each."""
    return attempt(lambda: calls[pg.rank % 2](pg))


@pytest.mark.multiprocess
@pytest.mark.parametrize("calls", [
    (lambda pg: pg.all_reduce(np.ones(4, np.float32)), lambda pg: pg.all_reduce(np.ones(4, np.float64))),
    (lambda pg: pg.all_reduce(np.ones(2, np.float32)), lambda pg: pg.all_reduce(np.ones(3, np.float32))),
    (lambda pg: pg.all_reduce(np.ones(2, np.float32)), lambda pg: pg.all_reduce(np.ones(2, np.float32), op="max")),
], ids=["f32-vs-f64", "2-vs-3-elements", "sum-vs-max"])
def test_ranks_of_one_host_that_disagree_all_raise_mismatch(calls, monkeypatch):
    """Small all-reduces that differ inside each host meet on the host's board: every rank raises
    CollectiveMismatch, nobody hangs."""
    results = _run_with_timeout("halves", 4, _disagree_inside_hosts, calls, monkeypatch)
    for rank, out in enumerate(results):
        assert out["kind"] == "CollectiveMismatch", (rank, out["msg"])
        assert out["call_s"] < MISMATCH_NOTICE_S, (rank, out)


def _run_with_timeout(layout, n, body, arg, monkeypatch):
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    return run_ranks(n, body, arg)


def test_a_rank_published_without_an_address_is_reached_where_the_store_was():
    """A rank on rank 0's host that reached the store over loopback publishes no address (bootstrap's
    _tcp_transport); each peer connects to it where the peer itself reached the store."""
    from types import SimpleNamespace

    from shmcoll.bootstrap import _reachable

    seen_from_elsewhere = SimpleNamespace(store_address="10.0.0.1")
    assert _reachable(["", 5001], seen_from_elsewhere) == ("10.0.0.1", 5001)
    assert _reachable(["10.0.0.2", 5002], seen_from_elsewhere) == ("10.0.0.2", 5002)


# ---- reduce_scatter, reduce, all_gather_v, gather, scatter and all_to_all ----
# Each takes (or, for all_gather_v, averages) 1 MiB per rank; with 3 ranks the element count is cut
# to a multiple of 3 (262143 float32, S - 4 bytes) so reduce_scatter, scatter and all_to_all split
# it evenly. Every action checks its result, so a path that moves the right bytes wrongly fails.
ROOT = 1  # rooted calls: rank 1 is on host a in halves, on host b in interleaved and first-alone


def _elems(n: int) -> int:
    """float32 elements per rank: S bytes, cut to a multiple of n."""
    return S // 4 // n * n


def _size(n: int) -> int:
    """Bytes per rank (S for 4 ranks, S - 4 for 3)."""
    return 4 * _elems(n)


def _reduce_scatter(pg):
    n, e = pg.world_size, _elems(pg.world_size)
    # Block j of rank r holds (r + 1) * (j + 1) plus a within-block pattern: a block delivered to the
    # wrong rank, or shifted, shows up.
    x = ((pg.rank + 1) * (1 + np.arange(e) // (e // n)) + np.arange(e) % 5).astype(np.float32)
    out = pg.reduce_scatter(x)
    b = e // n
    expected = (pg.rank + 1) * n * (n + 1) / 2 + n * (np.arange(pg.rank * b, (pg.rank + 1) * b) % 5)
    assert out.shape == (e // n,) and np.array_equal(out, expected.astype(np.float32))


def _reduce(pg):
    n, e = pg.world_size, _elems(pg.world_size)
    x = (pg.rank + 1 + np.arange(e) % 5).astype(np.float32)
    pg.reduce(ROOT, x)
    if pg.rank == ROOT:
        assert np.array_equal(x, (n * (n + 1) / 2 + n * (np.arange(e) % 5)).astype(np.float32))


def _v_length(rank: int) -> int:
    """all_gather_v: rank r contributes (r + 1) * S / 4 bytes (S/4, S/2, 3S/4, S)."""
    return (rank + 1) * (S // 16)


def _all_gather_v(pg):
    n = pg.world_size
    out, lengths = pg.all_gather_v(np.full(_v_length(pg.rank), float(pg.rank), dtype=np.float32))
    assert lengths == [_v_length(r) for r in range(n)]
    assert np.array_equal(out, np.repeat(np.arange(n, dtype=np.float32), lengths))


def _gather(pg):
    n, e = pg.world_size, _elems(pg.world_size)
    out = pg.gather(ROOT, np.arange(e, dtype=np.float32) + pg.rank)
    if pg.rank == ROOT:
        assert np.array_equal(out, (np.arange(e)[None, :] + np.arange(n)[:, None]).reshape(-1).astype(np.float32))
    else:
        assert out is None


def _scatter(pg):
    n, e = pg.world_size, _elems(pg.world_size)
    got = pg.scatter(ROOT, np.arange(e, dtype=np.float32) if pg.rank == ROOT else None)
    assert np.array_equal(got, np.arange(pg.rank * (e // n), (pg.rank + 1) * (e // n), dtype=np.float32))


def _all_to_all(pg):
    n, e = pg.world_size, _elems(pg.world_size)
    # Block j of rank r holds r * n + j: rank j must end with s * n + j from every source s, in order.
    out = pg.all_to_all(np.repeat(np.arange(pg.rank * n, (pg.rank + 1) * n, dtype=np.float32), e // n))
    assert np.array_equal(out, np.repeat(np.arange(n, dtype=np.float32) * n + pg.rank, e // n))


REDUCE_GATHER_SCATTER_ALL_TO_ALL = (_reduce_scatter, _reduce, _all_gather_v, _gather, _scatter, _all_to_all)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3), ("interleaved", 4), ("each", 4)])
@pytest.mark.parametrize("action", REDUCE_GATHER_SCATTER_ALL_TO_ALL, ids=lambda a: a.__name__.lstrip("_"))
def test_reduce_gather_scatter_all_to_all_follow_the_hosts(layout, n, action, monkeypatch):
    """As test_paths_follow_the_hosts, for the large paths of these collectives."""
    _assert_paths_follow(_hosts(layout, n), _run(layout, n, "hier", action, monkeypatch), action.__name__)


S3 = _size(3)  # bytes per rank with 3 ranks (S - 4: 262143 float32, a multiple of 3)
HEAD = 8 * (1 + MAX_NDIM)  # all_gather_v's length header on one level: [ndim, dim0, ...] as int64 (72 bytes)
BLOCK_HEAD = HEAD + 8  # scatter's announcement before each block on one level: [dtype code, ndim, dim0, ...]
V_HEAD = GATHER_V_HEAD_BYTES  # all_gather_v's head across hosts (its piece's shape, the piece where it fits)
SCATTER_HEAD = SCATTER_HEAD_BYTES  # scatter's head across hosts (the blocks' shape, the blocks where they fit)


# Bytes that must cross host boundaries, two-level versus flat TCP, for the collectives above.
# reduce_scatter: each owner sends its host's partial sum of a target's block (S/n) straight to the
#   target, once per other host: (hosts - 1) * S = S on two hosts, whatever the layout. Flat: the
#   ring carries (n - 1) blocks of S/n over every edge: 3S/4 per edge, 2 edges cross in 2+2 (1.5S),
#   all 4 in a,b,a,b (3S); 1+2: (2/3)S3 over 2 of 3 edges.
# reduce (root 1): K = min_local slices of the host's sum go from every other host's column to the
#   root's host: (hosts - 1) * S again (1+2: K = 1, rank 0 sends all of S3 to rank 1). Flat: the
#   ring reduce-scatter as above, then every rank sends its S/n segment to the root: 2+2 adds
#   ranks 2, 3 (S/2) to 1.5S; a,b,a,b adds 0, 2 (S/2) to 3S; 1+2 adds rank 0's S3/3 to (4/3)S3.
# all_gather_v (rank r gives (r + 1)S/4, T = 2.5S in all with 4 ranks, 1.5S with 3): the leaders'
#   ring passes each host's span to the other leader once, T, plus the heads (V_HEAD each, no
#   piece fitting) through the small two-level all-gather, whose every column carries its host's
#   heads across (2+2 and a,b,a,b: 2 columns, 2 * n * V_HEAD; 1+2: the leaders alone, n *
#   V_HEAD). Flat: every pair swaps headers (8 cross pairs in 2+2 and a,b,a,b, 4 in 1+2), and
#   ring edge r -> r+1 carries all blocks but r+1's: 2+2 crosses 1->2 (T - S*3/4) and 3->0
#   (T - S/4), a,b,a,b every edge (3T), 1+2 0->1 (T - S/2) and 2->0 (T - S/4).
# gather, scatter, all_to_all: every block goes straight from its source to its destination, so it
#   crosses at most once on either transport, and but for scatter's heads the counts are equal:
#   byte-minimal already (the agreement frames, barrier or all-pairs, are empty). gather (root
#   1): S from each rank on another host; scatter: S/n to each such rank, after a BLOCK_HEAD
#   announcing its dtype and shape (flat), or after the small broadcast of a SCATTER_HEAD across
#   hosts, once per crossing column of the root's host (two levels: 2 in 2+2 and a,b,a,b, 1 in
#   1+2); all_to_all: S/n per ordered pair on different hosts (8 in 2+2 and a,b,a,b, 4 in 1+2).
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, action, hier_bytes, flat_bytes", [
    ("halves", 4, _reduce_scatter, S, 3 * S // 2),
    ("interleaved", 4, _reduce_scatter, S, 3 * S),
    ("first-alone", 3, _reduce_scatter, S3, 4 * S3 // 3),
    ("halves", 4, _reduce, S, 2 * S),
    ("interleaved", 4, _reduce, S, 7 * S // 2),
    ("first-alone", 3, _reduce, S3, 5 * S3 // 3),
    ("halves", 4, _all_gather_v, 5 * S // 2 + 8 * V_HEAD, 4 * S + 8 * HEAD),
    ("interleaved", 4, _all_gather_v, 5 * S // 2 + 8 * V_HEAD, 15 * S // 2 + 8 * HEAD),
    ("first-alone", 3, _all_gather_v, 3 * S // 2 + 3 * V_HEAD, 9 * S // 4 + 4 * HEAD),
    ("halves", 4, _gather, 2 * S, 2 * S),
    ("interleaved", 4, _gather, 2 * S, 2 * S),
    ("first-alone", 3, _gather, S3, S3),
    ("halves", 4, _scatter, S // 2 + 2 * SCATTER_HEAD, S // 2 + 2 * BLOCK_HEAD),
    ("interleaved", 4, _scatter, S // 2 + 2 * SCATTER_HEAD, S // 2 + 2 * BLOCK_HEAD),
    ("first-alone", 3, _scatter, S3 // 3 + SCATTER_HEAD, S3 // 3 + BLOCK_HEAD),
    ("halves", 4, _all_to_all, 2 * S, 2 * S),
    ("interleaved", 4, _all_to_all, 2 * S, 2 * S),
    ("first-alone", 3, _all_to_all, 4 * S3 // 3, 4 * S3 // 3),
], ids=lambda v: v.__name__.lstrip("_") if callable(v) else None)
def test_reduce_gather_scatter_all_to_all_cross_hosts_exactly(layout, n, action, hier_bytes, flat_bytes, monkeypatch):
    hosts = _hosts(layout, n)
    hier = _cross(_run(layout, n, "hier", action, monkeypatch), hosts)
    flat = _cross(_run(layout, n, "tcp", action, monkeypatch), hosts)
    assert (hier, flat) == (hier_bytes, flat_bytes)
    if action in (_gather, _all_to_all):
        assert hier == flat  # direct sends: nothing for two levels to save
    elif action is not _scatter:  # direct sends too, after a broadcast head larger than the flat one's
        assert hier < flat


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3)])
def test_large_reduce_scatter_reads_what_the_host_ring_would_have_sent(layout, n, monkeypatch):
    """Inside each host a rank of a large reduce_scatter folds the blocks it owns straight out of
    its host peer's staged array: it reads exactly what that peer sends it around the host's ring
    with SHMCOLL_SINGLE_COPY=0, and nothing goes around the ring; across hosts the same bytes go
    either way (each rank's result is checked in _reduce_scatter)."""
    monkeypatch.setenv("SHMCOLL_SINGLE_COPY", "0")
    ring = _run(layout, n, "hier", _reduce_scatter, monkeypatch)
    monkeypatch.setenv("SHMCOLL_SINGLE_COPY", "1")
    reads = _run(layout, n, "hier", _reduce_scatter, monkeypatch)
    for rank in range(n):
        assert reads[rank]["read"] == [ring[peer]["shm"][rank] for peer in range(n)], (rank, reads, ring)
        assert (reads[rank]["shm"], ring[rank]["read"]) == ([0] * n, [0] * n)
        assert reads[rank]["tcp"] == ring[rank]["tcp"]
    assert sum(sum(out["read"]) for out in reads) > 0


def _reduce_scatter_rows(pg):
    """_reduce_scatter's traffic, and how many native rows of duplexes this rank ran."""
    from shmcoll import kernels
    rows = []
    row = kernels.duplex_row

    def counted(*args):
        rows.append(args)
        return row(*args)
    kernels.duplex_row = counted
    try:
        return {**_traffic_of(pg, _reduce_scatter), "rows": len(rows)}
    finally:
        kernels.duplex_row = row


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("each", 4), ("pairs", 6)])
def test_large_reduce_scatter_among_more_hosts_crosses_in_rows(layout, n, monkeypatch):
    """Among more than two hosts of as many ranks, each rank's host's partial sums of its
    counterparts' blocks (same local index, every other host) go out, and theirs of its own block
    come in, as one row of duplexes (two_level_reduce._shifts): over TCP each rank sends exactly one
    block to each counterpart and nothing to any other rank, and ranks ran native rows (at least
    one: a rank whose reader thread took a peer's frame first finishes the general way). Results
    are checked in _reduce_scatter."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(n, _reduce_scatter_rows)
    hosts, block = _hosts(layout, n), _size(n) // n
    per_host = n // len(set(hosts))  # each, pairs: a rank's local index is rank % per_host
    for rank, out in enumerate(results):
        counterparts = [p for p in range(n) if hosts[p] != hosts[rank] and p % per_host == rank % per_host]
        assert out["tcp"] == [block if p in counterparts else 0 for p in range(n)], (rank, out)
    assert any(out["rows"] for out in results)


def _small_reduce(pg):
    x = np.full(2, pg.rank + 1.0, dtype=np.float32)  # 8 bytes
    pg.reduce(ROOT, x)
    if pg.rank == ROOT:
        assert np.all(x == 10.0)


def _small_reduce_scatter(pg):
    x = (np.arange(4) + pg.rank).astype(np.float16)  # 8 bytes: one float16 per rank's block
    out = pg.reduce_scatter(x)
    assert out.dtype == np.float16 and out.tolist() == [4.0 * pg.rank + 6.0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("action", [_small_reduce, _small_reduce_scatter], ids=lambda a: a.__name__.lstrip("_"))
def test_small_reductions_cross_hosts_by_column(action, monkeypatch):
    """8 bytes per rank over 2+2 (<= SHMCOLL_ONE_SHOT_BYTES): reduce and reduce_scatter reuse
    all_reduce's one-step path: inside each host the ranks meet on the board, then each swaps the
    whole 8 bytes with its column peer on the other host, once each way."""
    results = _run("halves", 4, "hier", action, monkeypatch)
    assert [out["tcp"] for out in results] == [[0, 0, 8, 0], [0, 0, 0, 8], [8, 0, 0, 0], [0, 8, 0, 0]]
    assert [out["shm"] for out in results] == [[0] * 4] * 4


def _subgroup_all_reduce(pg):
    """A sub-group over all ranks, numbered a,b,a,b across the 2+2 hosts: its all_reduce of S."""
    sub = pg.split([2, 0, 3, 1])
    out = _traffic_of(pg, lambda _: _all_reduce(sub))
    topology = sub.transport.topology
    sub.close()
    return out, topology.hosts


@pytest.mark.multiprocess
def test_subgroup_spanning_hosts_runs_two_level(monkeypatch):
    """Sub-group ranks 0..3 are parent ranks 2, 0, 3, 1: hosts ((0, 2), (1, 3)) in its numbering. Its
    large all_reduce sends 2S across hosts (two-level), not the 6S of a flat ring over a,b,a,b."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    results = run_ranks(4, _subgroup_all_reduce)
    assert all(hosts == ((0, 2), (1, 3)) for _, hosts in results)
    assert _cross([out for out, _ in results], _hosts("halves", 4)) == 2 * S


# ---- many hosts: a small all-reduce among the leaders by recursive doubling ----

def _small_all_reduces(pg):
    """Small all-reduces among one rank per host: SUM, AVG and a SUM of NaNs whose payloads differ
    by rank (x86 keeps the first operand's payload, so a fold in another order on two ranks gives
    other bits); the results, and the bytes sent to each rank during the first SUM alone."""
    summed = np.full(2, pg.rank + 1.0, dtype=np.float32)  # 8 bytes
    traffic = _traffic_of(pg, lambda _: pg.all_reduce(summed))
    averaged = np.arange(4, dtype=np.float64) * (pg.rank + 1)
    pg.all_reduce(averaged, shmcoll.ReduceKind.AVG)
    nans = np.full(3, 0x7FC00001 + pg.rank, dtype=np.uint32)
    pg.all_reduce(nans.view(np.float32))
    return {"sum": summed.tolist(), "avg": averaged.tolist(), "nan bits": nans.tolist(), "tcp": traffic["tcp"]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, messages", [(3, 4), (5, 10), (6, 12), (8, 24)])
def test_small_all_reduce_among_many_hosts_doubles(n, messages, monkeypatch):
    """One rank per host, more hosts than ONE_SHOT_MAX_HOSTS: recursive doubling. At 8 hosts each
    rank sends the 8 bytes log2 8 = 3 times (24 messages, against 56 for one step to all); at 5 the
    fifth gives its array to the first and takes the result back around 2 steps among 4 (10), at 6
    the fifth and sixth to the first and second (12), at 3 the third to the first around 1 step (4)."""
    from shmcoll.algorithms.select import ONE_SHOT_MAX_HOSTS

    assert n > ONE_SHOT_MAX_HOSTS
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _small_all_reduces)
    assert sum(sum(out["tcp"]) for out in results) == messages * 8
    for out in results:
        assert out["sum"] == [n * (n + 1) / 2] * 2
        assert out["avg"] == [i * (n + 1) / 2 for i in range(4)]
    assert len({tuple(out["nan bits"]) for out in results}) == 1


# ---- many hosts: a large all-reduce by halving and doubling ----

def _large_all_reduces(pg):
    """The bytes sent to each rank during an all-reduce of S; then the sum of an odd length (uneven
    segments) and an AVG, for their values."""
    x = np.full(S // 4, pg.rank + 1.0, dtype=np.float32)
    traffic = _traffic_of(pg, lambda _: pg.all_reduce(x))
    odd = np.arange(S // 8 - 3, dtype=np.float64) + pg.rank
    pg.all_reduce(odd)
    averaged = np.full(S // 8, 2.0 * (pg.rank + 1))
    pg.all_reduce(averaged, shmcoll.ReduceKind.AVG)
    return {"tcp": traffic["tcp"], "sum": sorted(set(x.tolist())), "odd": odd[[0, 1, -1]].tolist(),
            "avg": sorted(set(averaged.tolist()))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [4, 5])
def test_large_all_reduce_among_many_hosts_halves_then_doubles(n, monkeypatch):
    """One rank per host, HALVING_FROM_HOSTS hosts or more: position p swaps half of S with p XOR 2
    (out, then back) and a quarter with p XOR 1, never talking to p XOR 3 (a ring would send all
    1.5 S to p + 1). At 5 hosts the fifth sends its S to the first and gets S back."""
    from shmcoll.algorithms.select import HALVING_FROM_HOSTS

    assert n >= HALVING_FROM_HOSTS
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _large_all_reduces)
    for rank, out in enumerate(results):
        want = [0] * n
        if rank < 4:
            want[rank ^ 1], want[rank ^ 2] = S // 2, S
        if rank == 0 and n == 5:
            want[4] = S
        if rank == 4:
            want[0] = S
        assert out["tcp"] == want, (rank, out["tcp"])
        assert out["sum"] == [n * (n + 1) / 2]
        assert out["odd"] == [n * (n - 1) / 2, n + n * (n - 1) / 2, n * (S // 8 - 4) + n * (n - 1) / 2]
        assert out["avg"] == [n + 1.0]


# ---- many hosts: a large reduce down a binomial tree, or by halving ----

def _large_reduce(pg, root, elems):
    """The bytes sent to each rank during a SUM reduce of `elems` float32 to root; then an AVG of an
    odd length (uneven segments). The root checks both results."""
    n = pg.world_size
    x = (pg.rank + 1 + np.arange(elems) % 7).astype(np.float32)
    traffic = _traffic_of(pg, lambda _: pg.reduce(root, x))
    averaged = np.full(elems + 3, 2.0 * (pg.rank + 1))
    pg.reduce(root, averaged, shmcoll.ReduceKind.AVG)
    if pg.rank == root:
        assert np.array_equal(x, (n * (n + 1) / 2 + n * (np.arange(elems) % 7)).astype(np.float32))
        assert np.all(averaged == n + 1.0)
    return traffic["tcp"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, root, sends", [
    (5, 2, {3: 2, 4: 2, 0: 4, 1: 2}),
    (8, 3, {4: 3, 5: 3, 6: 5, 7: 3, 0: 7, 1: 7, 2: 1}),
])
def test_large_reduce_among_many_hosts_goes_down_a_binomial_tree(n, root, sends, monkeypatch):
    """One rank per host, past the one-step size and below REDUCE_HALVING_FROM_BYTES: counted from
    the root, position q folds in q + 1, q + 2, q + 4, ... while those bits of q are clear, then
    sends its partial sum once, to q with its lowest set bit cleared. The root takes in
    ceil(log2 n) arrays, not n - 1; n - 1 cross in all."""
    from shmcoll.algorithms.select import REDUCE_HALVING_FROM_BYTES
    from shmcoll.config import ONE_SHOT_BYTES_ACROSS_HOSTS

    size = (ONE_SHOT_BYTES_ACROSS_HOSTS + REDUCE_HALVING_FROM_BYTES) // 2
    assert ONE_SHOT_BYTES_ACROSS_HOSTS < size < REDUCE_HALVING_FROM_BYTES
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _large_reduce, root, size // 4)
    assert results == [[size if sends.get(r) == p else 0 for p in range(n)] for r in range(n)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n, root, sent", [
    (4, 1, [{2: S // 2, 1: S // 2}, {3: S // 2, 0: S // 4}, {0: S // 2, 3: S // 4, 1: S // 4},
            {1: 3 * S // 4, 2: S // 4}]),
    (5, 4, [{2: S // 2, 1: S // 4, 4: S // 4}, {3: S // 2, 0: S // 4, 4: S // 4},
            {0: S // 2, 3: S // 4, 4: S // 4}, {1: S // 2, 2: S // 4, 4: S // 4}, {0: S}]),
])
def test_large_reduce_among_many_hosts_halves_then_sends_each_quarter_to_the_root(n, root, sent, monkeypatch):
    """One rank per host, S per rank (REDUCE_HALVING_FROM_BYTES or more) among HALVING_FROM_HOSTS
    hosts: position p swaps half of S with p XOR 2 and a quarter with p XOR 1, as the all-reduce's
    halving does, then sends its finished quarter to the root, which takes in 3S/2 where a tree
    would bring it 2S. At 5 hosts the root is the fifth: it gives its S to the first, then takes
    every quarter."""
    from shmcoll.algorithms.select import HALVING_FROM_HOSTS, REDUCE_HALVING_FROM_BYTES

    assert n >= HALVING_FROM_HOSTS and S >= REDUCE_HALVING_FROM_BYTES
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _large_reduce, root, S // 4)
    assert results == [[sent[r].get(p, 0) for p in range(n)] for r in range(n)]


# ---- many hosts: a small broadcast doubles among the leaders ----

def _small_broadcasts(pg, root):
    """A broadcast of 12 bytes from root, then one of 3 float64s from the last rank; the bytes sent
    to each rank during the first."""
    x = np.full(3, float(pg.rank), dtype=np.float32)
    traffic = _traffic_of(pg, lambda _: pg.broadcast(root, x))
    y = np.arange(3, dtype=np.float64) * (pg.rank + 1)
    pg.broadcast(pg.world_size - 1, y)
    return {"tcp": traffic["tcp"], "x": x.tolist(), "y": y.tolist()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["hier", "tcp"])
@pytest.mark.parametrize("n, root, sends", [
    (8, 3, [(3, 2), (2, 0), (3, 1), (0, 4), (1, 5), (2, 6), (3, 7)]),
    (5, 2, [(2, 3), (2, 0), (3, 1), (0, 4)]),
    (5, 4, [(4, 0), (0, 1), (0, 2), (1, 3)]),
])
def test_small_broadcast_among_many_hosts_doubles(n, root, sends, transport, monkeypatch):
    """One rank per host: in step k the half of each 2^(k+1) block that holds the data sends it to
    the other half, so every host receives it once, after log2 hosts steps (a chain would take
    hosts - 1). A fifth host joins through the first: it hands its data over when it is the root,
    else gets the data at the end. Flat TCP doubles among all ranks alike."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", transport)
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _small_broadcasts, root)
    for rank, out in enumerate(results):
        want = [0] * n
        for src, dst in sends:
            if src == rank:
                want[dst] = 12
        assert out["tcp"] == want, (rank, out["tcp"])
        assert out["x"] == [float(root)] * 3
        assert out["y"] == [0.0, float(n), 2.0 * n]


# ---- a small broadcast across hosts: each host's board, then its columns ----

def _one_step_broadcast(pg, root, nbytes):
    """A broadcast of nbytes from root (its array read-only), checked everywhere; the bytes each
    rank sent to each rank meanwhile."""
    x = np.full(nbytes // 4, float(pg.rank + 1), dtype=np.float32)
    if pg.rank == root:
        x.flags.writeable = False
    traffic = _traffic_of(pg, lambda _: pg.broadcast(root, x))
    assert np.all(x == root + 1.0)
    return {"tcp": traffic["tcp"], "shm": traffic["shm"]}


def _sent(n, sends):
    """sends: {(src, dst): bytes} as each rank's row of bytes sent to every rank."""
    return [[sends.get((src, dst), 0) for dst in range(n)] for src in range(n)]


SMALL_CAST = 12  # bytes of the small broadcasts below


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, root, tcp, shm", [
    # 2 + 2, root 1: the board gives host {0, 1} the data; column 0 (0, 2) and column 1 (1, 3) cross
    ("halves", 4, 1, {(0, 2): SMALL_CAST, (1, 3): SMALL_CAST}, {}),
    # 1 + 3, root 3: host {1, 2, 3}'s board; only column 0 (0, 1) crosses; leader 1 hands the data to
    # rank 2, and root 3, which has it, an empty frame
    ("first-alone", 4, 3, {(1, 0): SMALL_CAST}, {(1, 2): SMALL_CAST}),
    # 2 + 2 + 1, root 4: among more than 2 hosts only the leaders (0, 2, 4) cross, by doubling (4 joins
    # through 0), and hand on
    ("pairs", 5, 4, {(4, 0): SMALL_CAST, (0, 2): SMALL_CAST}, {(0, 1): SMALL_CAST, (2, 3): SMALL_CAST}),
])
def test_a_small_broadcast_crosses_hosts_after_one_step_on_each_board(layout, n, root, tcp, shm, monkeypatch):
    """As the small all-reduce: one compiled step on each host's board (the root's host takes the
    root's array there, the others only meet, sending nothing), then the crossing columns double
    from the root's host, and a leader hands the result to the ranks of no column."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(n, _one_step_broadcast, root, SMALL_CAST)
    assert [r["tcp"] for r in results] == _sent(n, tcp)
    assert [r["shm"] for r in results] == _sent(n, shm)


@pytest.mark.multiprocess
def test_a_small_broadcast_larger_than_a_board_entry_doubles_inside_the_root_host(monkeypatch):
    """An array past the board's entry (one-step threshold raised above it): the root's host doubles
    over its rings, the other host meets with empty frames, then both columns cross."""
    entry = 256 << 10
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "halves")
    monkeypatch.setenv("SHMCOLL_SHM_BOARD_BYTES", str(entry))
    monkeypatch.setenv("SHMCOLL_ONE_SHOT_BYTES", str(4 * entry))
    big = 2 * entry
    results = run_ranks(4, _one_step_broadcast, 1, big)
    assert [r["tcp"] for r in results] == _sent(4, {(0, 2): big, (1, 3): big})
    assert [r["shm"] for r in results] == _sent(4, {(1, 0): big})


# ---- a large broadcast across hosts: in slices, one per column ----

BIG_CAST = 2 * S  # bytes of the large broadcasts below: past SMALL_BROADCAST_BYTES


def _large_broadcast(pg, root, unreadable):
    """A broadcast of BIG_CAST bytes from root (its array read-only), checked everywhere; the bytes
    each rank sent to, and read from, each rank meanwhile."""
    if pg.rank == unreadable:
        cannot_be_read()
    x = np.arange(BIG_CAST // 4, dtype=np.float32) * (pg.rank + 1)
    if pg.rank == root:
        x.flags.writeable = False
    traffic = _traffic_of(pg, lambda _: pg.broadcast(root, x))
    assert np.array_equal(x, np.arange(BIG_CAST // 4, dtype=np.float32) * (root + 1))
    return {path: traffic[path] for path in ("tcp", "shm", "read")}


HALF_CAST = BIG_CAST // 2  # a half: the slice of each column of 2 + 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, root, unreadable, tcp, shm, read", [
    # 2 + 2, root 1: rank 0 reads the array from 1; columns (0, 2) and (1, 3) carry a half each; 2
    # and 3 read each other's half
    ("halves", 4, 1, None, {(0, 2): HALF_CAST, (1, 3): HALF_CAST}, {},
     {(0, 1): BIG_CAST, (2, 3): HALF_CAST, (3, 2): HALF_CAST}),
    # ... with rank 3 unreadable: host {2, 3} swaps its halves around its ring instead
    ("halves", 4, 1, 3, {(0, 2): HALF_CAST, (1, 3): HALF_CAST}, {(2, 3): HALF_CAST, (3, 2): HALF_CAST},
     {(0, 1): BIG_CAST}),
    # 1 + 3, root 2: one column, (0, 1): its host's ranks read the array from the root, 1 carries it
    ("first-alone", 4, 2, None, {(1, 0): BIG_CAST}, {}, {(1, 2): BIG_CAST, (3, 2): BIG_CAST}),
    # 2 + 2 + 1, root 4, alone on its host: the leaders double (4 joins through 0), and each
    # leader's host peer reads it from the leader
    ("pairs", 5, 4, None, {(4, 0): BIG_CAST, (0, 2): BIG_CAST}, {}, {(1, 0): BIG_CAST, (3, 2): BIG_CAST}),
])
def test_a_large_broadcast_crosses_hosts_in_one_slice_per_column(layout, n, root, unreadable, tcp, shm, read,
                                                                  monkeypatch):
    """The root's host takes the array from the root, local rank j of every host carries slice j
    across hosts in its column, every other host gathers the slices from their carriers: each
    byte crosses each host boundary once. read[(r, p)]: bytes rank r read from rank p's array."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    results = run_ranks(n, _large_broadcast, root, unreadable)
    assert [r["tcp"] for r in results] == _sent(n, tcp)
    assert [r["shm"] for r in results] == _sent(n, shm)
    assert [r["read"] for r in results] == _sent(n, read)


# ---- a small all-gather: on each host's board, Bruck across hosts ----

def _small_all_gathers(pg):
    """An all-gather of 3 float32s per rank (and the bytes sent to each rank meanwhile), then an
    all_gather_v of rank % 3 rows, some empty."""
    x = np.full(3, float(pg.rank), dtype=np.float32)
    got = {}
    traffic = _traffic_of(pg, lambda _: got.update(out=pg.all_gather(x)))
    v, lengths = pg.all_gather_v(np.full((pg.rank % 3, 2), pg.rank, dtype=np.int64))
    return {"tcp": traffic["tcp"], "shm": traffic["shm"], "out": got["out"].tolist(), "v": v.tolist(),
            "lengths": list(lengths)}


def _check_gathered(results, n):
    for out in results:
        assert out["out"] == [float(r) for r in range(n) for _ in range(3)]
        assert out["lengths"] == [r % 3 for r in range(n)]
        assert out["v"] == [[r, r] for r in range(n) for _ in range(r % 3)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", ["hier", "tcp"])
@pytest.mark.parametrize("n", [5, 8])
def test_small_all_gather_among_many_hosts_takes_log_steps(n, transport, monkeypatch):
    """One rank per host: in step k each rank sends the min(2^k, n - 2^k) blocks it holds from its
    own on to the rank 2^k below it. At 5 hosts: 1 block to p - 1, 2 to p - 2, 1 to p - 4; at 8: 1,
    2 and 4 blocks. n - 1 blocks in all, as a ring, in ceil(log2 n) steps instead of n - 1. Flat
    TCP runs Bruck among all ranks alike."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", transport)
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", "each")
    results = run_ranks(n, _small_all_gathers)
    _check_gathered(results, n)
    for rank, out in enumerate(results):
        want = [0] * n
        distance = 1
        while distance < n:
            want[(rank - distance) % n] += 12 * min(distance, n - distance)
            distance <<= 1
        assert out["tcp"] == want, (rank, out["tcp"])


def _on_hosts(layout: str, n: int, body, monkeypatch) -> tuple[list, list[str], list[list[int]]]:
    """run_ranks(n, body) on the simulated hosts of `layout`: the results, each rank's host and
    each host's ranks."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    hosts = _hosts(layout, n)
    return run_ranks(n, body), hosts, [[r for r in range(n) if hosts[r] == h] for h in dict.fromkeys(hosts)]


def _small_step_traffic(rank: int, hosts: list[str], on: list[list[int]], crossed: int, handed: int,
                        crosses: bool = True) -> tuple[list[int], list[int]]:
    """(shm, tcp) bytes `rank` sends in a call that goes the small all-reduce's way: `crossed` over
    TCP to its column peer on every other host (where it crosses: local index j < the smallest
    host's rank count), and from its host's leader `handed` to each rank of no column."""
    n, mine = len(hosts), next(ranks for ranks in on if rank in ranks)
    columns, j = min(len(ranks) for ranks in on), mine.index(rank)
    tcp, shm = [0] * n, [0] * n
    for ranks in on:
        if crosses and j < columns and ranks is not mine:
            tcp[ranks[j]] = crossed
    for r in mine[columns:] if j == 0 else ():
        shm[r] = handed
    return shm, tcp


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3), ("interleaved", 4)])
def test_small_all_gather_goes_the_small_all_reduces_way(layout, n, monkeypatch):
    """Each host's ranks gather the host's blocks on its board (no ring frames); between 2 hosts
    local rank j < K of every host (K: the smallest host's rank count) swaps its host's blocks with
    its column (12 bytes per rank of its host); the ranks of no column get the whole array (12 n)
    from their leader."""
    results, hosts, on = _on_hosts(layout, n, _small_all_gathers, monkeypatch)
    _check_gathered(results, n)
    for rank, out in enumerate(results):
        mine = hosts.count(hosts[rank])
        assert (out["shm"], out["tcp"]) == _small_step_traffic(rank, hosts, on, 12 * mine, 12 * n), (rank, out)


def _small_gather_and_all_to_all(pg):
    """A gather of 3 float32s per rank to rank 1, then an all_to_all of one float32 per rank pair:
    each call's results, and the bytes this rank sent to each rank during it."""
    n, got = pg.world_size, {}
    gather = _traffic_of(pg, lambda _: got.update(gather=pg.gather(ROOT, np.full(3, float(pg.rank), np.float32))))
    mine = np.arange(n, dtype=np.float32) + 10 * pg.rank  # block j: 10 * rank + j
    all_to_all = _traffic_of(pg, lambda _: got.update(all_to_all=pg.all_to_all(mine)))
    gathered = None if got["gather"] is None else got["gather"].tolist()
    return {"gather": gather, "all_to_all": all_to_all, "gathered": gathered, "exchanged": got["all_to_all"].tolist()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3), ("interleaved", 4)])
def test_small_gather_and_all_to_all_go_the_small_all_gathers_way(layout, n, monkeypatch):
    """Across hosts a small gather, and a small all_to_all, is the small all-gather of every rank's
    input (select.GATHER_EVERYTHING_BYTES), each rank keeping its part: exactly
    test_small_all_gather_goes_the_small_all_reduces_way's bytes for inputs of 12 bytes (the gather)
    and 4 n (the all_to_all), where the direct forms sent one message to the root, or to every rank."""
    results, hosts, on = _on_hosts(layout, n, _small_gather_and_all_to_all, monkeypatch)
    for rank, out in enumerate(results):
        assert out["gathered"] == ([float(r) for r in range(n) for _ in range(3)] if rank == ROOT else None)
        assert out["exchanged"] == [10.0 * r + rank for r in range(n)]
        mine = hosts.count(hosts[rank])
        for call, each in (("gather", 12), ("all_to_all", 4 * n)):
            want = _small_step_traffic(rank, hosts, on, each * mine, each * n)
            assert (out[call]["shm"], out[call]["tcp"]) == want, (rank, call, out[call])


def _small_scatter_and_all_gather_v(pg):
    """A scatter of 3 float32s per rank from rank 1, then an all_gather_v of r + 1 float32s from
    rank r: each call's results, and the bytes this rank sent to each rank during it."""
    n, got = pg.world_size, {}
    full = np.arange(3 * n, dtype=np.float32) if pg.rank == ROOT else None
    scatter = _traffic_of(pg, lambda _: got.update(scatter=pg.scatter(ROOT, full)))
    all_gather_v = _traffic_of(pg, lambda _: got.update(v=pg.all_gather_v(np.full(pg.rank + 1, pg.rank, np.int16))))
    out, lengths = got["v"]
    return {"scatter": scatter, "all_gather_v": all_gather_v, "scattered": got["scatter"].tolist(),
            "gathered": out.tolist(), "lengths": lengths, "dtypes": [got["scatter"].dtype.str, out.dtype.str]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("first-alone", 3), ("interleaved", 4)])
def test_small_scatter_and_all_gather_v_take_one_small_step_across_hosts(layout, n, monkeypatch):
    """Across hosts a small scatter is one small broadcast of SCATTER_HEAD_BYTES (the blocks'
    description, and the blocks), and a small all_gather_v one small all-gather of every rank's
    GATHER_V_HEAD_BYTES (its shape, and its piece): every crossing column of the root's host sends
    the scatter's head to its peers on the other hosts, every crossing column carries its host's
    heads across, and each leader hands the whole result to its host's ranks of no column; where
    they took the length exchange, an agreement step and then messages of their own before."""
    results, hosts, on = _on_hosts(layout, n, _small_scatter_and_all_gather_v, monkeypatch)
    for rank, out in enumerate(results):
        assert out["scattered"] == [3.0 * rank, 3.0 * rank + 1, 3.0 * rank + 2]
        assert (out["lengths"], out["gathered"]) == (list(range(1, n + 1)), [r for r in range(n) for _ in range(r + 1)])
        assert out["dtypes"] == [np.dtype(np.float32).str, np.dtype(np.int16).str]
        mine = hosts.count(hosts[rank])
        scatter = _small_step_traffic(rank, hosts, on, SCATTER_HEAD_BYTES, SCATTER_HEAD_BYTES,
                                      crosses=hosts[rank] == hosts[ROOT])
        all_gather_v = _small_step_traffic(rank, hosts, on, GATHER_V_HEAD_BYTES * mine, GATHER_V_HEAD_BYTES * n)
        for call, want in (("scatter", scatter), ("all_gather_v", all_gather_v)):
            assert (out[call]["shm"], out[call]["tcp"]) == want, (rank, call, out[call])


# ---- hosts that share one machine share its cores ----

def _spins(pg):
    """How long this rank's TCP waits, native exchanges and shared-memory waits spin before they
    sleep (seconds), and whether its large all-reduces overlap (and any rank's in the group)."""
    net = pg.transport.net
    return {"tcp": net._spin_s, "native": net._native_spin_ns * 1e-9, "shm": pg.transport.shm.board.spin_ns * 1e-9,
            "overlap": pg.transport.overlap, "in group": pg.transport.overlap_in_group}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n, cores, tcp_s, native_s, shm_s, overlap", [
    ("each", 3, 2, 0.0, 200e-6, 200e-6, False), ("each", 3, 3, 200e-6, 200e-6, 2000e-6, False),
    ("halves", 4, 2, 0.0, 200e-6, 200e-6, False), ("halves", 4, 8, 200e-6, 200e-6, 2000e-6, True)])
def test_hosts_on_one_kernel_weigh_all_their_ranks_against_its_cores(layout, n, cores, tcp_s, native_s, shm_s,
                                                                     overlap, monkeypatch):
    """Simulated hosts run on one kernel (as network namespaces do): each rank weighs all the job's
    ranks there against the cores (patched here), not its host's, so on 2 cores nobody's Python
    polls its socket and shared-memory waits spin briefly. The native exchanges still poll. Large
    all-reduces overlap only where every rank there has two cores."""
    import shmcoll.config

    monkeypatch.delenv("SHMCOLL_SPIN_US", raising=False)
    monkeypatch.delenv("SHMCOLL_OVERLAP", raising=False)
    monkeypatch.setattr(shmcoll.config, "_cores", lambda: cores)
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    for out in run_ranks(n, _spins):
        assert out == {"tcp": pytest.approx(tcp_s), "native": pytest.approx(native_s, abs=1e-8),
                       "shm": pytest.approx(shm_s, abs=1e-8), "overlap": overlap, "in group": overlap}  # whole ns
