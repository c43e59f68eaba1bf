"""Doubling broadcast: a small array reaches n ranks in ceil(log2 n) exchange steps, and agreement
comes with it.

A chain takes n - 1 steps, and a binomial tree log2 n but leaves its leaves' disagreement unseen
by the root. Here, in step k, position p and position p XOR 2^k swap one frame each, at once: the
one whose half of their 2^(k+1) block already holds the data sends it, the other an empty frame
that still carries the call's description (both send one in blocks the data has not reached
yet). Pairs do not depend on the root, so ranks that name different roots still meet and compare.
Every rank sends a step's frame only after its earlier steps came in, so by induction a rank that
finished step k has seen, directly or through its partners, every position of its 2^(k+1) block
make the same call; a rank that finishes them all has seen everyone. Positions past the largest
power of two join through position p - core first (their data or an empty frame) and get the data
(or, for the source, an empty frame) back at the end.

A rank's steps (cast_steps) are one row of Transport.exchanges() for an array that goes in one
frame, which TCP runs in one native call, as recursive doubling's all-reduce does: no Python
between the steps, or between a step's send, wait and read. A larger one streams in chunk-sized
frames, each exchange one native duplex over TCP.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..transport.base import EMPTY, PeerStep, Way
from ..transport.tcp import SWAP_MAX_BYTES
from ..types import ReduceKind
from .call import Call
from .direct import recv_stream, send_stream


def doubling_broadcast(c: Call, data: np.ndarray, members: Sequence[int], source: int) -> None:
    """members[source]'s data to every member, in place over a 1-D storage array (this rank a member)."""
    steps = cast_steps(members, c.rank, source)
    if in_one_row(data.nbytes, c.chunk_bytes):
        c.t.exchanges(steps, c.tag, data, c.code, c.meta, c.deadline, ReduceKind.SUM)
        return
    for peer, way in steps:
        if not way.receives:
            give(c, peer, data, way.sends_data)
        elif not way.sends:
            take(c, peer, data, way.takes_data)
        else:
            swap(c, peer, data, way.sends_data, way.takes_data)


def in_one_row(nbytes: int, chunk_bytes: int) -> bool:
    """Whether a broadcast of nbytes runs its steps as one row (one frame each, as a native call
    takes it), not in chunk-sized frames: ranks must agree, so the lean path asks here too."""
    return nbytes <= min(SWAP_MAX_BYTES, chunk_bytes)


def cast_steps(members: Sequence[int], rank: int, source: int) -> tuple[PeerStep, ...]:
    """rank's steps of the doubling broadcast from position `source` among members, in order: the
    data or an empty frame given to or taken from a partner, or one each way at once (CAST_OUT,
    CAST_IN, MEET)."""
    n, p = len(members), list(members).index(rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:
        partner = members[p - core]
        return ((partner, Way.GIVE if p == source else Way.GIVE_EMPTY),
                (partner, Way.TAKE if p != source else Way.TAKE_EMPTY))
    root_in_core = source - core if source >= core else source
    steps: list[PeerStep] = []
    extra = members[p + core] if p + core < n else None
    if extra is not None:
        steps.append((extra, Way.TAKE if p + core == source else Way.TAKE_EMPTY))
    distance = 1
    while distance < core:
        gives, takes = (p ^ root_in_core) < distance, (p ^ distance ^ root_in_core) < distance
        steps.append((members[p ^ distance], Way.CAST_OUT if gives else Way.CAST_IN if takes else Way.MEET))
        distance <<= 1
    if extra is not None:
        steps.append((extra, Way.GIVE if p + core != source else Way.GIVE_EMPTY))
    return tuple(steps)


def swap(c: Call, partner: int, data: np.ndarray, gives: bool, takes: bool) -> None:
    """One step's frames both ways at once: data or an empty frame out (gives), data or an empty
    frame in (takes). Over TCP that is one native duplex (Transport.send_recv), no Python between
    the send, the wait and the read."""
    out, into = (data if gives else EMPTY), (data if takes else EMPTY)
    c.t.send_recv(partner, partner, c.tag, out, into, c.code, c.meta, c.deadline)


def give(c: Call, to: int, data: np.ndarray, with_data: bool) -> None:
    """Send data (in chunk-sized frames) or one empty frame that only describes the call."""
    if with_data:
        send_stream(c, to, data)
    else:
        c.t.send(to, c.tag, EMPTY, c.code, c.meta, c.deadline)


def take(c: Call, src: int, data: np.ndarray, with_data: bool) -> None:
    """Receive what give sent: into data, or the empty frame (its description checked either way)."""
    if with_data:
        recv_stream(c, src, data)
    else:
        c.t.recv_into(src, c.tag, EMPTY, c.code, c.deadline, c.meta)
