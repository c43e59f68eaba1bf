"""One process of bench/hosts_compare.py, started inside a network-namespace "host".

    hosts_rank.py shmcoll|openmpi|gloo OUT SIZES [--collective C] [--transport T] [--iters K] [--warmup K]
                  [--max-time S] [--algorithm one-shot|recursive-doubling|ring|halving-doubling]   (shmcoll only)
    hosts_rank.py recv PORT [--span BYTES]                one end of "the link": receive one stream, print its rate
    hosts_rank.py send HOST PORT SECONDS [--span BYTES]   the other end: send to HOST:PORT for SECONDS

A rank times a float32 SUM all_reduce (or --collective C), at each size with shmcoll.bench.measure.measure,
the loop shmcoll-bench and its OpenMPI and gloo peers use (warm-up, an iteration count every rank
agrees on, a barrier, the timed loop; the slowest rank's mean per call), so the columns differ only
in the library. Rank 0 writes {"library", "transport", "rows"} to OUT. shmcoll joins with
shmcoll.init() and gloo with shmcoll-run's variables (peers.py's adapter), OpenMPI through mpirun's.
`--algorithm A` makes every all-reduce cross hosts by A, at every size (bench/cost_model.py
measures each algorithm this way; see `force_algorithm`).
Large sizes get fewer warm-up calls (64 MiB's worth, at least 2): across hosts a 64 MiB call of gloo
takes a good part of a second, and 20 of them would be most of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from shmcoll.algorithms import select
from shmcoll.bench.adapters import GLOO, OPENMPI, SHMCOLL, open_group
from shmcoll.bench.collectives import COLLECTIVES
from shmcoll.bench.measure import Spec, measure
from shmcoll.bench.results import write_json
from shmcoll.config import ONE_SHOT_BYTES_VAR, load_tuning
from shmcoll.net.congestion import set_congestion
from shmcoll.net.sockets import connect_with_retry

WARMUP_BYTES = 64 << 20  # warm-up calls per size: at most this many bytes' worth (at least 2 calls)
CHUNK = 1 << 20          # one send or receive of the link
CONNECT_S = 20.0         # the link's ends wait this long for each other
#: The collectives a rank can time: those of an array, sized as shmcoll-bench sizes them, and the
#: barrier (one row of size 0).
TIMED = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "reduce", "all_to_all", "gather", "scatter",
         "barrier")
NEVER = 1 << 30          # more hosts, or bytes, than any job here has (and SHMCOLL_ONE_SHOT_BYTES's maximum)


@dataclasses.dataclass(frozen=True)
class Forcing:
    """select.py's knobs set so that one algorithm crosses hosts at every size. select reads its two
    host-count constants as module globals at each call, and one_shot_bytes from the environment at
    init (every rank sets the same, as the selection requires). A small-enough array (one_shot_bytes
    NEVER) runs TWO_LEVEL_ONE_SHOT, whose columns (or leaders) cross by ONE_SHOT or
    RECURSIVE_DOUBLING; a large one (one_shot_bytes 0) runs TWO_LEVEL, whose columns cross by RING
    or HALVING_DOUBLING. With one rank per host both are the crossing alone."""

    one_shot_max_hosts: int
    halving_from_hosts: int
    one_shot_bytes: int


FORCINGS = {
    "one-shot": Forcing(one_shot_max_hosts=NEVER, halving_from_hosts=NEVER, one_shot_bytes=NEVER),
    "recursive-doubling": Forcing(one_shot_max_hosts=1, halving_from_hosts=NEVER, one_shot_bytes=NEVER),
    "ring": Forcing(one_shot_max_hosts=NEVER, halving_from_hosts=NEVER, one_shot_bytes=0),
    "halving-doubling": Forcing(one_shot_max_hosts=NEVER, halving_from_hosts=2, one_shot_bytes=0),
}


def force_algorithm(name: str) -> None:
    """Before shmcoll.init(): every all-reduce of this process crosses hosts by FORCINGS[name]."""
    f = FORCINGS[name]
    select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS = f.one_shot_max_hosts, f.halving_from_hosts
    os.environ[ONE_SHOT_BYTES_VAR] = str(f.one_shot_bytes)


@contextmanager
def forced(name: str) -> Iterator[Forcing]:
    """FORCINGS[name]'s host-count constants in select.py for a while, in this process (to ask
    select what a forced job runs); one_shot_bytes is the caller's to pass in a Setting."""
    saved = select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS
    f = FORCINGS[name]
    select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS = f.one_shot_max_hosts, f.halving_from_hosts
    try:
        yield f
    finally:
        select.ONE_SHOT_MAX_HOSTS, select.HALVING_FROM_HOSTS = saved


