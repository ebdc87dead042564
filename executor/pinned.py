"""Host buffers for the KV tiers: page-aligned, and on CUDA page-locked by registering exactly
their own bytes with the driver. torch's pinned allocator rounds every allocation up to a power
of two (a 2.5 GiB layer would pin 4 GiB), which a 1M-token host tier of ~90 GiB cannot afford.
A `HostArena` owns what it registered and unregisters it on `close()`."""
from __future__ import annotations

import torch

ALIGN = 4096   # page size; O_DIRECT alignment of addresses, offsets and lengths


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


class HostArena:
    """Makes page-aligned host buffers, pinned when `pin` (CUDA); a context manager."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.registered: list[torch.Tensor] = []

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
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        n = 1
        for d in shape:
            n *= d
        return self.bytes(n * dtype.itemsize).view(dtype).view(shape)

    def close(self) -> None:
        """Unregister everything (the caller has synchronised: no copy uses the buffers)."""
        while self.registered:
            buf = self.registered.pop()
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def __enter__(self) -> "HostArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
