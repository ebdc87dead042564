"""A replayed step's window layers: which rows of a layer's home (a ring of R rows, position p at
row p mod R, or the whole capacity) hold the keys the step's query sees, in position order, and
where its own K/V goes, all computed on the device from the device-held position, so one captured
graph serves every step. The step gathers those W rows into the store's scratch buffer and attends
them with the length `lens` (the tail past it never read): the same keys, in the same order, for a
resident head (gathered from its home) and an offloaded one (from the whole ring fetched into a
slot), so placement changes no bit."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowIndex:
    """Device buffers of one (window, home rows) kind, rewritten by `refresh` each step.
    rows [W] long: the home rows of positions first .. first + W - 1 (mod `held`; those past the
    query's own are never attended); lens [1] int32: keys attended (pos - first + 1); cu_k (0, W)
    int32; write [1] long: the row of the step's own K/V (pos mod held)."""

    window: int
    held: int
    offsets: torch.Tensor   # [W] long: 0 .. W - 1
    rows: torch.Tensor
    lens: torch.Tensor
    cu_k: torch.Tensor
    write: torch.Tensor

    def refresh(self, pos: torch.Tensor) -> None:
        """This step's rows, length and write row from pos [1] long (device ops only: graph-safe)."""
        window_rows(pos, self.window, self.held, self.offsets, self.rows, self.lens, self.write)


def window_rows(pos: torch.Tensor, window: int, held: int, offsets: torch.Tensor, rows: torch.Tensor,
                lens: torch.Tensor, write: torch.Tensor) -> None:
    """Fill rows [W] with (first + j) mod held for j < W, lens [1] with pos - first + 1 and write [1]
    with pos mod held, where first = max(0, pos - W + 1) (layer_kinds.first_visible, HF's window)."""
    first = (pos - (window - 1)).clamp(min=0)            # [1]
    torch.remainder(offsets + first, held, out=rows)
    lens.copy_(pos - first + 1)
    torch.remainder(pos, held, out=write)


def open_windows(layout, device: torch.device) -> dict[int, WindowIndex]:
    """layer -> its WindowIndex for every layer whose window is shorter than the capacity (layers
    of one window and home size share one); {} without such layers."""
    kinds: dict[tuple[int, int], WindowIndex] = {}
    out: dict[int, WindowIndex] = {}
    for layer in range(layout.layers):
        w = layout.window(layer)
        if not w:
            continue
        key = (w, layout.held(layer))
        if key not in kinds:
            i32 = dict(dtype=torch.int32, device=device)
            kinds[key] = WindowIndex(w, key[1], torch.arange(w, dtype=torch.long, device=device),
                                     torch.zeros(w, dtype=torch.long, device=device), torch.ones(1, **i32),
                                     torch.tensor([0, w], **i32), torch.zeros(1, dtype=torch.long, device=device))
        out[layer] = kinds[key]
    return out


def gathered(scratch: torch.Tensor, src: torch.Tensor, win: WindowIndex) -> torch.Tensor:
    """src [1, G, rows, 2, D] (a home or a slot) -> its window's keys in position order,
    [1, G, W, 2, D], written into the front of `scratch` (contiguous there: index_select's out)."""
    G, D = src.shape[1], src.shape[-1]
    n = G * win.window * 2 * D
    assert src.shape[0] == 1 and scratch.numel() >= n, (src.shape, scratch.shape, win.window)
    out = scratch.view(-1)[:n].view(1, G, win.window, 2, D)
    torch.index_select(src, 2, win.rows, out=out)
    return out