def time_sizes(group, args: argparse.Namespace, library: str) -> list[dict]:
    """measure.measure at every size: the rows of shmcoll-bench's JSON form. The first size is
    measured twice, the first time untimed: a fresh job's first tenths of a second run slower
    (processes settling on the cores, TCP windows opening), which would count against the first
    size only (2 + 2 namespace ranks on 2 cores, 8 B: 100-150 us per call in the first 100 calls,
    about 45 from the 1000th on)."""
    spec = Spec(COLLECTIVES[args.collective], "f32", "sum", args.iters, args.warmup, False, args.max_time)
    rows = []
    for i, size in enumerate([*args.sizes[:1], *args.sizes]):
        warmup = max(2, min(args.warmup, WARMUP_BYTES // max(1, size)))
        row = measure(group, dataclasses.replace(spec, warmup=warmup), np.dtype(np.float32), size, library)
        if i:
            rows.append(row.to_json(warmup=warmup))
    return rows


def run_rank(args: argparse.Namespace) -> int:
    """Join the job of `args.library`, time every size, rank 0 writes OUT."""
    if args.library == SHMCOLL:
        import shmcoll

        if args.algorithm:
            force_algorithm(args.algorithm)
        with shmcoll.init(transport=args.transport) as pg:
            t = pg.transport
            where = t.name if t.topology is None else f"{t.name} ({t.topology.describe()})"
            rows = time_sizes(pg, args, SHMCOLL)
            if pg.rank == 0:
                write_json(args.out, {"library": f"shmcoll {shmcoll.__version__}", "transport": where,
                                      "algorithm": args.algorithm, "rows": rows})
        return 0
    group = open_group(args.library, args.timeout)
    try:
        rows = time_sizes(group, args, args.library)
        if group.rank == 0:
            write_json(args.out, {"library": group.library, "transport": "", "rows": rows})
    finally:
        group.close()
    return 0


def windows(span: int) -> Iterator[memoryview]:
    """CHUNK-sized windows of a filled array of `span` bytes, round and round: one window (span
    CHUNK) stays in cache; a span larger than the caches makes every send read memory and every
    receive write it, as a large collective's data does. Filled, since a never-written buffer maps
    the kernel's zero page, which no copy of real data matches."""
    data = np.ones(max(CHUNK, span // CHUNK * CHUNK), np.uint8).data
    while True:
        for at in range(0, len(data), CHUNK):
            yield data[at:at + CHUNK]


def recv(port: int, span: int) -> int:
    """Accept one stream on `port`, read it to its end into `span` bytes (windows); print its bytes
    and seconds from the first byte."""
    with socket.create_server(("", port)) as server:
        server.settimeout(CONNECT_S)
        conn, _ = server.accept()
    into = windows(span)
    with conn:
        conn.settimeout(CONNECT_S)
        conn.recv_into(next(into))  # the clock starts at the first byte, not at the connection
        t0, total = time.perf_counter(), 0
        while got := conn.recv_into(next(into)):
            total += got
        seconds = time.perf_counter() - t0
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)
    return 0


def send(host: str, port: int, seconds: float, span: int) -> int:
    """Connect to host:port (retrying while the receiver starts), send `span` bytes (windows) round
    and round for `seconds`, close; under the congestion control shmcoll's own connections take
    (SHMCOLL_TCP_CONGESTION)."""
    choice = load_tuning().tcp_congestion
    sock = connect_with_retry(host, port, time.monotonic() + CONNECT_S,
                              prepare=lambda s: set_congestion(s, choice))  # the sender's algorithm is the stream's
    data = windows(span)
    with sock:
        sock.settimeout(CONNECT_S)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(next(data))
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/hosts_rank.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    for library in (SHMCOLL, OPENMPI, GLOO):
        r = sub.add_parser(library)
        r.set_defaults(library=library)
        r.add_argument("out")
        r.add_argument("sizes", type=lambda s: [int(x) for x in s.split(",")], help="bytes, comma-separated")
        r.add_argument("--transport", default="auto", help="shmcoll only: hier, tcp, auto")
        r.add_argument("--iters", type=int, default=1000)
        r.add_argument("--warmup", type=int, default=20)
        r.add_argument("--max-time", dest="max_time", type=float, default=0.5)
        r.add_argument("--timeout", type=float, default=300.0, help="gloo's collective timeout (seconds)")
        r.add_argument("--collective", choices=TIMED, default="all_reduce")
        r.add_argument("--algorithm", choices=sorted(FORCINGS), default=None,
                       help="shmcoll only: cross hosts by this algorithm at every size (default: as select picks)")
    r = sub.add_parser("recv")
    r.add_argument("port", type=int)
    s = sub.add_parser("send")
    s.add_argument("host")
    s.add_argument("port", type=int)
    s.add_argument("seconds", type=float)
    for end in (r, s):
        end.add_argument("--span", type=int, default=CHUNK, help="bytes the stream cycles through (default 1 MiB)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.role == "recv":
        return recv(args.port, args.span)
    if args.role == "send":
        return send(args.host, args.port, args.seconds, args.span)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
