"""Real multi-host jobs on one machine: two network namespaces (tools/netns.sh) as two hosts, ranks
started with `shmcoll-run --hostfile ... --rsh "ip netns exec"`, every public collective checked
exactly by tests/programs/api_check.py. Ranks on different "hosts" have separate network stacks,
so whatever crosses between them really went over TCP through the bridge.

Needs root and `ip netns`; skipped otherwise, unless SHMCOLL_REQUIRE_NETNS=1 (CI), where a missing
capability is a failure: this test must not silently stop running.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from bounds import REAP_S, RUN_HANG_S
from harness import REPO, launcher_cmd, subprocess_env

pytestmark = pytest.mark.multiprocess

NETNS = REPO / "tools" / "netns.sh"
API_CHECK = REPO / "tests" / "programs" / "api_check.py"
OK_LINE = re.compile(r"^\[(\d+)\] OK rank=(\d+) world=(\d+) host=(\S+) transport=(\S+) netns=(\S+)$")


def _sh(*args: str, timeout: float = RUN_HANG_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (probed, not guessed)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the 'ip' command)"
    if shutil.which("bash") is None or shutil.which("flock") is None:
        return "tools/netns.sh needs bash and flock"
    probe = "scprobe" + secrets.token_hex(3)
    res = _sh("ip", "netns", "add", probe)
    _sh("ip", "netns", "del", probe)
    if res.returncode != 0:
        return f"'ip netns add' failed here: {res.stderr.strip()}"
    return None


def require_netns() -> None:
    """Skip where namespaces cannot be made here; fail instead under SHMCOLL_REQUIRE_NETNS=1
    (CI runs as root, where a skip would only hide a broken setup)."""
    reason = netns_unavailable()
    if reason is not None:
        if os.environ.get("SHMCOLL_REQUIRE_NETNS") == "1":
            pytest.fail(f"SHMCOLL_REQUIRE_NETNS=1 but {reason}")
        pytest.skip(reason)


def leftovers(prefix: str) -> list[str]:
    """Anything tools/netns.sh made for prefix that is still there."""
    found = [f"namespace {n}" for n in _sh("ip", "netns", "list").stdout.split() if n.startswith(prefix)]
    if _sh("ip", "link", "show", f"{prefix}-sw").returncode == 0:
        found.append(f"interface {prefix}-sw")
    found += [f"/etc/netns/{p.name}" for p in Path("/etc/netns").glob(f"{prefix}*")]
    if f"shmcoll-netns {prefix}" in Path("/etc/hosts").read_text():
        found.append("/etc/hosts block")
    if Path("/run/shmcoll-netns", prefix).exists():
        found.append("state file")
    return found


@pytest.fixture(scope="module")
def hosts():
    """The prefix of two fresh namespace hosts, PREFIX1 and PREFIX2; everything removed afterwards."""
    require_netns()
    prefix = "sc" + secrets.token_hex(3)  # unique per session: parallel runs never share names
    try:
        up = _sh("bash", str(NETNS), "up", "2", prefix)
        assert up.returncode == 0, up.stderr
        yield prefix
    finally:
        down = _sh("bash", str(NETNS), "down", prefix)
        assert down.returncode == 0, down.stderr
        assert leftovers(prefix) == []


def run_job(tmp_path: Path, hostfile: str) -> list[re.Match]:
    """api_check.py on the hostfile's hosts through `ip netns exec`; its OK lines, by rank."""
    (tmp_path / "hosts").write_text(hostfile)
    cmd = launcher_cmd("--hostfile", str(tmp_path / "hosts"), "--rsh", "ip netns exec", "--tag-output",
                       "--timeout", str(RUN_HANG_S), str(API_CHECK))  # the launcher stops a hung job itself
    res = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                         timeout=RUN_HANG_S + REAP_S)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-4000:]}"
    lines = [OK_LINE.match(ln) for ln in res.stdout.splitlines() if " OK " in ln]
    assert lines and all(m and m.group(1) == m.group(2) for m in lines), res.stdout  # tag = rank
    return sorted(lines, key=lambda m: int(m.group(1)))


def check_layout(oks: list[re.Match], layout: list[str]) -> None:
    """One OK per rank, each on the host the hostfile put it on, in that host's own network stack."""
    world = len(layout)
    assert [int(m.group(2)) for m in oks] == list(range(world))
    assert {int(m.group(3)) for m in oks} == {world}
    assert [m.group(4) for m in oks] == layout
    assert len({m.group(5) for m in oks}) == 1  # one transport for the whole job
    by_host = {}
    for m in oks:
        by_host.setdefault(m.group(4), set()).add(m.group(6))
    assert all(len(ids) == 1 for ids in by_host.values()), by_host  # one namespace per host...
    namespaces = {ids.pop() for ids in by_host.values()}
    assert len(namespaces) == len(by_host) == 2  # ...and a different one for each host
    assert str(os.stat("/proc/self/ns/net").st_ino) not in namespaces


