"""The board: small collectives on shared memory in one step, whatever the number of ranks.

Each local rank owns two board entries, used alternately by sequence number. For a small
collective every rank writes its whole input into its entry once (payload, frame header, then the
"published" word), and every rank reads every entry straight out of shared memory, in rank order,
so reductions are bitwise identical everywhere. A rank reuses an entry only when every peer has
finished the call that last read it (each rank's "done" word says which). Loads and stores are
plain: on x86 (total store order) a reader that sees the published word sees the payload too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from ..errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from . import frame
from .frame import HEADER_SIZE, Meta
from .shm_layout import BOARD_HEADER_OFFSET, SLOT_HEADER_BYTES, W_DONE, Layout

_MAX_SLEEP = 1e-3  # longest nap between looks once spinning has not paid off
_SRC_START, _SRC_END = frame.SRC_FIELD  # the one header field that differs between ranks' entries


class Board:
    def __init__(self, mem: np.ndarray, layout: Layout, rank: int, local_of: dict[int, int], spin_s: float):
        self._mem, self._layout, self._rank, self._local_of = mem, layout, rank, local_of
        self._me = local_of[rank]
        self._words = mem.view(np.uint64)
        self._spin_s = spin_s
        self._last_written = [0, 0]  # per parity: 1 + the sequence number of our last entry there

    @property
    def capacity(self) -> int:
        return self._layout.board_bytes

    def publish(self, meta: Meta, code: int, data: np.ndarray, deadline: float, check: Callable[[], None],
                with_payload: bool = True) -> None:
        """Write our entry for meta.seq (data: a 1-D array of wire type `code`) once no peer can
        still be reading the entry it replaces. Without payload only the call's description goes
        out (a broadcast's receivers: everyone still checks that everyone made the same call)."""
        seq, payload = meta.seq, data.view(np.uint8)
        header = self._header = frame.pack(frame.DATA, self._rank, 0, meta, code, data.shape, data.nbytes)
        self._nbytes = data.nbytes
        previous = self._last_written[seq % 2]
        if previous and not self._all_done(previous):
            self._wait(lambda: self._all_done(previous), deadline, check, "peers to finish reading our board entry")
        at = self._layout.board_offset(self._me, seq)
        self._mem[at + BOARD_HEADER_OFFSET:at + BOARD_HEADER_OFFSET + HEADER_SIZE] = np.frombuffer(header, np.uint8)
        if with_payload:
            self._mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + len(payload)] = payload
        self._words[at // 8] = seq + 1  # last: publishes the entry
        self._last_written[seq % 2] = seq + 1

    def read(self, src: int, seq: int, want: Meta, deadline: float, check: Callable[[int], None]) -> np.ndarray:
        """Rank src's payload (uint8 view into shared memory) for seq; CollectiveMismatch if its call differs."""
        at, raw = self._published(src, seq, deadline, check)
        if raw[_SRC_END:] != self._header[_SRC_END:] or raw[:_SRC_START] != self._header[:_SRC_START]:
            self._mismatch(raw, src, want)  # the same call makes the same header, but for the source rank
        return self._mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + self._nbytes]

    def read_any_size(self, src: int, seq: int, want: Meta, deadline: float,
                      check: Callable[[int], None]) -> np.ndarray:
        """As read, for calls whose ranks publish different amounts (all_gather_v, scatter): only the
        call's description must match; the payload is as long as src's entry says."""
        at, raw = self._published(src, seq, deadline, check)
        header = frame.unpack(raw, src)
        problem = frame.describe_mismatch(header.meta, want, src)
        if problem:
            raise CollectiveMismatch(problem)
        return self._mem[at + SLOT_HEADER_BYTES:at + SLOT_HEADER_BYTES + min(header.nbytes, self.capacity)]

    def _published(self, src: int, seq: int, deadline: float, check: Callable[[int], None]) -> tuple[int, bytes]:
        """Wait for src's entry of seq; its offset and raw frame header."""
        at = self._layout.board_offset(self._local_of[src], seq)
        word = at // 8
        if self._words[word] != seq + 1:
            self._wait(lambda: self._words[word] == seq + 1, deadline, lambda: check(src), f"rank {src}'s board entry")
        return at, self._mem[at + BOARD_HEADER_OFFSET:at + BOARD_HEADER_OFFSET + HEADER_SIZE].tobytes()

    def _mismatch(self, raw: bytes, src: int, want: Meta) -> None:
        header = frame.unpack(raw, src)
        problem = frame.describe_mismatch(header.meta, want, src)
        raise CollectiveMismatch(problem or f"rank {src} published {header.nbytes} bytes of dtype code "
                                            f"{header.dtype}, this rank {self._nbytes}")

    def _all_done(self, mark: int) -> bool:
        return all(self._words[W_DONE + w] >= mark for w in self._local_of.values() if w != self._me)

    def published(self, src: int, seq: int) -> bool:
        """Whether rank src has published its entry for seq (it is inside that call)."""
        return self._words[self._layout.board_offset(self._local_of[src], seq) // 8] == seq + 1

    def finish(self, seq: int) -> None:
        """We have read every entry of seq: peers may overwrite theirs."""
        self._words[W_DONE + self._me] = seq + 1

    def wait_all_finished(self, seq: int, deadline: float, check: Callable[[], None]) -> None:
        """Until every peer has finished seq. A call that goes on over the rings after a board step
        waits here first, so no peer still waiting on the board takes its ring frames for a
        mismatch. check must not consume frames (peers past this point may already send them)."""
        if not self._all_done(seq + 1):
            self._wait(lambda: self._all_done(seq + 1), deadline, check, "peers to finish the board step")

    def probe(self, want: Meta) -> str | None:
        """A peer that published an entry for want.seq describing another call: how it differs."""
        for src, local in self._local_of.items():
            at = self._layout.board_offset(local, want.seq)
            if local == self._me or self._words[at // 8] != want.seq + 1:
                continue
            raw = self._mem[at + BOARD_HEADER_OFFSET:at + BOARD_HEADER_OFFSET + HEADER_SIZE].tobytes()
            problem = frame.describe_mismatch(frame.unpack(raw, src).meta, want, src)
            if problem:
                return problem
        return None

    def _wait(self, ready: Callable[[], bool], deadline: float, check: Callable[[], None], what: str) -> None:
        """Spin (yielding the core) for a while, then nap with growing pauses; check() raises on failure."""
        end_spin = time.perf_counter() + self._spin_s
        while time.perf_counter() < end_spin:
            if ready():
                return
            os.sched_yield()
        nap = 20e-6
        while not ready():
            try:
                check()
            except CollectiveError:
                if ready():  # it came after our last look (a peer that published, then left)
                    return
                raise
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"waited for {what} until the deadline")
            time.sleep(nap)
            nap = min(2 * nap, _MAX_SLEEP)
