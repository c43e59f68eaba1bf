"""Time from fault to error, per failure scenario and transport, as a markdown table.

Runs tests/test_failures.py under pytest (a subprocess, with -s so its "[timing]" lines come out),
or reads a saved log, and tabulates those lines: one row per scenario, one column per transport,
each cell the largest time over the survivors (and over repeated runs) from the fault to the error,
then the largest time from the survivor's call to its error. The hierarchy over other simulated
host layouts than halves (first-alone, interleaved, each) gets rows of its own, in the hier column.

    python bench/fault_times.py                      # run the tests, print the table
    python bench/fault_times.py -k sigkill           # only some scenarios (pytest's -k)
    python bench/fault_times.py --save run.txt       # ...and keep pytest's whole output
    python bench/fault_times.py --log run.txt        # tabulate a saved `pytest -s` output

The fault is: the victim's SIGKILL or SIGSTOP, the victim's close() for a clean early exit, the
moment the last rank made its call for a mismatch; rendezvous scenarios have no fault instant and
show the call time only. Exit status: pytest's (0 when every test passed or xfailed).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILE = "tests/test_failures.py"
_LINE = re.compile(r"^\[timing\] (?P<label>\S+) \| (?P<scenario>.+?): (?P<ranks>rank \d+: .*)$")
_RANK = re.compile(r"rank (?P<rank>\d+): (?P<kind>\w+) call (?P<call>[\d.]+)s(?: fault (?P<fault>[\d.]+)s)?")
_ORDER = ["tcp", "shm", "hier", "any"]


@dataclass
class Cell:
    fault: float | None = None  # the largest fault-to-error time seen
    call: float = 0.0  # the largest call-to-error time seen
    survivors: int = 0  # ranks measured (over every repeat)
    kinds: set[str] = field(default_factory=set)

    def add(self, kind: str, call: float, fault: float | None) -> None:
        self.kinds.add(kind)
        self.survivors += 1
        self.call = max(self.call, call)
        if fault is not None:
            self.fault = fault if self.fault is None else max(self.fault, fault)

    def text(self) -> str:
        fault = "–" if self.fault is None else f"{self.fault:.3f}"
        return f"{fault} ({self.call:.3f})"


def parse(lines) -> dict[str, dict[str, Cell]]:
    """{scenario: {transport label: Cell}} from pytest output lines."""
    table: dict[str, dict[str, Cell]] = {}
    for line in lines:
        found = _LINE.match(line.strip())
        if not found:
            continue
        scenario, label = found["scenario"], found["label"]
        transport, _, hosts = label.partition(":")
        if hosts:  # the hierarchy over another simulated host layout: a row of its own, in hier's column
            scenario, label = f"{scenario}, hosts {hosts}", transport
        cell = table.setdefault(scenario, {}).setdefault(label, Cell())
        for rank in _RANK.finditer(found["ranks"]):
            fault = float(rank["fault"]) if rank["fault"] else None
            cell.add(rank["kind"], float(rank["call"]), fault)
    return table


def markdown(table: dict[str, dict[str, Cell]]) -> str:
    labels = sorted({label for row in table.values() for label in row},
                    key=lambda label: (_ORDER.index(label) if label in _ORDER else len(_ORDER), label))
    head = ["scenario", "error", *labels]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, row in table.items():
        kinds = sorted(set().union(*(cell.kinds for cell in row.values())))
        cells = [row[label].text() if label in row else "" for label in labels]
        rows.append("| " + " | ".join([scenario, ", ".join(kinds), *cells]) + " |")
    note = ("Each cell: the largest time over every survivor, in seconds, from the fault to its error "
            "(in parentheses: from its call to its error); – where the scenario has no fault instant.")
    return "\n".join(rows) + "\n\n" + note


def run_tests(extra: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", TEST_FILE, "-p", "no:cacheprovider", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, help="tabulate this saved `pytest -s` output instead of running the tests")
    parser.add_argument("--save", type=Path, help="write pytest's whole output here")
    parser.add_argument("-k", help="pytest -k expression: only these scenarios")
    args = parser.parse_args(argv)
    if args.log:
        status, output = 0, args.log.read_text()
    else:
        status, output = run_tests(["-k", args.k] if args.k else [])
        if args.save:
            args.save.write_text(output)
    table = parse(output.splitlines())
    if not table:
        print(output[-4000:], file=sys.stderr)
        print("no [timing] lines found", file=sys.stderr)
        return status or 1
    print(markdown(table))
    summary = [line for line in output.splitlines() if re.search(r"\b(passed|failed|error)\b", line)]
    if summary:
        print(f"\npytest: {summary[-1].strip('= ')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
