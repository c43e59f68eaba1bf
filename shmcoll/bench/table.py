"""What `shmcoll-bench` prints: the header, nccl-tests style rows, the footer, each peer's section,
the ratio table, and a transient progress line on a terminal.

Pure text (no collective runs here): rank 0 prints shmcoll's table with it as the rows come, the
spawning process the peers' sections and the ratios after their jobs (cli.py). A row is a Row or
its JSON form (a peer's rows arrive as JSON), and both print the same.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .adapters import OPENMPI
from .buffers import MAX_COLD_BUFFERS, capped_up_to, llc
from .descriptor import Payload
from .inputs import DTYPE_NAMES
from .measure import Spec
from .options import PROG
from .peer_jobs import PeerRun, ratios
from .results import Row

# (header, width): the data columns of nccl-tests, one mode (in-place or not, see the header line)
COLUMNS = (("size(B)", 12), ("count", 12), ("type", 9), ("redop", 6), ("time(us)", 11),
           ("algbw(GB/s)", 12), ("busbw(GB/s)", 12), ("#wrong", 7))
RATIO_WIDTH = 12


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def buffers_note(cold: bool, llc_bytes: int, llc_from: str) -> str:
    """What the timed loop's buffers were: warm (one, reused) or cold (rotating past the LLC)."""
    if not cold:
        return "buffers warm (one per size, reused by every call)"
    return (f"buffers cold (each call on the next of buffers totalling more than the {llc_bytes >> 20} MiB "
            f"last-level cache, {llc_from}; sizes up to {capped_up_to(llc_bytes)} B are capped at "
            f"{MAX_COLD_BUFFERS} buffers)")


def column_labels() -> str:
    return "#" + "".join(label.rjust(width) for label, width in COLUMNS)[1:]


def format_header(spec: Spec, world: int, transport: str) -> list[str]:
    coll = spec.collective
    dtype = {Payload.ARRAY: f"{spec.dtype_name} ({DTYPE_NAMES[spec.dtype_name]})",
             Payload.BYTES: "- (pickled bytes objects)", Payload.NOTHING: "-"}[coll.payload]
    buffers = "buffers n/a" if coll.payload is Payload.NOTHING else buffers_note(spec.cold, *llc())
    return [
        f"# {PROG}: collective {coll.name}, world size {world}, transport {transport}, dtype {dtype}, "
        f"op {spec.redop}, in-place {coll.in_place}",
        f"# iters {spec.iters}, warmup {spec.warmup}, max-time {spec.max_time:g} s, "
        f"check {'on' if spec.check else 'off'}, {buffers}",
        "#",
        column_labels(),
    ]


def _fields(row: Row | dict[str, Any]) -> dict[str, Any]:
    return row if isinstance(row, dict) else asdict(row)


def format_row(row: Row | dict[str, Any]) -> str:
    """One data line, right-aligned under column_labels(); a Row or its JSON form (peers' rows)."""
    r = _fields(row)
    cells = (str(r["size"]), str(r["count"]), r["type"], r["redop"], f"{r['time_us']:.2f}",
             _cell(r["algbw"], ".2f"), _cell(r["busbw"], ".2f"), "N/A" if r["wrong"] is None else str(r["wrong"]))
    return "".join(cell.rjust(width) for cell, (_, width) in zip(cells, COLUMNS))


def format_footer(rows: Sequence[Row | dict[str, Any]], check: bool) -> list[str]:
    lines = []
    fields = [_fields(r) for r in rows]
    if check:
        wrong = sum(r["wrong"] or 0 for r in fields)
        lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    bus = [r["busbw"] for r in fields if r["busbw"] is not None]
    if bus:
        lines.append(f"# Avg bus bandwidth    : {sum(bus) / len(bus):.4f} GB/s")
    return lines


def format_peer(run: PeerRun, n: int, check: bool) -> list[str]:
    """A peer's section under shmcoll's table: its status line, then (when it ran) the same columns."""
    if run.status != "ok":
        return ["#", f"# peer: {run.name}: {run.status}: {run.reason}"]
    how = "under mpirun" if run.name == OPENMPI else "started by shmcoll-run"
    return ["#", f"# peer: {run.name} ({run.library}): {n} ranks {how}, same sweep, timing and check, "
                 "run after shmcoll's", column_labels(), *map(format_row, run.rows), *format_footer(run.rows, check)]


def format_ratios(mine: list[dict[str, Any]], peers: list[PeerRun]) -> list[str]:
    """A short table: per size, shmcoll's time / each peer's that ran (below 1: shmcoll is faster)."""
    ran = [p for p in peers if p.rows]
    if not ran:
        return ["#", "# no peer ran: nothing to compare"]
    table = {p.name: ratios(mine, p.rows) for p in ran}
    lines = ["#", "# shmcoll time / peer time, per size (below 1: shmcoll is faster)",
             "#" + "size(B)".rjust(11) + "".join(p.name.rjust(RATIO_WIDTH) for p in ran)]
    for r in mine:
        cells = (table[p.name].get(r["size"]) for p in ran)
        lines.append(str(r["size"]).rjust(12) + "".join(("-" if c is None else f"{c:.3g}x").rjust(RATIO_WIDTH)
                                                         for c in cells))
    return lines


class Progress:
    """A transient line on stderr per size, only on a terminal; erased before the row is printed."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def show(self, k: int, total: int, size: int, coll: str) -> None:
        self.say(f"{coll} {size} B ({k}/{total}) ...")

    def say(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{PROG}: {text}\x1b[K")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
