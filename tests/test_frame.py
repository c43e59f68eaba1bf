"""Pure protocol logic without I/O: wire frames, the mailbox (threads, no sockets), abort reasons,
and the chunking arithmetic the algorithms use."""

from __future__ import annotations

import math
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmcoll.algorithms.call import chunk_count, segment_bounds, sub_bounds
from shmcoll.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerLost
from shmcoll.transport import frame
from shmcoll.transport.frame import (
    ABORT,
    DATA,
    GOODBYE,
    HEADER_SIZE,
    MAX_CONTROL_PAYLOAD,
    MAX_NDIM,
    MAX_PAYLOAD,
    FrameError,
    Header,
    Meta,
)
from shmcoll.transport.mailbox import AbortReason, Mailbox, Message
from shmcoll.types import WIRE_TYPES, Collective

from bounds import CALL_DEADLINE_S, LATE_S, NO_WAIT_S, WAIT_HANG_S

#: Every frame kind this version knows (control kinds may be added: HEARTBEAT, ...).
KNOWN_KINDS = {getattr(frame, k) for k in ("DATA", "ABORT", "GOODBYE", "HEARTBEAT") if hasattr(frame, k)}
UNKNOWN_KIND = max(KNOWN_KINDS) + 1

# The documented layout (frame.py's docstring: a fixed 116-byte little-endian header), written out
# independently so tests can build frames that frame.pack would never produce.
LAYOUT = struct.Struct("<4s6BH4I3Q8Q")
FIELDS = ("magic", "version", "kind", "dtype", "ndim", "coll", "op", "flags",
          "src", "tag", "root", "meta_dtype", "seq", "count", "nbytes")


def raw_header(**over) -> bytes:
    """A valid DATA header (4 x f32 from rank 1), with any field overridden; dims=[...] sets all 8."""
    f = dict(magic=b"SHMC", version=1, kind=DATA, dtype=3, ndim=1, coll=2, op=0, flags=0,
             src=1, tag=7, root=0, meta_dtype=3, seq=5, count=4, nbytes=16)
    dims = over.pop("dims", [4, 0, 0, 0, 0, 0, 0, 0])
    f.update(over)
    return LAYOUT.pack(*(f[k] for k in FIELDS), *dims)


def test_layout_matches_pack():
    assert HEADER_SIZE == LAYOUT.size == 116
    meta = Meta(seq=5, coll=2, dtype=3, elements=4, op=0, root=0)
    assert frame.pack(DATA, 1, 7, meta, 3, (4,), 16) == raw_header()
    assert frame.unpack(raw_header(), 1) == Header(DATA, 1, 7, meta, 3, (4,), 16)


# ---------------------------------------------------------------- round trips

SHAPES = [(), (3,), (2, 3), (1, 2, 1), (2, 1, 2, 1), (1, 1, 1, 1, 2), (1, 2, 1, 1, 1, 1),
          (2, 1, 1, 1, 1, 1, 3), (1, 1, 2, 1, 1, 1, 1, 2), (0,), (5, 0, 7)]
assert {len(s) for s in SHAPES} == set(range(MAX_NDIM + 1))


