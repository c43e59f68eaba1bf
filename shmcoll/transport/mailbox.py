"""Per-(source, tag) message queues shared by a transport's reader threads and its callers.

Reader threads `put` frames as they arrive, so a socket is always drained and a send never waits
on a peer that is itself sending. Callers `take` the next message of one (source, tag) with a
deadline. The mailbox also records what ends waiting early: a peer that vanished (PeerLost), a peer
that left on purpose (goodbye), and an abort broadcast by any rank of the group.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import CollectiveError, CollectiveTimeout, PeerLost, error_of_kind
from .frame import Header, queue_tag, unpack

_MAX_WAIT_SLICE = 3600.0  # Condition.wait rejects timeouts past threading.TIMEOUT_MAX; loop instead


@dataclass(slots=True)
class Message:
    header: Header
    payload: np.ndarray  # uint8 bytes exactly as they came from the wire


@dataclass(frozen=True)
class AbortReason:
    """Why the group was aborted; rebuilt into a fresh exception for every waiter."""

    kind: str  # the name of a shmcoll error class
    message: str
    peer: int | None = None

    def error(self) -> CollectiveError:
        return error_of_kind(self.kind, self.message, self.peer)

    def encode(self) -> bytes:
        return f"{self.kind}\n{'' if self.peer is None else self.peer}\n{self.message}".encode()[:60000]

    @classmethod
    def decode(cls, raw: bytes, sender: int) -> AbortReason:
        kind, peer, message = (raw.decode(errors="replace").split("\n", 2) + ["", ""])[:3]
        peer_rank = int(peer) if peer.isascii() and peer.isdigit() and len(peer) < 10 else None
        return cls(kind, f"rank {sender} aborted the group: {message}", peer_rank)


class Mailbox:
    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self._cond = threading.Condition()
        self._queues: dict[tuple[int, int], collections.deque[Message]] = collections.defaultdict(collections.deque)
        self._lost: dict[int, str] = {}
        self._departed: set[int] = set()
        self._abort: AbortReason | None = None
        self._retired_below = 0  # collective frames with a lower sequence number are stale: dropped
        self.last_heard = [0.0] * world_size

    # ---- producers (reader threads, self-sends) ----
    def put(self, msg: Message) -> None:
        h = msg.header
        with self._cond:
            if not self.accepts(h):
                return  # e.g. a straggler's vector for a federated round that already ended
            self._queues[(h.src, queue_tag(h))].append(msg)
            self._cond.notify_all()

    def accepts(self, header: Header) -> bool:
        """A frame a caller read for itself instead of through put: its sender counts as heard from;
        False when put would drop it (a collective frame retired before it came)."""
        self.last_heard[header.src] = time.monotonic()
        return not (header.meta.coll and header.meta.seq < self._retired_below)

    def post_to_self(self, header: bytes, buf: np.ndarray) -> None:
        """A send to our own rank: a copy of the array goes straight into the mailbox."""
        self.put(Message(unpack(header, self.rank), np.frombuffer(buf.tobytes(), dtype=np.uint8)))

    def touch(self, src: int) -> None:
        """A control frame (heartbeat) came from src: it is alive."""
        self.last_heard[src] = time.monotonic()

    def peer_gone(self, peer: int, reason: str, graceful: bool) -> None:
        with self._cond:
            if graceful:
                self._departed.add(peer)
            else:
                self._lost.setdefault(peer, reason)
            self._cond.notify_all()

    def set_abort(self, reason: AbortReason) -> None:
        with self._cond:
            if self._abort is None:
                self._abort = reason
            self._cond.notify_all()

    # ---- consumers ----
    @property
    def aborted(self) -> AbortReason | None:
        return self._abort

    @property
    def troubled(self) -> bool:
        """Aborted, or a peer lost: a quick look (no lock) for paths that then look closer."""
        return self._abort is not None or bool(self._lost)

    def lost_peers(self) -> dict[int, str]:
        with self._cond:
            return dict(self._lost)

    def unreachable(self) -> set[int]:
        """Peers lost or departed: no message from them will come any more."""
        with self._cond:
            return set(self._lost) | self._departed

    def has(self, src: int, tag: int) -> bool:
        """Whether a message from src with tag is queued. No lock: a dict lookup is atomic, and a
        caller that must trust the answer holds src's connection, so nothing is queued meanwhile."""
        return bool(self._queues.get((src, tag)))

    def peek(self, src: int, tag: int) -> Message | None:
        """The next queued message from src with tag, left queued."""
        with self._cond:
            queue = self._queues.get((src, tag))
            return queue[0] if queue else None

    def pop(self, src: int, tag: int) -> Message | None:
        """The next queued message from src with tag, without waiting."""
        with self._cond:
            queue = self._queues.get((src, tag))
            if not queue:
                return None
            msg = queue.popleft()
            if not queue:
                del self._queues[(src, tag)]
            return msg

    def take(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        """Next message from src with tag. strict: any lost peer fails the wait (collectives need all)."""
        key = (src, tag)
        with self._cond:
            while True:
                queue = self._queues.get(key)
                if queue:
                    msg = queue.popleft()
                    if not queue:
                        del self._queues[key]
                    return msg
                self._raise_if_hopeless(src, strict)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"no message from rank {src} (tag {tag}) before the deadline")
                self._cond.wait(min(left, _MAX_WAIT_SLICE))

    def take_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        """First message with tag from any of srcs; lost or departed peers are skipped; None at the deadline."""
        with self._cond:
            while True:
                for src in srcs:
                    queue = self._queues.get((src, tag))
                    if queue:
                        msg = queue.popleft()
                        if not queue:
                            del self._queues[(src, tag)]
                        return msg
                if self._abort is not None:
                    raise self._abort.error()
                srcs = {s for s in srcs if s not in self._lost and s not in self._departed}
                left = deadline - time.monotonic()
                if not srcs or left <= 0:
                    return None
                self._cond.wait(min(left, _MAX_WAIT_SLICE))

    def _raise_if_hopeless(self, src: int, strict: bool) -> None:
        if self._abort is not None:
            raise self._abort.error()
        if src in self._lost:
            raise PeerLost(f"rank {src} was lost: {self._lost[src]}", src)
        if strict and self._lost:
            peer, reason = next(iter(self._lost.items()))
            raise PeerLost(f"rank {peer} was lost: {reason}", peer)
        if src in self._departed:
            raise PeerLost(f"rank {src} closed its group while this rank still expected a message from it", src)

    def retire_below(self, seq: int) -> None:
        """Drop queued and future collective frames older than seq (a round that is over)."""
        with self._cond:
            self._retired_below = max(self._retired_below, seq)
            stale = [k for k, q in self._queues.items() if q and q[0].header.meta.coll and q[0].header.meta.seq < seq]
            for key in stale:
                kept = collections.deque(m for m in self._queues[key] if m.header.meta.seq >= seq)
                if kept:
                    self._queues[key] = kept
                else:
                    del self._queues[key]
