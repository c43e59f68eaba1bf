"""The buffers `shmcoll-bench` times on: one warm buffer, or (--cold) many rotating ones.

A warm loop calls the collective on the same buffer again and again, so from the second call on
its data sits in the CPU caches and the bandwidth of big sizes is flattered. --cold rotates through
enough distinct buffers that together they exceed the last-level cache: each timed call then
touches memory that the previous calls did not, and (where the buffers total more than the LLC) was
evicted since it was last used. The buffers are views into one arena, each starting on its own
cache line, visited in a fixed shuffled order so the hardware prefetcher cannot run ahead. A peer
library that writes into an output argument gets one output per input buffer, rotated alike
(output_buffers), so its outputs are as cold as its inputs.

The number of buffers is capped (MAX_COLD_BUFFERS): for sizes up to LLC / cap bytes (512 B with a
32 MiB LLC) the buffers total less than the LLC. Those sizes are latency-bound anyway.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CACHE_ROOT = Path("/sys/devices/system/cpu/cpu0/cache")
DEFAULT_LLC = 32 << 20   # when sysfs does not say
CACHE_LINE = 64
MAX_COLD_BUFFERS = 1 << 16  # bounds memory and set-up time (a view each: ~100 B, ~1 us in torch)
SHUFFLE_SEED = 20240601
_CACHE_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_cache_size(text: str) -> int | None:
    """sysfs' '32768K' / '1M' / '512' -> bytes; None when it is not that shape."""
    m = _CACHE_SIZE_RE.match(text)
    return int(m.group(1)) * _UNITS[m.group(2).lower()] if m else None


def read_llc(root: Path = CACHE_ROOT) -> tuple[int, str]:
    """(bytes, where it came from) of the last-level cache: the highest-level data or unified cache.

    Falls back to DEFAULT_LLC when sysfs is missing or unreadable (containers, non-Linux).
    """
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if size and (best is None or level > best[0]):
            best = (level, size)
    if best is None:
        return DEFAULT_LLC, "default, not found in sysfs"
    return best[1], f"L{best[0]} of {root.parent.name}"


@functools.lru_cache(maxsize=1)
def llc() -> tuple[int, str]:
    """read_llc() once per process."""
    return read_llc()


@dataclass(frozen=True)
class Plan:
    """How many buffers to rotate through, and how far apart (bytes) they start."""

    count: int
    stride: int

    @property
    def span(self) -> int:
        return self.count * self.stride


def plan(nbytes: int, cold: bool, llc_bytes: int) -> Plan:
    """One buffer when warm; when cold, enough that they total more than the LLC (at least 2, capped)."""
    stride = -(-max(nbytes, 1) // CACHE_LINE) * CACHE_LINE
    if not cold:
        return Plan(1, stride)
    return Plan(max(2, min(MAX_COLD_BUFFERS, llc_bytes // stride + 1)), stride)


def capped_up_to(llc_bytes: int) -> int:
    """Sizes (bytes) up to this one hit MAX_COLD_BUFFERS: their cold buffers do not exceed the LLC."""
    return llc_bytes // MAX_COLD_BUFFERS


def rotating(dtype: np.dtype, elems: int, p: Plan, fill: float = 1.0) -> list[np.ndarray]:
    """p.count arrays of `elems` elements, filled with `fill`, in the order the timed loop uses them.

    Every page is written here, so no timed call pays a first-touch page fault.
    """
    if p.count == 1:
        return [np.full(elems, fill, dtype)]
    step = p.stride // dtype.itemsize  # the stride is a multiple of 64, itemsize divides it
    arena = np.full(step * p.count, fill, dtype)
    order = np.random.default_rng(SHUFFLE_SEED).permutation(p.count)
    return [arena[k * step:k * step + elems] for k in order.tolist()]


def output_buffers(inputs: Sequence[np.ndarray], elems: int) -> list[np.ndarray]:
    """One zeroed output of `elems` elements per input buffer, in the same rotation (one arena when several)."""
    dtype = inputs[0].dtype
    stride = -(-elems * dtype.itemsize // CACHE_LINE) * CACHE_LINE
    return rotating(dtype, elems, Plan(len(inputs), stride), fill=0.0)


def cycle_calls(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """A zero-argument call that runs the next of `calls` each time (just the call itself when one)."""
    if len(calls) == 1:
        return calls[0]
    nxt = itertools.cycle(calls).__next__
    return lambda: nxt()()
