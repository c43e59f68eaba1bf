"""SubTransport: the transport of a group made by `ProcessGroup.split`, over some ranks of a parent.

It owns nothing: every frame goes through the root transport (the one `init()` built), with ranks
renumbered (sub rank i is root rank `ranks[i]`). A nested split wraps the root again with the
composed rank list, so there is only ever one level of translation.

Keeping groups apart on one mailbox (frames are queued by (source rank, tag)):
- tags: the root group's collectives use [2**30, 2**31) (group.py); sub-groups use
  [2**31, 2**32 - 1), cut into `N_SLOTS` slots of `SLOT_SPAN` tags. Each sub-group gets a slot that
  no other live sub-group with a member in common uses (agreed at split time: every rank reports its
  slots in use), so two groups sharing a rank never share a tag. Sequence numbers wrap modulo
  SLOT_SPAN inside a slot, as the root's wrap modulo its span.
- sequence numbers: collective frames carry the sub-group's own sequence number plus SEQ_OFFSET,
  because the root mailbox drops collective frames numbered below the root's last retired federated
  round (`retire_below`); offset sub-group frames are never below it. Frames are translated back on
  receipt, so algorithms and mismatch checks see the sub-group's numbers. The offset also keeps the
  shared-memory transport's mismatch probe (which compares a wait's call with the parent's board
  entry of the same sequence number) from taking a parent call for a mismatched sub-group call.
- user point-to-point frames keep their tag (there is no spare range below 2**30) but carry the
  slot + 1 in meta.seq (0 for the root group); the mailbox queues them under tag + that context
  above 32 bits (frame.queue_tag), so a sub-group's send/recv never meet the parent's or another
  live sub-group's, whatever tags the user picks (as MPI communicators' contexts).

A failure anywhere aborts the root transport, so it breaks every group over it (the parent and all
its sub-groups), as peers could otherwise wait on a rank that has given up.
"""

from __future__ import annotations

import numbers
import re
import threading
import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import CollectiveMismatch, InvalidArgument
from ..types import TAG_RESERVED_BASE, ReduceKind
from .base import HostRange, PeerStep, RangeStep, Step, Transport
from .frame import Meta
from .mailbox import AbortReason, Message
from .topology import Topology

SUB_TAG_BASE = 1 << 31
SLOT_SPAN = 1 << 16
#: The top tag (2**32 - 1) stays init()'s startup tag, so the last slot ends just below it.
N_SLOTS = ((1 << 32) - 1 - SUB_TAG_BASE) // SLOT_SPAN
SEQ_OFFSET = 1 << 61  # below init()'s startup sequence number (2**62), above any real one

_slots: weakref.WeakKeyDictionary[Transport, set[int]] = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def check_ranks(ranks, world_size: int) -> list[int]:
    """The member list of a split as plain ints; InvalidArgument when empty, duplicated or out of range."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise InvalidArgument(f"split takes a list of ranks, not {ranks!r}")
    items = list(ranks)
    if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in items):
        raise InvalidArgument(f"split takes a list of int ranks, not {ranks!r}")
    members = [int(r) for r in items]
    if not members:
        raise InvalidArgument("split needs at least one rank")
    if len(set(members)) != len(members):
        raise InvalidArgument(f"split: duplicate ranks in {members}")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise InvalidArgument(f"split: ranks {bad} are outside 0..{world_size - 1}")
    return members


def used_slots(root: Transport) -> list[int]:
    """Slots this process's live sub-groups over root occupy (reported to peers at split time)."""
    with _slots_lock:
        return sorted(_slots.get(root, ()))


def pick_slot(used_by_members: Iterable[Iterable[int]]) -> int:
    """The lowest slot no member uses; every rank computes it from the same gathered data."""
    taken = set().union(*used_by_members)
    for slot in range(N_SLOTS):
        if slot not in taken:
            return slot
    raise InvalidArgument(f"split: all {N_SLOTS} sub-group slots are in use; close sub-groups you no longer need")


def _member_topology(root_topology: Topology | None, ranks: tuple[int, ...]) -> Topology | None:
    """The members' hosts, renumbered: a sub-group spanning hosts runs the two-level algorithms
    over the root's routing (shared memory to its host, TCP to the others), as its parent does."""
    if root_topology is None:
        return None
    return Topology.from_host_ids({i: str(root_topology.host_of[r]) for i, r in enumerate(ranks)})


