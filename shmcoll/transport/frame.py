"""Wire frames: a fixed 116-byte little-endian header, then `nbytes` of payload.

Pure functions, no I/O (tested alone). Every field is validated before the receiver allocates
anything, so a hostile or corrupt peer can at worst get its connection closed.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, NamedTuple

from ..types import WIRE_TYPES, Collective, ReduceKind

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"SHMC"
VERSION = 1
MAX_NDIM = 8
#: Largest payload a peer may announce (NetTransport's max_payload can lower it); bigger frames are hostile.
MAX_PAYLOAD = 1 << 40
MAX_CONTROL_PAYLOAD = 1 << 16

# kinds of frame
DATA = 1
ABORT = 2  # payload: utf-8 "<error class>\n<peer>\n<message>"
GOODBYE = 3  # the sender closes on purpose; not a failure
HEARTBEAT = 4  # "still alive": lets a timeout name the ranks that really went silent

_STRUCT = struct.Struct("<4s6BH4I3Q8Q")
HEADER_SIZE = _STRUCT.size
SRC_FIELD = (12, 16)  # byte range of the source rank in a packed header
_TAG = struct.Struct("<I")  # the tag, at TAG_AT
TAG_AT = 16
_SEQ = struct.Struct("<Q")  # meta.seq, at SEQ_AT
SEQ_AT = 28
NBYTES_AT = 44  # the payload's bytes (8, as meta.seq)
DIM0_AT = 52  # the payload's first dimension (8)

#: Meta.dtype of calls whose dtype only one rank knows (scatter: the root's data decides).
ROOTS_DTYPE = 0


class FrameError(ValueError):
    """A frame that breaks the protocol; the connection it came on must be closed."""


class Meta(NamedTuple):
    """What a collective frame says about the call that sent it, so ranks can detect mismatches.
    (Named tuples: built for every frame, so cheaper than dataclasses on the hot path.)"""

    seq: int = 0
    coll: int = 0  # a types.Collective (0: point-to-point)
    dtype: int = 0
    elements: int = 0  # elements of the whole collective call (not of this chunk)
    op: int = 0
    root: int = 0

    def numbered(self, seq: int) -> Meta:
        """This description with sequence number seq: _replace's result at a third of its cost (the
        common calls number their kept description at every call)."""
        return tuple.__new__(Meta, (seq, *self[1:]))


class Header(NamedTuple):
    kind: int
    src: int
    tag: int
    meta: Meta
    dtype: int  # element type of this frame's payload
    shape: tuple[int, ...]
    nbytes: int


def queue_tag(header: Header) -> int:
    """The tag a frame is queued and matched under: its tag, except that a point-to-point frame of
    a sub-group (split) carries the group's context in meta.seq (0 for the root group), which goes
    above the 32 tag bits, so sub-groups and the parent never take each other's send/recv frames."""
    if header.meta.coll == 0 and header.meta.seq:
        return header.tag | (header.meta.seq << 32)
    return header.tag


def pack(kind: int, src: int, tag: int, meta: Meta, dtype: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Serialise a header; the caller guarantees the fields are in range (they come from our own arrays)."""
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    return _STRUCT.pack(
        MAGIC, VERSION, kind, dtype, len(shape), meta.coll, meta.op, 0,
        src, tag, meta.root, meta.dtype, meta.seq, meta.elements, nbytes, *dims,
    )


def for_call(header: bytes | np.ndarray, tag: int, seq: int) -> bytes:
    """A packed header with another call's tag and sequence number written in: what
    kernels.swap_row sends from a header kept per kind of call."""
    out = bytearray(header)
    _TAG.pack_into(out, TAG_AT, tag)
    _SEQ.pack_into(out, SEQ_AT, seq)
    return bytes(out)


def without_payload(header: bytes) -> bytes:
    """The header of the same call's empty frame (a 1-D array's header with no bytes and a first
    dimension of 0): what kernels.swap_row sends for a step whose own frame is empty."""
    out = bytearray(header)
    _SEQ.pack_into(out, NBYTES_AT, 0)
    _SEQ.pack_into(out, DIM0_AT, 0)
    return bytes(out)


def unpack(raw: bytes | bytearray | memoryview, expected_src: int, max_payload: int = MAX_PAYLOAD) -> Header:
    """Parse and validate a header received from `expected_src`; raise FrameError on anything off."""
    if len(raw) != HEADER_SIZE:
        raise FrameError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    (magic, version, kind, dtype, ndim, coll, op, _flags,
     src, tag, root, meta_dtype, seq, count, nbytes, *dims) = _STRUCT.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"protocol version {version}, this side speaks {VERSION}")
    if src != expected_src:
        raise FrameError(f"frame claims source rank {src} on the connection of rank {expected_src}")
    if kind not in (DATA, ABORT, GOODBYE, HEARTBEAT):
        raise FrameError(f"unknown frame kind {kind}")
    if ndim > MAX_NDIM or any(dims[ndim:]):
        raise FrameError(f"bad ndim {ndim}")
    shape = tuple(dims[:ndim])
    _check_payload(kind, dtype, shape, nbytes, max_payload)
    meta = Meta(seq=seq, coll=coll, dtype=meta_dtype, elements=count, op=op, root=root)
    return Header(kind, src, tag, meta, dtype, shape, nbytes)


def _check_payload(kind: int, dtype: int, shape: tuple[int, ...], nbytes: int, max_payload: int) -> None:
    if kind != DATA:
        if nbytes > MAX_CONTROL_PAYLOAD:
            raise FrameError(f"control frame of {nbytes} bytes")
        return
    wire = WIRE_TYPES.get(dtype)
    if wire is None:
        raise FrameError(f"unknown dtype code {dtype}")
    if nbytes > max_payload:
        raise FrameError(f"payload of {nbytes} bytes exceeds the limit of {max_payload}")
    if math.prod(shape) * wire.itemsize != nbytes:
        raise FrameError(f"shape {shape} of {wire.name} does not hold {nbytes} bytes")


def describe_mismatch(got: Meta, want: Meta, src: int) -> str | None:
    """None when `got` (from rank `src`) matches the call this rank made, else a sentence saying how."""
    if got == want:
        return None
    return (f"at sequence number {want.seq} rank {src} called {describe_call(got)} (its sequence number "
            f"{got.seq}) but this rank called {describe_call(want)}")


def describe_call(m: Meta) -> str:
    """A collective call as a reader would write it: all_reduce(dtype=float32, count=4, op=SUM, root=0)."""
    if m.dtype in WIRE_TYPES:
        dtype = WIRE_TYPES[m.dtype].name
    else:
        dtype = "root's" if m.dtype == ROOTS_DTYPE else f"dtype#{m.dtype}"
    op = ReduceKind(m.op).name if m.op in ReduceKind._value2member_map_ else f"op#{m.op}"
    coll = Collective(m.coll).label if m.coll in Collective._value2member_map_ else f"collective#{m.coll}"
    return f"{coll}(dtype={dtype}, count={m.elements}, op={op}, root={m.root})"
