"""A window layer's GPU and host homes as rings (pipeline/windows.py sizes them): position p lives
at row p mod R, so a home of R = W - 1 + REWIND_TOKENS rows keeps what the window still sees
however long the run; reads and writes of a token range are at most two contiguous copies. The
bits attention sees never depend on the ring: a read hands the keys over in position order."""
from __future__ import annotations

import torch


def segments(a: int, b: int, ring: int) -> list[tuple[int, int, int]]:
    """(offset from a, row, count) of the contiguous pieces of positions [a, b) in a ring of
    `ring` rows (0: no ring, row = position)."""
    if b <= a:
        return []
    if not ring:
        return [(0, a, b - a)]
    out, p = [], a
    while p < b:
        row = p % ring
        n = min(b - p, ring - row)
        out.append((p - a, row, n))
        p += n
    return out


def read(home: torch.Tensor, a: int, b: int, ring: int, dst: torch.Tensor, non_blocking: bool = False) -> int:
    """Copy positions [a, b) of `home` [..., R, 2, D] into dst [..., b - a, 2, D]; returns bytes."""
    moved = 0
    for off, row, n in segments(a, b, ring):
        src = home[..., row:row + n, :, :]
        dst[..., off:off + n, :, :].copy_(src, non_blocking=non_blocking)
        moved += src.numel() * src.element_size()
    return moved


def write(home: torch.Tensor, src: torch.Tensor, a: int, ring: int, non_blocking: bool = False) -> int:
    """Write src [..., T, 2, D], positions [a, a+T), into `home` [..., R, 2, D]: in a ring only
    its last R tokens (the earlier ones no later query sees); returns bytes."""
    T = src.shape[-3]
    skip = max(0, T - ring) if ring else 0
    moved = 0
    for off, row, n in segments(a + skip, a + T, ring):
        part = src[..., skip + off:skip + off + n, :, :]
        home[..., row:row + n, :, :].copy_(part, non_blocking=non_blocking)
        moved += part.numel() * part.element_size()
    return moved


class RingMarks:
    """How far each ring layer has been written (the largest end position), so that a caller
    stepping back to n tokens learns whether the keys the next query sees are still home."""

    def __init__(self, rings: tuple[int, ...], windows: tuple[int, ...]) -> None:
        self.rings, self.windows = rings, windows
        self.top = [0] * len(rings)

    def wrote(self, layer: int, end: int) -> None:
        if self.rings and self.rings[layer]:
            self.top[layer] = max(self.top[layer], end)

    def holds(self, n: int) -> bool:
        """Whether every ring layer still holds the keys (n - W, n) a query at position n sees:
        none of them overwritten by a write R positions later."""
        return n == 0 or all(max(0, n - w + 1) >= t - r for r, w, t in zip(self.rings, self.windows, self.top) if r)

    def forget(self, n: int) -> None:
        """Tokens from n on are dropped; from 0, nothing in the rings is kept."""
        if n == 0:
            self.top = [0] * len(self.rings)
