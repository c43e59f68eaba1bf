"""The congestion control of the TCP connections between ranks (SHMCOLL_TCP_CONGESTION).

A collective's connections run between hosts of one cluster, and it sends in bursts, both ways at
once. BBR, the default of some kernels, paces each connection with a timer per burst wherever no
fq qdisc does the pacing for it; once past its start-up phase it holds a connection near the rate
it last measured, and for bursts that is often half of what the link takes. Between two network
namespaces (bench/link_exchange.py, 6 connections each) a 4 MiB exchange both ways took 1.03 ms
on four connections under BBR and 2.3 ms on the other two; under cubic or reno 1.02 to 1.08 ms
on every one.

So AUTO replaces BBR with cubic, or with reno where this process may not choose cubic (any
process may choose reno), and keeps any other choice of the kernel's (dctcp on a fabric with ECN,
say). SYSTEM keeps the kernel's always. Any other value names the algorithm to use.

The choice must be made before a connection exists: on the listener (accepted connections are
born with its algorithm) and on a socket before it connects. A connection that starts under BBR
keeps the kernel's timer pacing after a switch, at the new algorithm's rate: switched to reno,
a 64 KiB all-reduce on 4 hosts of one rank sharing 2 cores took 230 us instead of 108.
"""

from __future__ import annotations

import socket

from ..errors import InvalidArgument

AUTO, SYSTEM = "auto", "system"
_PACED_PREFIX = "bbr"  # bbr, bbr2, bbr3
_INSTEAD_OF_PACED = ("cubic", "reno")
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
    """Give a listener or a socket not yet connected the algorithm `choice` asks for
    (check_congestion has passed): its name."""
    current = congestion_of(sock)
    if choice == SYSTEM or (choice == AUTO and not current.startswith(_PACED_PREFIX)):
        return current
    for name in _INSTEAD_OF_PACED if choice == AUTO else (choice,):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
            return name
        except OSError:
            if choice != AUTO:
                raise
    return current  # a kernel that lets us choose neither: a slower job, not a failed one


def congestion_of(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, _NAME_BYTES).split(b"\0")[0].decode()


def paced(sock: socket.socket) -> bool:
    """Whether a TCP connection runs under an algorithm that paces it with timers (BBR)."""
    try:
        return congestion_of(sock).startswith(_PACED_PREFIX)
    except OSError:
        return False  # not TCP
