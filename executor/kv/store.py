"""The KV store: every (layer, KV head) unit's K/V in the tier `placement()` gave it (GPU, pinned
host RAM or the disk file of `executor.disk.tier`), plus the ring of GPU transfer slots that offloaded
head groups are fetched into, and for disk units the host staging they pass through.

Layout, per layer, K and V interleaved per token so that one head's prefix is ONE contiguous
copy per sequence (the builder's `ops = batch * heads`); S: S_cap, or a window layer's ring (ring.py):
  gpu[layer]   [B, n_res, S, 2, D]   resident heads 0 .. n_res-1 (lowest indices first)
  host[layer]  [B, n_host, S, 2, D]  host heads n_res .. n_res+n_host-1, pinned on CUDA
  disk rows    one row per (layer, sequence, disk head), heads n_res+n_host .. H-1 (the top ones);
               a window layer's a ring row (disk/tier.py) where layout.disk_rings says so
  wstage[layer] [B, n_disk, W, 2, D] new K/V of disk heads on their way to disk (W: chunk)
  rstage[i]    [B, G_max, row]       disk heads' prefixes read for slot i (page-aligned rows; a ring
                                     row's window from the start of its first block)
  slots[i]     [B, G_max, S_slot, 2, D]  group head j at slot row j
Every buffer is allocated once (uninitialised: only written tokens are ever read), in `open()`,
for the whole workload; `close()` frees it all. Copies are issued on the caller's current
stream; ordering is the caller's business (the graph's deps)."""
from __future__ import annotations

import torch

from kvpipe.executor.disk.tier import DiskFile
from kvpipe.executor.kv.disk_lane import DiskLane
from kvpipe.executor.kv.layout import DiskOptions, KVLayout
from kvpipe.executor.kv.pinned import HostArena
from kvpipe.executor.kv import ring as rings

