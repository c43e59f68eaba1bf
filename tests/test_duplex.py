"""A frame out while a frame comes in, in native calls (kernels.duplex, NetTransport._duplexes).

Over real TCP connections on loopback: both ends at once with frames far larger than the sockets'
buffers, folded (through a scratch that splits elements between reads) or copied into place;
heartbeats before the peer's frame are read and counted, anything else is left in the socket; a
frame that stops half-way is resumed by the next call; a connection that ends and a failed send are
reported; no end sends more than the lead it is given past what came of its peer's frame (a
transport gives each connection its own, smaller where BBR paces it), and unequal frames, also
around a ring, still finish; a row of steps (send_recv_row) takes its connections once, and meets
a peer on the general path or another frame between its steps. Then in ranks on simulated hosts:
ring and halving-doubling steps across hosts take this path, and the results and the bytes each
rank sends are those of the general path.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import numpy as np
import pytest

from shmcoll import kernels
from shmcoll.errors import CollectiveTimeout
from shmcoll.net.congestion import congestion_of, set_congestion
from shmcoll.net.sockets import connect_with_retry
from shmcoll.transport import frame
from shmcoll.transport.frame import DATA, HEADER_SIZE, HEARTBEAT, Meta
from shmcoll.transport.tcp import DUPLEX_LEAD_BYTES, DUPLEX_LEAD_BYTES_PACED, NetTransport
from shmcoll.types import F16, F32, F64, I64, Collective, ReduceKind

import bounds
from harness import read_exactly, run_ranks, wait_until

TAG = 9
WAIT_NS = 5 * 10**9  # long enough for the other end's thread on a loaded machine; the tests do not wait it out
CODES = {t.user: t.code for t in (F16, F32, F64, I64)}
COPY = -1  # kernels.duplex's op that copies
SENT, GOT, PENDING, IN_STATE, BEATS = range(5)  # the progress words


def _storage(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _header(src: int, data: np.ndarray, seq: int = 3) -> bytes:
    meta = Meta(seq=seq, coll=int(Collective.ALL_REDUCE), dtype=CODES[data.dtype], elements=data.size)
    return frame.pack(DATA, src, TAG, meta, CODES[data.dtype], data.shape, data.nbytes)


def _beat(src: int) -> bytes:
    return frame.pack(HEARTBEAT, src, 0, Meta(), 0, (), 0)


def _duplex(out_sock, in_sock, me: int, peer: int, out: np.ndarray, into: np.ndarray, op: int,
            progress: np.ndarray, scratch: np.ndarray | None = None, wait_ns: int = WAIT_NS,
            lead: int = DUPLEX_LEAD_BYTES) -> int:
    """One call; the scratch must be the same from one call of a frame to the next (it holds what
    was read and not folded yet)."""
    if scratch is None:
        scratch = np.empty(256 << 10 if op != COPY else 0, np.uint8)
    return kernels.duplex(out_sock.fileno(), _header(me, out), _storage(out), in_sock.fileno(), _header(peer, into),
                          _beat(peer), _storage(into), scratch, CODES[into.dtype], op, 0, wait_ns, progress, lead)


def _until_done(*args, **kwargs) -> tuple[int, int]:
    """Call again while the wait runs out; the last status and the number of calls."""
    calls = 0
    while True:
        calls += 1
        status = _duplex(*args, **kwargs)
        if status != kernels.DUPLEX_PENDING:
            return status, calls


def _both_ends(pair, arrays: list[np.ndarray], intos: list[np.ndarray], op: int, scratch_bytes: int) -> list:
    """Rank 0 and rank 1 of one connection duplex at once; each end's status and progress."""
    results: list = [None, None]

    def end(i: int) -> None:
        progress = np.zeros(5, np.int64)
        status, _ = _until_done(pair[i], pair[i], i, 1 - i, arrays[i], intos[i], op, progress,
                                np.empty(scratch_bytes, np.uint8))
        results[i] = (status, progress.tolist())
    other = threading.Thread(target=end, args=(1,))
    other.start()
    end(0)
    other.join(timeout=60)
    return results


