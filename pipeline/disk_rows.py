"""The disk tier's rows as the executor lays them out in its file (executor/disk/tier.py) and the
memory model counts them: one row per (layer, sequence, disk unit), of checksummed blocks. A full
layer's row is append-only: its full blocks lie in the file, the partial last one in RAM (the
row's tail). A window layer's row whose GPU and host units keep a ring (windows.rings) is a ring
of smaller blocks: logical block k of the row's byte stream at slot k mod n, n blocks enough for
the ring's R tokens beside the tail in RAM, so that the file holds what the window still sees."""
from __future__ import annotations

from .pinned_blocks import ALIGN, pow2_ceil

MAX_BLOCK = 1 << 20   # a full row's block: large enough for full-speed requests, small for the tail
RING_SLACK = 8        # a ring's block is at most 1/8 of its bytes: its blocks hold <= 1/8 more than R tokens


def block_bytes(write_bytes: int) -> int:
    """A full row's block: one step's write of a unit (the prefill chunk's K/V), as a power of
    two in [ALIGN, MAX_BLOCK]."""
    return min(max(pow2_ceil(max(write_bytes, 1)), ALIGN), MAX_BLOCK)


def ring_block_bytes(ring_bytes: int, block: int) -> int:
    """A ring row's block: the largest power of two in [ALIGN, block] at most ring_bytes / RING_SLACK."""
    b = ALIGN
    while 2 * b <= min(block, ring_bytes // RING_SLACK):
        b *= 2
    return b


def ring_blocks(ring_bytes: int, rblock: int) -> int:
    """Slots of a ring row: with the tail block in RAM, the last `ring_bytes` of the stream are
    always in the file's last ceil(ring_bytes / rblock) blocks or the tail."""
    return -(-ring_bytes // rblock)


def row_file_bytes(row_bytes: int, block: int, ring_bytes: int = 0) -> int:
    """Bytes one row takes in the file: a ring row (ring_bytes > 0) its slots, a full row of
    `row_bytes` its full blocks (the partial one stays in RAM)."""
    if ring_bytes:
        rb = ring_block_bytes(ring_bytes, block)
        return ring_blocks(ring_bytes, rb) * rb
    return row_bytes // block * block
