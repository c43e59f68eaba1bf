"""What a kind of call needs, worked out once and kept for the next call of that kind.

Training repeats a handful of kinds of call (a collective, its dtype and size, its peers), so the
transports and algorithms keep per kind what every such call would otherwise rebuild: a prepared
row of connections, a frame header, room for a peer's frame, a board's descriptors. A program that
makes ever new kinds (a new size at every step) would grow such a cache without end, so one that is
full starts over instead: its entries are cheap to work out again.

Each cache's lookup stays with its caller, inline (on the hot path one Python call more costs as
much as the lookup); only a miss comes here.
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def keep(cache: dict[K, V], key: K, value: V, limit: int) -> V:
    """cache[key] = value, after emptying cache if it already holds `limit` entries; returns value."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
