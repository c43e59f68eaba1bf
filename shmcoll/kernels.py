"""Reduction kernels (``dst = op(dst, src)`` in place, per wire code and op) and the shared-memory
board's ordered words, waits and one-call steps: the Python face of ``shmcoll._native``.

Why C (``shmcoll/native/``): the loops run on every chunk a collective moves and the waits on every
message, so they must run near memory speed, order memory on every CPU (acquire loads, release
stores, futexes) and release the GIL, so a spawned all-reduce really overlaps the caller's work.
Compiled once when the package is installed, they cost a rank nothing to load, where a JIT costs
every process of a job its compiler (about 75 MiB and a second each).

Numerics (API.md, proved in native/reduce.c): each float16, bfloat16 and float32 step equals
"compute in float64, round once to nearest even"; 16-bit floats travel as uint16 bit patterns.
MIN/MAX propagate NaN like ``np.minimum``/``np.maximum`` and order -0.0 below +0.0; integer SUM and
PROD wrap around. ``scale_into`` (AVG's last step) divides in float64 and rounds once.
"""

from __future__ import annotations

import numpy as np

from shmcoll import _native

#: Where a board entry keeps its parts (native/board.h; transport/shm_layout.py lays entries out).
BOARD_HEADER_AT, BOARD_HEADER_BYTES, BOARD_SLEEPERS_AT, BOARD_PAYLOAD_AT = 8, 116, 124, 128
SRC_FIELD = (12, 16)  # bytes of the header that name the source rank: the one field ranks differ in
#: board_all_reduce's results besides a position to resume at (>= 0): done, or -(2 + r) when
#: rank r's entry describes another call.
BOARD_DONE = _native.BOARD_DONE