class KVStore(DiskLane):
    """The KV buffers of one run on `device` in `dtype`; a context manager (allocates on enter)."""

    def __init__(self, layout: KVLayout, device: torch.device, dtype: torch.dtype,
                 disk: DiskOptions | None = None, replay: bool = False) -> None:
        """`replay`: decode steps will be captured as CUDA graphs (the KV homes are then pinned
        by torch's allocator, which graph capture requires; see pinned.HostArena)."""
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.disk_opts = disk or DiskOptions()
        self.gpu: list[torch.Tensor | None] = []
        self.host: list[torch.Tensor | None] = []
        self.slots: list[torch.Tensor] = []
        self.disk: DiskFile | None = None
        self.wstage: list[torch.Tensor | None] = []
        self.rstage: torch.Tensor | None = None
        self.cstage: torch.Tensor | None = None
        self.row_base: list[int] = []
        self.q = None   # LOSSY: the quantised homes (executor/quant/store.py) when layout.quant_bits
        self.coded = None   # the compressed homes (executor/codecs/h2d_store.py) with an h2d codec
        self.sparse = None   # LOSSY: the sparse selection's state (executor/sparse/homes.py) when layout.sparse
        self.arena = HostArena(self.cuda, torch_pinned=replay)
        self.scratch: torch.Tensor | None = None   # a ring layer's resident window, in position order
        self.marks = rings.RingMarks(layout.rings, layout.windows)

    # ---- lifetime ----------------------------------------------------------------------
    def open(self) -> "KVStore":
        lo = self.layout
        B, S, D, H = lo.batch, lo.capacity, lo.head_dim, lo.kv_heads
        gpu = dict(dtype=self.dtype, device=self.device)
        self.gpu = [torch.empty(B, n, lo.held(i), 2, D, **gpu) if n else None for i, n in enumerate(lo.resident)]
        homed = [i for i, n in enumerate(lo.resident)
                 if n + lo.n_disk(i) < H and not lo.quant_bits and lo.h2d_codec == "none"]
        homes = self.arena.empties([(B, H - lo.resident[i] - lo.n_disk(i), lo.held(i), 2, D) for i in homed], self.dtype)
        self.host = [None] * lo.layers
        for i, t in zip(homed, homes):   # one call: torch-pinned homes share power-of-two blocks
            self.host[i] = t
        self.slots = [torch.empty(B, lo.slot_heads, lo.slot_tokens or S, 2, D, **gpu) for _ in range(lo.slots)]
        if lo.scratch_tokens:
            self.scratch = torch.empty(B, lo.slot_heads, lo.scratch_tokens, 2, D, **gpu)
        try:
            if any(lo.disk):
                self._open_disk()
            if lo.quant_bits:
                from kvpipe.executor.quant.store import QuantHomes
                self.q = QuantHomes(self, lo.quant_bits, lo.quant_group, lo.quant_vgroup)
            if lo.h2d_codec != "none":
                from kvpipe.executor.codecs.h2d_store import CompressedHomes
                self.coded = CompressedHomes(self, lo.h2d_codec)
            if lo.sparse is not None:
                from kvpipe.executor.sparse.homes import SparseHomes
                self.sparse = SparseHomes(self, lo.sparse)
        except BaseException:
            self.close()
            raise
        return self

    token_bytes = property(lambda self: 2 * self.layout.head_dim * self.dtype.itemsize)   # one unit's token, K and V

    def close(self) -> None:
        try:
            if self.cuda:
                torch.cuda.synchronize(self.device)  # no copy may still read or write a buffer
            if self.coded is not None:
                self.coded.close()
        finally:
            if self.disk is not None:
                self.disk.close()      # removes the file, whatever ended the run
            self.arena.close()   # unregisters (CUDA) and drops the carved blocks
        self.gpu, self.host, self.slots, self.wstage, self.rstage, self.cstage, self.scratch = [], [], [], [], None, None, None
        self.q = self.coded = self.sparse = None

    def __enter__(self) -> "KVStore":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def host_bytes(self) -> int:
        """Host buffers of the run: the host KV tier and, with disk units, their staging and tails."""
        bufs = [t for t in self.host + self.wstage if t is not None]
        if self.rstage is not None:
            bufs += [self.rstage, self.disk.tails] + ([self.cstage] if self.cstage is not None else [])
        return (sum(t.numel() * t.element_size() for t in bufs) + (self.q.host_bytes if self.q else 0)
                + (self.coded.host_bytes if self.coded else 0))

    @property
    def host_reserved_bytes(self) -> int:
        """Host bytes the arena pinned or carved: its share of `host_bytes` and the slack of the
        power-of-two blocks torch-pinned homes are carved from (pinned.carve); 0 on CPU runs."""
        return self.arena.reserved_bytes

    @property
    def gpu_bytes(self) -> int:
        bufs = [t for t in self.gpu if t is not None] + self.slots + ([self.scratch] if self.scratch is not None else [])
        return sum(t.numel() * t.element_size() for t in bufs) + (self.sparse.gpu_bytes if self.sparse else 0)

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
            self.marks.wrote(layer, start + T)
            rings.write(buf, kv[:, :n], start, self.layout.ring(layer))

    def resident_prefix(self, layer: int, heads: tuple[int, ...], length: int, first: int = 0) -> torch.Tensor:
        """[B, G, P - first, 2, D]: resident heads' tokens [first, length), a view in place (a ring
        layer's: copied into the scratch buffer in position order)."""
        assert heads and heads[-1] < self.layout.resident[layer], (layer, heads)
        assert heads == tuple(range(heads[0], heads[0] + len(heads))), heads
        home = self.gpu[layer][:, heads[0]:heads[-1] + 1]
        if not self.layout.ring(layer):
            return home[:, :, first:length]
        out = self.scratch[:, :len(heads), :length - first]
        rings.read(home, first, length, self.layout.ring(layer), out)
        return out

    def slot_prefix(self, slot: int, size: int, length: int) -> torch.Tensor:
        """[B, size, P, 2, D] view of a transfer slot holding a group of `size` heads."""
        assert size <= self.layout.slot_heads, (size, self.layout.slot_heads)
        return self.slots[slot][:, :size, :length]

    def fill_resident(self, layer: int, heads: tuple[int, ...], slot: int, length: int, first: int = 0) -> None:
        """Mixed group: copy its resident heads' tokens [first, length) into the slot (device to device)."""
        n = self.layout.resident[layer]
        res = [h for h in heads if h < n]
        if res:
            j0 = res[0] - heads[0]
            rings.read(self.gpu[layer][:, res[0]:res[-1] + 1], first, length, self.layout.ring(layer),
                       self.slots[slot][:, j0:j0 + len(res)])

    # ---- transfers (h2d / d2h lanes) ---------------------------------------------------
    def fetch(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int, first: int = 0) -> int:
        """Copy the tokens [first, length) of offloaded `heads` from pinned host (or the disk's
        read staging) into the slot's rows [0, length - first), head h at slot row h - base. One
        contiguous copy per (sequence, head), two where a ring wraps; returns bytes moved."""
        n, host, dst = self.layout.resident[layer], self.host[layer], self.slots[slot]
        first_disk, ring = self.layout.first_disk(layer), self.layout.ring(layer)
        assert heads and heads[0] >= n and length <= self.layout.capacity, (layer, heads, n, length)
        moved = 0
        for b in range(self.layout.batch):
            for h in heads:
                if h < first_disk:   # [R, 2, D] home, contiguous
                    moved += rings.read(host[b, h - n], first, length, ring, dst[b, h - base], self.cuda)
                    continue
                src = self._staged(layer, slot, b, h - base, first, length)
                dst[b, h - base, :length - first].copy_(src, non_blocking=self.cuda)
                moved += src.numel() * src.element_size()
        return moved

    def store(self, layer: int, heads: tuple[int, ...], kv: torch.Tensor, start: int) -> int:
        """Copy the new K/V, kv [B, H, T, 2, D] (contiguous, on the GPU), of offloaded `heads` to
        their pinned home at [start, start+T). One copy per (sequence, head); returns bytes."""
        n, host = self.layout.resident[layer], self.host[layer]
        first_disk = self.layout.first_disk(layer)
        T = kv.shape[2]
        assert heads and heads[0] >= n and start + T <= self.layout.capacity, (layer, heads, n, start, T)
        assert kv.is_contiguous(), "new K/V must be contiguous for one copy per (sequence, head)"
        moved, ring = 0, self.layout.ring(layer)
        self.marks.wrote(layer, start + T)
        for b in range(self.layout.batch):
            for h in heads:
                src = kv[b, h]  # [T, 2, D], contiguous
                if h < first_disk:   # a ring keeps only the tokens later queries see
                    moved += rings.write(host[b, h - n], src, start, ring, self.cuda)
                    continue
                self.wstage[layer][b, h - first_disk, :T].copy_(src, non_blocking=self.cuda)   # staged for kv_write
                moved += src.numel() * src.element_size()
        return moved


def k_of(buf: torch.Tensor) -> torch.Tensor:
    """K of an interleaved [..., P, 2, D] buffer: a strided [..., P, D] view."""
    return buf[..., 0, :]


def v_of(buf: torch.Tensor) -> torch.Tensor:
    return buf[..., 1, :]
