"""The KV store: every (layer, KV head) unit's K/V in the tier `placement()` gave it (GPU or pinned
host RAM), plus the ring of GPU transfer slots that offloaded head groups are fetched into.

Layout, per layer, K and V interleaved per token so that one head's prefix is ONE contiguous
copy per sequence (the builder's `ops = batch * heads`):
  gpu[layer]   [B, n_res, S_cap, 2, D]  resident heads 0 .. n_res-1 (lowest indices first)
  host[layer]  [B, n_off, S_cap, 2, D]  offloaded heads n_res .. H-1, pinned on CUDA
  slots[i]     [B, G_max, S_cap, 2, D]  group head j at slot row j
Every buffer is allocated once (uninitialised: only written tokens are ever read), in `open()`,
for the whole workload; `close()` frees it all.
Copies are issued on the caller's current stream; ordering is the caller's business (the
graph's deps)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpipe.pipeline.plan import Tier, placement
from kvpipe.pipeline.stage import Graph


@dataclass(frozen=True)
class KVLayout:
    """Shapes of every KV buffer of one run. `resident[layer]` is the layer's count of GPU heads;
    `capacity` tokens per sequence (S_cap); `slots` x `slot_heads` is the transfer ring."""

    batch: int
    kv_heads: int
    head_dim: int
    capacity: int
    resident: tuple[int, ...]
    slots: int
    slot_heads: int

    def __post_init__(self) -> None:
        for f in ("batch", "kv_heads", "head_dim", "capacity"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}: must be positive, got {getattr(self, f)!r}")
        if any(not 0 <= n <= self.kv_heads for n in self.resident):
            raise ValueError(f"resident: counts must lie in 0..{self.kv_heads}, got {self.resident}")

    @classmethod
    def of(cls, graph: Graph) -> "KVLayout":
        m, w, plan = graph.model, graph.workload, graph.plan
        tiers = placement(m, plan)
        if any(t is Tier.DISK for t in tiers.values()):
            raise ValueError("disk tier: not supported by the executor yet")
        resident = tuple(sum(tiers[(layer, h)] is Tier.GPU for h in range(m.kv_heads))
                         for layer in range(m.layers))
        for layer, n in enumerate(resident):   # the layout relies on resident heads coming first
            assert all(tiers[(layer, h)] is (Tier.GPU if h < n else Tier.HOST) for h in range(m.kv_heads))
        phases = [plan.prefill] + ([plan.decode] if w.decode_tokens else [])
        offloaded = any(n < m.kv_heads for n in resident)
        return cls(w.batch, m.kv_heads, m.head_dim, w.kv_capacity, resident,
                   max(p.depth for p in phases) if offloaded else 0, max(p.group for p in phases))

    @property
    def layers(self) -> int:
        return len(self.resident)

    def unit_elems(self) -> int:
        """Elements of one unit's K/V for the whole capacity, all sequences."""
        return self.batch * self.capacity * 2 * self.head_dim


