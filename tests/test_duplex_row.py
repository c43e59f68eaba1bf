"""A whole schedule of duplex steps in one native call (kernels.duplex_row,
Transport.send_recv_ranges).

Over real TCP connections on loopback. The native row alone: two ends run a ring's two steps
(the second sends what the first folded in), small and far past the sockets' buffers, with the
headers frame.pack writes; a row whose wait runs out goes on from where it stopped; arguments that
do not describe a row are refused. Then NetTransports fully connected: ring_all_reduce among 3
(every step to one peer, from another) and halving-doubling among 4 (a partner per step) run in
one native call each and send the bytes the general path sends, and so does a sub-group's ring
through its root's rows; a peer that sends and receives each step on its own meets a row; calls
that share a row send each their own description; a row stopped by another frame, or whose
connections another thread holds, finishes the general way; a reader thread leaves the frame that
comes while a caller holds its connection to that caller's next call.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from shmcoll import kernels
from shmcoll.algorithms.call import Call, segment_bounds
from shmcoll.algorithms.halving import halving_doubling_all_reduce
from shmcoll.algorithms.ring import ring_all_reduce
from shmcoll.transport import frame, tcp
from shmcoll.transport.frame import DATA, HEARTBEAT, Meta
from shmcoll.transport.sub import SubTransport
from shmcoll.transport.tcp import DUPLEX_LEAD_BYTES, NetTransport
from shmcoll.types import F32, I64, Collective, ReduceKind

import bounds
from harness import connected_pair, wait_until

TAG, SEQ = 9, 4
WAIT_NS = 5 * 10**9  # long enough for the other end's thread on a loaded machine; the tests do not wait it out


def _meta(n: int, code: int) -> Meta:
    return Meta(seq=SEQ, coll=int(Collective.ALL_REDUCE), dtype=code, elements=n)


def _two_step_row(fd: int, me: int, n: int, itemsize: int) -> np.ndarray:
    """A ring of two at position me over one connection: step 1 sends this end's half and folds the
    peer's into the other half, step 2 sends that half, finished, and copies the peer's in."""
    half = n // 2
    mine, theirs = (0, half) if me == 0 else (half, 0)
    size = (n - half) if me else half
    other = n - size
    rows = [(fd, fd, 1 - me, theirs * itemsize, other * itemsize, other, mine * itemsize, size * itemsize, size, 1,
             DUPLEX_LEAD_BYTES, 1),
            (fd, fd, 1 - me, mine * itemsize, size * itemsize, size, theirs * itemsize, other * itemsize, other, 0,
             DUPLEX_LEAD_BYTES, 1)]
    return np.array(rows, np.int64)


class RowEnd:
    """One end's two-step row over its connection, called as far as each test asks (host: the
    host range its data lies in, native/host_range.h; test_host_range.py's ends have one)."""

    host: tuple | None = None

    def __init__(self, sock, me: int, data: np.ndarray, code: int, op: int):
        self.data, self.code, self.op = data, code, op
        self.steps = _two_step_row(sock.fileno(), me, len(data), data.itemsize)
        self.header = frame.pack(DATA, me, 0, _meta(len(data), code), code, (0,), 0)
        self.beats = frame.pack(HEARTBEAT, 1 - me, 0, Meta(), 0, (), 0) * len(self.steps)
        self.at, self.progress = np.zeros(1, np.int64), np.zeros(5, np.int64)
        self.scratch = np.empty(256 << 10, np.uint8)

    def call(self, wait_ns: int = WAIT_NS) -> int:
        return kernels.duplex_row(self.steps, self.at, self.header, self.beats, TAG, SEQ, self.data, self.scratch,
                                  self.code, self.op, 0, wait_ns, self.progress, self.host)

    def to_the_end(self) -> int:
        """Called again while its wait runs out: the last status."""
        while (status := self.call()) == kernels.DUPLEX_PENDING:
            pass
        assert status != kernels.DUPLEX_DONE or self.at[0] == len(self.steps)
        return status


def _both_rows(pair, arrays: list[np.ndarray], code: int, op: int) -> list[int]:
    return both_to_the_end([RowEnd(pair[i], i, arrays[i], code, op) for i in range(2)])