#: wait_word(mem, word, target, at_least, sleepers, spin_ns, slice_ns) -> bool: until u64 word
#: `word` of mem equals target (or, at_least, passes it), with acquire ordering. Spins for spin_ns,
#: then sleeps counted in u32 counter `sleepers`; False once slice_ns have passed without it (the
#: caller then looks for failures and waits again).
wait_word = _native.wait_word
#: store_and_wake(mem, word, value, sleepers): set u64 word `word` of mem to value, ordered after
#: every store before it; wake the sleepers counted in u32 counter `sleepers`.
store_and_wake = _native.store_and_wake
#: load_word(mem, word) -> int: u64 word `word` of mem, with acquire ordering.
load_word = _native.load_word
#: board_all_reduce(mem, data, header, where, rank, seq, code, op, position, spin_ns, slice_ns,
#: done_sleepers) -> status: one all-reduce on the board, from publishing our entry to marking it
#: read. data: this rank's 1-D input (storage dtype), reduced in place; header: our 116-byte frame
#: header (the step fills in the sequence number); where[r]: rank r's entry offsets for even and
#: odd sequence numbers and the index of its "done" word. Folds every entry in rank order, so every
#: rank computes bitwise the same result. Returns BOARD_DONE, -(2 + r) when rank r made another
#: call, or a position to call again with after a wait slice ran out.
board_all_reduce = _native.board_all_reduce
#: board_broadcast(mem, data, header, where, rank, seq, code, source, position, spin_ns, slice_ns,
#: done_sleepers) -> status: one broadcast on the board, as board_all_reduce but for args[7]: only
#: board rank `source` publishes its payload (data, which only it may pass read-only), and every other
#: rank copies it into data; a source past the last rank publishes nothing, and the ranks only meet.
#: Every rank still waits for every entry and compares its call.
board_broadcast = _native.board_broadcast
#: board_all_gather(mem, out, header, where, rank, seq, code, position, spin_ns, slice_ns,
#: done_sleepers) -> status: one all-gather on the board, as board_all_reduce but with no op: out
#: holds one block per board rank (len(out) // ranks bytes each, in board order), this rank's in
#: place; each rank publishes its own block (the header describes that block) and copies every
#: other rank's into place.
board_all_gather = _native.board_all_gather
#: board_gather_open(...) -> status: board_all_gather's arguments and step, but this rank's
#: reading of the call is not marked done: it goes on reading its peers' arrays, whose addresses
#: the blocks carry (algorithms/single_copy.py), and Board.finish marks it once the call is over.
#: The header is whatever the call's board entry describes (its array, not the block).
board_gather_open = _native.board_gather_open
#: address_of(buffer) -> the address of a contiguous buffer's first byte in this process: what a
#: rank publishes for peers to read or write (numpy's __array_interface__ builds a dict each time).
address_of = _native.address_of
#: read_peer(out, pid, address) -> 0, or the errno of the failed read: len(out) bytes of process
#: pid's memory from address into out (process_vm_readv; algorithms/single_copy.py).
read_peer = _native.read_peer
#: write_to_peers(own, peers, me, lo, hi) -> None, or (rank, errno) of the failed write: bytes [lo,
#: hi) of own (rank me's array, taken as bytes) written into every other rank's array at the same bytes
#: (peers as for reduce_from_peers), the next rank first (process_vm_writev).
write_to_peers = _native.write_to_peers
#: scale_to_peers(own, peers, me, lo, hi, code, divisor) -> None, or (rank, errno) of the failed
#: write: write_to_peers, each 128 KiB of own[lo:hi] (whole elements of float wire type `code`)
#: divided by divisor in place first (AVG's last step, as scale_into rounds), while in cache.
scale_to_peers = _native.scale_to_peers
#: reduce_from_peers(own, peers, me, lo, hi, code, op, scratch, deliver) -> None, or (rank, errno)
#: of the failed read or write: bytes [lo, hi) of every rank's array folded in rank order into
#: own[lo:hi] (own: rank me's array, any contiguous buffer, taken as bytes; peers[r]: rank r's
#: descriptor as it published it, PEER_BYTES of int64 words starting with its pid and the address
#: of its array: the rows Board.gather_open gathers), reading len(scratch) // 2 bytes of a peer at
#: a time into scratch. deliver 0 keeps the result in own; d >= 1 also divides each finished piece
#: by d where d > 1 (AVG, float codes) and writes it into every peer's array (process_vm_writev)
#: while it is still in cache.
reduce_from_peers = _native.reduce_from_peers
PEER_BYTES = _native.PEER_BYTES
#: swap_row(fds, srcs, ways, header, tag, seq, data, into, inbound, code, op, spin_ns, wait_ns,
#: left_ns) -> (status, done, sent): pairwise steps with TCP peers in a row (native/swap.h), step
#: i as byte i of ways says (WAY_*). A step that sends sends header, with the call's tag and
#: sequence number written in (frame.for_call), and data on socket fds[i]; one that receives waits
#: until that peer's frame (its header ours with srcs[i] as the source, its payload data's length)
#: is whole in the socket, reads it into inbound and folds it into data (data op theirs for
#: WAY_OWN_FIRST and WAY_FOLD_IN, theirs op data for WAY_THEIRS_FIRST; into must be data) or
#: copies it into `into` (WAY_TAKE, and WAY_SWAP, which sends too; data's length). WAY_OURS_EMPTY
#: or WAY_THEIRS_EMPTY added to a way that sends or receives without folding makes that frame
#: empty (the same header with no payload: a 1-D array's call), as a broadcast's step sends the
#: array one way and only meets the other.
#: Each wait lasts at most wait_ns, the row at most left_ns. done: the steps finished; status, of
#: the step that stopped the row: SWAP_SENT (whatever it sends went out, the peer's frame is not
#: there in time or another frame comes first: nothing was read); SWAP_PARTIAL (only `sent` bytes
#: went out); below 0, -errno of a failed send; SWAP_DONE when every step finished.
swap_row = _native.swap_row
SWAP_DONE, SWAP_SENT, SWAP_PARTIAL = _native.SWAP_DONE, _native.SWAP_SENT, _native.SWAP_PARTIAL
WAY_THEIRS_FIRST, WAY_OWN_FIRST = _native.WAY_THEIRS_FIRST, _native.WAY_OWN_FIRST
WAY_GIVE, WAY_TAKE, WAY_FOLD_IN = _native.WAY_GIVE, _native.WAY_TAKE, _native.WAY_FOLD_IN
WAY_SWAP, WAY_OURS_EMPTY, WAY_THEIRS_EMPTY = _native.WAY_SWAP, _native.WAY_OURS_EMPTY, _native.WAY_THEIRS_EMPTY
#: duplex(out_fd, header, data, in_fd, expect, beat, into, scratch, code, op, spin_ns, wait_ns,
#: progress, lead_bytes) -> status: one frame out on socket out_fd (header, then data) while a
#: peer's comes in on in_fd (native/duplex.h): its header byte for byte `expect`, the heartbeats
#: (`beat`) before it read and counted, its payload copied into `into` (op < 0) or read through
#: scratch and folded (into = into op theirs). Until the peer's frame is whole, at most lead_bytes
#: (> 0) of payload go out past what came of it. progress (int64[5]: sent, got, pending, in_state,
#: beats) carries one call over to the next. status: DUPLEX_DONE (both frames whole);
#: DUPLEX_PENDING (wait_ns ran out first); DUPLEX_ENDED (the incoming connection ended, maybe
#: mid-frame); DUPLEX_ELSEWHERE (another frame came first and is left in the socket, in_state
#: IN_ELSEWHERE: the caller drains that socket while it sends the rest, progress[0] bytes having
#: gone out); below 0, -errno of a failed send.
duplex = _native.duplex
#: duplex_row(steps, at, header, beats, tag, seq, data, scratch, code, op, spin_ns, wait_ns,
#: progress, host) -> status: duplexes in a row (native/duplex.h), each step with its own peers: steps
#: is int64 (count, DUPLEX_STEP_WORDS), a row per step of (out_fd, in_fd, src, out_at, out_bytes,
#: out_count, in_at, in_bytes, in_count, folds, lead_bytes, final): byte ranges of data and their
#: elements (what the frames' headers say), and whether no later step receives into the step's
#: received bytes again; header is ours for the call's 1-D
#: array (frame.pack), the native call writes in the tag, the sequence number and each frame's
#: size (and the source of the one it expects); beats holds each step's peer's heartbeat header.
#: From step at[0] on, which advances past each whole step (progress starting over), within
#: wait_ns in all: duplex's status of the step at at[0], DUPLEX_DONE once every step is whole.
#: host: None, or the host range data lies in (native/host_range.h), a tuple (own, peers, scratch,
#: words, me, lo, hi, piece, delivers): bytes [lo, hi) of own (the rank's whole array, taken as
#: bytes, data a view of it) are folded with (code, op) out of the arrays peers (as for
#: reduce_from_peers) describes, own's at position me, `piece` bytes at a time through scratch (two pieces), each just
#: before the row sends it or receives into it; where `delivers`, final steps' bytes are written
#: into the peers' arrays as they come. words (int64, zeros to start, HOST_FOLDED + one per piece):
#: HOST_DELIVERED bytes written, and where a read or write failed (status DUPLEX_HOST_FAILED) its
#: errno at HOST_ERROR and the peer's position at HOST_FAILED.
duplex_row = _native.duplex_row
#: host_range_fold(host, code, op) -> 0, or the errno of a failed read (words say whose): every
#: piece of a duplex_row host range not folded yet folded now.
host_range_fold = _native.host_range_fold
HOST_DELIVERED, HOST_ERROR, HOST_FAILED = _native.HOST_DELIVERED, _native.HOST_ERROR, _native.HOST_FAILED
HOST_FOLDED = _native.HOST_FOLDED
DUPLEX_STEP_WORDS = _native.DUPLEX_STEP_WORDS
DUPLEX_DONE, DUPLEX_PENDING, DUPLEX_ENDED = _native.DUPLEX_DONE, _native.DUPLEX_PENDING, _native.DUPLEX_ENDED
DUPLEX_ELSEWHERE, DUPLEX_HOST_FAILED = _native.DUPLEX_ELSEWHERE, _native.DUPLEX_HOST_FAILED
IN_WAITING, IN_BODY, IN_DONE = _native.IN_WAITING, _native.IN_BODY, _native.IN_DONE
IN_ELSEWHERE = _native.IN_ELSEWHERE
#: collapse_to_huge_pages(buffer) -> 0, or the errno: the whole 2 MiB pages inside a buffer
#: backed by huge pages now (MADV_COLLAPSE, Linux 6.1+), so a peer's read of it pins one
#: page per 2 MiB instead of 512. Contents do not change.
collapse_to_huge_pages = _native.collapse_to_huge_pages


