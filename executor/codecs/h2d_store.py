"""Lossless, opt-in (`--codec h2d=nvcomp-ans-planes`): the host units' K/V stored compressed, so a
fetch moves fewer bytes over PCIe and the GPU decodes them (executor/codecs/nvcomp_ans_planes.py).

Tokens of a host (layer, KV head) unit are cut into blocks of `block` tokens (pipeline.codecs.
H2D_BLOCK_TOKENS, or the prefill chunk if smaller). When a block fills (`encode`, gpu lane), its bytes
are split into planes on the GPU and the high plane of every filled block of the layer is
ANS-encoded in one nvCOMP batch; `store` (d2h) appends each encoded block to the unit's high-plane
log in pinned host RAM (16-byte aligned; a block that does not shrink is stored raw and marked so)
and the low plane to the unit's low-plane region. Offsets, sizes and raw marks are kept on the
host. Tokens of a block not yet full stay exact in a small GPU tail (as in executor/quant/store.py), so
a token is encoded exactly once. A fetch (`fetch`, h2d) is ONE contiguous copy of the compressed
prefix into the front half of the slot row and one of the low-plane prefix into its back half;
`decode` (gpu lane) decodes the blocks in one batch into a shared GPU buffer, sets the low plane
aside, interleaves both into the exact slot and appends the tail. The attention then reads the
slot exactly as on the exact path. Host reservation stays at raw size (a block is never stored
larger than raw), so host RAM is not saved, only PCIe bytes. Host units only: disk units and
lossy KV are refused by `Plan.check`."""
from __future__ import annotations

import torch

from kvpipe.pipeline.codecs import H2D_BLOCK_TOKENS

from kvpipe.executor.codecs.nvcomp_ans_planes import ALIGN, AnsBlocks, align, check_available, interleave, split_planes


