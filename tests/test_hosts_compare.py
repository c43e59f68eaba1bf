"""bench/hosts_compare.py for real, at its smallest: two namespace hosts with one rank each, two sizes,
one round. Checked: the table's shape, a positive time in every shmcoll cell, the JSON saying what
the table says, the three link figures (and no use of the link worked out below 16 MiB), and nothing
left of the namespaces. OpenMPI's and gloo's cells are checked only where that library is
installed, and no ratio's value ever: these machines are noisy. Needs root and `ip netns`,
skipped as tests/test_netns_hosts.py skips (SHMCOLL_REQUIRE_NETNS=1 makes that a failure).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
from test_netns_hosts import leftovers, require_netns

from shmcoll.bench.adapters import GLOO, OPENMPI
from shmcoll.bench.peer_jobs import missing_reason

from bounds import REAP_S, RUN_HANG_S
from harness import REPO, subprocess_env

pytestmark = pytest.mark.multiprocess

SCRIPT = REPO / "bench" / "hosts_compare.py"
ARGS = ["--layout", "2x1", "--sizes", "8,64K", "--rounds", "1", "--max-time", "0.1", "--link-seconds", "0.5",
        "--timeout", "20"]
HEADER = ("| size | shmcoll two-level (us) | shmcoll flat TCP (us) | OpenMPI (us) | gloo (us) "
          "| two-level / OpenMPI | two-level / gloo |")
COLUMNS = ["hier", "tcp", OPENMPI, GLOO]
TIME = re.compile(r"^\d+\.\d$")
RATIO = re.compile(r"^\d+\.\d\dx$")
GBPS = r"(\d+\.\d\d) GB/s"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run(tmp_path_factory, ARGS)


def _run(tmp_path_factory, args: list[str]):
    """The script's stdout and its JSON document; SIGTERM past the bound, so it still takes its hosts down."""
    require_netns()
    path = tmp_path_factory.mktemp("hosts") / "out.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, "--json", str(path)], cwd=REPO, text=True,
                            env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=RUN_HANG_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=REAP_S + 30)
        pytest.fail(f"hosts_compare.py outlived {RUN_HANG_S:g} s\n{out}\n{err[-3000:]}")
    assert proc.returncode == 0, out + err[-3000:]
    return out, json.loads(path.read_text())


def test_the_table_has_a_time_in_every_shmcoll_cell_and_says_what_the_json_says(run):
    out, doc = run
    lines = out.splitlines()
    assert lines[0].startswith("# $ ") and "hosts_compare.py --layout 2x1 --sizes 8,64K" in lines[0]
    table = [ln for ln in lines if ln.startswith("|")]
    assert table[0] == HEADER and table[1] == "|---" * 7 + "|", out
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in table[2:]]
    assert [row[0] for row in cells] == ["8 B", "64 KiB"]
    rows = doc["layouts"]["2x1"]["rows"]
    assert [r["size"] for r in rows] == [8, 65536]
    installed = {c: c in ("hier", "tcp") or missing_reason(c) is None for c in COLUMNS}
    for row, r in zip(cells, rows):
        for cell, col in zip(row[1:5], COLUMNS):
            if installed[col]:
                assert TIME.match(cell) and float(cell) > 0, (col, cell, out)
                assert cell == f"{r[col]:.1f}"
            else:
                assert cell == "n/a" and r[col] is None
        for cell, peer in zip(row[5:], (OPENMPI, GLOO)):
            if installed[peer]:
                assert RATIO.match(cell) and cell == f"{r[f'hier_over_{peer}']:.2f}x", (cell, out)
    columns = doc["layouts"]["2x1"]["columns"]
    assert columns["hier"]["transport"] == "hier (1 + 1 ranks on 2 hosts)"
    assert columns["tcp"]["transport"] == "tcp"
    assert all(columns[c]["status"] == ("ok" if installed[c] else "n/a") for c in COLUMNS), columns