@pytest.mark.parametrize("code", sorted(WIRE_TYPES), ids=lambda c: WIRE_TYPES[c].name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pack_unpack_round_trip(code, shape):
    nbytes = math.prod(shape) * WIRE_TYPES[code].itemsize
    meta = Meta(seq=2**63 + 5, coll=3, dtype=code, elements=2**40 + 1, op=4, root=3)
    raw = frame.pack(DATA, 6, 2**32 - 1, meta, code, shape, nbytes)
    assert len(raw) == HEADER_SIZE
    assert frame.unpack(raw, 6) == Header(DATA, 6, 2**32 - 1, meta, code, shape, nbytes)
    assert frame.unpack(memoryview(bytearray(raw)), 6).shape == shape  # any bytes-like input


def test_a_header_kept_per_kind_of_call_takes_each_calls_tag_and_number():
    """for_call writes what kernels.swap_row writes into a header packed with tag and seq 0."""
    kept = frame.pack(DATA, 6, 0, Meta(seq=0, coll=3, dtype=7, elements=5, op=1, root=2), 7, (5,), 20)
    meta = Meta(seq=2**63 + 9, coll=3, dtype=7, elements=5, op=1, root=2)
    assert frame.for_call(kept, 2**32 - 1, meta.seq) == frame.pack(DATA, 6, 2**32 - 1, meta, 7, (5,), 20)
    assert frame.for_call(np.frombuffer(kept, np.uint8), 9, 1) == frame.pack(DATA, 6, 9, meta._replace(seq=1), 7,
                                                                              (5,), 20)


def test_control_frames_round_trip():
    for kind, n in [(ABORT, 0), (ABORT, MAX_CONTROL_PAYLOAD), (GOODBYE, 0)] + [(k, 0) for k in KNOWN_KINDS - {DATA}]:
        h = frame.unpack(frame.pack(kind, 0, 0, Meta(), 0, (), n), 0)
        assert (h.kind, h.nbytes, h.shape) == (kind, n, ())


def test_payload_exactly_at_the_limit_is_accepted():
    h = frame.unpack(raw_header(dtype=8, dims=[64] + [0] * 7, nbytes=64), 1, max_payload=64)
    assert h.nbytes == 64


# ---------------------------------------------------------------- every validation failure

BAD_HEADERS = {
    "bad magic": (raw_header(magic=b"SHMX"), {}),
    "zero magic": (bytes(HEADER_SIZE), {}),
    "version 0": (raw_header(version=0), {}),
    "version 2": (raw_header(version=2), {}),
    "kind 0": (raw_header(kind=0), {}),
    "first unknown kind": (raw_header(kind=UNKNOWN_KIND), {}),
    "kind 255": (raw_header(kind=255), {}),
    "ndim 9": (raw_header(ndim=9), {}),
    "ndim 255": (raw_header(ndim=255), {}),
    "dim past ndim": (raw_header(ndim=1, dims=[4, 1, 0, 0, 0, 0, 0, 0]), {}),
    "last dim past ndim": (raw_header(ndim=0, nbytes=4, dims=[0] * 7 + [1]), {}),
    "dtype code 0": (raw_header(dtype=0), {}),
    "dtype code 16": (raw_header(dtype=16), {}),
    "dtype code 255": (raw_header(dtype=255), {}),
    "nbytes too small": (raw_header(nbytes=15), {}),
    "nbytes too large": (raw_header(nbytes=17), {}),
    "nbytes for a 0-d frame": (raw_header(ndim=0, dims=[0] * 8, nbytes=0), {}),
    "payload 2**62": (raw_header(dtype=8, dims=[2**62] + [0] * 7, nbytes=2**62), {}),
    "payload over MAX_PAYLOAD": (raw_header(dtype=8, dims=[MAX_PAYLOAD + 1] + [0] * 7, nbytes=MAX_PAYLOAD + 1), {}),
    "payload over max_payload": (raw_header(dtype=8, dims=[65] + [0] * 7, nbytes=65), {"max_payload": 64}),
    "shape overflows uint64 product": (raw_header(ndim=2, dims=[2**32, 2**32] + [0] * 6, nbytes=0), {}),
    "abort over MAX_CONTROL_PAYLOAD": (raw_header(kind=ABORT, nbytes=MAX_CONTROL_PAYLOAD + 1), {}),
    "goodbye of 2**63 bytes": (raw_header(kind=GOODBYE, nbytes=2**63), {}),
}


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_unpack_rejects(name):
    raw, kwargs = BAD_HEADERS[name]
    with pytest.raises(FrameError):
        frame.unpack(raw, 1, **kwargs)


def test_wrong_source_rank():
    raw = raw_header(src=1)
    with pytest.raises(FrameError, match="source rank 1"):
        frame.unpack(raw, 2)
    assert frame.unpack(raw, 1).src == 1


@pytest.mark.parametrize("length", [0, 1, HEADER_SIZE - 1, HEADER_SIZE + 1, 2 * HEADER_SIZE])
def test_header_of_wrong_length(length):
    raw = (raw_header() * 2)[:length]
    with pytest.raises(FrameError, match="header is"):
        frame.unpack(raw, 1)


def test_frame_error_is_a_value_error():
    assert issubclass(FrameError, ValueError)


# ---------------------------------------------------------------- describe_mismatch

def test_describe_mismatch():
    want = Meta(seq=4, coll=Collective.ALL_REDUCE, dtype=3, elements=10, op=0, root=0)
    assert frame.describe_mismatch(want, want, 1) is None
    assert frame.describe_mismatch(want._replace(), want, 1) is None
    got = Meta(seq=4, coll=Collective.BROADCAST, dtype=4, elements=11, op=0, root=2)
    text = frame.describe_mismatch(got, want, 3)
    assert isinstance(text, str)
    assert "rank 3" in text and "broadcast(" in text and "all_reduce(" in text
    assert "count=11" in text and "count=10" in text and "f64" in text and "f32" in text
    assert "sequence number 4" in text
    for field, value in (("seq", 5), ("dtype", 4), ("elements", 9), ("op", 1), ("root", 1), ("coll", 3)):
        changed = want._replace(**{field: value})
        assert frame.describe_mismatch(changed, want, 0) is not None, field
    odd = frame.describe_mismatch(Meta(coll=99, dtype=200), want, 1)  # codes it does not know
    assert "collective#99" in odd and "dtype#200" in odd


# ---------------------------------------------------------------- property: unpack never misbehaves

def _check_unpack(raw: bytes, src: int, max_payload: int) -> None:
    try:
        h = frame.unpack(raw, src, max_payload)
    except FrameError:
        return
    assert h.src == src and h.kind in KNOWN_KINDS and len(h.shape) <= MAX_NDIM
    if h.kind == DATA:
        assert h.dtype in WIRE_TYPES
        assert h.nbytes <= max_payload
        assert h.nbytes == math.prod(h.shape) * WIRE_TYPES[h.dtype].itemsize
    else:
        assert h.nbytes <= MAX_CONTROL_PAYLOAD
    # everything the header says survives a re-pack (only the unused flags field may differ)
    repacked = frame.pack(h.kind, h.src, h.tag, h.meta, h.dtype, h.shape, h.nbytes)
    assert repacked[:10] + repacked[12:] == bytes(raw[:10]) + bytes(raw[12:])


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE), st.integers(0, 2**32 - 1),
       st.integers(0, 2**64))
