"""The results of a sweep: Row, one line of the table, and the JSON files rows are written to.

A Row's JSON form (to_json) is its fields plus the job's context (measure.Spec.json_context);
rank 0 writes a list of them for --json, or hands them to the process that spawned the job
(--rows-to); a peer's rank 0 writes {"library": ..., "rows": [...]} the same way (peers.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One line of the table (wrong is None without --check); to_json adds the job's context."""

    size: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw: float | None  # GB/s (1e9 bytes per second)
    busbw: float | None
    wrong: int | None
    iters: int
    buffers: int = 1  # distinct buffers the timed loop rotated through (1: warm)

    def to_json(self, **context: Any) -> dict[str, Any]:
        return {**asdict(self), **context}


def write_json(path: str, doc: object) -> None:
    """Replace `path` at once, so a reader never sees half a file."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