@pytest.mark.parametrize("dtype, op, scratch_bytes", [
    (np.float32, ReduceKind.SUM, 256 << 10), (np.float16, ReduceKind.SUM, 4093),
    (np.float64, ReduceKind.MIN, 12), (np.int64, ReduceKind.MAX, 1 << 20), (np.float64, ReduceKind.PROD, 65541)])
def test_both_ends_fold_the_peer_array_into_theirs(pair, dtype, op, scratch_bytes):
    """4 MiB and more each way at once, far past the sockets' buffers, so both ends must read while
    they send: each end ends with into = into op theirs, bit for bit as the reduction kernel makes
    it, also where a scratch of an odd size splits elements between reads."""
    rng = np.random.default_rng(11)
    n = (4 << 20) // np.dtype(dtype).itemsize + 3
    sent = [(rng.normal(size=n) * 50).astype(dtype) for _ in range(2)]
    intos = [(rng.normal(size=n) * 50).astype(dtype) for _ in range(2)]
    expected = [into.copy() for into in intos]
    for i in range(2):
        kernels.reduce_into(_storage(expected[i]), _storage(sent[1 - i]), CODES[np.dtype(dtype)], int(op))
    results = _both_ends(pair, sent, intos, int(op), scratch_bytes)
    for i in range(2):
        status, progress = results[i]
        assert status == kernels.DUPLEX_DONE
        assert progress == [HEADER_SIZE + sent[i].nbytes, intos[i].nbytes, 0, kernels.IN_DONE, 0]
        assert intos[i].tobytes() == expected[i].tobytes()


def test_a_copy_lands_in_place(pair):
    """op < 0: the peer's payload is copied into `into`, the array sent is untouched."""
    sent = [np.arange(3 << 20, dtype=np.float32), -np.arange(3 << 20, dtype=np.float32)]
    intos = [np.zeros(3 << 20, np.float32), np.zeros(3 << 20, np.float32)]
    results = _both_ends(pair, sent, intos, COPY, 0)
    assert [status for status, _ in results] == [kernels.DUPLEX_DONE] * 2
    assert np.array_equal(intos[0], sent[1]) and np.array_equal(intos[1], sent[0])
    assert np.array_equal(sent[0], np.arange(3 << 20, dtype=np.float32))


def test_a_large_frame_goes_out_no_further_ahead_than_the_lead(pair):
    """Sockets with room for megabytes, a peer that sends nothing: the lead asked for, of payload,
    goes out and no more; as the peer's payload comes, as much more again; once it is whole, the
    rest."""
    a, b = pair
    for end in pair:
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    mine, theirs = np.ones(2 << 20, np.float32), np.full(1 << 18, 2.0, np.float32)
    into, progress = np.zeros_like(theirs), np.zeros(5, np.int64)
    lead = 96 << 10
    assert _duplex(a, a, 0, 1, mine, into, COPY, progress, wait_ns=20_000_000, lead=lead) == kernels.DUPLEX_PENDING
    assert progress[SENT] == HEADER_SIZE + lead
    first = 200_000
    b.sendall(_header(1, theirs) + theirs.tobytes()[:first])
    assert _duplex(a, a, 0, 1, mine, into, COPY, progress, wait_ns=20_000_000, lead=lead) == kernels.DUPLEX_PENDING
    assert progress[GOT] == first and progress[SENT] == HEADER_SIZE + first + lead
    reader = threading.Thread(target=read_exactly, args=(b, HEADER_SIZE + mine.nbytes))
    reader.start()
    b.sendall(theirs.tobytes()[first:])
    assert _until_done(a, a, 0, 1, mine, into, COPY, progress, lead=lead)[0] == kernels.DUPLEX_DONE
    reader.join(timeout=60)
    assert progress[SENT] == HEADER_SIZE + mine.nbytes and np.array_equal(into, theirs)