class KVStore:
    """The KV buffers of one run on `device` in `dtype`; a context manager (allocates on enter)."""

    def __init__(self, layout: KVLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.gpu: list[torch.Tensor | None] = []
        self.host: list[torch.Tensor | None] = []
        self.slots: list[torch.Tensor] = []

    # ---- lifetime ----------------------------------------------------------------------
    def open(self) -> "KVStore":
        lo = self.layout
        B, S, D, H = lo.batch, lo.capacity, lo.head_dim, lo.kv_heads
        gpu = dict(dtype=self.dtype, device=self.device)
        self.gpu = [torch.empty(B, n, S, 2, D, **gpu) if n else None for n in lo.resident]
        self.host = [torch.empty(B, H - n, S, 2, D, dtype=self.dtype, pin_memory=self.cuda)
                     if n < H else None for n in lo.resident]
        self.slots = [torch.empty(B, lo.slot_heads, S, 2, D, **gpu) for _ in range(lo.slots)]
        return self

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still read or write a buffer
        self.gpu, self.host, self.slots = [], [], []
        if self.cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # hand the pinned pages back instead of caching them

    def __enter__(self) -> "KVStore":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host if t is not None)

    @property
    def gpu_bytes(self) -> int:
        bufs = [t for t in self.gpu if t is not None] + self.slots
        return sum(t.numel() * t.element_size() for t in bufs)

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses of every buffer (a test checks they never change during a run)."""
        bufs = [t for t in self.gpu + self.host if t is not None] + self.slots
        return tuple(t.data_ptr() for t in bufs)

    # ---- compute-side access -----------------------------------------------------------
    def write_resident(self, layer: int, kv: torch.Tensor, start: int) -> None:
        """New K/V of a step, kv [B, H, T, 2, D]: the resident heads' part goes to their GPU home."""
        n, buf = self.layout.resident[layer], self.gpu[layer]
        T = kv.shape[2]
        assert kv.shape == (self.layout.batch, self.layout.kv_heads, T, 2, self.layout.head_dim), kv.shape
        assert start + T <= self.layout.capacity, (start, T, self.layout.capacity)
        if n:
            buf[:, :, start:start + T].copy_(kv[:, :n])

    def resident_prefix(self, layer: int, heads: tuple[int, ...], length: int) -> torch.Tensor:
        """[B, G, P, 2, D] view of resident heads' first `length` tokens, in place."""
        assert heads and heads[-1] < self.layout.resident[layer], (layer, heads)
        assert heads == tuple(range(heads[0], heads[0] + len(heads))), heads
        return self.gpu[layer][:, heads[0]:heads[-1] + 1, :length]

    def slot_prefix(self, slot: int, size: int, length: int) -> torch.Tensor:
        """[B, size, P, 2, D] view of a transfer slot holding a group of `size` heads."""
        assert size <= self.layout.slot_heads, (size, self.layout.slot_heads)
        return self.slots[slot][:, :size, :length]

    def fill_resident(self, layer: int, heads: tuple[int, ...], slot: int, length: int) -> None:
        """Mixed group: copy its resident heads' prefix into the slot (device to device)."""
        n = self.layout.resident[layer]
        res = [h for h in heads if h < n]
        if res:
            j0 = res[0] - heads[0]
            self.slots[slot][:, j0:j0 + len(res), :length].copy_(self.gpu[layer][:, res[0]:res[-1] + 1, :length])

    # ---- transfers (h2d / d2h lanes) ---------------------------------------------------
    def fetch(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """Copy the prefix [0, length) of offloaded `heads` from pinned host into the slot, head h
        at slot row h - base. One contiguous copy per (sequence, head); returns bytes moved."""
        n, host, dst = self.layout.resident[layer], self.host[layer], self.slots[slot]
        assert heads and heads[0] >= n and length <= self.layout.capacity, (layer, heads, n, length)
        moved = 0
        for b in range(self.layout.batch):
            for h in heads:
                src = host[b, h - n, :length]  # [P, 2, D], contiguous
                dst[b, h - base, :length].copy_(src, non_blocking=self.cuda)
                moved += src.numel() * src.element_size()
        return moved

    def store(self, layer: int, heads: tuple[int, ...], kv: torch.Tensor, start: int) -> int:
        """Copy the new K/V, kv [B, H, T, 2, D] (contiguous, on the GPU), of offloaded `heads` to
        their pinned home at [start, start+T). One copy per (sequence, head); returns bytes."""
        n, host = self.layout.resident[layer], self.host[layer]
        T = kv.shape[2]
        assert heads and heads[0] >= n and start + T <= self.layout.capacity, (layer, heads, n, start, T)
        assert kv.is_contiguous(), "new K/V must be contiguous for one copy per (sequence, head)"
        moved = 0
        for b in range(self.layout.batch):
            for h in heads:
                src = kv[b, h]  # [T, 2, D], contiguous
                host[b, h - n, start:start + T].copy_(src, non_blocking=self.cuda)
                moved += src.numel() * src.element_size()
        return moved


def k_of(buf: torch.Tensor) -> torch.Tensor:
    """K of an interleaved [..., P, 2, D] buffer: a strided [..., P, D] view."""
    return buf[..., 0, :]


def v_of(buf: torch.Tensor) -> torch.Tensor:
    return buf[..., 1, :]
