"""Hostfiles and rank placement, with no I/O beyond reading the file (so every rule is unit-tested).

A hostfile line is `HOST [slots=K]`; `#` starts a comment anywhere on a line. Duplicate hosts merge
(their slots add up, first appearance keeps its place), as in Open MPI. Ranks fill each host's
slots before moving to the next one (Open MPI's `--map-by slot`), so neighbouring ranks share a
host and its shared memory. Anything unexpected is an error naming the file and line: a typo in a
hostfile should never silently change where ranks run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shmcoll.errors import InvalidArgument

# Host names, IPv4 and IPv6 literals. No leading '-' (it would reach the rsh command as an option),
# no '@' or spaces (the name is also the rendezvous address and SHMCOLL_HOST_ID).
_HOST_RE = re.compile(r"^[A-Za-z0-9_:][A-Za-z0-9_.:-]{0,252}$")
_SLOTS_RE = re.compile(r"^[0-9]{1,6}$")


@dataclass(frozen=True)
class Host:
    """One host of a hostfile and how many ranks it may run."""

    name: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its host, and its numbers among the ranks of that host."""

    rank: int
    host: str
    local_rank: int
    local_world_size: int


def _parse_line(line: str, where: str) -> Host | None:
    """One line (comment already stripped) -> Host, or None when blank."""
    words = line.split()
    if not words:
        return None
    name, options = words[0], words[1:]
    if not _HOST_RE.match(name):
        raise InvalidArgument(f"{where}: bad host name {name!r}")
    slots = None
    for option in options:
        key, eq, value = option.partition("=")
        if key != "slots" or not eq:
            raise InvalidArgument(f"{where}: unexpected {option!r} (a line is HOST [slots=K])")
        if slots is not None:
            raise InvalidArgument(f"{where}: slots given twice")
        if not _SLOTS_RE.match(value) or int(value) < 1:
            raise InvalidArgument(f"{where}: slots must be an integer >= 1, got {value!r}")
        slots = int(value)
    return Host(name, 1 if slots is None else slots)


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """The hosts of a hostfile's text, duplicates merged, in order of first appearance."""
    merged: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        host = _parse_line(raw.split("#", 1)[0], f"{path}:{number}")
        if host is not None:
            merged[host.name] = merged.get(host.name, 0) + host.slots
    if not merged:
        raise InvalidArgument(f"{path}: no hosts (a line is HOST [slots=K])")
    return [Host(name, slots) for name, slots in merged.items()]


def read_hostfile(path: str) -> list[Host]:
    """parse_hostfile on a file; an unreadable file is an InvalidArgument too."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read hostfile {path!r}: {getattr(e, 'strerror', None) or e}") from None
    return parse_hostfile(text, path)


def place_ranks(hosts: list[Host], n: int | None = None) -> list[Placement]:
    """The first n slots (all of them when n is None), host by host; no oversubscription."""
    total = sum(h.slots for h in hosts)
    if n is None:
        n = total
    if n < 1:
        raise InvalidArgument(f"the number of ranks must be >= 1, got {n}")
    if n > total:
        names = ", ".join(f"{h.name}={h.slots}" for h in hosts)
        raise InvalidArgument(f"{n} ranks requested but the hostfile has only {total} slots ({names}); "
                              "add slots=K to its lines or lower -n")
    counts: list[tuple[str, int]] = []
    left = n
    for h in hosts:
        if left == 0:
            break
        take = min(h.slots, left)
        counts.append((h.name, take))
        left -= take
    placements: list[Placement] = []
    for name, count in counts:
        for local in range(count):
            placements.append(Placement(len(placements), name, local, count))
    return placements