def test_netns_tool_status_names_and_no_clobbering(hosts):
    status = _sh("bash", str(NETNS), "status", hosts)
    assert status.returncode == 0, status.stderr
    addrs = dict(re.findall(rf"^  ({hosts}\d) UP (\S+)/24$", status.stdout, re.M))
    assert sorted(addrs) == [f"{hosts}1", f"{hosts}2"], status.stdout
    assert _sh("getent", "hosts", f"{hosts}2").stdout.split()[0] == addrs[f"{hosts}2"]  # this namespace
    inside = _sh("ip", "netns", "exec", f"{hosts}1", "getent", "hosts", f"{hosts}2")  # a host's own view
    assert inside.stdout.split()[0] == addrs[f"{hosts}2"], inside.stderr
    again = _sh("bash", str(NETNS), "up", "2", hosts)
    assert again.returncode == 1 and "already up" in again.stderr


def _netns_up(prefix: str, rate: str) -> subprocess.CompletedProcess:
    return _sh("bash", str(NETNS), "up", "2", prefix, env={**os.environ, "NETNS_RATE": rate})


def test_hosts_get_links_of_a_rate_where_asked():
    """NETNS_RATE puts a token bucket of that rate on both ends of each host's veth pair (its
    sending and its receiving side); a rate tc would not read is refused before anything is made."""
    require_netns()
    if shutil.which("tc") is None:
        pytest.fail("tools/netns.sh's NETNS_RATE needs tc, which comes with iproute2")
    prefix = "sr" + secrets.token_hex(3)
    try:
        up = _netns_up(prefix, "200mbit")
        assert up.returncode == 0 and "links of 200mbit" in up.stdout, up.stderr
        for i in (1, 2):
            for where in (["-n", f"{prefix}{i}", "qdisc", "show", "dev", "eth0"],
                          ["-n", f"{prefix}sw", "qdisc", "show", "dev", f"h{i}"]):
                shown = _sh("tc", *where).stdout
                assert re.search(r"\btbf\b.* rate 200Mbit\b", shown), (where, shown)
    finally:
        assert _sh("bash", str(NETNS), "down", prefix).returncode == 0
    assert leftovers(prefix) == []
    bad = _netns_up(prefix, "fast")
    assert bad.returncode == 1 and "NETNS_RATE" in bad.stderr, bad.stderr
    assert leftovers(prefix) == []


def test_two_hosts_two_ranks_each(hosts, tmp_path):
    oks = run_job(tmp_path, f"{hosts}1 slots=2\n{hosts}2 slots=2\n")
    check_layout(oks, [f"{hosts}1", f"{hosts}1", f"{hosts}2", f"{hosts}2"])


def test_uneven_hosts_one_and_two(hosts, tmp_path):
    oks = run_job(tmp_path, f"{hosts}1 slots=1   # the rendezvous host\n{hosts}2 slots=2\n")
    check_layout(oks, [f"{hosts}1", f"{hosts}2", f"{hosts}2"])


@pytest.fixture
def first_host_named_loopback(hosts):
    """Inside its own namespace, host 1's name resolves to 127.0.1.1 first, as Debian's installer
    writes /etc/hosts; host 2 still resolves it to host 1's real address. Undone afterwards."""
    path = Path("/etc/netns") / f"{hosts}1" / "hosts"
    original = path.read_text()
    path.write_text(f"127.0.1.1 {hosts}1\n{original}")
    try:
        inside = _sh("ip", "netns", "exec", f"{hosts}1", "getent", "hosts", f"{hosts}1")
        assert inside.stdout.split()[0] == "127.0.1.1", inside
        yield hosts
    finally:
        path.write_text(original)


def test_a_rendezvous_name_that_is_loopback_on_its_own_host(first_host_named_loopback, tmp_path):
    """The ranks on rank 0's host reach the store over loopback; those on the other host over the
    bridge. The store and those ranks listen on every interface, so the job still forms."""
    hosts = first_host_named_loopback
    oks = run_job(tmp_path, f"{hosts}1 slots=2\n{hosts}2 slots=2\n")
    check_layout(oks, [f"{hosts}1", f"{hosts}1", f"{hosts}2", f"{hosts}2"])