def test_frames_of_very_different_sizes_both_finish(pair):
    """4 MiB one way, 8 bytes the other: the end that gets the small frame whole sends the rest of
    its own without a lead, the other reads it all."""
    sent = [np.arange(1 << 20, dtype=np.float32), np.array([5.0, 6.0], np.float32)]
    intos = [np.zeros(2, np.float32), np.zeros(1 << 20, np.float32)]
    results = _both_ends(pair, sent, intos, COPY, 0)
    assert [status for status, _ in results] == [kernels.DUPLEX_DONE] * 2
    assert np.array_equal(intos[0], sent[1]) and np.array_equal(intos[1], sent[0])


def test_a_ring_of_three_with_unequal_frames_finishes():
    """Three ends in a ring, each sending to the next while the previous one's frame comes in
    (4 MiB, 8 bytes, 2 MiB): every end waits only on the one before it, and every frame arrives."""
    links = [socket.socketpair() for _ in range(3)]  # links[i]: end i's out, end i + 1's in
    sent = [np.full(1 << 20, 1.0, np.float32), np.full(2, 2.0, np.float32), np.full(1 << 19, 3.0, np.float32)]
    intos = [np.zeros_like(sent[(i - 1) % 3]) for i in range(3)]
    statuses: list = [None] * 3

    def end(i: int) -> None:
        out, into_sock = links[i][0], links[(i - 1) % 3][1]
        statuses[i] = _until_done(out, into_sock, i, (i - 1) % 3, sent[i], intos[i], COPY, np.zeros(5, np.int64))[0]
    threads = [threading.Thread(target=end, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert statuses == [kernels.DUPLEX_DONE] * 3
        assert all(np.array_equal(intos[i], sent[(i - 1) % 3]) for i in range(3))
    finally:
        for link in links:
            for s in link:
                s.close()


def test_heartbeats_before_the_frame_are_read_and_counted(pair):
    a, b = pair
    theirs, into = np.full(5, 2.0, np.float64), np.ones(5, np.float64)
    b.sendall(_beat(1) * 2 + _header(1, theirs) + theirs.tobytes())
    progress = np.zeros(5, np.int64)
    assert _duplex(a, a, 0, 1, np.zeros(5), into, int(ReduceKind.SUM), progress) == kernels.DUPLEX_DONE
    assert progress[BEATS] == 2 and np.array_equal(into, np.full(5, 3.0))


def test_another_frame_first_is_left_in_the_socket(pair):
    """The peer's frame of another call (another sequence number): nothing is read, for the general
    receive to report the mismatch, and the call says how much of its own frame went out."""
    a, b = pair
    mine, into = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    other_call = _header(1, into, seq=4) + into.tobytes()
    b.sendall(other_call)
    progress = np.zeros(5, np.int64)
    assert _duplex(a, a, 0, 1, mine, into, int(ReduceKind.SUM), progress) == kernels.DUPLEX_ELSEWHERE
    assert progress[IN_STATE] == kernels.IN_ELSEWHERE and progress[SENT] == HEADER_SIZE + mine.nbytes
    assert a.recv(len(other_call), socket.MSG_PEEK | socket.MSG_WAITALL) == other_call
    assert read_exactly(b, HEADER_SIZE + mine.nbytes) == _header(0, mine) + mine.tobytes()


def test_another_frame_first_stops_a_large_send_at_once(pair):
    """Another frame first while a frame larger than the sockets' buffers goes out: the call returns
    with part of it sent, rather than go on sending to a peer that may itself be waiting for this
    end to read."""
    a, b = pair
    mine, into = np.ones(8 << 20, np.float32), np.ones(8 << 20, np.float32)
    b.sendall(_header(1, into, seq=4))
    progress = np.zeros(5, np.int64)
    assert _duplex(a, a, 0, 1, mine, into, int(ReduceKind.SUM), progress) == kernels.DUPLEX_ELSEWHERE
    assert 0 < progress[SENT] < HEADER_SIZE + mine.nbytes and progress[GOT] == 0


def test_a_frame_that_stops_half_way_is_resumed(pair):
    """The peer sends half its payload and stops: the call returns PENDING once the wait passed,
    keeping what it read; with the rest sent, the next call finishes the fold."""
    a, b = pair
    theirs, into = np.arange(1000, dtype=np.float64), np.ones(1000, np.float64)
    wire = _header(1, theirs) + theirs.tobytes()
    half = HEADER_SIZE + 501  # an element split across the two parts
    b.sendall(wire[:half])
    progress, scratch = np.zeros(5, np.int64), np.empty(1 << 10, np.uint8)
    mine = np.zeros(1000, np.float64)
    status = _duplex(a, a, 0, 1, mine, into, int(ReduceKind.SUM), progress, scratch, wait_ns=50_000_000)
    assert status == kernels.DUPLEX_PENDING
    assert progress[IN_STATE] == kernels.IN_BODY and progress[GOT] == 501
    b.sendall(wire[half:])
    assert _until_done(a, a, 0, 1, mine, into, int(ReduceKind.SUM), progress, scratch)[0] == kernels.DUPLEX_DONE
    assert np.array_equal(into, theirs + 1)


def test_out_and_in_on_two_connections(pair):
    """A ring of three: the frame goes to the right-hand peer on one connection while the left-hand
    peer's comes in on another."""
    left_end, from_left = socket.socketpair()
    with left_end, from_left:
        mine, theirs, into = np.full(7, 5, np.int64), np.full(7, 2, np.int64), np.full(7, 1, np.int64)
        left_end.sendall(_header(2, theirs) + theirs.tobytes())
        progress = np.zeros(5, np.int64)
        assert _duplex(pair[0], from_left, 0, 2, mine, into, int(ReduceKind.SUM), progress) == kernels.DUPLEX_DONE
        assert np.array_equal(into, np.full(7, 3))
        assert read_exactly(pair[1], HEADER_SIZE + mine.nbytes) == _header(0, mine) + mine.tobytes()


@pytest.mark.parametrize("cut", [0, HEADER_SIZE + 10])
def test_a_connection_that_ends_is_reported(pair, cut):
    """The peer closes before its frame or in the middle of it: DUPLEX_ENDED."""
    a, b = pair
    theirs = np.ones(64, np.float32)
    b.sendall((_header(1, theirs) + theirs.tobytes())[:cut])
    b.shutdown(socket.SHUT_WR)
    progress = np.zeros(5, np.int64)
    assert _duplex(a, a, 0, 1, np.ones(64, np.float32), np.ones(64, np.float32), COPY, progress) == \
        kernels.DUPLEX_ENDED


def test_a_failed_send_is_its_errno(pair):
    a, _ = pair
    a.shutdown(socket.SHUT_WR)
    progress = np.zeros(5, np.int64)
    assert _duplex(a, a, 0, 1, np.ones(2, np.float32), np.ones(2, np.float32), COPY, progress) == -errno.EPIPE


@pytest.mark.parametrize("change", ["progress past the frame", "short progress", "no loop", "tiny scratch",
                                    "other header length", "negative wait", "no lead", "negative lead"])
def test_arguments_that_do_not_describe_a_duplex_are_refused(pair, change):
    data = np.ones(4, dtype=np.float32)
    progress = np.zeros(5, np.int64)
    args = [pair[0].fileno(), _header(0, data), data, pair[0].fileno(), _header(1, data), _beat(1), data.copy(),
            np.empty(64, np.uint8), F32.code, int(ReduceKind.SUM), 0, WAIT_NS, progress, DUPLEX_LEAD_BYTES]
    if change == "progress past the frame":
        progress[GOT] = data.nbytes + 1
    index, value = {"short progress": (12, np.zeros(4, np.int64)), "no loop": (8, 99),
                    "tiny scratch": (7, np.empty(2, np.uint8)), "other header length": (4, _header(1, data)[:-1]),
                    "negative wait": (11, -1), "no lead": (13, 0),
                    "negative lead": (13, -1)}.get(change, (12, progress))
    args[index] = value
    with pytest.raises(ValueError, match="do not describe a frame each way"):
        kernels.duplex(*args)


@pytest.fixture
def transports(pair):
    """Rank 0's and rank 1's NetTransport over one loopback connection."""
    ends = [NetTransport(0, 2, {1: pair[0]}, timeout=bounds.WAIT_HANG_S),
            NetTransport(1, 2, {0: pair[1]}, timeout=bounds.WAIT_HANG_S)]
    yield ends
    for t in ends:
        t.close()


def _born_under(algorithm: str) -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback connection born under `algorithm` (set on the listener and before
    connecting, as bootstrap sets SHMCOLL_TCP_CONGESTION's choice)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        set_congestion(listener, algorithm)
        a = connect_with_retry(*listener.getsockname(), time.monotonic() + bounds.WAIT_HANG_S,
                               prepare=lambda s: set_congestion(s, algorithm))
        b, _ = listener.accept()
    for end in (a, b):
        end.settimeout(0.25)
    return a, b


@pytest.mark.parametrize("algorithm", ["reno", "system"])
def test_a_transport_leads_by_how_its_connection_is_paced(algorithm, monkeypatch):
    """Each duplex of a NetTransport gets its connection's lead: DUPLEX_LEAD_BYTES_PACED where BBR
    paces it (this kernel's own algorithm may be BBR), else DUPLEX_LEAD_BYTES."""
    pair = _born_under(algorithm)
    expected = DUPLEX_LEAD_BYTES_PACED if congestion_of(pair[0]).startswith("bbr") else DUPLEX_LEAD_BYTES
    ends = [NetTransport(i, 2, {1 - i: pair[i]}, timeout=bounds.WAIT_HANG_S) for i in (0, 1)]
    leads: list[int] = []
    duplex = kernels.duplex
    monkeypatch.setattr(kernels, "duplex", lambda *args: (leads.append(args[13]), duplex(*args))[1])
    outs = [np.full(1 << 16, i + 1.0, np.float32) for i in (0, 1)]
    intos = [np.zeros(1 << 16, np.float32) for _ in (0, 1)]
    try:
        other = threading.Thread(target=_send_recv, args=(ends[1], outs[1], intos[1]))
        other.start()
        _send_recv(ends[0], outs[0], intos[0])
        other.join(timeout=bounds.WAIT_HANG_S)
    finally:
        for t in ends:
            t.close()
        for end in pair:
            end.close()
    assert leads and set(leads) == {expected} and DUPLEX_LEAD_BYTES_PACED < DUPLEX_LEAD_BYTES
    assert intos[0].tolist() == outs[1].tolist() and intos[1].tolist() == outs[0].tolist()


def _counting(statuses: list[int], native=None):
    """kernels.duplex (or another native call with a status) as it is now, each call's status
    appended to statuses."""
    call = kernels.duplex if native is None else native

    def counted(*args):
        statuses.append(call(*args))
        return statuses[-1]
    return counted


def _counted_duplex_calls(monkeypatch) -> list[int]:
    statuses: list[int] = []
    monkeypatch.setattr(kernels, "duplex", _counting(statuses))
    return statuses


def _send_recv(t: NetTransport, out: np.ndarray, into: np.ndarray, deadline_s: float = bounds.WAIT_HANG_S) -> None:
    peer = 1 - t.rank
    t.send_recv(peer, peer, TAG, out, into, F32.code, META, time.monotonic() + deadline_s, ReduceKind.SUM)


META = Meta(seq=1, coll=int(Collective.ALL_REDUCE), dtype=F32.code, elements=3 << 20)


def test_transports_fold_each_other_at_once_and_count_the_bytes(transports, monkeypatch):
    """At least one end runs the native exchange. An end takes the general path where its reader
    thread took the peer's frame before its own step began (or a heartbeat held the connection:
    the first comes half a second after the transports start, past this exchange), and the peer
    sends only once its own step has begun, so both ends cannot. Which end, or both, is the
    threads' timing."""
    statuses = _counted_duplex_calls(monkeypatch)
    outs = [np.full(3 << 20, r + 1, np.float32) for r in range(2)]
    intos = [np.full(3 << 20, 10 * (r + 1), np.float32) for r in range(2)]
    other = threading.Thread(target=_send_recv, args=(transports[1], outs[1], intos[1]))
    other.start()
    _send_recv(transports[0], outs[0], intos[0])
    other.join(timeout=bounds.WAIT_HANG_S)
    assert np.all(intos[0] == 12) and np.all(intos[1] == 21)
    assert transports[0].bytes_to == [0, outs[0].nbytes] and transports[1].bytes_to == [outs[1].nbytes, 0]
    assert 1 <= statuses.count(kernels.DUPLEX_DONE) <= 2


def test_a_frame_queued_already_is_taken_from_the_mailbox(transports, monkeypatch):
    """The peer's frame came before the step began and the reader thread queued it: no native call,
    the general path sends and takes it from the mailbox."""
    statuses = _counted_duplex_calls(monkeypatch)
    theirs = np.full(1000, 2, np.float32)
    transports[1].send(0, TAG, theirs, F32.code, META, time.monotonic() + bounds.WAIT_HANG_S)
    wait_until(lambda: transports[0]._mailbox.has(1, TAG), bounds.WAIT_HANG_S, "the reader thread to queue it")
    into = np.ones(1000, np.float32)
    _send_recv(transports[0], np.zeros(1000, np.float32), into)
    assert statuses == [] and np.all(into == 3)


def _both_step(transports, outs: list[np.ndarray], intos: list[np.ndarray], deadline_s: float) -> None:
    other = threading.Thread(target=_send_recv, args=(transports[1], outs[1], intos[1], deadline_s))
    other.start()
    _send_recv(transports[0], outs[0], intos[0], deadline_s)
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not other.is_alive()


def test_both_ends_with_another_frame_first_still_finish(transports):
    """Each rank sent the other a small message of another call before the step, while its reader
    thread naps (as it does for a while after a caller found its frame): each end's native call
    finds that message first. Both steps still finish, the frames larger than the sockets' buffers
    going out while the reader threads drain the sockets, and the small messages wait in the
    mailboxes. (Were the native calls to go on sending without reading, each would wait for the
    other to read until the deadline.)"""
    for t in transports:
        inbox = t._inboxes[1 - t.rank]
        inbox._quiet_until = time.monotonic() + bounds.WAIT_HANG_S
        inbox.mute_reader(True)
    for t in transports:
        t.send(1 - t.rank, TAG + 1, np.full(3, 7, np.float32), F32.code, META, time.monotonic() + bounds.WAIT_HANG_S)
    outs = [np.full(24 << 20, r + 1, np.float32) for r in range(2)]  # 96 MiB: past what sockets buffer
    intos = [np.full(24 << 20, 10 * (r + 1), np.float32) for r in range(2)]
    _both_step(transports, outs, intos, 10.0)
    assert np.all(intos[0] == 12) and np.all(intos[1] == 21)
    for t in transports:
        assert t.recv(1 - t.rank, TAG + 1, time.monotonic() + bounds.WAIT_HANG_S).payload.view(np.float32).tolist() \
            == [7.0] * 3


def test_a_peer_whose_data_does_not_come_times_out(transports):
    """The peer takes this rank's frame but sends none: CollectiveTimeout names it, once the
    deadline passed (the wait is recv's once the frame is out)."""
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="no message from rank 1 "):
        _send_recv(transports[0], np.ones(1000, np.float32), np.ones(1000, np.float32), deadline_s=0.1)
    assert time.monotonic() - start >= 0.1


def test_a_step_waiting_for_its_peer_leaves_the_connection_to_other_threads(transports):
    """Rank 0's step has sent its frame and waits for rank 1's, which rank 1 sends only after a
    message from another thread of rank 0 (a spawned call, another group's). The waiting step must
    not keep the connection's sending side, or both ranks wait until the deadline."""
    into = np.ones(1000, np.float32)
    deadline = time.monotonic() + bounds.WAIT_HANG_S
    step = threading.Thread(target=_send_recv, args=(transports[0], np.zeros(1000, np.float32), into))
    step.start()
    wait_until(lambda: transports[1]._mailbox.has(0, TAG), bounds.WAIT_HANG_S, "rank 0's frame of the step")
    other = threading.Thread(target=transports[0].send,
                             args=(1, TAG + 1, np.full(3, 7, np.float32), F32.code, META, deadline))
    other.start()
    assert transports[1].recv(0, TAG + 1, deadline).payload.view(np.float32).tolist() == [7.0] * 3
    transports[1].send(0, TAG, np.full(1000, 2, np.float32), F32.code, META, deadline)
    step.join(timeout=bounds.WAIT_HANG_S)
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not step.is_alive() and np.all(into == 3)


def test_a_send_behind_another_threads_send_ends_at_its_deadline(transports):
    """Another thread of rank 0 holds the connection's sending side (its send goes on and on): a
    send behind it raises CollectiveTimeout at its own deadline, and goes out once the side is free."""
    lock = transports[0]._send_locks[1]
    lock.acquire()
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="rank 1 did not accept data"):
            transports[0].send(1, TAG, np.ones(3, np.float32), F32.code, META, start + 0.3)
        assert time.monotonic() - start >= 0.3
    finally:
        lock.release()
    deadline = time.monotonic() + bounds.WAIT_HANG_S
    transports[0].send(1, TAG, np.full(3, 5, np.float32), F32.code, META, deadline)
    assert transports[1].recv(0, TAG, deadline).payload.view(np.float32).tolist() == [5.0] * 3


def _row(n: int, first: float) -> list[np.ndarray]:
    """Three arrays of n elements a row of steps passes along: [first, first, 0]."""
    return [np.full(n, first, np.float32), np.full(n, first, np.float32), np.zeros(n, np.float32)]


def _row_steps(arrays: list[np.ndarray]) -> list:
    """Step 1 sends arrays[0] and folds the peer's into arrays[1]; step 2 sends that sum and
    copies the peer's into arrays[2]: a step sends what the one before received, as a ring's do."""
    a, b, c = arrays
    return [(a, b, ReduceKind.SUM), (b, c, None)]


def _run_row(t: NetTransport, arrays: list[np.ndarray]) -> None:
    peer = 1 - t.rank
    t.send_recv_row(peer, peer, TAG, _row_steps(arrays), F32.code, META, time.monotonic() + bounds.WAIT_HANG_S)


def _one_by_one(t: NetTransport, arrays: list[np.ndarray]) -> None:
    """The same steps without any native call: a send, then a receive, each."""
    peer, deadline = 1 - t.rank, time.monotonic() + bounds.WAIT_HANG_S
    for out, into, op in _row_steps(arrays):
        t.send(peer, TAG, out, F32.code, META, deadline)
        t.recv_into(peer, TAG, into, F32.code, deadline, META, op)


def _row_against(transports, peer_side, n: int) -> None:
    """Rank 0 runs the row while rank 1 runs peer_side on its own arrays (in a thread); both end
    with the sums."""
    arrays = [_row(n, 1.0), _row(n, 2.0)]
    other = threading.Thread(target=peer_side, args=(transports[1], arrays[1]))
    other.start()
    _run_row(transports[0], arrays[0])
    other.join(timeout=bounds.WAIT_HANG_S)
    assert not other.is_alive()
    for mine in arrays:
        assert np.all(mine[1] == 3.0) and np.all(mine[2] == 3.0)


@pytest.mark.parametrize("n", [1000, 3 << 20])
def test_a_row_of_steps_takes_its_connections_once(transports, monkeypatch, n):
    """send_recv_row: both ends run two dependent steps (the second sends what the first folded
    in), small and far past the sockets' buffers. Rank 1 starts once rank 0 holds its connections,
    so rank 0 runs the row natively and claims them once for both steps. Rank 1 may find its
    reader thread taking rank 0's frame already, and then claims again for the second step (the
    first goes through its reader): at most once a step. The results and the bytes counted are the
    steps'."""
    claims: list[int] = []
    claimed = threading.Event()
    claim = NetTransport._claim

    def counted_claim(self, *args):
        claims.append(self.rank)
        inbox = claim(self, *args)
        claimed.set()
        return inbox
    monkeypatch.setattr(NetTransport, "_claim", counted_claim)
    statuses = _counted_duplex_calls(monkeypatch)
    _row_against(transports, lambda t, arrays: claimed.wait(bounds.WAIT_HANG_S) and _run_row(t, arrays), n)
    assert transports[0].bytes_to == [0, 2 * 4 * n] and transports[1].bytes_to == [2 * 4 * n, 0]
    assert claims[0] == 0 and claims.count(0) == 1 and claims.count(1) <= 2
    assert statuses.count(kernels.DUPLEX_DONE) >= 2  # rank 0 ran both steps natively


def test_a_row_meets_a_peer_that_takes_the_general_path(transports):
    """The peer sends and receives each step on its own (the frames any other path sends): the
    row's results are the same."""
    _row_against(transports, _one_by_one, 1000)


def test_a_row_stopped_by_another_frame_finishes_its_steps(transports, monkeypatch):
    """Between the steps the peer sends a message of another call: the row's second native call
    finds it first, stops there, and the step and the row finish the general way. The results are
    the steps', and the other message waits in the mailbox."""
    statuses = _counted_duplex_calls(monkeypatch)
    arrays = [_row(1000, 1.0), _row(1000, 2.0)]

    def peer_with_an_extra_frame() -> None:
        t, (a, b, c) = transports[1], arrays[1]
        deadline = time.monotonic() + bounds.WAIT_HANG_S
        t.recv_into(0, TAG, b, F32.code, deadline, META, ReduceKind.SUM)  # rank 0's step 1 has begun
        t.send(0, TAG, a, F32.code, META, deadline)
        t.send(0, TAG + 1, np.full(3, 7, np.float32), F32.code, META, deadline)
        t.send(0, TAG, b, F32.code, META, deadline)
        t.recv_into(0, TAG, c, F32.code, deadline, META)

    other = threading.Thread(target=peer_with_an_extra_frame)
    other.start()
    _run_row(transports[0], arrays[0])
    other.join(timeout=bounds.WAIT_HANG_S)
    for mine in arrays:
        assert np.all(mine[1] == 3.0) and np.all(mine[2] == 3.0)
    assert kernels.DUPLEX_ELSEWHERE in statuses
    extra = transports[0].recv(1, TAG + 1, time.monotonic() + bounds.WAIT_HANG_S)
    assert extra.payload.view(np.float32).tolist() == [7.0] * 3


def _large_calls(pg) -> dict:
    """Large all-reduces and all-gathers, each native duplex status counted (a step's, or a row of
    steps'); results and bytes sent."""
    statuses: list[int] = []
    kernels.duplex = _counting(statuses)  # in a rank process of its own
    kernels.duplex_row = _counting(statuses, kernels.duplex_row)
    sums, gathered = [], []
    for i in range(3):
        x = np.arange(300_001, dtype=np.float32) + pg.rank + i
        pg.all_reduce(x)
        sums.append(float(x[12345]))
        out = pg.all_gather(np.full(50_000, pg.rank + i, np.int64))
        gathered.append(out[::50_000].tolist())
    return {"statuses": statuses, "sums": sums, "gathered": gathered}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, n", [("halves", 4), ("each", 4), ("each", 3)])
def test_large_calls_across_hosts_move_both_ways_at_once(layout, n, monkeypatch):
    """2+2 ranks (a ring of two per column), 4 hosts of one rank (halving-doubling) and 3 (a ring
    over two connections): their steps across hosts run as native duplex calls, and every rank's
    results are right."""
    monkeypatch.setenv("SHMCOLL_TRANSPORT", "hier")
    monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout)
    out = run_ranks(n, _large_calls)
    for rank in range(n):
        assert out[rank]["sums"] == [12345.0 * n + sum(range(n)) + n * i for i in range(3)]
        assert out[rank]["gathered"] == [[r + i for r in range(n)] for i in range(3)]
        assert out[rank]["statuses"] and set(out[rank]["statuses"]) <= {kernels.DUPLEX_DONE, kernels.DUPLEX_PENDING}
