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

import os

import torch

from kvpipe.pipeline.disk_rows import block_bytes, ring_block_bytes

from kvpipe.executor.disk.tier import ALIGN, DiskFile, aligned_buffer, default_kv_dir
from kvpipe.executor.disk.frames import FramedDiskFile
from kvpipe.executor.kv.layout import DiskOptions, KVLayout
from kvpipe.executor.kv.pinned import HostArena
from kvpipe.executor.kv import ring as rings

class KVStore:
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

    @property
    def row_stride(self) -> int:
        """Bytes of a read staging row: the longest read of a layer with disk units (a full row's
        whole length, a ring row's window from the start of its first block)."""
        lo, tb = self.layout, self.token_bytes
        spans = [(lo.windows[i] - 1) * tb + ring_block_bytes(lo.disk_ring(i) * tb, self.disk_block)
                 if lo.disk_ring(i) else lo.capacity * tb for i in range(lo.layers) if lo.n_disk(i)]
        return -(-max(spans, default=0) // ALIGN) * ALIGN

    def _open_disk(self) -> None:
        lo, opts = self.layout, self.disk_opts
        B, D, W = lo.batch, lo.head_dim, lo.write_tokens
        self.row_base = [B * sum(lo.disk[:i]) for i in range(lo.layers)]
        self.wstage = [self.arena.empty((B, d, W, 2, D), self.dtype) if d and not lo.quant_bits else None
                       for d in lo.disk]
        wbytes = W * self.token_bytes
        if lo.quant_bits:   # LOSSY: a step writes quantised records (executor/quant/store.py)
            from kvpipe.executor.quant.blocks import BlockCodec
            wbytes = max(1, W // lo.quant_group) * BlockCodec(lo.quant_bits, lo.quant_group, D, self.dtype,
                                                              lo.quant_vgroup).record
        self.disk_block = opts.block_bytes or block_bytes(wbytes)
        self.rstage = self.arena.bytes(lo.slots * B * lo.slot_heads * self.row_stride)
        codec = None
        if lo.disk_codec != "none":
            from kvpipe.executor.codecs import load
            codec = load(lo.disk_codec)
            self.cstage = aligned_buffer(self.rstage.numel(), pin=False)   # stored frames, as read
        args = (opts.kv_dir or default_kv_dir(), B * sum(lo.disk), lo.capacity * self.token_bytes, self.disk_block,
                opts.threads, self.cuda)
        rings = tuple(lo.disk_ring(i) * self.token_bytes for i in range(lo.layers) for _ in range(B * lo.n_disk(i)))
        self.disk = DiskFile(*args, rings=rings if any(rings) else ()) if codec is None else \
            FramedDiskFile(*args, codec, self.dtype.itemsize)
        self.disk.open()

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

    disk_bytes = property(lambda self: self.disk.file_bytes if self.disk is not None else 0)

    def disk_bytes_by_layer(self) -> list[int]:
        """Bytes each layer's disk rows take in the file."""
        lo = self.layout
        return [sum(self.disk.row_file_bytes(self.row_base[i] + j) for j in range(lo.batch * lo.n_disk(i)))
                if self.disk is not None else 0 for i in range(lo.layers)]

    def disk_file_json(self, kinds: list[str]) -> dict:
        """The disk file's size on disk (st_size) and its bytes per layer kind (`kinds`, one a layer)."""
        by_kind: dict[str, int] = {}
        for kind, n in zip(kinds, self.disk_bytes_by_layer()):
            by_kind[kind] = by_kind.get(kind, 0) + n
        return {"file_bytes": os.fstat(self.disk.fd).st_size, "file_bytes_by_kind": by_kind}

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

    # ---- disk lane -----------------------------------------------------------------------
    def _rstage_row(self, slot: int, b: int, j: int, length: int) -> torch.Tensor:
        """[P, 2, D] view of the read staging row of slot `slot`, sequence b, group row j."""
        lo = self.layout
        at = ((slot * lo.batch + b) * lo.slot_heads + j) * self.row_stride
        return self.rstage[at:at + length * self.token_bytes].view(self.dtype).view(length, 2, lo.head_dim)

    def _read_from(self, layer: int, first: int) -> int:
        """The byte of a disk row a read of tokens from `first` starts at: 0, or in a ring row the
        start of the block holding `first` (reads start on a block)."""
        if not self.layout.disk_ring(layer):
            return 0
        B = self.disk.block[self.row_base[layer]]
        return first * self.token_bytes // B * B

    def _staged(self, layer: int, slot: int, b: int, j: int, first: int, length: int) -> torch.Tensor:
        """[length - first, 2, D] view of tokens [first, length) in the read staging of slot
        `slot`, sequence b, group row j: a row's prefix, or a ring row's read from its block."""
        if not self.layout.disk_ring(layer):
            return self._rstage_row(slot, b, j, length)[first:]   # full rows are read from 0
        lo = self.layout
        at = ((slot * lo.batch + b) * lo.slot_heads + j) * self.row_stride
        at += first * self.token_bytes - self._read_from(layer, first)
        n = (length - first) * self.token_bytes
        return self.rstage[at:at + n].view(self.dtype).view(length - first, 2, lo.head_dim)

    def _row(self, layer: int, b: int, h: int) -> int:
        return self.row_base[layer] + b * self.layout.n_disk(layer) + h - self.layout.first_disk(layer)

    def _read_items(self, layer, heads, base, slot, length):
        """(row, staging bytes[, first byte]) of each disk head's read (a ring row's from the block
        holding its window's first token), and the rows' frame staging."""
        lo = self.layout
        assert heads and heads[0] >= lo.first_disk(layer), (layer, heads)
        start = self._read_from(layer, lo.disk_first(layer, length))   # 0 but in a ring row
        items, frames = [], []
        for b in range(lo.batch):
            for h in heads:
                row0 = ((slot * lo.batch + b) * lo.slot_heads + h - base) * self.row_stride
                dst = self.rstage[row0:row0 + length * self.token_bytes - start]
                item = (self._row(layer, b, h), memoryview(dst.numpy()))
                items.append(item + (start,) if start else item)
                if self.cstage is not None:   # same place in the frame staging
                    frames.append(memoryview(self.cstage[row0:row0 + self.row_stride].numpy()))
        return items, frames

    def disk_read(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """Read the tokens [first, length) of disk `heads` (first: 0, or a ring row's window's
        first, layout.disk_first) into the read staging of `slot` (head h at group row h - base),
        verifying every block (with a codec: their frames, for `disk_decode`); returns bytes
        read from the file (raw: the tokens' bytes delivered)."""
        items, frames = self._read_items(layer, heads, base, slot, length)
        if frames:
            return self.disk.read(items, frames)
        self.disk.read(items)
        return len(items) * (length - self.layout.disk_first(layer, length)) * self.token_bytes

    def disk_decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """Decode the frames `disk_read` fetched into the read staging of `slot`; returns raw bytes."""
        items, frames = self._read_items(layer, heads, base, slot, length)
        self.disk.decode(items, frames)
        return sum(len(mv) for _, mv in items)

    def disk_flush(self, layer: int, heads: tuple[int, ...]) -> int:
        """Write the frames `disk_write` encoded (with a codec); returns bytes written."""
        return self.disk.flush([self._row(layer, b, h) for b in range(self.layout.batch) for h in heads])

    def disk_write(self, layer: int, heads: tuple[int, ...], start: int, tokens: int) -> int:
        """Append the staged new K/V [start, start+tokens) of disk `heads` to their rows."""
        fd = self.layout.first_disk(layer)
        assert heads and heads[0] >= fd, (layer, heads)
        items = []
        for b in range(self.layout.batch):
            for h in heads:
                row = self._row(layer, b, h)
                assert self.disk.fill[row] == start * self.token_bytes, (layer, h, start, self.disk.fill[row])
                src = self.wstage[layer][b, h - fd, :tokens]
                items.append((row, memoryview(src.view(torch.uint8).reshape(-1).numpy())))
        self.disk.append(items)   # a ring row writes no block that the append overwrites again
        ring = self.layout.disk_ring(layer)
        return len(items) * min(tokens, ring or tokens) * self.token_bytes


def k_of(buf: torch.Tensor) -> torch.Tensor:
    """K of an interleaved [..., P, 2, D] buffer: a strided [..., P, D] view."""
    return buf[..., 0, :]


def v_of(buf: torch.Tensor) -> torch.Tensor:
    return buf[..., 1, :]
