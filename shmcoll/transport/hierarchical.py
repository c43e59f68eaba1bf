"""HierarchicalTransport: shared memory to ranks on this host, TCP to ranks on other hosts.

Each peer is routed by the topology. The two transports below share one mailbox, so an abort or a
lost TCP peer ends shared-memory waits as well; a TCP wait, which only a mailbox signal could end,
is cut into slices between which the shared-memory side is checked (a local peer's death, the host's
abort flag), so a failure on either side reaches every wait within a slice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from ..errors import CollectiveTimeout, PeerLost
from ..types import ReduceKind
from .base import NOT_STARTED, BoardGuard, HostRange, PeerStep, RangeStep, Step, Transport
from .frame import Meta
from .mailbox import AbortReason, Mailbox, Message
from .shm import ShmTransport
from .shm_channel import WAIT_SLICE
from .tcp import NetTransport, RangeRow, SwapRow
from .topology import Topology

_T = TypeVar("_T")
_ANY_SLICE = WAIT_SLICE / 4  # recv_any looks at the shared-memory rings this often


class HierarchicalTransport(Transport):
    name = "hier"

    def __init__(self, shm: ShmTransport, net: NetTransport, topology: Topology, mailbox: Mailbox,
                 overlap: bool = False, overlap_in_group: bool = False):
        """shm and net must have been built with `mailbox` (and net with `local=shm`, so a blocked
        TCP send ends on this host's abort flag); net reaches exactly the remote ranks. overlap:
        config.overlaps_across_hosts for this rank; overlap_in_group: for any rank of the group."""
        self.rank, self.world_size, self.timeout = shm.rank, shm.world_size, shm.timeout
        self.shm, self.net, self.topology, self._mailbox = shm, net, topology, mailbox
        self.overlap, self.overlap_in_group = overlap, overlap_in_group
        self._local = frozenset(topology.local_ranks(self.rank))
        self.host_board = shm.board

    def _route(self, peer: int) -> Transport:
        return self.shm if peer in self._local else self.net

    def host_board_guard(self, tag: int, want: Meta) -> BoardGuard:
        """This host's board guard: aborts (the shared mailbox has remote ones too), lost peers on
        either side, and local peers that made another call."""
        return self.shm.board_guard(tag, want)

    def traffic(self) -> dict[str, list[int]]:
        """Payload bytes this rank sent so far to each rank, per path, and the bytes it read straight
        from each local rank's memory ("read") and wrote straight into it ("written";
        algorithms/single_copy.py)."""
        board = self.host_board
        read, written = (board.bytes_read_from, board.bytes_written_to) if board is not None else ([], [])
        return {"shm": list(self.shm.bytes_to), "tcp": list(self.net.bytes_to),
                "read": read + [0] * (self.world_size - len(read)),
                "written": written + [0] * (self.world_size - len(written))}

    # ---- moving data ----
    def send(self, to: int, tag: int, buf: np.ndarray, code: int, meta: Meta, deadline: float) -> None:
        self._route(to).send(to, tag, buf, code, meta, deadline)

    def prepare_row(self, steps: Sequence[PeerStep]) -> SwapRow | None:
        """The TCP side's row, as far as the peers are remote; the rest of exchanges() runs here (its
        receives in slices that look at this host's shared memory)."""
        remote = self._remote_steps(steps)
        return self.net.prepare_row(steps[:remote]) if remote else None

    def row_transport(self) -> Transport:
        return self.net

    def swap_row(self, row: SwapRow, header: bytes | np.ndarray, tag: int, seq: int, data: np.ndarray, code: int,
                 op: ReduceKind, deadline: float, into: np.ndarray | None = None) -> tuple[int, int]:
        return self.net.swap_row(row, header, tag, seq, data, code, op, deadline, into)

    def _remote_steps(self, steps: Sequence[PeerStep]) -> int:
        """How many of the first steps have remote peers."""
        for i, (peer, _) in enumerate(steps):
            if peer in self._local:
                return i
        return len(steps)

    def _duplexes(self, to: int, src: int, tag: int, steps: Sequence[Step], code: int, meta: Meta,
                  deadline: float) -> tuple[int, int]:
        """The TCP side's send_recv_row() where both peers are remote."""
        if to in self._local or src in self._local:
            return 0, NOT_STARTED
        try:
            return self.net._duplexes(to, src, tag, steps, code, meta, deadline)
        except PeerLost:
            self.shm.check_health(strict=False)  # as _sliced: an abort's reason that came through this host
            raise

    def prepare_range_row(self, steps: tuple[RangeStep, ...], itemsize: int) -> RangeRow | None:
        """The TCP side's, where every step's peer is remote."""
        return self.net.prepare_range_row(steps, itemsize)

    def run_range_row(self, row: RangeRow, tag: int, data: np.ndarray, code: int, meta: Meta, deadline: float,
                      op: ReduceKind | None, host_range: HostRange, before: Callable[[], bool]) -> bool:
        try:
            return self.net.run_range_row(row, tag, data, code, meta, deadline, op, host_range, before)
        except PeerLost:
            self.shm.check_health(strict=False)  # as _duplexes
            raise

    def _duplex_ranges(self, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                       deadline: float, op: ReduceKind | None, host_range: HostRange | None) -> tuple[int, int]:
        """The TCP side's send_recv_ranges(), which runs none where a step's peer is local (no
        connection of its own reaches it)."""
        try:
            return self.net._duplex_ranges(steps, tag, data, code, meta, deadline, op, host_range)
        except PeerLost:
            self.shm.check_health(strict=False)  # as _duplexes
            raise

    def recv(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        if src in self._local:
            return self.shm.recv(src, tag, deadline, strict)
        return self._sliced(lambda d: self.net.recv(src, tag, d, strict), deadline, strict)

    def recv_into(self, src: int, tag: int, out: np.ndarray, code: int, deadline: float,
                  want: Meta | None = None, op=None, strict: bool = True) -> None:
        if src in self._local:
            return self.shm.recv_into(src, tag, out, code, deadline, want, op, strict)
        return super().recv_into(src, tag, out, code, deadline, want, op, strict)

    def _sliced(self, wait: Callable[[float], _T], deadline: float, strict: bool) -> _T:
        """A TCP wait in slices, checking the shared-memory side (aborts, local deaths) between them."""
        while True:
            try:
                return wait(min(deadline, time.monotonic() + WAIT_SLICE))
            except CollectiveTimeout:
                if time.monotonic() >= deadline:
                    raise
            except PeerLost:
                # A remote rank that aborted quits at once; its reason may have reached this host only
                # through the shared-memory abort flag: that reason, not the loss, is the real error.
                self.shm.check_health(strict=False)
                raise
            self.shm.check_health(strict)

    def recv_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        """Alternately drain the local rings into the shared mailbox and wait on it briefly."""
        srcs = set(srcs)
        while True:
            self.shm.drain_incoming()
            gone = self._mailbox.unreachable()
            srcs = {s for s in srcs if (self.shm.usable(s) if s in self._local else s not in gone)}
            msg = self._mailbox.take_any(srcs, tag, min(deadline, time.monotonic() + _ANY_SLICE))
            if msg is not None or not srcs or time.monotonic() >= deadline:
                return msg
            self.shm.check_health(strict=False)

    # ---- state ----
    def check_health(self, strict: bool = True) -> None:
        """The shared-memory side sees both: its host's abort flag and local deaths, and (through the
        shared mailbox) aborts and lost peers reported over TCP."""
        self.shm.check_health(strict)

    def abort(self, reason: AbortReason) -> None:
        """Local ranks learn it from the host's abort flag, remote ones from ABORT frames. Both are
        written even when the abort came from elsewhere (the shared mailbox already holds it), so
        every peer sees the abort before it sees this rank close (else it would report PeerLost)."""
        self.shm.abort(reason)
        self.net.abort(reason)

    def retire_below(self, seq: int) -> None:
        self._mailbox.retire_below(seq)

    def last_heard(self) -> list[float]:
        heard = self.net.last_heard()
        local = self.shm.last_heard()
        for peer in self._local:
            heard[peer] = local[peer]
        return heard

    def close(self) -> None:
        """Stop this rank's waits on both sides, let background threads finish, then release."""
        self.shm.begin_close()
        self.net.close()
        self.join_background(2 * WAIT_SLICE + 1.0)
        self.shm.close()