def both_to_the_end(ends: list[RowEnd]) -> list[int]:
    """Both ends' rows run to the end at once, the second on a thread: their last statuses."""
    results = [0, 0]

    def end(i: int) -> None:
        results[i] = ends[i].to_the_end()
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not other.is_alive()
    return results


@pytest.mark.parametrize("n, dtype, wire", [(1001, np.float32, F32), (4 << 20, np.float32, F32),
                                             (2 << 20, np.int64, I64)])
def test_two_ends_run_a_ring_of_two_in_one_call(pair, n, dtype, wire):
    """Both ends end with the sum, the second step sending what the first folded in, also far past
    the sockets' buffers and with odd halves."""
    arrays = [np.arange(n, dtype=dtype), np.arange(n, dtype=dtype) * 3]
    assert _both_rows(pair, arrays, wire.code, int(ReduceKind.SUM)) == [kernels.DUPLEX_DONE] * 2
    want = np.arange(n, dtype=dtype) * 4
    assert np.array_equal(arrays[0], want) and np.array_equal(arrays[1], want)


def test_a_row_whose_wait_runs_out_goes_on_where_it_stopped(pair):
    """Rank 0's first call waits no time while rank 1 has not begun: it returns pending in its first
    step, having sent what the socket took; with rank 1 running, the next calls finish that step
    and the rest."""
    n = 4 << 20
    arrays = [np.ones(n, np.float32), np.full(n, 2.0, np.float32)]
    first = RowEnd(pair[0], 0, arrays[0], F32.code, int(ReduceKind.SUM))
    assert first.call(wait_ns=0) == kernels.DUPLEX_PENDING
    assert first.at[0] == 0 and 0 < first.progress[0] < n * 2  # sent: some of its 8 MiB frame, not all
    second = RowEnd(pair[1], 1, arrays[1], F32.code, int(ReduceKind.SUM))
    other = threading.Thread(target=second.to_the_end)
    other.start()
    assert first.to_the_end() == kernels.DUPLEX_DONE
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not other.is_alive()
    assert np.all(arrays[0] == 3.0) and np.all(arrays[1] == 3.0)


def _row_args(pair) -> list:
    data = np.zeros(1000, np.float32)
    steps = _two_step_row(pair[0].fileno(), 0, len(data), 4)
    header = frame.pack(DATA, 0, 0, _meta(1000, F32.code), F32.code, (0,), 0)
    beats = frame.pack(HEARTBEAT, 1, 0, Meta(), 0, (), 0) * 2
    return [steps, np.zeros(1, np.int64), header, beats, TAG, SEQ, data, np.empty(4096, np.uint8), F32.code,
            int(ReduceKind.SUM), 0, 0, np.zeros(5, np.int64), None]


def _past_the_data(args: list) -> None:
    args[0] = args[0].copy()
    args[0][1, 3] = 4000 - 100  # step 2 sends bytes [3900, 3900 + 2000) of a 4000-byte array


@pytest.mark.parametrize("change", [
    _past_the_data,
    lambda args: args.__setitem__(1, np.array([3], np.int64)),  # a step past the last
    lambda args: args.__setitem__(3, args[3][:-1]),  # a heartbeat header short
    lambda args: args.__setitem__(2, args[2][:40]),  # a header without the payload's size
    lambda args: args.__setitem__(9, 99),  # no loop for this op
    lambda args: args.__setitem__(0, args[0][:, :10].copy()),  # steps of the wrong width
    lambda args: (args.__setitem__(0, args[0][::-1].copy()),  # a copy, then a fold whose scratch
                  args.__setitem__(7, np.empty(2, np.uint8))),  # is shorter than an element
], ids=["range", "at", "beats", "header", "op", "width", "scratch"])
def test_arguments_that_do_not_describe_a_row_are_refused(pair, change):
    args = _row_args(pair)
    change(args)
    with pytest.raises(ValueError, match="duplex_row"):
        kernels.duplex_row(*args)


# ---- in transports ----