#: reduce_into(dst, src, code, op): dst[i] = op(dst[i], src[i]) in place over contiguous storage
#: arrays (uint16 bits for f16/bf16) of any alignment; AVG reduces as SUM (the caller divides at the
#: end with scale_into). ValueError for a (code, op) with no loop or operands of different lengths.
#: Called once per chunk of every collective: the C function itself, no Python frame around it.
reduce_into = _native.reduce_into
#: scale_into(dst, code, divisor): dst[i] = dst[i] / divisor in float64, rounded once (float codes
#: only; AVG's last step).
scale_into = _native.scale_into


_F16_TO_F64, _BF16_TO_F64, _F64_TO_F16, _F64_TO_BF16 = range(4)  # native convert's kinds


def _convert(kind: int, values, in_dtype, out_dtype) -> np.ndarray:
    flat = np.ascontiguousarray(values, dtype=in_dtype)
    out = np.empty(flat.shape, dtype=out_dtype)
    _native.convert(kind, flat, out)
    return out


def f16_bits_to_f64(bits) -> np.ndarray:
    """float16 bit patterns (uint16) -> float64 values, exactly."""
    return _convert(_F16_TO_F64, bits, np.uint16, np.float64)


def bf16_bits_to_f64(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float64 values, exactly."""
    return _convert(_BF16_TO_F64, bits, np.uint16, np.float64)


def f64_to_f16_bits(values) -> np.ndarray:
    """float64 values -> float16 bit patterns, rounded once to nearest even."""
    return _convert(_F64_TO_F16, values, np.float64, np.uint16)


def f64_to_bf16_bits(values) -> np.ndarray:
    """float64 values -> bfloat16 bit patterns, rounded once to nearest even (no float32 step)."""
    return _convert(_F64_TO_BF16, values, np.float64, np.uint16)
