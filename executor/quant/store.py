"""LOSSY, opt-in (`--lossy int8|int4`): the offloaded KV stored, moved and read back quantised.

Tokens of an offloaded (layer, KV head) unit are cut into blocks of `group` tokens. A full block
is quantised on the GPU into one fixed-size byte record (quant/blocks.py); the records of a unit
lie one after another in its home (pinned host RAM, or its disk row: the same bytes), so a prefix
of whole blocks is ONE contiguous copy per (sequence, head). The tokens of a block not yet full
stay exact in a small GPU tail buffer (KIVI's residual), so a token is quantised exactly once,
when its block fills. A fetch moves the records of the prefix's full blocks into a GPU byte slot;
`dequant` decodes them into the exact transfer slot and appends the exact tail (quant/dequant.py),
and the attention reads the slot as on the exact path. Resident units never pass through here.
With sparse decode too, a step fetches only the selected blocks' records and `decode_selected`
decodes those alone (executor/sparse/homes.py).

Stages (builder: `quant` before `kv_store`, `dequant` after `kv_fetch`): `encode` (compute lane)
-> `store` (d2h) -> `disk_write` (disk lane), and `disk_read` -> `fetch` (h2d) -> `decode`."""
from __future__ import annotations

import contextlib

import torch

from kvpipe.executor.quant.blocks import BlockCodec
from kvpipe.executor.quant.dequant import DECODE_VALUES, SlotDequant


