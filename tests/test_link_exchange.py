"""bench/link_exchange.py for real, at its smallest: two namespace hosts, two congestion controls,
one connection each, two sizes. Checked: a row per algorithm and size with as many positive times
as runs, and nothing left of the namespaces; never a time's value (these machines are noisy).
Needs root and `ip netns`, skipped as tests/test_netns_hosts.py skips (SHMCOLL_REQUIRE_NETNS=1
makes that a failure)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_netns_hosts import leftovers, require_netns

from bounds import RUN_HANG_S
from harness import REPO, subprocess_env

pytestmark = pytest.mark.multiprocess

ROW = re.compile(r"^\| (\w+) \| (\d+) KiB \| ([\d ]+) \| (\d+) \| (\d+\.\d\d) \|$")


def test_each_congestion_control_and_size_gets_a_time_per_run():
    require_netns()
    args = ["--sizes", "64K,256K", "--runs", "2", "--congestion", "system,reno", "--timeout", "60"]
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "link_exchange.py"), *args], cwd=REPO, text=True,
                          env=subprocess_env(), capture_output=True, timeout=RUN_HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [m.groups() for line in proc.stdout.splitlines() if (m := ROW.match(line))]
    assert [(cc, int(kib)) for cc, kib, *_ in rows] == [("system", 64), ("system", 256), ("reno", 64), ("reno", 256)]
    for _, _, runs, median, _ in rows:
        times = [int(t) for t in runs.split()]
        assert len(times) == 2 and min(times) > 0 and min(times) <= int(median) <= max(times)
    hosts = re.search(r"^# hosts (\w+)1\.\.(\w+)2 on ", proc.stdout, re.MULTILINE)
    assert hosts and hosts.group(1) == hosts.group(2) and leftovers(hosts.group(1)) == []