class SubTransport(Transport):
    """A view of `root` restricted to `ranks` (root ranks, in the sub-group's rank order)."""

    name = "sub"
    board = None  # the shared-memory board is per host and belongs to the root group's sequence numbers

    def __init__(self, root: Transport, ranks: list[int], slot: int):
        self.root, self.ranks, self.slot = root, tuple(ranks), slot
        self._sub_of = {r: i for i, r in enumerate(self.ranks)}
        self.rank = self._sub_of[root.rank]
        self.world_size = len(self.ranks)
        self.timeout = root.timeout
        self.topology = _member_topology(root.topology, self.ranks)
        self._closed = False
        with _slots_lock:
            _slots.setdefault(root, set()).add(slot)

    def tag_of(self, seq: int) -> int:
        """The tag of this group's collective number seq: its slot's range."""
        return SUB_TAG_BASE + self.slot * SLOT_SPAN + seq % SLOT_SPAN

    # ---- translation ----
    def _out(self, meta: Meta) -> Meta:
        """Collective frames: offset sequence numbers; point-to-point frames: this group's context."""
        return meta._replace(seq=meta.seq + SEQ_OFFSET) if meta.coll else meta._replace(seq=self.slot + 1)

    def _tag(self, tag: int) -> int:
        """The root mailbox's queue tag: user tags (below 2**30) get this group's context (see _out)."""
        return tag | ((self.slot + 1) << 32) if tag < TAG_RESERVED_BASE else tag

    def _in(self, msg: Message) -> Message:
        h = msg.header
        meta = h.meta._replace(seq=h.meta.seq - SEQ_OFFSET) if h.meta.coll and h.meta.seq >= SEQ_OFFSET else h.meta
        return Message(h._replace(src=self._sub_of.get(h.src, h.src), meta=meta), msg.payload)

    # ---- moving data ----
    def send(self, to: int, tag: int, buf: np.ndarray, code: int, meta: Meta, deadline: float) -> None:
        self.root.send(self.ranks[to], tag, buf, code, self._out(meta), deadline)

    def _swaps(self, steps: Sequence[PeerStep], tag: int, data: np.ndarray, code: int, meta: Meta,
               deadline: float, op: ReduceKind) -> tuple[int, int]:
        """The root's exchanges in a row, in its numbering (exchanges() carries collective tags only,
        which the root's mailbox queues unchanged)."""
        steps = tuple((self.ranks[peer], way) for peer, way in steps)
        return self.root._swaps(steps, tag, data, code, self._out(meta), deadline, op)

    def _duplexes(self, to: int, src: int, tag: int, steps: Sequence[Step], code: int, meta: Meta,
                  deadline: float) -> tuple[int, int]:
        """The root's send_recv_row() at once, in its numbering (collective tags only, as _swaps)."""
        return self.root._duplexes(self.ranks[to], self.ranks[src], tag, steps, code, self._out(meta), deadline)

    def _duplex_ranges(self, steps: Sequence[RangeStep], tag: int, data: np.ndarray, code: int, meta: Meta,
                       deadline: float, op: ReduceKind | None, host_range: HostRange | None) -> tuple[int, int]:
        """The root's send_recv_ranges() row at once, in its numbering (collective tags only, as
        _swaps): a ring's or halving's whole schedule in one native call where the root runs one."""
        steps = tuple((self.ranks[to], self.ranks[src], a, b, lo, hi, folds) for to, src, a, b, lo, hi, folds in steps)
        return self.root._duplex_ranges(steps, tag, data, code, self._out(meta), deadline, op, host_range)

    def recv(self, src: int, tag: int, deadline: float, strict: bool = True) -> Message:
        return self._in(self.root.recv(self.ranks[src], self._tag(tag), deadline, strict))

    def recv_any(self, srcs: set[int], tag: int, deadline: float) -> Message | None:
        msg = self.root.recv_any({self.ranks[s] for s in srcs}, self._tag(tag), deadline)
        return self._in(msg) if msg is not None else None

    def recv_into(self, src: int, tag: int, out: np.ndarray, code: int, deadline: float,
                  want: Meta | None = None, op=None, strict: bool = True) -> None:
        """The root's own recv_into (shared memory reduces in place), with the wire's numbering."""
        try:
            ours = self._out(want) if want is not None else None
            self.root.recv_into(self.ranks[src], self._tag(tag), out, code, deadline, ours, op, strict)
        except CollectiveMismatch as exc:
            text = re.sub(r"\d{19,}", lambda m: str(int(m.group()) - SEQ_OFFSET) if int(m.group()) >= SEQ_OFFSET
                          else m.group(), str(exc))  # the sub-group's own sequence numbers
            raise CollectiveMismatch(f"in the sub-group over parent ranks {list(self.ranks)} (rank numbers "
                                     f"here are the parent's): {text}") from None

    # ---- state ----
    def check_health(self, strict: bool = True) -> None:
        self.root.check_health(strict)

    def abort(self, reason: AbortReason) -> None:
        """Aborts the root: every group over it breaks (peers must not wait on a rank that gave up)."""
        self.root.abort(reason)

    def retire_below(self, seq: int) -> None:
        """No-op. The root mailbox retires by one number for all frames; retiring a sub-group's
        number there would drop the parent's (and other sub-groups') live frames. The cost: a late
        federated vector in a sub-group is kept (on a tag no later round uses) instead of dropped."""

    def last_heard(self) -> list[float]:
        heard = self.root.last_heard()
        return [heard[r] for r in self.ranks]

    def close(self) -> None:
        """Frees the tag slot only: the sockets and shared memory belong to the root group."""
        with _slots_lock:
            if not self._closed:
                self._closed = True
                _slots.get(self.root, set()).discard(self.slot)