def test_unpack_of_arbitrary_bytes(raw, src, max_payload):
    _check_unpack(raw, src, max_payload)


@st.composite
def plausible_headers(draw):
    """Mostly-valid headers, so the property reaches the payload checks and not just the magic."""
    small = st.integers(0, 4) | st.integers(0, 2**64 - 1)
    ndim = draw(st.integers(0, 10))
    dims = draw(st.lists(small, min_size=8, max_size=8))
    if draw(st.booleans()):
        dims = [d if i < min(ndim, 8) else 0 for i, d in enumerate(dims)]
    kind = draw(st.sampled_from([DATA, DATA, *sorted(KNOWN_KINDS), 0, UNKNOWN_KIND, 255]))
    dtype = draw(st.sampled_from(sorted(WIRE_TYPES) + [0, 16, 255]))
    nbytes = draw(st.one_of(st.integers(0, 2**64 - 1), st.just(
        math.prod(dims[:min(ndim, 8)]) * WIRE_TYPES[dtype].itemsize if dtype in WIRE_TYPES else 0)))
    if nbytes >= 2**64:
        nbytes = 2**64 - 1
    return raw_header(kind=kind, dtype=dtype, ndim=ndim, dims=dims, nbytes=nbytes,
                      version=draw(st.sampled_from([1, 1, 1, 0, 2])), flags=draw(st.integers(0, 2**16 - 1)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plausible_headers(), st.sampled_from([MAX_PAYLOAD, 2**64, 0, 16, 1 << 20]))
def test_unpack_of_plausible_headers(raw, max_payload):
    _check_unpack(raw, 1, max_payload)


# ---------------------------------------------------------------- mailbox

def msg(src: int, tag: int, value: int = 0, *, seq: int = 0, coll: int = 0) -> Message:
    header = Header(DATA, src, tag, Meta(seq=seq, coll=coll, dtype=8, elements=1), 8, (1,), 1)
    return Message(header, np.array([value], dtype=np.uint8))


def soon(seconds: float = 0.2) -> float:
    return time.monotonic() + seconds


class Waiter:
    """Runs one blocking mailbox call on a thread and keeps its result or exception."""

    def __init__(self, call):
        self.result = self.error = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()
        assert self.started.wait(CALL_DEADLINE_S)

    def _run(self, call):
        self.started.set()
        try:
            self.result = call()
        except BaseException as exc:  # handed to the test
            self.error = exc

    def join(self, timeout: float = WAIT_HANG_S) -> Waiter:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "mailbox call did not return"
        return self


def test_fifo_per_source_and_tag():
    mb = Mailbox(0, 3)
    for i in range(20):
        mb.put(msg(1, 5, i))
        mb.put(msg(2, 5, 100 + i))
        mb.put(msg(1, 6, 200 + i))
    assert [int(mb.take(1, 6, soon()).payload[0]) for _ in range(20)] == [200 + i for i in range(20)]
    assert [int(mb.take(2, 5, soon()).payload[0]) for _ in range(20)] == [100 + i for i in range(20)]
    assert [int(mb.take(1, 5, soon()).payload[0]) for _ in range(20)] == list(range(20))
    with pytest.raises(CollectiveTimeout):
        mb.take(1, 5, soon(0.05))


def test_fifo_with_a_concurrent_producer():
    mb = Mailbox(0, 2)
    producer = threading.Thread(target=lambda: [mb.put(msg(1, 3, i % 256)) for i in range(2000)], daemon=True)
    producer.start()
    got = [int(mb.take(1, 3, soon(WAIT_HANG_S)).payload[0]) for _ in range(2000)]
    producer.join(WAIT_HANG_S)
    assert got == [i % 256 for i in range(2000)]


def test_take_on_one_tag_is_not_blocked_by_another():
    mb = Mailbox(0, 2)
    for i in range(50):
        mb.put(msg(1, 1, i))  # unread messages on tag 1
    waiter = Waiter(lambda: mb.take(1, 2, soon(WAIT_HANG_S)))
    mb.put(msg(1, 1, 99))
    mb.put(msg(1, 2, 42))
    assert int(waiter.join().result.payload[0]) == 42
    assert [int(mb.take(1, 1, soon()).payload[0]) for _ in range(51)] == list(range(50)) + [99]


def test_deadline_raises_timeout():
    mb = Mailbox(0, 2)
    mb.put(msg(1, 1))  # another tag and another source do not count
    mb.put(msg(0, 2))
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="rank 1"):
        mb.take(1, 2, start + 0.2)
    assert 0.19 <= time.monotonic() - start < 0.2 + LATE_S
    with pytest.raises(CollectiveTimeout):
        mb.take(1, 2, time.monotonic() - 1)  # already past: no wait at all


