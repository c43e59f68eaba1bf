"""The collectives `shmcoll-bench` times, one descriptor each (the type: descriptor.py), and their
registry COLLECTIVES.

To add a collective to the bench, write its descriptor here and list it in COLLECTIVES: the command
line, the table, the JSON, --check, --cold, --compare and --plot all follow from it.

Sizes and bus bandwidths follow nccl-tests' PERFORMANCE.md where it defines them: a size is the
whole output of all_gather, one rank's whole input (n blocks) of reduce_scatter and all_to_all,
else the buffer; busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter,
all_to_all), 1 (broadcast, reduce). gather and scatter are not in PERFORMANCE.md: their size is the
root's whole output / input and their factor (n-1)/n, as all_gather's (the root's own block does
not travel). all_gather_v and all_gather_object count as all_gather, broadcast_object as broadcast.
Check inputs are small integers every float type holds exactly (inputs.py), so the float64
reference is exact whatever order a library reduces in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmcoll import ProcessGroup
from shmcoll.types import ReduceKind

from .adapters import GlooGroup, MpiGroup, raw
from .buffers import output_buffers
from .descriptor import ROOT, Call, Collective, Payload, Sizing, block_bounds, returning, share
from .inputs import (
    BROADCAST_FILL,
    block_values,
    blocks_wrong,
    bytes_wrong,
    count_wrong,
    fill,
    payload,
    payload_values,
    reduce_expected,
    reduce_input,
    v_lengths,
)

# ---- typed arrays ----

class AllReduce(Collective):
    """Every rank gets the reduction of every rank's buffer, in place."""

    name, in_place, sizing, reduces = "all_reduce", "yes", Sizing.BUFFER, True

    def bus_factor(self, n: int) -> float:
        return 2 * share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: reduce_input(op, rank, n, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return count_wrong(buf, lambda i: reduce_expected(op, n, i))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.all_reduce(b, op) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        allreduce, in_place, mop = mpi.comm.Allreduce, mpi.MPI.IN_PLACE, mpi.ops[op]
        return [lambda b=b: allreduce(in_place, b, op=mop) for b in bufs]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        all_reduce, rop = g.dist.all_reduce, g.ops[op]
        return [lambda t=t: all_reduce(t, op=rop) for t in map(g.tensor, bufs)]


class AllGather(Collective):
    """Every rank gets every rank's block, in rank order (shmcoll returns a new array each call)."""

    name, in_place, sizing = "all_gather", "no", Sizing.OUTPUT_BLOCKS

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: block_values(rank, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return blocks_wrong(result, block_bounds(len(buf), n), block_values)

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.all_gather(b) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, mpi.world_size * len(bufs[0]))
        return [returning(o, mpi.comm.Allgather, raw(b), raw(o)) for b, o in zip(bufs, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, g.world_size * len(bufs[0]))
        return [returning(o, g.all_gather_single, g.tensor(o), g.tensor(b)) for b, o in zip(bufs, outs)]


class Broadcast(Collective):
    """The root's buffer into every rank's, in place."""

    name, in_place, sizing, rooted = "broadcast", "yes", Sizing.BUFFER, True

    def bus_factor(self, n: int) -> float:
        return 1.0

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        if rank == ROOT:
            fill(buf, lambda i: block_values(ROOT, i))
        else:
            buf.fill(BROADCAST_FILL)

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return count_wrong(buf, lambda i: block_values(ROOT, i))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.broadcast(ROOT, b) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        bcast = mpi.comm.Bcast
        return [lambda b=b: bcast(b, root=ROOT) for b in map(raw, bufs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        broadcast = g.dist.broadcast
        return [lambda t=t: broadcast(t, src=ROOT) for t in map(g.tensor, bufs)]


class Barrier(Collective):
    """No data: one row of size 0 and no bandwidth; "correct" means it returned on every rank."""

    name, in_place, sizing, payload = "barrier", "n/a", Sizing.NOTHING, Payload.NOTHING

    def bus_factor(self, n: int) -> None:
        return None

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        pass

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return 0

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [pg.barrier]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [mpi.comm.Barrier]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [g.dist.barrier]


class ReduceScatter(Collective):
    """Rank r gets block r of the reduction of every rank's n blocks."""

    name, in_place, sizing, reduces = "reduce_scatter", "no", Sizing.INPUT_BLOCKS, True

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: reduce_input(op, rank, n, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        block = len(buf) // n
        return count_wrong(result, lambda i: reduce_expected(op, n, i + rank * block)) + abs(len(result) - block)

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.reduce_scatter(b, op) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]) // mpi.world_size)
        return [returning(o, mpi.comm.Reduce_scatter_block, b, o, mpi.ops[op]) for b, o in zip(bufs, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]) // g.world_size)
        return [returning(o, g.reduce_scatter_single, g.tensor(o), g.tensor(b), g.ops[op])
                for b, o in zip(bufs, outs)]


class Reduce(Collective):
    """In place on the root; only the root's result is defined, so only the root's is checked."""

    name, in_place, sizing, reduces, rooted = "reduce", "yes", Sizing.BUFFER, True, True

    def bus_factor(self, n: int) -> float:
        return 1.0

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: reduce_input(op, rank, n, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return count_wrong(buf, lambda i: reduce_expected(op, n, i)) if rank == ROOT else 0

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.reduce(ROOT, b, op) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        reduce, mop = mpi.comm.Reduce, mpi.ops[op]
        if mpi.rank == ROOT:
            in_place = mpi.MPI.IN_PLACE
            return [lambda b=b: reduce(in_place, b, op=mop, root=ROOT) for b in bufs]
        return [lambda b=b: reduce(b, None, op=mop, root=ROOT) for b in bufs]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        reduce, rop = g.dist.reduce, g.ops[op]
        return [lambda t=t: reduce(t, dst=ROOT, op=rop) for t in map(g.tensor, bufs)]


class AllToAll(Collective):
    """Block s of rank r's result is block r of rank s's input."""

    name, in_place, sizing = "all_to_all", "no", Sizing.INPUT_BLOCKS

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: block_values(rank, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        block = len(buf) // n
        return (blocks_wrong(result, block_bounds(block, n), lambda s, i: block_values(s, i + rank * block))
                + abs(len(result) - len(buf)))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.all_to_all(b) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]))
        return [returning(o, mpi.comm.Alltoall, raw(b), raw(o)) for b, o in zip(bufs, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]))
        return [returning(o, g.dist.all_to_all_single, g.tensor(o), g.tensor(b)) for b, o in zip(bufs, outs)]


class Gather(Collective):
    """The root gets every rank's block in rank order; the others get None."""

    name, in_place, sizing, rooted = "gather", "no", Sizing.OUTPUT_BLOCKS, True

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: block_values(rank, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        if rank != ROOT:
            return 0 if result is None else 1
        return blocks_wrong(result, block_bounds(len(buf), n), block_values) + abs(len(result) - n * len(buf))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.gather(ROOT, b) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        gather = mpi.comm.Gather
        if mpi.rank != ROOT:
            return [lambda b=b: gather(b, None, root=ROOT) for b in map(raw, bufs)]
        outs = output_buffers(bufs, mpi.world_size * len(bufs[0]))
        return [returning(o, gather, raw(b), raw(o), ROOT) for b, o in zip(bufs, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """dist.gather into views of one output tensor (the root's), in rank order."""
        gather = g.dist.gather
        if g.rank != ROOT:
            return [lambda t=t: gather(t, None, dst=ROOT) for t in map(g.tensor, bufs)]
        outs = output_buffers(bufs, g.world_size * len(bufs[0]))
        return [returning(o, gather, g.tensor(b), list(g.tensor(o).chunk(g.world_size)), ROOT)
                for b, o in zip(bufs, outs)]


class Scatter(Collective):
    """Rank r gets block r of the root's input. shmcoll's non-roots pass None; MPI and gloo take a
    buffer of the root's size on every rank (they need the receive size; only the root's is read)."""

    name, in_place, sizing, rooted = "scatter", "no", Sizing.INPUT_BLOCKS, True

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        if rank == ROOT:
            fill(buf, lambda i: block_values(ROOT, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        block = len(buf) // n
        return count_wrong(result, lambda i: block_values(ROOT, i + rank * block)) + abs(len(result) - block)

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        sent = bufs if pg.rank == ROOT else [None] * len(bufs)
        return [lambda b=b: pg.scatter(ROOT, b) for b in sent]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]) // mpi.world_size)
        sent = [raw(b) for b in bufs] if mpi.rank == ROOT else [None] * len(bufs)
        return [returning(o, mpi.comm.Scatter, b, raw(o), ROOT) for b, o in zip(sent, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        outs = output_buffers(bufs, len(bufs[0]) // g.world_size)
        sent = [list(g.tensor(b).chunk(g.world_size)) for b in bufs] if g.rank == ROOT else [None] * len(bufs)
        return [returning(o, g.dist.scatter, g.tensor(o), s, ROOT) for s, o in zip(sent, outs)]


# ---- uneven lengths and pickled objects ----

class AllGatherV(Collective):
    """Uneven lengths: rank r sends v_lengths(count, n)[r] elements, 1 plus a share of the rest weighted
    r + 1; the result is the concatenation and every rank's length, both checked."""

    name, in_place, sizing = "all_gather_v", "no", Sizing.UNEVEN_BLOCKS

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: block_values(rank, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        out, lengths = result
        want = v_lengths(count, n)
        wrong = sum(int(a != b) for a, b in zip(list(lengths), want)) + abs(len(lengths) - n)
        wrong += abs(len(out) - count)
        return wrong + blocks_wrong(out, np.cumsum([0, *want]).tolist(), block_values)

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda b=b: pg.all_gather_v(b) for b in bufs]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """The lengths' Allgather (an MPI user must know them before Allgatherv, and shmcoll exchanges
        them inside each call too), then Allgatherv into a preallocated output."""
        lens = np.empty(mpi.world_size, np.int64)
        outs = output_buffers(bufs, sum(_mpi_lengths(mpi, len(bufs[0]), lens)))
        return [_mpi_allgatherv(mpi, b, o, lens) for b, o in zip(bufs, outs)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        """torch.distributed has no all_gather_v; as a gloo user would: exchange the lengths, copy the
        input into a buffer of the longest length, all_gather those, copy each rank's part out."""
        lengths = _gloo_lengths(g, len(bufs[0]))  # once: every buffer has this rank's length
        return [_gloo_padded_all_gather(g, b, lengths) for b in bufs]


def _mpi_lengths(mpi: MpiGroup, k: int, out: np.ndarray) -> list[int]:
    """Every rank's length: an Allgather of one int64 into `out`."""
    mpi.comm.Allgather(np.array([k], np.int64), out)
    return out.tolist()


def _mpi_allgatherv(mpi: MpiGroup, buf: np.ndarray, out: np.ndarray, lens: np.ndarray) -> Call:
    scale = buf.itemsize // raw(buf).itemsize  # 16-bit floats travel as twice as many bytes
    send, recv, allgatherv = raw(buf), raw(out), mpi.comm.Allgatherv

    def call() -> tuple[np.ndarray, list[int]]:
        lengths = _mpi_lengths(mpi, len(buf), lens)
        allgatherv(send, [recv, [k * scale for k in lengths]])
        return out, lengths
    return call


def _gloo_lengths(g: GlooGroup, k: int) -> list[int]:
    """Every rank's length: an all_gather of one int64."""
    torch = g.torch
    out = torch.empty(g.world_size, dtype=torch.int64)
    g.all_gather_single(out, torch.tensor([k], dtype=torch.int64))
    return out.tolist()


def _gloo_padded_all_gather(g: GlooGroup, buf: np.ndarray, lengths: list[int]) -> Call:
    longest, dtype = max(lengths), buf.dtype
    pad, out, joined = np.zeros(longest, dtype), np.empty(longest * g.world_size, dtype), np.empty(sum(lengths), dtype)
    pad_t, out_t = g.tensor(pad), g.tensor(out)

    def call() -> tuple[np.ndarray, list[int]]:
        now = _gloo_lengths(g, len(buf))
        pad[:len(buf)] = buf
        g.all_gather_single(out_t, pad_t)
        np.concatenate([out[r * longest:r * longest + k] for r, k in enumerate(now)], out=joined)
        return joined, now
    return call


def _objects(bufs: list[np.ndarray], sends: bool) -> list[bytes | None]:
    """The bytes object of each (uint8) buffer, built before the timed loop so that it pays the library's
    pickling, transfer and unpickling, not building the payload; None for a rank that sends nothing."""
    return [b.tobytes() for b in bufs] if sends else [None] * len(bufs)


class BroadcastObject(Collective):
    """The root's bytes object (a size is its length); every rank's result checked byte for byte."""

    name, in_place, sizing, payload, rooted = "broadcast_object", "no", Sizing.BUFFER, Payload.BYTES, True

    def bus_factor(self, n: int) -> float:
        return 1.0

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        if rank == ROOT:
            fill(buf, lambda i: payload_values(ROOT, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        return bytes_wrong(result, payload(ROOT, len(buf)))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda o=o: pg.broadcast_object(ROOT, o) for o in _objects(bufs, pg.rank == ROOT)]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        bcast = mpi.comm.bcast  # mpi4py's pickling broadcast
        return [lambda o=o: bcast(o, root=ROOT) for o in _objects(bufs, mpi.rank == ROOT)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [_gloo_broadcast_object(g, o) for o in _objects(bufs, g.rank == ROOT)]


def _gloo_broadcast_object(g: GlooGroup, obj: bytes | None) -> Call:
    broadcast_object_list = g.dist.broadcast_object_list

    def call() -> object:
        box = [obj]
        broadcast_object_list(box, src=ROOT)
        return box[0]
    return call


class AllGatherObject(Collective):
    """Every rank's bytes object (a size is all of them together, size/n bytes each), as a list."""

    name, in_place, sizing, payload = "all_gather_object", "no", Sizing.OUTPUT_BLOCKS, Payload.BYTES

    def bus_factor(self, n: int) -> float:
        return share(n)

    def fill_check_input(self, buf: np.ndarray, rank: int, n: int, op: ReduceKind) -> None:
        fill(buf, lambda i: payload_values(rank, i))

    def wrong_elements(self, result: Any, buf: np.ndarray, rank: int, n: int, op: ReduceKind, count: int) -> int:
        if not isinstance(result, list) or len(result) != n:
            return max(1, count)
        return sum(bytes_wrong(result[r], payload(r, len(buf))) for r in range(n))

    def shmcoll(self, pg: ProcessGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [lambda o=o: pg.all_gather_object(o) for o in _objects(bufs, True)]

    def openmpi(self, mpi: MpiGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        allgather = mpi.comm.allgather  # mpi4py's pickling all-gather
        return [lambda o=o: allgather(o) for o in _objects(bufs, True)]

    def gloo(self, g: GlooGroup, bufs: list[np.ndarray], op: ReduceKind) -> list[Call]:
        return [_gloo_all_gather_object(g, o) for o in _objects(bufs, True)]


def _gloo_all_gather_object(g: GlooGroup, obj: bytes | None) -> Call:
    all_gather_object, n = g.dist.all_gather_object, g.world_size

    def call() -> list[object]:
        out: list[object] = [None] * n
        all_gather_object(out, obj)
        return out
    return call


#: Every collective the bench runs, by name, in the order --help lists them.
COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    AllReduce(), AllGather(), Broadcast(), Barrier(), ReduceScatter(), Reduce(), AllToAll(), Gather(), Scatter(),
    AllGatherV(), BroadcastObject(), AllGatherObject(),
)}
