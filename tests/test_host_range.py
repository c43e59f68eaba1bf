"""A rank's range folded out of its host peers' arrays and written back into theirs by the row that
carries it across hosts (native/host_range.h, single_copy.HostRange).

Each end of a ring of two over a real TCP connection on loopback plays one host: its "host peer"
is a second array of the same process, which the kernel reads and writes as it would another
process's (process_vm_readv and process_vm_writev on this pid). The row folds both arrays, carries
the sum across and writes the result into both, or into its own alone where it does not deliver; a
row that stops early leaves the rest to host_range_fold; an unreadable peer stops the row before
it sends anything, and its failure reaches the caller as the peer's; arguments that do not
describe a host range holding the row's data are refused. The two-level all-reduce that uses all
this is tested across processes in test_hierarchy.py.
"""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import numpy as np
import pytest
from test_duplex_row import RowEnd, both_to_the_end

from shmcoll import kernels
from shmcoll.algorithms import single_copy
from shmcoll.errors import CollectiveError, PeerLost
from shmcoll.types import F32, I64, ReduceKind

TAG, SEQ = 9, 4
WAIT_NS = 5 * 10**9  # long enough for the other end's thread on a loaded machine; the tests do not wait it out
PIECE = 64 << 10  # bytes folded at a time: several pieces per step of the larger arrays


