"""The congestion control of the connections between ranks (net/congestion.py).

On real sockets: "auto" turns BBR into cubic (reno where cubic is not allowed) and keeps anything
else, "system" keeps the kernel's choice, a name sets that algorithm, and a name the kernel does
not allow is refused before anything connects; a connection is given its algorithm before it
exists. Then in ranks over TCP: every connection a group opens has the algorithm
SHMCOLL_TCP_CONGESTION asks for.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from shmcoll.errors import InvalidArgument
from shmcoll.net.congestion import AUTO, SYSTEM, check_congestion, congestion_of, set_congestion
from shmcoll.net.sockets import connect_with_retry

from harness import RankFailed, run_ranks

PROC = Path("/proc/sys/net/ipv4")
KERNEL_DEFAULT = (PROC / "tcp_congestion_control").read_text().strip()
AVAILABLE = (PROC / "tcp_available_congestion_control").read_text().split()


def _allowed(name: str) -> bool:
    """Whether this process may give a socket `name` (root: any available; others: the allowed list)."""
    with socket.socket() as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            return True
        except OSError:
            return False


INSTEAD_OF_BBR = "cubic" if _allowed("cubic") else "reno"


@pytest.fixture
def fresh():
    """A TCP socket not connected yet, as set_congestion gets them."""
    with socket.socket() as sock:
        yield sock


def _set(sock, name: str) -> None:
    set_congestion(sock, name)
    assert congestion_of(sock) == name


def test_a_named_algorithm_is_set(fresh):
    assert set_congestion(fresh, "reno") == "reno"
    assert congestion_of(fresh) == "reno"


def test_auto_replaces_bbr_with_cubic_or_else_reno(fresh):
    if "bbr" not in AVAILABLE:
        pytest.skip(f"this kernel has no BBR to replace (available: {' '.join(AVAILABLE)})")
    _set(fresh, "bbr")
    assert set_congestion(fresh, AUTO) == INSTEAD_OF_BBR
    assert congestion_of(fresh) == INSTEAD_OF_BBR


@pytest.mark.parametrize("choice", [AUTO, SYSTEM])
def test_auto_and_system_keep_an_algorithm_that_does_not_pace(fresh, choice):
    _set(fresh, "reno")
    assert set_congestion(fresh, choice) == "reno"
    assert congestion_of(fresh) == "reno"


def test_system_keeps_bbr(fresh):
    if "bbr" not in AVAILABLE:
        pytest.skip(f"this kernel has no BBR (available: {' '.join(AVAILABLE)})")
    _set(fresh, "bbr")
    assert set_congestion(fresh, SYSTEM) == "bbr"


@pytest.mark.parametrize("choice", [AUTO, SYSTEM, "reno"])
def test_choices_the_kernel_allows_pass_the_check(choice):
    check_congestion(choice)


def test_a_name_the_kernel_does_not_know_is_refused():
    with pytest.raises(InvalidArgument, match="SHMCOLL_TCP_CONGESTION='nosuchalgorithm'.*does not allow it"):
        check_congestion("nosuchalgorithm")


def test_a_connection_is_prepared_before_it_exists():
    """connect_with_retry's prepare sees a socket with no peer yet, and what it set holds on the
    connection; the listener's setting holds on the connection it accepts."""
    seen = []

    def prepare(sock):
        with pytest.raises(OSError):
            sock.getpeername()
        seen.append(set_congestion(sock, "reno"))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        set_congestion(listener, "reno")
        with connect_with_retry(*listener.getsockname(), time.monotonic() + 10, prepare=prepare) as out:
            accepted, _ = listener.accept()
            with accepted:
                assert seen == ["reno"] and congestion_of(out) == "reno" == congestion_of(accepted)


def test_a_socket_option_the_kernel_refuses_fails_the_connect_at_once():
    """An OSError from prepare is raised by the first try, not retried until the deadline as a
    listener that is not up yet would be."""
    tries = []

    def prepare(sock):
        tries.append(sock.fileno())
        raise PermissionError(1, "not allowed to choose this algorithm")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(PermissionError, match="not allowed"):
            connect_with_retry(*listener.getsockname(), time.monotonic() + 60, prepare=prepare)
    assert len(tries) == 1


def _connections(pg) -> list[str]:
    return [congestion_of(sock) for sock in pg.transport._socks.values()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("choice, expected", [
    ("reno", "reno"), (SYSTEM, KERNEL_DEFAULT),
    (AUTO, INSTEAD_OF_BBR if KERNEL_DEFAULT.startswith("bbr") else KERNEL_DEFAULT)])
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
