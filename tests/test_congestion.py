"""The congestion control of the connections between ranks (net/congestion.py).

On real loopback connections: "auto" turns BBR into reno and keeps anything else, "system" keeps
the kernel's choice, a name sets that algorithm, and a name the kernel does not allow is refused
before anything connects. Then in ranks over TCP: every connection a group opens has the
algorithm SHMCOLL_TCP_CONGESTION asks for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shmcoll.errors import InvalidArgument
from shmcoll.net.congestion import AUTO, SYSTEM, check_congestion, congestion_of, set_congestion

from harness import RankFailed, run_ranks

PROC = Path("/proc/sys/net/ipv4")
KERNEL_DEFAULT = (PROC / "tcp_congestion_control").read_text().strip()
AVAILABLE = (PROC / "tcp_available_congestion_control").read_text().split()


def _set(sock, name: str) -> None:
    set_congestion(sock, name)
    assert congestion_of(sock) == name


def test_a_named_algorithm_is_set(pair):
    assert set_congestion(pair[0], "reno") == "reno"
    assert congestion_of(pair[0]) == "reno"


def test_auto_replaces_bbr_with_reno(pair):
    if "bbr" not in AVAILABLE:
        pytest.skip(f"this kernel has no BBR to replace (available: {' '.join(AVAILABLE)})")
    _set(pair[0], "bbr")
    assert set_congestion(pair[0], AUTO) == "reno"
    assert congestion_of(pair[0]) == "reno"


@pytest.mark.parametrize("choice", [AUTO, SYSTEM])
def test_auto_and_system_keep_an_algorithm_that_does_not_pace(pair, choice):
    _set(pair[0], "reno")
    assert set_congestion(pair[0], choice) == "reno"
    assert congestion_of(pair[0]) == "reno"


def test_system_keeps_bbr(pair):
    if "bbr" not in AVAILABLE:
        pytest.skip(f"this kernel has no BBR (available: {' '.join(AVAILABLE)})")
    _set(pair[0], "bbr")
    assert set_congestion(pair[0], SYSTEM) == "bbr"


@pytest.mark.parametrize("choice", [AUTO, SYSTEM, "reno"])
def test_choices_the_kernel_allows_pass_the_check(choice):
    check_congestion(choice)


def test_a_name_the_kernel_does_not_know_is_refused():
    with pytest.raises(InvalidArgument, match="SHMCOLL_TCP_CONGESTION='nosuchalgorithm'.*does not allow it"):
        check_congestion("nosuchalgorithm")


def _connections(pg) -> list[str]:
    return [congestion_of(sock) for sock in pg.transport._socks.values()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("choice, expected", [
    ("reno", "reno"), (SYSTEM, KERNEL_DEFAULT), (AUTO, "reno" if KERNEL_DEFAULT.startswith("bbr") else KERNEL_DEFAULT)])
def test_a_group_connects_under_the_algorithm_asked_for(choice, expected):
    env = {"SHMCOLL_TRANSPORT": "tcp", "SHMCOLL_TCP_CONGESTION": choice}
    assert run_ranks(3, _connections, env=env) == [[expected] * 2] * 3


@pytest.mark.multiprocess
def test_a_group_refuses_an_algorithm_the_kernel_does_not_allow():
    def init_error(pg) -> None:
        raise AssertionError("init should have refused SHMCOLL_TCP_CONGESTION")
    env = {"SHMCOLL_TRANSPORT": "tcp", "SHMCOLL_TCP_CONGESTION": "nosuchalgorithm"}
    with pytest.raises(RankFailed, match="InvalidArgument: SHMCOLL_TCP_CONGESTION='nosuchalgorithm'"):
        run_ranks(2, init_error, env=env)