class _Host(RowEnd):
    """One end's row over its connection (a SUM), its array (`own`) a host range with one host
    peer (`peer`)."""

    def __init__(self, sock, me: int, own: np.ndarray, peer: np.ndarray, code: int, delivers: bool = True):
        super().__init__(sock, me, own, code, int(ReduceKind.SUM))
        self.own = own
        self.words = np.zeros(kernels.HOST_FOLDED + -(-own.nbytes // PIECE), np.int64)
        peers = np.zeros((2, kernels.PEER_BYTES // 8), np.int64)  # descriptors: pid and address first
        peers[:, :2] = [(os.getpid(), kernels.address_of(a)) for a in (own, peer)]
        self.host = (own.view(np.uint8), peers, np.empty(2 * PIECE, np.uint8), self.words, 0, 0, own.nbytes, PIECE,
                     int(delivers))

    @property
    def folded(self) -> np.ndarray:
        return self.words[kernels.HOST_FOLDED:]


def _base(n: int, dtype) -> np.ndarray:
    """Small whole numbers, so that float32 sums of them are exact in any order."""
    return (np.arange(n) % 1000).astype(dtype)


def _arrays(n: int, dtype) -> list[np.ndarray]:
    """Own and peer arrays of both ends: _base times 1, 2, 3 and 4."""
    return [_base(n, dtype) * (k + 1) for k in range(4)]


@pytest.mark.parametrize("n, dtype, wire", [(1001, np.float32, F32), (1 << 20, np.float32, F32),
                                             (1 << 19, np.int64, I64)])
def test_the_row_folds_both_hosts_and_writes_the_sum_into_every_array(pair, n, dtype, wire):
    """Every array of both hosts ends with the sum of all four, own and peer alike; every piece was
    folded once, and the row wrote the whole array into the peer's (odd halves, and far past the
    sockets' buffers)."""
    arrays = _arrays(n, dtype)
    hosts = [_Host(pair[i], i, arrays[2 * i], arrays[2 * i + 1], wire.code) for i in range(2)]
    assert both_to_the_end(hosts) == [kernels.DUPLEX_DONE] * 2
    want = _base(n, dtype) * 10
    assert all(np.array_equal(a, want) for a in arrays)
    for host in hosts:
        assert np.all(host.folded == 1) and host.words[kernels.HOST_DELIVERED] == host.own.nbytes


def test_a_row_that_does_not_deliver_leaves_the_peers_arrays_as_they_were(pair):
    """Without delivering (an AVG, divided after the row), only the ends' own arrays hold the sum."""
    n = 1 << 20
    arrays = _arrays(n, np.float32)
    hosts = [_Host(pair[i], i, arrays[2 * i], arrays[2 * i + 1], F32.code, delivers=False) for i in range(2)]
    assert both_to_the_end(hosts) == [kernels.DUPLEX_DONE] * 2
    base = _base(n, np.float32)
    assert np.array_equal(arrays[0], base * 10) and np.array_equal(arrays[2], arrays[0])
    assert np.array_equal(arrays[1], base * 2) and np.array_equal(arrays[3], base * 4)
    assert hosts[0].words[kernels.HOST_DELIVERED] == 0 and np.all(hosts[0].folded == 1)


def test_a_row_that_stops_early_leaves_the_rest_to_host_range_fold(pair):
    """With no peer at the other end, the row sends only what may go ahead of the peer's frame:
    it folds the pieces it sends and no others; host_range_fold then folds the rest, and every
    piece holds own + peer once."""
    n = 1 << 20
    arrays = _arrays(n, np.float32)
    host = _Host(pair[0], 0, arrays[0], arrays[1], F32.code)
    assert host.call(wait_ns=0) == kernels.DUPLEX_PENDING
    assert 0 < host.folded.sum() < len(host.folded)
    assert kernels.host_range_fold(host.host, F32.code, int(ReduceKind.SUM)) == 0
    assert np.all(host.folded == 1)
    assert np.array_equal(arrays[0], _base(n, np.float32) * 3)


def test_a_host_peer_that_cannot_be_read_stops_the_row_before_it_sends(pair):
    """The peer's array is not mapped: the row stops at its first fold, sending nothing, and the
    words say why and whose."""
    arrays = _arrays(1 << 16, np.float32)
    host = _Host(pair[0], 0, arrays[0], arrays[1], F32.code)
    host.host[1][1, :2] = (os.getpid(), 8)
    assert host.call() == kernels.DUPLEX_HOST_FAILED
    assert host.progress[0] == 0
    assert (host.words[kernels.HOST_ERROR], host.words[kernels.HOST_FAILED]) == (errno.EFAULT, 1)
    assert kernels.host_range_fold(host.host, F32.code, int(ReduceKind.SUM)) == errno.EFAULT


def _with(host: tuple, at: int, value) -> tuple:
    return (*host[:at], value, *host[at + 1:])


@pytest.mark.parametrize("change", [
    lambda host: _with(host, 6, host[6] - 8),  # a range that ends before the row's data
    lambda host: _with(host, 5, 4),  # ... that starts after it
    lambda host: _with(host, 3, host[3][:kernels.HOST_FOLDED]),  # no word for each piece
    lambda host: _with(host, 2, host[2][:PIECE]),  # scratch for one piece
    lambda host: _with(host, 4, 2),  # a position past the peers
    lambda host: _with(host, 7, 0),  # pieces of no bytes
    lambda host: _with(host, 7, PIECE + 2),  # ... or of part of an element
    lambda host: host[:8],  # too short a tuple
], ids=["end", "start", "words", "scratch", "position", "piece", "split", "tuple"])
def test_host_ranges_that_do_not_hold_the_row_are_refused(pair, change):
    arrays = _arrays(1 << 12, np.float32)
    host = _Host(pair[0], 0, arrays[0], arrays[1], F32.code)
    host.host = change(host.host)
    with pytest.raises(ValueError, match="host range"):
        host.call()


def _failed_host_range(error: int, guarded: list[int]) -> single_copy.HostRange:
    """A HostRange among group ranks 5 and 7 (this one 5) whose row failed at the peer with `error`;
    its guard notes the rank it was asked about in `guarded`."""
    among = single_copy.Readers(board=None, ranks=(5, 7), guard=lambda: guarded.append)
    c = SimpleNamespace(rank=5, code=F32.code)
    own = np.zeros(1024, np.uint8)
    host_range = single_copy.HostRange(c, among, own, ReduceKind.SUM, np.zeros((2, 2), np.int64), (0, 1024), True)
    host_range.native[3][[kernels.HOST_ERROR, kernels.HOST_FAILED]] = error, 1
    return host_range


def test_a_failed_host_range_raises_what_the_peer_s_failure_means():
    """A peer gone (ESRCH) is PeerLost naming its group rank, after its guard had its say; any other
    failure (its memory changed under the call) a CollectiveError."""
    guarded: list[int] = []
    with pytest.raises(PeerLost, match="rank 7") as raised:
        _failed_host_range(errno.ESRCH, guarded).raise_failure()
    assert raised.value.peer == 7 and guarded == [7]
    with pytest.raises(CollectiveError, match="Bad address"):
        _failed_host_range(errno.EFAULT, guarded).raise_failure()