class QuantHomes(SlotDequant):
    """The quantised side of a KVStore (`store`): per layer the GPU tail [B, n_off, group, 2, D],
    the host records [B, n_host, blocks * record], the disk heads' write staging; per transfer
    slot a GPU byte slot [B, slot_heads, blocks * record]. Allocated at construction (the store's
    `open`), freed with the store; the dequantise (SlotDequant) is decided and compiled there too."""

    def __init__(self, store, bits: int, group: int, vgroup: int | None = None) -> None:
        self.s = store
        lo = store.layout
        self.codec = c = BlockCodec(bits, group, lo.head_dim, store.dtype, vgroup)
        self.g, self.rec = group, c.record
        B, H, D = lo.batch, lo.kv_heads, lo.head_dim
        self.blocks = lo.capacity // group                       # full blocks a unit can hold
        row = self.blocks * c.record
        gpu = dict(device=store.device)
        self.tail = [torch.zeros(B, H - n, group, 2, D, dtype=store.dtype, **gpu) if n < H else None
                     for n in lo.resident]
        self.host = [store.arena.bytes(B * (H - n - lo.n_disk(i)) * row).view(B, H - n - lo.n_disk(i), row)
                     if n + lo.n_disk(i) < H else None for i, n in enumerate(lo.resident)]
        self.wblocks = (lo.write_tokens + group - 1) // group + 1
        self.wstage = [store.arena.bytes(B * d * self.wblocks * c.record).view(B, d, self.wblocks * c.record)
                       if d else None for d in lo.disk] if any(lo.disk) else []
        self.qslots = [torch.empty(B, lo.slot_heads, row, dtype=torch.uint8, **gpu) for _ in range(lo.slots)]
        self.pending: dict[int, tuple[int, int]] = {}            # layer -> (first block, blocks) staged
        self._open_dequant()

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host + self.wstage if t is not None)

    # ---- store side ------------------------------------------------------------------------
    def encode(self, layer: int, kv: torch.Tensor, start: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Compute lane: the step's new K/V kv [B, H, T, 2, D] of the layer's offloaded heads join
        their tail; the blocks that fill are quantised. Returns (records [B, n_off, nb, record],
        first block, the filled blocks' exact K/V [B, n_off, nb, group, 2, D])."""
        lo, g = self.s.layout, self.g
        n, T = lo.resident[layer], kv.shape[2]
        had = start % g
        seq = torch.cat([self.tail[layer][:, :, :had], kv[:, n:]], 2)        # [B, n_off, had+T, 2, D]
        nb = seq.shape[2] // g
        full = seq[:, :, :nb * g].reshape(*seq.shape[:2], nb, g, *seq.shape[3:])
        left = seq.shape[2] - nb * g
        self.tail[layer][:, :, :left].copy_(seq[:, :, nb * g:])
        recs = self.codec.encode(full.reshape(-1, g, 2, lo.head_dim)).view(*seq.shape[:2], nb, self.rec)
        return recs, start // g, full

    def store(self, layer: int, heads: tuple[int, ...], recs: torch.Tensor, block0: int) -> int:
        """D2H lane: records [B, n_off, nb, record] to the host homes (host heads) or the disk
        write staging (disk heads). One copy per (sequence, head); returns bytes moved."""
        lo, nb = self.s.layout, recs.shape[2]
        n, fd = lo.resident[layer], lo.first_disk(layer)
        self.pending[layer] = (block0, nb)
        if nb == 0:
            return 0
        moved = 0
        for b in range(lo.batch):
            for h in heads:
                src = recs[b, h - n].reshape(-1)
                dst = (self.host[layer][b, h - n, block0 * self.rec:(block0 + nb) * self.rec] if h < fd
                       else self.wstage[layer][b, h - fd, :nb * self.rec])
                dst.copy_(src, non_blocking=self.s.cuda)
                moved += src.numel()
        return moved

    def disk_write(self, layer: int, heads: tuple[int, ...]) -> int:
        """Disk lane: append the staged records of disk `heads` to their rows."""
        block0, nb = self.pending[layer]
        if nb == 0:
            return 0
        fd, items = self.s.layout.first_disk(layer), []
        for b in range(self.s.layout.batch):
            for h in heads:
                row = self.s._row(layer, b, h)
                assert self.s.disk.fill[row] == block0 * self.rec, (layer, h, block0, self.s.disk.fill[row])
                items.append((row, memoryview(self.wstage[layer][b, h - fd, :nb * self.rec].numpy())))
        self.s.disk.append(items)
        return sum(len(mv) for _, mv in items)

    # ---- fetch side (the dequantise: SlotDequant) ------------------------------------------
    def _rstage(self, slot: int, b: int, j: int, nbytes: int) -> torch.Tensor:
        lo = self.s.layout
        at = ((slot * lo.batch + b) * lo.slot_heads + j) * self.s.row_stride
        return self.s.rstage[at:at + nbytes]

    def disk_read(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """Disk lane: the records of the prefix's full blocks of disk `heads`, into the read staging."""
        nbytes = (length // self.g) * self.rec
        if nbytes == 0:
            return 0
        items = [(self.s._row(layer, b, h), memoryview(self._rstage(slot, b, h - base, nbytes).numpy()))
                 for b in range(self.s.layout.batch) for h in heads]
        self.s.disk.read(items)
        return nbytes * len(items)

    def fetch(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> int:
        """H2D lane: the records of the prefix's full blocks into the GPU byte slot (head h at row
        h - base). One copy per (sequence, head); returns bytes moved."""
        lo = self.s.layout
        n, fd, nbytes = lo.resident[layer], lo.first_disk(layer), (length // self.g) * self.rec
        if nbytes == 0:
            return 0
        for b in range(lo.batch):
            for h in heads:
                src = (self.host[layer][b, h - n, :nbytes] if h < fd else self._rstage(slot, b, h - base, nbytes))
                self.qslots[slot][b, h - base, :nbytes].copy_(src, non_blocking=self.s.cuda)
        return nbytes * lo.batch * len(heads)

    def prefix(self, layer: int, length: int) -> torch.Tensor:
        """The K/V a `length`-token prefix of the layer's host units reads back, every record
        decoded (eagerly, on the store's device, in passes of DECODE_VALUES: bounded temporaries)
        and the exact tail after them, in host memory: [B, n_host, length, 2, D] (the run's error
        probe, once, in the first decode step, which the per-token timing leaves out)."""
        lo, g = self.s.layout, self.g
        nb, host = length // g, self.host[layer]
        B, J = host.shape[:2]
        out = torch.empty(B, J, length, 2, lo.head_dim, dtype=self.s.dtype)
        step = max(1, DECODE_VALUES // (g * 2 * lo.head_dim))                  # blocks per pass
        for b in range(B):
            for j in range(J):
                for c in range(0, nb, step):
                    k = min(step, nb - c)
                    rec = host[b, j, c * self.rec:(c + k) * self.rec].to(self.s.device).view(k, self.rec)
                    got = torch.empty(k, g, 2, lo.head_dim, dtype=self.s.dtype, device=self.s.device)
                    self.codec.decode(rec, got)
                    out[b, j, c * g:(c + k) * g] = got.reshape(k * g, 2, lo.head_dim).cpu()
        out[:, :, nb * g:] = self.tail[layer][:, :J, :length - nb * g].cpu()
        return out

    # ---- replayed sparse steps (executor/replay/sparse_step.py: a step's counts in the device row `a`) ----
    def open_replay(self) -> None:
        """The static record each offloaded layer's filling block is encoded into every replayed step."""
        self.open_rec = [None if t is None else torch.empty(*t.shape[:2], 1, self.rec, dtype=torch.uint8,
                                                             device=self.s.device) for t in self.tail]
        self.overflow = torch.zeros((), dtype=torch.bool, device=self.s.device)   # checked by `check_overflow`

    def check_overflow(self) -> None:
        """After replayed steps: the ValueError `encode` raises eagerly, for K/V past float16."""
        from kvpipe.executor.quant.quantize import OVERFLOW
        if bool(self.overflow):
            raise ValueError(OVERFLOW)

    def encode_static(self, layer: int, kv: torch.Tensor, a: torch.Tensor,
                      side: torch.cuda.Stream | None = None) -> None:
        """`encode` of one new token at a device-held place (a[IN_BLOCK]) of the filling block, which
        is encoded whole into `open_rec` (stale tokens past it included: its record goes home only
        in the step that fills it, `store_filled`, then from the eager path's values). `side`: a
        stream the encoding (~70 small kernels) runs on, off the step's critical path; the new
        token is written into the tail on the current stream first, so that side stream only reads
        the tail and writes `open_rec` and the overflow flag, which nothing reads before the caller
        joins it (DeviceStep's end of step)."""
        from kvpipe.executor.replay.sparse_step import IN_BLOCK
        t = self.tail[layer]
        if t is None:
            return
        n, (B, J) = self.s.layout.resident[layer], t.shape[:2]
        t.index_copy_(2, a[IN_BLOCK:IN_BLOCK + 1], kv[:, n:])                     # [B, n_off, g, 2, D]
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            recs = self.codec.encode(t.reshape(-1, self.g, 2, t.shape[-1]), self.overflow)
            self.open_rec[layer].copy_(recs.view(B, J, 1, self.rec))

    def store_filled(self, layer: int, heads: tuple[int, ...], position: int) -> int:
        """D2H lane, after a replayed step whose new token sat at `position`: the filled block's
        record home when that token filled it, else nothing. Returns bytes moved."""
        rec = self.open_rec[layer]
        full = position % self.g == self.g - 1
        return self.store(layer, heads, rec if full else rec[:, :, :0], position // self.g)