def test_lost_peer_wakes_a_waiter_with_peer_lost():
    mb = Mailbox(0, 3)
    waiter = Waiter(lambda: mb.take(2, 0, soon(WAIT_HANG_S)))
    mb.peer_gone(2, "socket reset", graceful=False)
    err = waiter.join().error
    assert isinstance(err, PeerLost) and err.peer == 2 and "socket reset" in str(err)
    with pytest.raises(PeerLost) as again:  # and every later wait on it
        mb.take(2, 1, soon(WAIT_HANG_S))
    assert again.value.peer == 2
    assert mb.lost_peers() == {2: "socket reset"}


def test_messages_that_arrived_before_the_loss_are_still_delivered():
    mb = Mailbox(0, 3)
    mb.put(msg(2, 0, 7))
    mb.peer_gone(2, "died", graceful=False)
    assert int(mb.take(2, 0, soon()).payload[0]) == 7
    with pytest.raises(PeerLost):
        mb.take(2, 0, soon())


def test_strict_and_non_strict():
    mb = Mailbox(0, 3)
    mb.peer_gone(2, "died", graceful=False)
    with pytest.raises(PeerLost) as strict:  # a collective needs everybody
        mb.take(1, 0, soon(WAIT_HANG_S))
    assert strict.value.peer == 2
    with pytest.raises(CollectiveTimeout):  # point-to-point only cares about its own source
        mb.take(1, 0, soon(0.05), strict=False)
    mb.put(msg(1, 0, 9))
    assert int(mb.take(1, 0, soon(), strict=False).payload[0]) == 9
    with pytest.raises(PeerLost):
        mb.take(2, 0, soon(WAIT_HANG_S), strict=False)