@pytest.fixture
def mesh():
    """Four NetTransports, every pair of them connected over loopback."""
    socks: list[dict] = [{} for _ in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            socks[i][j], socks[j][i] = connected_pair()
    ends = [NetTransport(r, 4, socks[r], timeout=bounds.WAIT_HANG_S) for r in range(4)]
    yield ends
    for t in ends:
        t.close()


def _statuses(monkeypatch) -> list[int]:
    """Every kernels.duplex_row call's status, from now on."""
    statuses: list[int] = []
    row = kernels.duplex_row

    def counted(*args):
        statuses.append(row(*args))
        return statuses[-1]
    monkeypatch.setattr(kernels, "duplex_row", counted)
    return statuses


def _at_once(ranks, run) -> None:
    """run(rank) on a thread of each rank but the first, and the first's here."""
    others = [threading.Thread(target=run, args=(r,)) for r in ranks[1:]]
    for thread in others:
        thread.start()
    run(ranks[0])
    for thread in others:
        thread.join(timeout=bounds.WAIT_HANG_S)
        assert not thread.is_alive()


def _all_reduce_among(mesh, members: tuple[int, ...], algorithm, n: int) -> list[np.ndarray]:
    arrays = {r: np.arange(n, dtype=np.float32) + r for r in members}
    meta = Meta(seq=SEQ, coll=int(Collective.ALL_REDUCE), dtype=F32.code, elements=n)

    def run(r: int) -> None:
        c = Call(mesh[r], TAG, meta, F32.code, time.monotonic() + bounds.WAIT_HANG_S, 256 << 10)
        algorithm(c, arrays[r], ReduceKind.SUM, members)
    _at_once(members, run)
    want = np.arange(n, dtype=np.float32) * len(members) + sum(members)
    for r in members:
        assert np.array_equal(arrays[r], want)
    return [arrays[r] for r in members]


def test_a_sub_groups_ring_runs_as_one_native_row_each(mesh, monkeypatch):
    """A sub-group over root ranks 2, 0 and 3 (its ranks 0, 1, 2): its ring_all_reduce's steps
    run in the root's rows, in the root's numbering, one native call each (at least one rank's),
    and each member sends the ring's bytes to its right neighbour's root rank alone."""
    statuses = _statuses(monkeypatch)
    ranks, n = (2, 0, 3), 300_007
    subs = {r: SubTransport(mesh[r], list(ranks), slot=0) for r in ranks}
    arrays = {r: np.arange(n, dtype=np.float32) + r for r in ranks}
    meta = Meta(seq=SEQ, coll=int(Collective.ALL_REDUCE), dtype=F32.code, elements=n)

    def run(r: int) -> None:
        c = Call(subs[r], subs[r].tag_of(SEQ), meta, F32.code, time.monotonic() + bounds.WAIT_HANG_S, 256 << 10)
        ring_all_reduce(c, arrays[r], ReduceKind.SUM)
    _at_once(ranks, run)
    for r in ranks:
        assert np.array_equal(arrays[r], np.arange(n, dtype=np.float32) * 3 + sum(ranks))
    assert kernels.DUPLEX_DONE in statuses and set(statuses) <= {kernels.DUPLEX_DONE, kernels.DUPLEX_PENDING}
    for p, r in enumerate(ranks):
        want = [0] * 4
        want[ranks[(p + 1) % 3]] = _segment_bytes(n, 3, [(p - 1) % 3, (p - 2) % 3, p, (p - 1) % 3])
        assert mesh[r].bytes_to == want


def _segment_bytes(n: int, parts: int, which) -> int:
    bounds = segment_bounds(n, parts)
    return 4 * sum(bounds[s][1] - bounds[s][0] for s in which)


def test_a_ring_of_three_runs_as_one_native_row_each(mesh, monkeypatch):
    """ring_all_reduce among 3 of 4 transports: each rank's steps (each segment in frames of 256
    KiB) to its right neighbour, from its left, run in one native call (where a rank's reader
    thread took no frame of the call before it began: at least one rank's), and each rank sends the
    ring's bytes, to its right neighbour alone: the two segments before its own in the
    reduce-scatter, its own and the one before in the all-gather."""
    statuses = _statuses(monkeypatch)
    n = 600_001
    _all_reduce_among(mesh, (0, 1, 2), ring_all_reduce, n)
    assert kernels.DUPLEX_DONE in statuses and set(statuses) <= {kernels.DUPLEX_DONE, kernels.DUPLEX_PENDING}
    for p in range(3):
        want = [0] * 4
        want[(p + 1) % 3] = _segment_bytes(n, 3, [(p - 1) % 3, (p - 2) % 3, p, (p - 1) % 3])
        assert mesh[p].bytes_to == want


def test_halving_doubling_among_four_runs_as_one_native_row_each(mesh, monkeypatch):
    """Each rank's halving and doubling steps, with a partner per step, in one native call (as the
    ring's: at least one rank's); each
    rank sends its partners what the general path sends: half the array, then a quarter, to its
    first and second partner, and back the other way."""
    statuses = _statuses(monkeypatch)
    n = 1_000_003
    _all_reduce_among(mesh, (0, 1, 2, 3), halving_doubling_all_reduce, n)
    assert kernels.DUPLEX_DONE in statuses and set(statuses) <= {kernels.DUPLEX_DONE, kernels.DUPLEX_PENDING}
    for p in range(4):
        far, near = p ^ 2, p ^ 1
        assert mesh[p].bytes_to[far] == _segment_bytes(n, 4, [s for s in range(4) if s // 2 != p // 2]) \
            + _segment_bytes(n, 4, [p, near])
        assert mesh[p].bytes_to[near] == _segment_bytes(n, 4, [near]) + _segment_bytes(n, 4, [p])


def _ring_of_two(t: NetTransport, data: np.ndarray, deadline: float) -> None:
    c = Call(t, TAG, _meta(len(data), F32.code), F32.code, deadline, len(data) * 4)  # a frame per step
    ring_all_reduce(c, data, ReduceKind.SUM, (0, 1))


def _steps_one_by_one(t: NetTransport, data: np.ndarray, deadline: float) -> None:
    """Rank 1's side of the ring of two without any native call, each step a send, then a receive:
    the first half out, the second folded in, then that sum out and the first copied in."""
    half, meta = len(data) // 2, _meta(len(data), F32.code)
    t.send(0, TAG, data[:half], F32.code, meta, deadline)
    t.recv_into(0, TAG, data[half:], F32.code, deadline, meta, ReduceKind.SUM)
    t.send(0, TAG, data[half:], F32.code, meta, deadline)
    t.recv_into(0, TAG, data[:half], F32.code, deadline, meta)


def _rank_0_against(mesh, peer_side, n: int) -> list[np.ndarray]:
    """Rank 0 runs its ring of two with rank 1 while rank 1 runs peer_side (in a thread)."""
    arrays = [np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)]
    deadline = time.monotonic() + bounds.WAIT_HANG_S
    other = threading.Thread(target=peer_side, args=(mesh[1], arrays[1], deadline))
    other.start()
    _ring_of_two(mesh[0], arrays[0], deadline)
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not other.is_alive()
    return arrays


@pytest.mark.parametrize("n", [1001, 4 << 20])
def test_a_row_meets_a_peer_that_takes_the_general_path(mesh, n):
    """The frames a row sends and expects are those of send and recv: both end with the sum."""
    for data in _rank_0_against(mesh, _steps_one_by_one, n):
        assert np.all(data == 3.0)


def _keep_reader_asleep(t: NetTransport, src: int) -> None:
    """t's reader thread of src's connection naps, as after a caller found its frame there, so what
    src sends waits on the socket for the next caller."""
    inbox = t._inboxes[src]
    inbox._quiet_until = time.monotonic() + bounds.WAIT_HANG_S
    inbox.mute_reader(True)


def _described_steps(t: NetTransport, data: np.ndarray, meta: Meta, op: ReduceKind, deadline: float) -> None:
    """_steps_one_by_one for the call `meta` of `op`."""
    half = len(data) // 2
    t.send(0, TAG, data[:half], F32.code, meta, deadline)
    t.recv_into(0, TAG, data[half:], F32.code, deadline, meta, op)
    t.send(0, TAG, data[half:], F32.code, meta, deadline)
    t.recv_into(0, TAG, data[:half], F32.code, deadline, meta)


def test_calls_that_share_a_row_each_send_their_own_description(mesh):
    """A SUM, then a MAX, of the same size: the same steps over the same element size, one row
    kept for both, but each call's frames carry its own description (the row keeps a header per
    kind of call): the peer on the general path, which checks every frame's against its own
    call's, takes both, and both ends hold each call's result."""
    n = 1001
    for op, want in ((ReduceKind.SUM, 3.0), (ReduceKind.MAX, 2.0)):
        _keep_reader_asleep(mesh[0], 1)  # the row, not the reader thread, takes rank 1's frames
        meta = _meta(n, F32.code)._replace(op=int(op))
        arrays = [np.full(n, 1.0, np.float32), np.full(n, 2.0, np.float32)]
        deadline = time.monotonic() + bounds.WAIT_HANG_S
        other = threading.Thread(target=_described_steps, args=(mesh[1], arrays[1], meta, op, deadline))
        other.start()
        ring_all_reduce(Call(mesh[0], TAG, meta, F32.code, deadline, n * 4), arrays[0], op, (0, 1))
        other.join(timeout=bounds.WAIT_HANG_S)
        assert not other.is_alive()
        assert all(np.all(data == want) for data in arrays), op
    (row,) = mesh[0]._range_rows.values()
    assert len(row.headers) == 2


def test_a_row_stopped_by_another_frame_finishes_its_steps(mesh, monkeypatch):
    """Rank 1 sends a message of another call first: rank 0's row finds it, stops, and the step and
    the rest finish the general way; the other message waits in the mailbox."""
    statuses = _statuses(monkeypatch)

    def another_frame_first(t: NetTransport, data: np.ndarray, deadline: float) -> None:
        t.send(0, TAG + 1, np.full(3, 7, np.float32), F32.code, _meta(3, F32.code), deadline)
        _steps_one_by_one(t, data, deadline)

    _keep_reader_asleep(mesh[0], 1)
    for data in _rank_0_against(mesh, another_frame_first, 1 << 20):
        assert np.all(data == 3.0)
    assert kernels.DUPLEX_ELSEWHERE in statuses
    extra = mesh[0].recv(1, TAG + 1, time.monotonic() + bounds.WAIT_HANG_S)
    assert extra.payload.view(np.float32).tolist() == [7.0] * 3


def test_a_row_whose_connection_another_thread_holds_goes_the_general_way(mesh, monkeypatch):
    """Another thread of rank 0 is sending to rank 1: the row cannot hold that connection, runs no
    native call, and the steps go as send_recv_row runs them; the results are the same."""
    statuses = _statuses(monkeypatch)
    lock = mesh[0]._send_locks[1]
    lock.acquire()
    release = threading.Timer(0.2, lock.release)
    release.start()
    try:
        for data in _rank_0_against(mesh, _ring_of_two, 1 << 20):
            assert np.all(data == 3.0)
    finally:
        release.join()
    assert statuses.count(kernels.DUPLEX_DONE) <= 1  # rank 1's row, where it held its connections first


def test_a_reader_thread_leaves_the_next_frame_to_a_caller_that_just_let_go(mesh, monkeypatch):
    """While a caller holds a connection (as a row does, longer than QUIET_SECONDS), its reader
    thread, woken by a frame, naps instead of queueing for the lock; once the caller gives the
    connection back having found its message, the frame still waits on the socket for the
    caller's next call, which can hold the connection again, and nothing went to the mailbox."""
    monkeypatch.setattr(tcp, "QUIET_SECONDS", 1.0)  # the nap outlasts this test's steps on a loaded machine
    t, inbox = mesh[0], mesh[0]._inboxes[1]
    inbox.leave(False)  # the socket is the reader thread's: no caller found anything lately
    deadline = time.monotonic() + bounds.WAIT_HANG_S
    with inbox.lock:
        mesh[1].send(0, TAG, np.full(5, 2, np.float32), F32.code, _meta(5, F32.code), deadline)
        wait_until(lambda: inbox.whole_frame_waiting(1, 1 << 20), bounds.WAIT_HANG_S, "the frame to come")
        wait_until(lambda: inbox._napping, bounds.WAIT_HANG_S, "the reader thread to nap")
    inbox.leave(True)
    assert inbox.lock.acquire(False)
    try:
        assert not t._mailbox.has(1, TAG)
        assert inbox.whole_frame_waiting(1, 1 << 20) is not None
    finally:
        inbox.lock.release()
    msg = t.recv(1, TAG, deadline)
    assert msg.payload.view(np.float32).tolist() == [2.0] * 5
