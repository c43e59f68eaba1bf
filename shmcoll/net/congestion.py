"""The congestion control of the TCP connections between ranks (SHMCOLL_TCP_CONGESTION).

A collective's connections run between hosts of one cluster, and it sends in bursts, both ways at
once. BBR, the default of some kernels, paces each connection with a timer per burst wherever no
fq qdisc does the pacing for it; once past its start-up phase it holds a connection near the rate
it last measured, and for bursts that is often half of what the link takes. Between two network
namespaces (bench/link_exchange.py, 6 connections each) a 4 MiB exchange both ways took 1.04 to
1.07 ms on five connections under BBR and 2.38 ms on the sixth; under reno 1.04 to 1.07 ms on
every one; under cubic 1.05 to 1.44 ms.

So AUTO replaces BBR with reno (which every process may choose) and keeps any other choice of
the kernel's (cubic, or dctcp on a fabric with ECN). SYSTEM keeps the kernel's always. Any other
value names the algorithm to use.
"""

from __future__ import annotations

import socket

from ..errors import InvalidArgument

AUTO, SYSTEM = "auto", "system"
_PACED_PREFIX = "bbr"  # bbr, bbr2, bbr3
_INSTEAD_OF_PACED = "reno"
_NAME_BYTES = 16  # the kernel's TCP_CA_NAME_MAX


def check_congestion(choice: str) -> None:
    """Refuse, before anything connects, a named algorithm this kernel does not let us set."""
    if choice in (AUTO, SYSTEM):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, choice.encode())
        except OSError as exc:
            raise InvalidArgument(
                f"SHMCOLL_TCP_CONGESTION={choice!r}: this kernel does not allow it ({exc.strerror}); see "
                f"net.ipv4.tcp_allowed_congestion_control, or use {AUTO!r} or {SYSTEM!r}") from exc


def set_congestion(sock: socket.socket, choice: str) -> str:
    """Give a connection the algorithm `choice` asks for (check_congestion has passed): its name."""
    current = congestion_of(sock)
    if choice == SYSTEM or (choice == AUTO and not current.startswith(_PACED_PREFIX)):
        return current
    name = _INSTEAD_OF_PACED if choice == AUTO else choice
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError:
        if choice != AUTO:
            raise
        return current  # a kernel without reno for us: a slower job, not a failed one
    return name


def congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, _NAME_BYTES).split(b"\0")[0].decode()
