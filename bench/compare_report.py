"""The output half of bench/compare.py: the targets, the tables, the JSON document, the plot
(drawn by shmcoll-bench's own --plot code, shmcoll/bench/plot.py).

No process is started here; everything works on PeerResult objects, so it is testable alone.
A ratio is always of time per call measured in the same run: shmcoll/OpenMPI (lower is better,
the target is a ceiling) and gloo/shmcoll (shmcoll's speedup over gloo, the target is a floor).
The targets are the all-reduce speeds shmcoll is held to on a 2-core host: with 2 ranks, at 8 B
and 1 KiB at most 2x OpenMPI's time and at least 20x faster than gloo, at 64 KiB as fast as
OpenMPI and 20x faster than gloo, at 1, 16 and 64 MiB as fast as OpenMPI and 3x faster than gloo;
with 4 ranks on the 2 cores (oversubscribed), at most 2x OpenMPI's time up to 64 KiB and as fast
as OpenMPI from 1 MiB up. Other world sizes and sizes have none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shmcoll.bench import plot as bench_plot
from shmcoll.bench.plot import human

KIB, MIB = 1 << 10, 1 << 20
# The targets with 2 ranks on a 2-core host: size -> (max shmcoll/OpenMPI time, min gloo/shmcoll time)
TARGETS_N2 = {8: (2.0, 20.0), KIB: (2.0, 20.0), 64 * KIB: (1.0, 20.0),
              MIB: (1.0, 3.0), 16 * MIB: (1.0, 3.0), 64 * MIB: (1.0, 3.0)}
# With 4 ranks on the 2 cores (oversubscribed): size -> max shmcoll/OpenMPI time
TARGETS_N4 = {8: 2.0, KIB: 2.0, 64 * KIB: 2.0, MIB: 1.0, 16 * MIB: 1.0, 64 * MIB: 1.0}
MPI, GLOO = "openmpi", "gloo"


@dataclass
class PeerResult:
    """One peer's outcome: status ok / partial (some sizes failed) / skipped / failed, and its rows."""

    name: str                    # shmcoll-shm, shmcoll-tcp, openmpi, gloo
    status: str = "ok"
    reason: str = ""             # why skipped or failed (plain words, with the tool's own message)
    library: str = ""
    rows: dict[int, dict] = field(default_factory=dict)  # size in bytes -> the best row over rounds
    commands: list[str] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return bool(self.rows)

    def merge(self, rows: Iterable[dict]) -> None:
        """Keep, per size, the row with the lowest time (best of --rounds)."""
        for row in rows:
            old = self.rows.get(row["size"])
            if old is None or row["time_us"] < old["time_us"]:
                self.rows[row["size"]] = row


def targets(n: int, size: int) -> tuple[float | None, float | None]:
    """(max shmcoll/OpenMPI time, min gloo/shmcoll time) for n ranks at `size`; None where there is no target."""
    if n == 2:
        return TARGETS_N2.get(size, (None, None))
    if n == 4:
        return TARGETS_N4.get(size), None
    return None, None


def compare(n: int, shm: PeerResult, mpi: PeerResult | None, gloo: PeerResult | None, sizes) -> list[dict]:
    """One record per size for one shmcoll transport: the ratios and whether each target is met."""
    out = []
    for size in sizes:
        mine = shm.rows.get(size)
        theirs = mpi.rows.get(size) if mpi else None
        slow = gloo.rows.get(size) if gloo else None
        mpi_max, gloo_min = targets(n, size)
        r_mpi = mine["time_us"] / theirs["time_us"] if mine and theirs else None
        r_gloo = slow["time_us"] / mine["time_us"] if mine and slow else None
        out.append(dict(
            peer=shm.name, size=size,
            shmcoll_us=mine and mine["time_us"], openmpi_us=theirs and theirs["time_us"],
            gloo_us=slow and slow["time_us"],
            shmcoll_over_openmpi=r_mpi, openmpi_target_max=mpi_max,
            openmpi_target_met=None if r_mpi is None or mpi_max is None else r_mpi <= mpi_max,
            gloo_over_shmcoll=r_gloo, gloo_target_min=gloo_min,
            gloo_target_met=None if r_gloo is None or gloo_min is None else r_gloo >= gloo_min))
    return out