def test_goodbye_fails_only_waits_on_that_peer():
    mb = Mailbox(0, 3)
    waiter = Waiter(lambda: mb.take(2, 0, soon(WAIT_HANG_S)))
    mb.peer_gone(2, "goodbye", graceful=True)
    err = waiter.join().error
    assert isinstance(err, PeerLost) and err.peer == 2
    assert mb.lost_peers() == {}  # a clean departure is not a loss
    with pytest.raises(CollectiveTimeout):  # waiting on someone else: unaffected, even strict
        mb.take(1, 0, soon(0.05), strict=True)
    mb.put(msg(1, 0, 3))
    assert int(mb.take(1, 0, soon()).payload[0]) == 3


@pytest.mark.parametrize("kind,cls", [("CollectiveTimeout", CollectiveTimeout), ("PeerLost", PeerLost),
                                      ("CollectiveMismatch", CollectiveMismatch),
                                      ("CollectiveError", CollectiveError), ("SomethingElse", CollectiveError)])
def test_abort_wakes_every_waiter_with_its_class(kind, cls):
    mb = Mailbox(0, 4)
    waiters = [Waiter(lambda: mb.take(1, 0, soon(WAIT_HANG_S))),
               Waiter(lambda: mb.take(2, 5, soon(WAIT_HANG_S), strict=False)),
               Waiter(lambda: mb.take_any({1, 2, 3}, 0, soon(WAIT_HANG_S)))]
    mb.set_abort(AbortReason(kind, "rank 3 gave up", 3))
    mb.set_abort(AbortReason("CollectiveMismatch", "second abort is ignored"))
    for w in waiters:
        err = w.join().error
        assert type(err) is cls and "rank 3 gave up" in str(err)
        if cls is PeerLost:
            assert err.peer == 3
    assert mb.aborted.kind == kind
    with pytest.raises(cls):  # later waits fail at once
        mb.take(3, 9, soon(WAIT_HANG_S))