class CompressedHomes:
    """The compressed side of a KVStore (`store`): per layer the GPU tail [B, n_host, block, 2, D],
    the pinned high-plane logs [B, n_host, blocks * block_bytes] and low planes (same shape), the
    block table; shared GPU buffers for the decoded high and the set-aside low planes of one
    group. Allocated at construction (the store's `open`), freed with the store."""

    def __init__(self, store, codec: str = "nvcomp-ans-planes", coder=None) -> None:
        """`coder`: the block codec (AnsBlocks' encode/decode/capacity); None: nvCOMP ANS, made on
        the gpu lane's stream at first use (tests of the layout pass another lossless coder)."""
        self.s = store
        lo = store.layout
        if coder is None:
            check_available(codec, store.device)
        if store.dtype.itemsize != 2:
            raise ValueError(f"codec: h2d={codec} needs bf16 or fp16 KV, got {store.dtype}")
        if any(lo.disk):
            raise ValueError(f"codec: h2d={codec} runs on host units only, not with disk units")
        B, H, D = lo.batch, lo.kv_heads, lo.head_dim
        self.bt = min(H2D_BLOCK_TOKENS, lo.write_tokens, lo.capacity)   # tokens per block (<= the chunk)
        self.blk = self.bt * 2 * D                               # bytes of one block's plane
        if self.blk % ALIGN:
            raise ValueError(f"codec: a block plane of {self.blk} bytes is not a multiple of {ALIGN}")
        self.blocks = lo.capacity // self.bt                     # full blocks a unit can hold
        self.row = lo.capacity * 2 * D * 2                       # bytes of one slot row
        gpu = dict(device=store.device)
        n_host = [H - n for n in lo.resident]
        self.tail = [torch.zeros(B, k, self.bt, 2, D, dtype=store.dtype, **gpu) if k else None for k in n_host]
        self.high = [store.arena.bytes(B * k * self.blocks * self.blk).view(B, k, -1) if k else None for k in n_host]
        self.low = [store.arena.bytes(B * k * self.blocks * self.blk).view(B, k, -1) if k else None for k in n_host]
        # block table: per layer, per (b, host head index): [(offset, size, raw)] of each stored block
        self.table = [[[[] for _ in range(k)] for _ in range(B)] for k in n_host]
        G = lo.slot_heads
        self.dec_high = torch.empty(B, G, self.blocks * self.blk, dtype=torch.uint8, **gpu)
        self.low_aside = torch.empty(B, G, self.blocks * self.blk, dtype=torch.uint8, **gpu)
        self.ans = coder                                         # nvCOMP: made on the gpu lane's stream, on first use
        self.raw_blocks = self.coded_blocks = self.stored_bytes = self.raw_bytes = 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.high + self.low if t is not None)

    @property
    def gpu_bytes(self) -> int:
        return (sum(t.numel() * t.element_size() for t in self.tail if t is not None)
                + self.dec_high.numel() + self.low_aside.numel())

    def ratio(self) -> float | None:
        """Raw / stored bytes of every block stored so far (measured on the run's own K/V)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None

    def stats(self) -> dict:
        return {"ratio": self.ratio(), "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
                "blocks_coded": self.coded_blocks, "blocks_raw": self.raw_blocks, "block_tokens": self.bt,
                "decode_configs": len(getattr(self.ans, "dconfigs", ())),   # header parses (stream syncs)
                "gpu_bytes": self.gpu_bytes}

    def _codec(self) -> AnsBlocks:
        if self.ans is None:
            self.ans = AnsBlocks(self.s.device, torch.cuda.current_stream(self.s.device), self.blk)
        if isinstance(self.ans, AnsBlocks):
            assert self.ans.stream == torch.cuda.current_stream(self.s.device), "nvCOMP runs on the gpu lane only"
        return self.ans

    def close(self) -> None:
        if isinstance(self.ans, AnsBlocks):
            self.ans.close()

    # ---- store side ------------------------------------------------------------------------
    def encode(self, layer: int, kv: torch.Tensor, start: int) -> tuple | None:
        """GPU lane: the step's new K/V kv [B, H, T, 2, D] of the layer's host heads join their
        tail; the blocks that fill are split and their high planes encoded. Returns what `store`
        sends, or None when no block filled."""
        lo, bt = self.s.layout, self.bt
        n, T = lo.resident[layer], kv.shape[2]
        had = start % bt
        seq = torch.cat([self.tail[layer][:, :, :had], kv[:, n:]], 2)        # [B, k, had+T, 2, D]
        nb = seq.shape[2] // bt
        left = seq.shape[2] - nb * bt
        self.tail[layer][:, :, :left].copy_(seq[:, :, nb * bt:])
        if nb == 0:
            return None
        B, k = seq.shape[:2]
        high, low = split_planes(seq[:, :, :nb * bt].reshape(B, k, nb, bt * 2 * lo.head_dim))  # [B, k, nb, blk]
        coded, sizes = self._codec().encode(high.view(-1, self.blk))
        return start // bt, nb, high, low, coded, sizes

    def store(self, layer: int, heads: tuple[int, ...], rec: tuple | None) -> int:
        """D2H lane: each filled block of `heads` appended to its unit's high-plane log (encoded,
        or raw where encoding did not shrink it), the low planes to their region. Returns bytes."""
        if rec is None:
            return 0
        block0, nb, high, low, coded, sizes = rec
        n, B, k = self.s.layout.resident[layer], high.shape[0], high.shape[1]
        moved = 0
        for b in range(B):
            for h in heads:
                j = h - n
                blocks = self.table[layer][b][j]
                assert len(blocks) == block0, (layer, b, h, len(blocks), block0)
                at = blocks[-1][0] + align(blocks[-1][1]) if blocks else 0
                for i in range(nb):
                    flat = (b * k + j) * nb + i
                    size = sizes[flat]
                    raw = size >= self.blk
                    src = high[b, j, i] if raw else coded[flat, :size]
                    n_bytes = self.blk if raw else size
                    self.high[layer][b, j, at:at + n_bytes].copy_(src, non_blocking=self.s.cuda)
                    blocks.append((at, n_bytes, raw))
                    self.raw_blocks += raw
                    self.coded_blocks += not raw
                    self.stored_bytes += n_bytes + self.blk   # high as stored, low raw
                    self.raw_bytes += 2 * self.blk
                    moved += n_bytes
                    at += align(n_bytes)
                self.low[layer][b, j, block0 * self.blk:(block0 + nb) * self.blk].copy_(
                    low[b, j].reshape(-1), non_blocking=self.s.cuda)
                moved += nb * self.blk
        return moved

    # ---- fetch side ------------------------------------------------------------------------
    def _prefix(self, layer: int, b: int, j: int, nb: int) -> int:
        """Stored bytes of the first `nb` blocks of a unit's high-plane log."""
        if nb == 0:
            return 0
        at, size, _ = self.table[layer][b][j][nb - 1]
        return at + size

    def fetch(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """H2D lane: per (sequence, head) one copy of the compressed prefix of the full blocks into
        the front of its slot row, one of the low-plane prefix into the back half. Returns bytes."""
        lo = self.s.layout
        n, nb = lo.resident[layer], length // self.bt
        if nb == 0:
            return 0
        dst = self.s.slots[slot].view(torch.uint8).view(lo.batch, lo.slot_heads, self.row)
        half, moved = self.row // 2, 0
        for b in range(lo.batch):
            for h in heads:
                c = self._prefix(layer, b, h - n, nb)
                dst[b, h - base, :c].copy_(self.high[layer][b, h - n, :c], non_blocking=self.s.cuda)
                dst[b, h - base, half:half + nb * self.blk].copy_(self.low[layer][b, h - n, :nb * self.blk],
                                                                    non_blocking=self.s.cuda)
                moved += c + nb * self.blk
        return moved

    def decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> None:
        """GPU lane: the fetched blocks decoded (one nvCOMP batch; raw blocks copied), the low
        plane set aside, both interleaved into the exact slot rows of `heads`; then the exact tail
        tokens [full blocks, length) copied from the GPU tail."""
        lo, bt, blk = self.s.layout, self.bt, self.blk
        n, nb = lo.resident[layer], length // bt
        j0, j1 = heads[0] - base, heads[-1] - base + 1
        slot_kv = self.s.slots[slot]
        if nb:
            G, row, cap = lo.slot_heads, self.row, self.dec_high.shape[2]
            flat = slot_kv.view(torch.uint8).view(-1)
            dec = self.dec_high.view(-1)
            offs, sizes, outs = [], [], []
            for b in range(lo.batch):
                for h in heads:
                    j = h - base
                    for i, (at, size, raw) in enumerate(self.table[layer][b][h - n][:nb]):
                        src_at, out_at = (b * G + j) * row + at, (b * G + j) * cap + i * blk
                        if raw:
                            dec[out_at:out_at + blk].copy_(flat[src_at:src_at + blk])
                        else:
                            offs.append(src_at), sizes.append(size), outs.append(out_at)
            self._codec().decode(flat, offs, sizes, dec, outs)
            u8 = slot_kv.view(torch.uint8).view(lo.batch, G, row)
            aside = self.low_aside[:, j0:j1, :nb * blk]
            aside.copy_(u8[:, j0:j1, row // 2:row // 2 + nb * blk])
            shape = (lo.batch, j1 - j0, nb * bt, 2, lo.head_dim)
            interleave(self.dec_high[:, j0:j1, :nb * blk].view(shape), aside.view(shape), slot_kv[:, j0:j1, :nb * bt])
        if length > nb * bt:
            slot_kv[:, j0:j1, nb * bt:length].copy_(
                self.tail[layer][:, heads[0] - n:heads[-1] - n + 1, :length - nb * bt])
