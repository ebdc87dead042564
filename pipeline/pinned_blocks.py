"""Power-of-two blocks that torch-pinned KV homes are carved from. torch's pinned allocator rounds
every allocation up to a power of two, so where torch must pin the homes (decode replay: CUDA
graphs capture copies only from memory torch pinned itself) the executor asks it for power-of-two
blocks and packs the homes into them (`carve`); the blocks' total, slack included, is what the
run pins (executor/pinned.HostArena) and what the memory model counts (pipeline/memory.breakdown).
Llama-3-8B at 512K + 4 tokens, 32 layer homes of 2 GiB + 16 KiB, takes 64 GiB + 4 GiB."""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4096   # page size; O_DIRECT alignment of addresses, offsets and lengths


def pow2_ceil(n: int) -> int:
    """The least power of two >= n (n >= 1): what torch's pinned allocator takes for n bytes."""
    assert n >= 1, n
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Carving:
    """Buffers packed into power-of-two blocks: `blocks[i]` bytes each; buffer j lies in block
    `places[j][0]` at byte offset `places[j][1]` (a multiple of ALIGN)."""

    blocks: tuple[int, ...]
    places: tuple[tuple[int, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.blocks)


def carve(sizes: list[int] | tuple[int, ...]) -> Carving:
    """Pack buffers of `sizes` bytes (each > 0) into few power-of-two blocks. Each block is the
    largest power of two not above the bytes still to place (the next one up when the largest
    remaining buffer is bigger), filled first-fit in decreasing size; offsets are ALIGN multiples.
    Every block's unused tail is smaller than the largest buffer: 32 equal buffers of just over
    2^k bytes take 2^(k+5) + 2^(k+1) bytes (31 buffers, then 1), not 32 * 2^(k+1)."""
    assert all(s > 0 for s in sizes), sizes
    padded = [-(-s // ALIGN) * ALIGN for s in sizes]
    left = sorted(range(len(sizes)), key=lambda j: (-padded[j], j))
    blocks: list[int] = []
    places: dict[int, tuple[int, int]] = {}
    while left:
        rest = sum(padded[j] for j in left)
        block = 1 << (rest.bit_length() - 1)           # the largest power of two <= rest
        if block < padded[left[0]]:
            block = pow2_ceil(padded[left[0]])
        at, kept = 0, []
        for j in left:
            if at + padded[j] <= block:
                places[j] = (len(blocks), at)
                at += padded[j]
            else:
                kept.append(j)
        blocks.append(block)
        left = kept
    return Carving(tuple(blocks), tuple(places[j] for j in range(len(sizes))))