def test_retire_below_drops_stale_collective_frames():
    mb = Mailbox(0, 3)
    for seq in (3, 4, 5):
        mb.put(msg(1, 1000 + seq, seq, seq=seq, coll=Collective.FEDERATED_AVERAGE))
    mb.put(msg(2, 1003, 33, seq=3, coll=Collective.ALL_REDUCE))
    mb.put(msg(1, 7, 1, seq=0, coll=Collective.P2P))  # point-to-point frames carry no sequence number
    mb.retire_below(5)
    for src, tag in ((1, 1003), (1, 1004), (2, 1003)):
        with pytest.raises(CollectiveTimeout):
            mb.take(src, tag, soon(0.02))
    assert int(mb.take(1, 1005, soon()).payload[0]) == 5
    mb.put(msg(2, 1004, 4, seq=4, coll=Collective.FEDERATED_AVERAGE))  # a straggler's late vector
    mb.retire_below(2)  # never goes back
    with pytest.raises(CollectiveTimeout):
        mb.take(2, 1004, soon(0.02))
    mb.put(msg(2, 1006, 6, seq=6, coll=Collective.FEDERATED_AVERAGE))
    mb.put(msg(2, 8, 8, seq=0, coll=Collective.P2P))
    assert int(mb.take(2, 1006, soon()).payload[0]) == 6
    assert int(mb.take(1, 7, soon()).payload[0]) == 1
    assert int(mb.take(2, 8, soon()).payload[0]) == 8


def test_take_any():
    mb = Mailbox(0, 4)
    start = time.monotonic()
    assert mb.take_any({1, 2}, 0, start + 0.2) is None
    assert 0.19 <= time.monotonic() - start < 0.2 + LATE_S
    mb.put(msg(3, 0, 3))
    mb.put(msg(2, 1, 21))  # other tag
    assert mb.take_any({1, 2}, 0, soon(0.05)) is None
    assert int(mb.take_any({1, 3}, 0, soon()).header.src) == 3
    waiter = Waiter(lambda: mb.take_any({1, 2}, 0, soon(WAIT_HANG_S)))
    mb.put(msg(2, 0, 22))
    assert int(waiter.join().result.payload[0]) == 22


def test_take_any_skips_lost_and_departed_peers():
    mb = Mailbox(0, 4)
    waiter = Waiter(lambda: mb.take_any({1, 2, 3}, 0, soon(WAIT_HANG_S)))
    mb.peer_gone(1, "died", graceful=False)
    mb.peer_gone(2, "goodbye", graceful=True)
    mb.put(msg(3, 0, 3))
    assert waiter.join().result.header.src == 3
    start = time.monotonic()
    assert mb.take_any({1, 2}, 0, soon(WAIT_HANG_S)) is None  # nobody left to wait for: no wait
    assert time.monotonic() - start < NO_WAIT_S


def _far_deadline_waiter(call):
    """A wait with a deadline centuries away must just wait; release it by losing the peer."""
    mb = Mailbox(0, 2)
    waiter = Waiter(lambda: call(mb, time.monotonic() + 1e10))
    waiter._thread.join(0.5)  # bounded: either it is (correctly) still waiting, or it failed
    mb.peer_gone(1, "died", graceful=False)
    return waiter.join()


def test_take_any_with_a_far_deadline_waits():
    w = _far_deadline_waiter(lambda mb, d: mb.take_any({1}, 0, d))
    assert w.error is None and w.result is None


def test_take_with_a_far_deadline_waits():
    w = _far_deadline_waiter(lambda mb, d: mb.take(1, 0, d))
    assert isinstance(w.error, PeerLost), repr(w.error)


def test_last_heard_is_updated_by_put():
    mb = Mailbox(0, 3)
    assert mb.last_heard == [0.0, 0.0, 0.0]
    before = time.monotonic()
    mb.put(msg(2, 0))
    assert mb.last_heard[0] == mb.last_heard[1] == 0.0 and before <= mb.last_heard[2] <= time.monotonic()


# ---------------------------------------------------------------- AbortReason

