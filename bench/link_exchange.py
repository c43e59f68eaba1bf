"""Exchanges both ways at once between two network-namespace hosts, per TCP congestion control.

    python bench/link_exchange.py [--sizes 1M,4M,16M] [--runs 6] [--congestion system,cubic,reno]

The step a large all-reduce across hosts repeats: each end sends a float32 array while it folds
the peer's into its own, in one native call (kernels.duplex, the transport's frame on the wire).
Every run is a fresh connection (tools/netns.sh makes two hosts, as bench/hosts_compare.py does),
since a congestion control's state, and under BBR the rate it paces at, belongs to a connection:
the table shows each run's time per exchange, so a bimodal algorithm shows as such.
net/congestion.py chooses for shmcoll's connections from what this prints.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

import numpy as np
from hosts_compare import namespaces, reap, run_together

from shmcoll import kernels
from shmcoll.bench.inputs import parse_float32_sizes
from shmcoll.net.congestion import check_congestion, set_congestion
from shmcoll.net.sockets import connect_with_retry
from shmcoll.transport import frame
from shmcoll.transport.frame import DATA, HEARTBEAT, Meta
from shmcoll.transport.tcp import duplex_lead
from shmcoll.types import F32, ReduceKind

PORT = 45124
CONNECT_S = 10.0
SPIN_NS = 200_000  # as the transport's native exchanges (config.native_spin_seconds)
WAIT_NS = 10**9
BYTES_PER_SIZE = 1 << 30  # timed exchanges at each size: this many bytes each way (a quarter more to warm up)


def connect(role: str, host: str, congestion: str) -> socket.socket:
    """The connection, born with `congestion` on this end ('system': the kernel's default): set on
    the listener and on the connecting socket, since a connection that starts under BBR keeps its
    timer pacing after a switch. An algorithm the kernel refuses stops the run at once."""
    check_congestion(congestion)
    if role == "listen":
        with socket.create_server(("", PORT)) as server:
            set_congestion(server, congestion)
            server.settimeout(CONNECT_S)
            sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        sock = connect_with_retry(host, PORT, time.monotonic() + CONNECT_S,
                                  prepare=lambda s: set_congestion(s, congestion))
    sock.setblocking(False)
    return sock


def exchange_us(sock: socket.socket, me: int, size: int) -> float:
    """Mean microseconds per exchange of `size` bytes each way, after a quarter as many untimed."""
    mine, into = np.ones(size // 4, np.float32), np.ones(size // 4, np.float32)
    header = frame.pack(DATA, me, 1, Meta(), F32.code, mine.shape, mine.nbytes)
    expect = frame.pack(DATA, 1 - me, 1, Meta(), F32.code, mine.shape, mine.nbytes)
    beat = frame.pack(HEARTBEAT, 1 - me, 0, Meta(), 0, (), 0)
    scratch = np.empty(256 << 10, np.uint8)
    lead = duplex_lead(sock)  # as NetTransport chooses

    def once() -> None:
        progress = np.zeros(5, np.int64)
        while kernels.duplex(sock.fileno(), header, mine, sock.fileno(), expect, beat, into, scratch, F32.code,
                             int(ReduceKind.SUM), SPIN_NS, WAIT_NS, progress, lead) == kernels.DUPLEX_PENDING:
            pass
    n = max(10, BYTES_PER_SIZE // size)
    for _ in range(max(5, n // 4)):
        once()
    t0 = time.perf_counter()
    for _ in range(n):
        once()
    return (time.perf_counter() - t0) / n * 1e6


def end(role: str, host: str, congestion: str, sizes: list[int]) -> int:
    """One end of one run: print {size: us per exchange} (the listening end)."""
    with connect(role, host, congestion) as sock:
        times = {size: exchange_us(sock, 0 if role == "listen" else 1, size) for size in sizes}
    if role == "listen":
        print(json.dumps(times), flush=True)
    return 0


def run(args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    """Each congestion control's runs, alternating between them run by run."""
    found: dict[str, dict[int, list[float]]] = {c: {s: [] for s in args.sizes} for c in args.congestion}
    sizes = ",".join(map(str, args.sizes))
    with namespaces(2) as hosts:
        print(f"# hosts {hosts.name(0)}..{hosts.name(1)} on {hosts.subnet}.0/24 (tools/netns.sh)", flush=True)
        ns = ["ip", "netns", "exec"]
        for _ in range(args.runs):
            for cc in args.congestion:
                cmds = [[*ns, hosts.name(0), sys.executable, __file__, "--end", "listen", "-", cc, sizes],
                        [*ns, hosts.name(1), sys.executable, __file__, "--end", "connect", f"{hosts.subnet}.1", cc,
                         sizes]]
                (rc, out, err), _ = run_together(cmds, args.timeout)
                reap(hosts)
                if rc != 0:
                    raise SystemExit(f"link_exchange.py: {cc}: exit {rc}: {err.strip()[-500:]}")
                for size, us in json.loads(out).items():
                    found[cc][int(size)].append(us)
    return found


def report(found: dict[str, dict[int, list[float]]]) -> None:
    print("| congestion | size | us per exchange, each run | median | GB/s each way (median) |")
    print("|---|---|---|---|---|")
    for cc, by_size in found.items():
        for size, times in by_size.items():
            med = statistics.median(times)
            print(f"| {cc} | {size >> 10} KiB | {' '.join(f'{t:.0f}' for t in times)} | {med:.0f} | "
                  f"{size / med / 1e3:.2f} |")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--end"]:
        return end(argv[1], argv[2], argv[3], [int(s) for s in argv[4].split(",")])
    p = argparse.ArgumentParser(prog="bench/link_exchange.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_float32_sizes, default=parse_float32_sizes("1M,4M,16M"),
                   help="bytes each way, K/M suffixes allowed (default 1M,4M,16M)")
    p.add_argument("--runs", type=int, default=6, help="connections per congestion control (default 6)")
    p.add_argument("--congestion", type=lambda s: s.split(","), default=["system", "cubic", "reno"],
                   help="comma-separated; system: the kernel's default (default system,cubic,reno)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before one run is killed")
    args = p.parse_args(argv)
    print(f"# $ {' '.join([sys.executable, *sys.argv])}")
    print(f"# kernel default: {open('/proc/sys/net/ipv4/tcp_congestion_control').read().strip()}")
    report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
