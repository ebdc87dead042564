"""The KV store's disk tier (a mixin of executor.kv.store.KVStore): its file of rows
(executor/disk/tier.py; a window layer's a ring row where layout.disk_rings says so), the host
read staging its prefixes pass through, the disk lane's reads and writes, and the file's bytes."""
from __future__ import annotations

import os

import torch

from kvpipe.pipeline.disk_rows import block_bytes, ring_block_bytes

from kvpipe.executor.disk.tier import ALIGN, DiskFile, aligned_buffer, default_kv_dir
from kvpipe.executor.disk.frames import FramedDiskFile


class DiskLane:
    """The disk side of KVStore: it uses the store's layout, dtype, arena and disk options."""

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