@pytest.mark.parametrize("reason", [
    AbortReason("PeerLost", "rank 2 died", 2),
    AbortReason("CollectiveTimeout", "took too long", None),
    AbortReason("CollectiveMismatch", "line one\nline two\n\nend", 0),
    AbortReason("CollectiveError", "", None),
    AbortReason("PeerLost", "ünïcødé ✓", 4095),
])
def test_abort_reason_round_trip(reason):
    raw = reason.encode()
    assert isinstance(raw, bytes) and len(raw) <= MAX_CONTROL_PAYLOAD
    back = AbortReason.decode(raw, 5)
    assert back.kind == reason.kind and back.peer == reason.peer
    assert back.message.endswith(reason.message) and "rank 5" in back.message
    err = back.error()
    assert type(err).__name__ == reason.kind and reason.message in str(err)
    if isinstance(err, PeerLost):
        assert err.peer == reason.peer


def test_abort_reason_long_message_fits_a_control_frame():
    raw = AbortReason("CollectiveTimeout", "x" * 10**6, None).encode()
    assert len(raw) <= MAX_CONTROL_PAYLOAD
    assert AbortReason.decode(raw, 0).kind == "CollectiveTimeout"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300).map(lambda b: bytes(c & 0x7F for c in b)), st.integers(0, 1000))
def test_abort_reason_decode_of_arbitrary_ascii(raw, sender):
    reason = AbortReason.decode(raw, sender)
    assert isinstance(reason.error(), CollectiveError)
    assert f"rank {sender}" in reason.message


@pytest.mark.parametrize("peer", ["²".encode(), b"1" * 5000], ids=["superscript", "long"])
def test_abort_reason_decode_of_odd_peer_field(peer):
    reason = AbortReason.decode(b"PeerLost\n" + peer + b"\nboom", 1)
    assert isinstance(reason.error(), PeerLost)


# ---------------------------------------------------------------- chunking arithmetic (algorithms/call.py)

def _assert_partition(bounds, start, stop, parts):
    assert len(bounds) == parts
    assert bounds[0][0] == start and bounds[-1][1] == stop
    for (_, a1), (b0, _) in zip(bounds, bounds[1:]):
        assert a1 == b0  # contiguous, in order: every index exactly once
    sizes = [b - a for a, b in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sum(sizes) == stop - start


@given(st.integers(0, 10**7), st.integers(1, 300))
def test_segment_bounds(length, parts):
    bounds = segment_bounds(length, parts)
    _assert_partition(bounds, 0, length, parts)
    covered = np.zeros(min(length, 5000), dtype=np.int64)
    for a, b in bounds:
        covered[min(a, len(covered)):min(b, len(covered))] += 1
    assert np.all(covered == 1)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 100))
def test_sub_bounds(start, length, pieces):
    _assert_partition(sub_bounds(start, start + length, pieces), start, start + length, pieces)


@given(st.integers(0, 10**8), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 1 << 22))
def test_chunk_count(max_elems, itemsize, chunk_bytes):
    n = chunk_count(max_elems, itemsize, chunk_bytes)
    per_chunk = max(1, chunk_bytes // itemsize)
    assert n >= 1
    assert n * per_chunk >= max_elems  # every element goes in some chunk
    if max_elems:
        assert (n - 1) * per_chunk < max_elems  # and no chunk is wasted
    # cut with sub_bounds, no piece is larger than one chunk
    assert -(-max_elems // n) <= per_chunk
    if n <= 10_000:
        assert max(b - a for a, b in sub_bounds(0, max_elems, n)) <= per_chunk


def test_chunk_count_examples():
    assert chunk_count(0, 4, 1024) == 1
    assert chunk_count(256, 4, 1024) == 1
    assert chunk_count(257, 4, 1024) == 2
    assert chunk_count(10, 16, 8) == 10  # an element larger than a chunk still moves, one per frame


def test_numbered_is_replace_of_the_sequence_number():
    meta = Meta(seq=3, coll=2, dtype=5, elements=7, op=1, root=4)
    numbered = meta.numbered(11)
    assert numbered == meta._replace(seq=11) and type(numbered) is Meta and meta.seq == 3