# ---- text ----

def _num(value, fmt: str, width: int, unit: str = "") -> str:
    return ("-" if value is None else format(value, fmt) + unit).rjust(width)


def _met(flag) -> str:
    return {True: "yes", False: "NO", None: "-"}[flag]


def times_table(peers: list[PeerResult], sizes, n: int) -> list[str]:
    """size, then time per call (us) and busbw (GB/s) per peer that ran."""
    ran = [p for p in peers if p.ran]
    widths = [max(12, len(p.name) + 5) for p in ran]
    lines = [f"# time per call (us, lower is better) and busbw (GB/s) = size/time * 2(n-1)/n = size/time * "
             f"{2 * (n - 1) / n:g}",
             "#" + "size".rjust(11) + "".join(f"{p.name + ' us':>{w}}{'GB/s':>9}" for p, w in zip(ran, widths))]
    for size in sizes:
        cells = []
        for p, w in zip(ran, widths):
            row = p.rows.get(size)
            cells.append(_num(row and row["time_us"], ".2f", w) + _num(row and row["busbw"], ".3f", 9))
        lines.append(human(size).rjust(12) + "".join(cells))
    return lines


def ratio_table(records: list[dict], n: int) -> list[str]:
    """One shmcoll transport against OpenMPI and gloo, with the targets."""
    name = records[0]["peer"]
    scope = {2: "the targets for n=2", 4: "the targets for 4 ranks on 2 cores"}.get(n, f"no target for n={n}")
    lines = [f"# {name}: ratios of time per call in this run; {scope}",
             "#" + "size".rjust(11) + f"{'shmcoll/openmpi':>17}{'target':>9}{'met':>5}"
             f"{'gloo/shmcoll':>14}{'target':>9}{'met':>5}"]
    for r in records:
        mpi_t = "-" if r["openmpi_target_max"] is None else f"<={r['openmpi_target_max']:g}x"
        gloo_t = "-" if r["gloo_target_min"] is None else f">={r['gloo_target_min']:g}x"
        lines.append(human(r["size"]).rjust(12)
                     + _num(r["shmcoll_over_openmpi"], ".2f", 17, "x") + mpi_t.rjust(9)
                     + _met(r["openmpi_target_met"]).rjust(5)
                     + _num(r["gloo_over_shmcoll"], ".2f", 14, "x") + gloo_t.rjust(9)
                     + _met(r["gloo_target_met"]).rjust(5))
    met = [r[k] for r in records for k in ("openmpi_target_met", "gloo_target_met")]
    judged = [m for m in met if m is not None]
    lines.append(f"# {name}: {sum(judged)} of {len(judged)} targets met"
                 + (f" ({met.count(None)} not judged: no target or a peer missing)" if None in met else ""))
    return lines


# ---- files ----

def write_json(path: str, config: dict, peers: list[PeerResult], comparison: list[dict]) -> None:
    doc = dict(config=config,
               peers={p.name: dict(status=p.status, reason=p.reason, library=p.library, commands=p.commands)
                      for p in peers},
               rows=[dict(row, peer=p.name) for p in peers for _, row in sorted(p.rows.items())],
               comparison=comparison)
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def plot(path: str, peers: list[PeerResult], n: int) -> str:
    """busbw against size, log-log, one line per peer; returns a message for the user."""
    lines = {p.name: list(p.rows.values()) for p in peers}
    _, message = bench_plot.plot(path, lines, f"all-reduce bus bandwidth, {n} ranks on one host",
                                 "message size (float32 SUM all-reduce, in place)")
    return message
