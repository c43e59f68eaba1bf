"""Which ranks share a host: the map the hierarchical algorithms plan their phases with.

Hosts are numbered by their lowest rank, and the ranks of a host are listed in rank order, so every
rank computes the same topology from the same host ids without talking. A rank's "local index" is
its position on its host; the "column" j is local index j of every host that has one. A large
all-reduce across hosts cuts its array into slices (as many as the smallest host has ranks, or the
largest); on each host every rank owns a run of them (slice_runs), and each slice crosses hosts
among its owners (slice_column): on hosts of one size, slice j is column j's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    hosts: tuple[tuple[int, ...], ...]  # ranks of each host, hosts ordered by their lowest rank
    host_of: tuple[int, ...]  # host index of each rank

    @classmethod
    def from_host_ids(cls, host_ids: Mapping[int, str]) -> Topology:
        """host_ids: rank -> host id string, for every rank 0..n-1."""
        order: dict[str, list[int]] = {}
        for rank in sorted(host_ids):
            order.setdefault(host_ids[rank], []).append(rank)
        hosts = tuple(tuple(ranks) for ranks in order.values())
        host_of = [0] * len(host_ids)
        for index, ranks in enumerate(hosts):
            for rank in ranks:
                host_of[rank] = index
        return cls(hosts, tuple(host_of))

    @classmethod
    def neighbourhoods(cls, n: int, size: int) -> Topology:
        """Ranks 0..n-1 cut into runs of consecutive ranks, about `size` each and as even as can be,
        planned with as if each run were a host: how a large all-reduce among many ranks of one host
        takes fewer sequential steps than one ring through them all."""
        parts = max(1, round(n / size))
        bounds = [n * i // parts for i in range(parts + 1)]
        return cls.from_host_ids({r: str(i) for i in range(parts) for r in range(bounds[i], bounds[i + 1])})

    @property
    def world_size(self) -> int:
        return len(self.host_of)

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    @functools.cached_property
    def min_local(self) -> int:
        """Ranks on the smallest host: how many columns every host can take part in."""
        return min(len(h) for h in self.hosts)

    @functools.cached_property
    def max_local(self) -> int:
        """Ranks on the largest host."""
        return max(len(h) for h in self.hosts)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def slice_runs(slices: int, ranks: int) -> tuple[range, ...]:
        """The slices each local index of a host of `ranks` owns, of `slices` (min_local or max_local):
        local index j < slices owns slice j where there are fewer slices than ranks (the rest own
        none), else each owns a run of consecutive ones, as even as can be."""
        if slices < ranks:
            return tuple(range(i, i + 1) if i < slices else range(slices, slices) for i in range(ranks))
        return tuple(range(slices * i // ranks, slices * (i + 1) // ranks) for i in range(ranks))

    def slice_column(self, s: int, slices: int) -> tuple[int, ...]:
        """The rank of every host that owns slice s of `slices` (min_local or max_local), in host
        order: those it crosses hosts among. Of min_local slices, slice s is column s."""
        return self._spread_columns[s] if slices > self.min_local else self.column(s)

    @functools.cached_property
    def _spread_columns(self) -> tuple[tuple[int, ...], ...]:
        """slice_column of max_local slices, worked out once: a large call across hosts asks every time."""
        m = self.max_local
        owners = [{s: h[i] for i, run in enumerate(self.slice_runs(m, len(h))) for s in run} for h in self.hosts]
        return tuple(tuple(owner[s] for owner in owners) for s in range(m))

    def local_ranks(self, rank: int) -> tuple[int, ...]:
        return self.hosts[self.host_of[rank]]

    def local_index(self, rank: int) -> int:
        return self.local_ranks(rank).index(rank)

    def leader(self, rank: int) -> int:
        """The lowest rank on rank's host: the one that talks to other hosts in leader-based phases."""
        return self.local_ranks(rank)[0]

    def leaders(self) -> tuple[int, ...]:
        return tuple(h[0] for h in self.hosts)

    def column(self, j: int) -> tuple[int, ...]:
        """Local index j of every host that has one, in host order."""
        return self._columns[j] if j < len(self._columns) else ()

    @functools.cached_property
    def _columns(self) -> tuple[tuple[int, ...], ...]:
        """Every column, worked out once: a large call across hosts asks for one every time."""
        return tuple(tuple(h[j] for h in self.hosts if j < len(h)) for j in range(max(map(len, self.hosts))))

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of[a] == self.host_of[b]

    def describe(self) -> str:
        return " + ".join(str(len(h)) for h in self.hosts) + f" ranks on {self.n_hosts} hosts"
