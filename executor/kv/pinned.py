"""Host buffers for the KV tiers: page-aligned, and on CUDA page-locked by registering exactly
their own bytes with the driver. torch's pinned allocator rounds every allocation up to a power
of two (a 2.5 GiB layer would pin 4 GiB), which a 1M-token host tier of ~90 GiB cannot afford.
A `HostArena` owns what it registered and unregisters it on `close()`.

Where torch must pin (decode replay, see `HostArena`), the arena asks it only for power-of-two
blocks, which torch does not round, and carves the buffers out of them (pipeline/pinned_blocks.carve,
the law the memory model counts too): Llama-3-8B at 512K + 4 tokens, 32 layer homes of 2 GiB +
16 KiB, pins 68 GiB, not the 128 GiB that one torch block per home would pin."""
from __future__ import annotations

import math

import torch

from kvpipe.pipeline.pinned_blocks import ALIGN, Carving, carve, pow2_ceil

__all__ = ["ALIGN", "Carving", "HostArena", "carve", "pow2_ceil", "release_cached_pinned"]


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


class HostArena:
    """Makes page-aligned host buffers, pinned when `pin` (CUDA); a context manager.

    With `torch_pinned`, `empty()`/`empties()` take torch's own pinned allocator instead of
    registering: torch refuses to capture a copy (CUDA-graph replay) from memory it did not pin
    itself, even when the driver has it registered, so decode replay needs torch-pinned KV homes.
    torch rounds each allocation up to a power of two, so the arena asks for power-of-two blocks
    and carves the buffers out of them (`carve`; plans that replay have no disk units; without
    `pin` the blocks are plain memory, as CPU tests run it). `reserved_bytes`: what the arena took
    from the system, the blocks' slack included (pinned on CUDA: the bytes the machine loses)."""

    def __init__(self, pin: bool, torch_pinned: bool = False) -> None:
        self.pin = pin
        self.torch_pinned = torch_pinned
        self.registered: list[torch.Tensor] = []
        self.blocks: list[torch.Tensor] = []   # torch-pinned blocks the buffers are views of

    @property
    def reserved_bytes(self) -> int:
        return sum(t.numel() for t in self.registered + self.blocks)

    def bytes(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes`, ALIGN-aligned, pinned when the arena pins."""
        buf = _aligned(nbytes)
        if self.pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"pinned memory: cudaHostRegister of {nbytes} bytes failed ({err})")
            self.registered.append(buf)
        return buf

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape`: in a registered buffer when the arena
        pins, else a plain allocation (no alignment needed off the disk path)."""
        return self.empties([shape], dtype)[0]

    def empties(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """`empty()` of each shape; torch-pinned ones carved out of shared power-of-two blocks."""
        numels = [math.prod(s) for s in shapes]
        if not self.torch_pinned:
            if not self.pin:
                return [torch.empty(s, dtype=dtype) for s in shapes]
            return [self.bytes(n * dtype.itemsize).view(dtype).view(s) for s, n in zip(shapes, numels)]
        out: list[torch.Tensor | None] = [torch.empty(s, dtype=dtype) if n == 0 else None
                                          for s, n in zip(shapes, numels)]
        sized = [j for j, n in enumerate(numels) if n]
        plan = carve([numels[j] * dtype.itemsize for j in sized])
        first = len(self.blocks)
        self.blocks += [torch.empty(b, dtype=torch.uint8, pin_memory=self.pin) for b in plan.blocks]
        for j, (b, at) in zip(sized, plan.places):
            nbytes = numels[j] * dtype.itemsize
            out[j] = self.blocks[first + b][at:at + nbytes].view(dtype).view(shapes[j])
        return out

    def close(self) -> None:
        """Unregister everything and drop the torch-pinned blocks (the caller has synchronised:
        no copy uses the buffers; the blocks return to torch once their views are gone)."""
        while self.registered:
            buf = self.registered.pop()
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self.blocks = []

    def __enter__(self) -> "HostArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release_cached_pinned() -> None:
    """Give torch's cached (freed, still pinned) host blocks back to the system, where this torch
    can (torch.accelerator.empty_host_cache); a no-op without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
        or getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()
