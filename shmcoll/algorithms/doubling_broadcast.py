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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .call import Call
from .direct import recv_stream, send_stream

_EMPTY = np.empty(0, dtype=np.uint8)


def doubling_broadcast(c: Call, data: np.ndarray, members: Sequence[int], source: int) -> None:
    """members[source]'s data to every member, in place over a 1-D storage array (this rank a member)."""
    n, p = len(members), members.index(c.rank)
    core = 1 << (n.bit_length() - 1)
    if p >= core:
        partner = members[p - core]
        give(c, partner, data, p == source)
        take(c, partner, data, p != source)
        return
    root_in_core = source - core if source >= core else source
    extra = members[p + core] if p + core < n else None
    if extra is not None:
        take(c, extra, data, p + core == source)
    distance = 1
    while distance < core:
        partner = members[p ^ distance]
        swap(c, partner, data, (p ^ root_in_core) < distance, (p ^ distance ^ root_in_core) < distance)
        distance <<= 1
    if extra is not None:
        give(c, extra, data, p + core != source)


def swap(c: Call, partner: int, data: np.ndarray, gives: bool, takes: bool) -> None:
    """One step's frames both ways at once: data or an empty frame out (gives), data or an empty
    frame in (takes). Over TCP that is one native duplex (Transport.send_recv), no Python between
    the send, the wait and the read."""
    out, into = (data if gives else _EMPTY), (data if takes else _EMPTY)
    c.t.send_recv(partner, partner, c.tag, out, into, c.code, c.meta, c.deadline)


def give(c: Call, to: int, data: np.ndarray, with_data: bool) -> None:
    """Send data (in chunk-sized frames) or one empty frame that only describes the call."""
    if with_data:
        send_stream(c, to, data)
    else:
        c.t.send(to, c.tag, _EMPTY, c.code, c.meta, c.deadline)


def take(c: Call, src: int, data: np.ndarray, with_data: bool) -> None:
    """Receive what give sent: into data, or the empty frame (its description checked either way)."""
    if with_data:
        recv_stream(c, src, data)
    else:
        c.t.recv_into(src, c.tag, _EMPTY, c.code, c.deadline, c.meta)