def test_the_link_is_measured_and_the_hosts_are_gone(run):
    out, doc = run
    link = doc["link"]
    one = re.search(rf"^one way: (\S+) -> (\S+) {GBPS}$", out, re.M)
    both = re.search(rf"^both directions at once, per direction: \S+ -> \S+ {GBPS}, \S+ -> \S+ {GBPS}$", out, re.M)
    data = re.search(rf"^both directions at once through 64 MiB arrays, per direction: \S+ -> \S+ {GBPS}, "
                     rf"\S+ -> \S+ {GBPS}$", out, re.M)
    assert one and both and data, out
    assert float(one.group(3)) > 0 and one.group(3) == f"{link['one_way']['gbps']:.2f}"
    assert [both.group(1), both.group(2)] == [f"{x['gbps']:.2f}" for x in link["both"]]
    assert link["both_data_sized"]["span_bytes"] == 64 << 20
    assert [data.group(1), data.group(2)] == [f"{x['gbps']:.2f}" for x in link["both_data_sized"]["streams"]]
    assert all(x["gbps"] > 0 for x in link["both_data_sized"]["streams"])
    prefix = one.group(1)[:-1]
    assert one.group(2) == prefix + "2" and leftovers(prefix) == []
    assert doc["link_use"] == [] and "the link's use" not in out  # 64 KiB is no large all-reduce


def test_columns_left_out_are_never_started_and_links_have_the_rate_asked(tmp_path_factory):
    """--columns hier,openmpi: the other two cells say skipped (no time, no job run for them), and
    the JSON says why; shmcoll's two-level still has its times. --link-rate 1gbit: the hosts say
    so, and no stream between them moves more than 1 Gbit/s (125 MB/s) each way. An uneven layout
    (1+2) runs its ranks on hosts of those sizes: its table says so, and has its own times."""
    args = ["--layout", "2x1,1+2", *ARGS[2:], "--columns", "hier,openmpi", "--link-rate", "1gbit"]
    out, doc = _run(tmp_path_factory, args)
    assert re.search(r"^# hosts \S+ on \S+ \(tools/netns.sh\), links of 1gbit each way$", out, re.M), out
    assert doc["config"]["link_rate"] == "1gbit"
    link = doc["link"]
    figures = [link["one_way"], *link["both"], *link["both_data_sized"]["streams"]]
    assert all(0 < x["gbps"] <= 0.13 for x in figures), link
    columns = doc["layouts"]["2x1"]["columns"]
    assert [columns[c]["status"] for c in ("tcp", GLOO)] == ["skipped", "skipped"], columns
    assert columns["tcp"]["commands"] == columns[GLOO]["commands"] == []
    assert all(r["hier"] > 0 and r["tcp"] is None and r[GLOO] is None for r in doc["layouts"]["2x1"]["rows"])
    rows = [line for line in out.splitlines() if line.startswith("| 8 B") or line.startswith("| 64 KiB")]
    assert len(rows) == 4 and all(line.split(" | ")[2] == "skipped" == line.split(" | ")[4] for line in rows), out
    uneven = doc["layouts"]["1+2"]
    assert "## 2 hosts of 1 + 2 ranks (1+2): float32 SUM all_reduce" in out, out
    assert (uneven["hosts"], uneven["ranks_on_hosts"]) == (2, [1, 2])
    assert all(r["hier"] > 0 for r in uneven["rows"]), uneven["rows"]
    assert uneven["columns"]["hier"]["transport"] == "hier (1 + 2 ranks on 2 hosts)"


@pytest.mark.parametrize("collective, sizes, timed", [("broadcast", "64K", 65536), ("barrier", "8,64K", 0)])
def test_another_collective_is_timed_under_its_own_name(collective, sizes, timed, tmp_path_factory):
    """--collective broadcast or barrier: the ranks time that call (the table and the JSON say so),
    each shmcoll column with a time; a barrier in one row of size 0, whatever --sizes says. The
    peers' columns are left out: their jobs start the same way for every collective."""
    args = [*ARGS[:2], "--sizes", sizes, *ARGS[4:], "--collective", collective, "--columns", "hier,tcp"]
    out, doc = _run(tmp_path_factory, args)
    title = "barrier" if collective == "barrier" else f"float32 {collective}"
    assert f"## 2 hosts x 1 rank (2x1): {title}, time per call in us" in out, out
    assert doc["config"]["collective"] == collective
    rows = doc["layouts"]["2x1"]["rows"]
    assert len(rows) == 1 and rows[0]["size"] == timed and rows[0]["hier"] > 0 and rows[0]["tcp"] > 0, rows
