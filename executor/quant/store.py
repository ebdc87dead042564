"""LOSSY, opt-in (`--lossy int8|int4`): the offloaded KV stored, moved and read back quantised.

Tokens of an offloaded (layer, KV head) unit are cut into blocks of `group` tokens. A full block
is quantised on the GPU (executor/quant/quantize.py: K per channel with its group along the block's tokens,
V per token with groups of gcd(group, head_dim) channels) into one fixed-size byte record; the
records of a unit lie one after another in its home (pinned host RAM, or its disk row: the same
bytes), so a prefix of whole blocks is ONE contiguous copy per (sequence, head). The tokens of a
block not yet full stay exact in a small GPU tail buffer (KIVI's residual), so a token is quantised
exactly once, when its block fills. A fetch moves the records of the prefix's full blocks into a
GPU byte slot; `dequant` decodes them into the exact transfer slot and appends the exact tail, and
the attention reads the slot as on the exact path. Resident units never pass through here. With
sparse decode too, a step fetches only the selected blocks' records and `decode_selected` decodes
those alone (executor/sparse/homes.py).

Stages (builder: `quant` before `kv_store`, `dequant` after `kv_fetch`): `encode` (compute lane)
-> `store` (d2h) -> `disk_write` (disk lane), and `disk_read` -> `fetch` (h2d) -> `decode`.

`decode` on CUDA with float16 metadata (bf16/fp16 models) is ONE torch.compile'd call per fetch
(`fused_decode`: unpack, scale, shift, round, write into the slot; no float32 temporaries in
memory) over the WHOLE byte slot, so its shapes never change: it is compiled once per slot
layout, in the store's open, not in a timed stage. Only the records and the slot rows they fill
enter the compiled region (`records_decode`; the slicing runs before it). Compiled with the whole
exact slot as an input written through a slice, AOTAutograd made that a slice_scatter over the
whole input and a copy back, so every call read and wrote all S_cap tokens of the slot through a
slot-sized temporary, whatever it decoded (128K, 8 heads: ~2.1 GB a call; seen in the graph
inductor builds on the CPU; the H200's 820-record sparse window took 1.24 ms a layer, as long as a
prefill's full-slot decode). It equals the eager `dequantize` bit for bit: a code (<= 255, 8 bits)
times a float16 scale (11 significant bits) is exact in float32, so a fused multiply-add (which the
compiler may emit) and eager's multiply-then-add round the same sum once; one rounding to the
model dtype follows. Float32 metadata (fp32 models) has no such guarantee and stays eager, as does
the CPU. The sparse window's decode (`decode_selected`, a replayed step's `decode_static`) runs
instead the hand-written Triton kernel of executor/quant/dequant_triton.py where it can (the same bits;
inductor's kernel took 285 us a layer at 128K on the H200, ~8x what its HBM traffic needs). `QuantHomes.paths()`
counts the dequantise calls by path (reported in `run --json` decode_issue.dequant)."""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections import Counter

import torch

from kvpipe.executor.quant import dequant_triton as quant_triton
from kvpipe.executor.engine.compiling import compile_fn
from kvpipe.executor.quant.quantize import LEVELS, Quantized, dequant_math, dequantize, quantize

DECODE_VALUES = 1 << 25   # eager decode: values dequantised per pass, bounding the float32
                          # temporaries (128 MiB each) under the exact-size output the plan books
# the dequantise's paths (QuantHomes.paths): the compiled call over the whole byte slot, over the
# sparse window, eager passes, and calls with no full block to decode
FULL, WINDOW, EAGER, EMPTY = "full", "window", "eager", "empty"


def block_decode(kc: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor,
                 vz: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    """The block decode arithmetic (pure but for writing `out`): K codes [*L, D, 1, g*bits/8] and
    scale/zero [*L, D, 1] (groups along the block's tokens), V codes [*L, g, nv, gv*bits/8] and
    scale/zero [*L, g, nv] (groups along channels) -> out [*L, g, 2, D] (the model dtype), written
    by one copy of K and V together: compiled, `out` is then overwritten, not read back (two
    copies into its K and V halves become a select_scatter that reads the old rows)."""
    k = dequant_math(kc, ks, kz, bits, torch.float32, out.dtype)          # [*L, D, 1, g]
    v = dequant_math(vc, vs, vz, bits, torch.float32, out.dtype)          # [*L, g, nv, gv]
    out.copy_(torch.stack([k.flatten(-2).transpose(-1, -2), v.flatten(-2)], -2))   # [*L, g, 2, D]


def records_decode(codec: "BlockCodec", rec: torch.Tensor, out: torch.Tensor) -> None:
    """Records rec [B, J, nb, record] uint8 -> out [B, J, nb, group, 2, D]: the region
    `fused_decode` compiles; its inputs are exactly the records it decodes and the slot rows they
    fill (views, cut by `slot_decode` before the call), so a call moves those bytes and no others."""
    block_decode(*codec.fields(rec), out, codec.bits)


def slot_decode(codec: "BlockCodec", qslot: torch.Tensor, slot: torch.Tensor, j0: int, j1: int,
                decode=records_decode) -> None:
    """EVERY record of rows [j0, j1) of a byte slot qslot [B, heads, blocks * record] decoded into
    the exact slot [B, heads, S_cap, 2, D], tokens [0, blocks * group) (`decode`: records_decode,
    eager, or its compiled version): fixed shapes, so the compiled version is built once per codec
    and slot layout. Blocks past the fetched prefix hold stale bytes; they decode into slot tokens
    the attention never reads (it reads [0, length), and the exact tail overwrites [full blocks,
    length)). Slot tokens past blocks * group are neither read nor written."""
    B, J, nb = qslot.shape[0], j1 - j0, qslot.shape[2] // codec.record
    rec = qslot[:, j0:j1].view(B, J, nb, codec.record)
    out = slot[:, j0:j1, :nb * codec.group].view(B, J, nb, codec.group, 2, codec.D)
    decode(codec, rec, out)


@functools.cache
def compiled_records():
    """`records_decode` compiled by torch.compile (inductor: Triton on CUDA, C++ on CPU), memoised
    for the process; static shapes (dynamo specialises on the codec's constants and the views'
    shapes and strides)."""
    return compile_fn(records_decode, dynamic=False)


@functools.cache
def fused_decode():
    """`slot_decode` with the compiled `records_decode`: the slicing runs eagerly, outside the
    compiled region (module docstring: compiled whole, every call rewrote the whole slot)."""
    return functools.partial(slot_decode, decode=compiled_records())


def dynamo_frames() -> tuple[int, int]:
    """(frames dynamo set out to compile, frames it compiled) so far in this process, from
    torch._dynamo.utils.counters["frames"] ("total" counts every call that missed all cached
    graphs, "ok" the ones compiled). A call that moves either made a graph (a compile) or failed
    to (then it ran eagerly: e.g. the recompile limit; after that, dynamo runs such calls eagerly
    without counting them). (0, 0) where torch keeps no such counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0
    frames = counters.get("frames", {})
    return int(frames.get("total", 0)), int(frames.get("ok", 0))


class BlockCodec:
    """One `group`-token block of one unit, K and V [group, 2, D] <-> a `record`-byte record:
    metadata first (K scale, K zero, V scale, V zero), then K codes, V codes; padded to 16 bytes."""

    def __init__(self, bits: int, group: int, head_dim: int, dtype: torch.dtype, vgroup: int | None = None) -> None:
        if bits not in LEVELS:
            raise ValueError(f"bits: must be 8 or 4, got {bits!r}")
        self.bits, self.group, self.D, self.dtype = bits, group, head_dim, dtype
        self.gv = math.gcd(vgroup or group, head_dim)          # V: channels per group (LossySpec.v_channels)
        self.meta = torch.float16 if dtype in (torch.bfloat16, torch.float16) else torch.float32
        ms, D, g = self.meta.itemsize, head_dim, group
        nv = g * (D // self.gv)                                # V groups per block
        self.parts = (("ks", D * ms), ("kz", D * ms), ("vs", nv * ms), ("vz", nv * ms),
                       ("kc", D * g * bits // 8), ("vc", g * D * bits // 8))
        self.record = -(-sum(n for _, n in self.parts) // 16) * 16

    def encode(self, kv: torch.Tensor, overflow: torch.Tensor | None = None) -> torch.Tensor:
        """kv [N, group, 2, D] -> records [N, record] uint8, on kv's device (`overflow`: as `quantize`'s)."""
        N = kv.shape[0]
        if N == 0:
            return torch.empty(0, self.record, dtype=torch.uint8, device=kv.device)
        qk = quantize(kv[:, :, 0], self.bits, self.group, axis=-2, overflow=overflow)     # groups along tokens
        qv = quantize(kv[:, :, 1], self.bits, self.gv, axis=-1, overflow=overflow)        # groups along channels
        out = torch.zeros(N, self.record, dtype=torch.uint8, device=kv.device)
        parts = {"ks": qk.scale, "kz": qk.zero, "vs": qv.scale, "vz": qv.zero, "kc": qk.codes, "vc": qv.codes}
        at = 0
        for name, n in self.parts:
            out[:, at:at + n] = parts[name].reshape(N, -1).view(torch.uint8)
            at += n
        return out

    @property
    def fusable(self) -> bool:
        """Whether `fused_decode` is bit-exact for this codec: float16 metadata (module docstring)."""
        return self.meta == torch.float16

    def fields(self, rec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of records rec [*L, record] uint8 (no copy): K codes [*L, D, 1, g*bits/8], K scale
        and zero [*L, D, 1], V codes [*L, g, nv, gv*bits/8], V scale and zero [*L, g, nv]."""
        lead, D, g, nv = tuple(rec.shape[:-1]), self.D, self.group, self.D // self.gv
        f, at = {}, 0
        for name, n in self.parts:
            f[name] = rec[..., at:at + n]
            at += n
        m = lambda name, *shape: f[name].view(self.meta).reshape(*lead, *shape)
        return (f["kc"].reshape(*lead, D, 1, -1), m("ks", D, 1), m("kz", D, 1),
                f["vc"].reshape(*lead, g, nv, -1), m("vs", g, nv), m("vz", g, nv))

    def decode(self, rec: torch.Tensor, out: torch.Tensor) -> None:
        """Records rec [..., record] uint8 -> out [..., group, 2, D] (the model dtype), in place,
        eagerly through `dequantize` (the reference the fused decode equals bit for bit)."""
        kc, ks, kz, vc, vs, vz = self.fields(rec)
        lead, D, g = tuple(rec.shape[:-1]), self.D, self.group
        k = Quantized(kc, ks, kz, self.bits, g, len(lead), (*lead, D, g), g, self.dtype)
        v = Quantized(vc, vs, vz, self.bits, self.gv, len(lead) + 1, (*lead, g, D), D, self.dtype)
        out[..., 0, :].copy_(dequantize(k))
        out[..., 1, :].copy_(dequantize(v))


class QuantHomes:
    """The quantised side of a KVStore (`store`): per layer the GPU tail [B, n_off, group, 2, D],
    the host records [B, n_host, blocks * record], the disk heads' write staging; per transfer
    slot a GPU byte slot [B, slot_heads, blocks * record]. Allocated at construction (the store's
    `open`), freed with the store."""

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
        # the fetch's dequantise as one compiled kernel (fused_decode) on CUDA where it is bit-exact;
        # compiled here, in the store's open, on the slots' real shapes (a group of every slot row),
        # so that no compile lands inside a timed stage (stale bytes decode into unread rows)
        self.fused = store.cuda and c.fusable
        # why this store's calls run eagerly (None: compiled), reported by `paths`
        self.unfused = (None if self.fused else "not CUDA" if not store.cuda
                        else "float32 metadata (not bit-exact fused)")
        # LOSSY sparse too (executor/sparse/homes.py): a decode step's records are the selected
        # blocks', at most `sel_blocks` of them, decoded by a second compiled call over that many
        sparse = lo.sparse
        self.sel_blocks = min(self.blocks, sparse.max_fetched_blocks(lo.capacity)) if sparse is not None else 0
        # that window decoded by the Triton kernel (quant_triton.decode_window) where it runs, else
        # by the compiled call; decided here, once
        self.triton_decode = self.fused and quant_triton.unavailable(c, store.device) is None
        self.triton_note: str | None = None   # why the Triton kernel was given up, if it was (paths)
        # the dequantise calls by path (`paths`): FULL, WINDOW, EAGER (and why), EMPTY (no full block)
        self.calls: Counter[str] = Counter()
        self.eager_why: Counter[str] = Counter()
        self.max_selected = 0                  # the most records one sparse dequantise decoded
        # in a dequant stage (dynamo_frames, and the Triton kernel's variants: compiled_variants)
        self.stage_compiles = self.stage_compile_failures = 0
        self.open_compiles = 0
        if self.fused:
            seen, seen_t = dynamo_frames(), quant_triton.compiled_variants()
            fused_decode()(c, self.qslots[0], store.slots[0], 0, lo.slot_heads)
            window = self.qslots[0][:, :, :self.sel_blocks * c.record]
            if self.sel_blocks and self.triton_decode:
                # both variants, the replayed one with its count a step row's slice (the same
                # pointer alignment, so the same variant): no compile in a stage or a capture
                from kvpipe.executor.replay.sparse_step import ARGS, N
                count = torch.zeros(ARGS, dtype=torch.int64, device=store.device)[N:N + 1]
                try:
                    quant_triton.decode_window(c, window, store.slots[0], 0, lo.slot_heads)
                    quant_triton.decode_window(c, window, store.slots[0], 0, lo.slot_heads, count=count)
                except torch.OutOfMemoryError:
                    raise
                except Exception as e:   # Triton: compiler missing, codegen or compile errors
                    self.triton_decode = False   # the compiled call instead, said once
                    self.triton_note = f"the Triton dequantise failed ({type(e).__name__}: {str(e)[:200]}); compiled call"
                    logging.getLogger("kvpipe").warning(self.triton_note)
            if self.sel_blocks and not self.triton_decode:
                fused_decode()(c, window, store.slots[0], 0, lo.slot_heads)
            self.open_compiles = dynamo_frames()[1] - seen[1] + quant_triton.compiled_variants() - seen_t

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

    # ---- fetch side ------------------------------------------------------------------------
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

    def decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> None:
        """Compute lane: the fetched records dequantised into the exact slot rows of `heads`, then
        the exact tail tokens [full blocks, length) copied from the GPU tail."""
        nb = length // self.g
        # one compiled call for the whole fetch: no float32 temporaries
        self._decode(layer, heads, base, slot, nb, length - nb * self.g,
                     self.qslots[slot] if self.fused else None, FULL, self.unfused)

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

    def decode_selected(self, layer: int, heads: tuple[int, ...], base: int, slot: int, blocks: int,
                        length: int) -> None:
        """Compute lane, LOSSY sparse decode over quantised blocks: the first `blocks` records of
        the byte slot (the selected blocks', gathered in token order by executor/sparse/homes.py)
        dequantised into slot tokens [0, blocks * group), then the exact tail of the `length`-token
        prefix (its tokens past the full blocks) right after them. Only the selected records are
        decoded: eagerly, or on CUDA by the compiled call over the first `sel_blocks` records (a
        fixed shape; rows past `blocks` hold stale bytes, decoded into slot rows the attention
        never reads, and the tail overwrites the first of them after). The arithmetic is
        `decode`'s, so a record decodes to the same bits wherever it lies."""
        fits = blocks <= self.sel_blocks
        self.max_selected = max(self.max_selected, blocks)
        window = (self.qslots[slot][:, :, :self.sel_blocks * self.rec]      # a fixed shape: compiled once
                  if self.fused and fits else None)
        # an overflow first: LossySpec.max_fetched_blocks promises none, on any device
        why = self.unfused if fits else f"more selected blocks than the window ({self.sel_blocks})"
        self._decode(layer, heads, base, slot, blocks, length % self.g, window, WINDOW, why)

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

    def decode_static(self, layer: int, heads: tuple[int, ...], base: int, slot: int, a: torch.Tensor) -> None:
        """`decode_selected` for a replayed step: the window's records dequantised (one call, a fixed
        shape: the Triton kernel, which decodes only the step's a[N] kept blocks, or the compiled
        call, all of the window's), then the whole exact tail block copied to slot rows a[TAIL_AT]
        onwards (its rows past the step's tail are not attended; the step's own token overwrites the
        first)."""
        from kvpipe.executor.replay.sparse_step import N, TAIL_AT
        n = self.s.layout.resident[layer]
        j0, j1 = heads[0] - base, heads[-1] - base + 1      # (not counted in `calls`: captured once, replayed)
        window = self.qslots[slot][:, :, :self.sel_blocks * self.rec]
        if self.triton_decode:
            quant_triton.decode_window(self.codec, window, self.s.slots[slot], j0, j1, count=a[N:N + 1])
        else:
            fused_decode()(self.codec, window, self.s.slots[slot], j0, j1)
        rows = a[TAIL_AT:TAIL_AT + 1] + torch.arange(self.g, device=self.s.device)
        self.s.slots[slot][:, j0:j1].index_copy_(2, rows, self.tail[layer][:, heads[0] - n:heads[-1] - n + 1])

    def paths(self) -> dict:
        """Which path this store's dequantise calls took (reported in `run --json`
        decode_issue.dequant): counts of compiled calls over the whole byte slot (`full`: prefill,
        decode without sparse) and of calls over the sparse window of `window_blocks` records
        (`window`, by the `window_kernel`),
        eager calls with their reasons (`eager_why`), calls with no full block (`empty`); the most
        records one sparse call decoded; which kernel decodes the window (`window_kernel`:
        "triton", quant_triton's; "compiled", fused_decode's; "eager" where the store is unfused,
        reason in `eager_why`); and the compiles (dynamo's, and the Triton kernel's variants) in the
        store's open and inside dequant stages (a compile in a timed stage, or one that failed and
        ran eagerly: see `dynamo_frames`; dynamo's silent eager runs past its recompile limit are
        not seen)."""
        kernel = "triton" if self.triton_decode else "compiled" if self.fused else "eager"
        return {**{k: self.calls[k] for k in (FULL, WINDOW, EAGER, EMPTY)}, "eager_why": dict(self.eager_why),
                "window_blocks": self.sel_blocks, "window_kernel": kernel, "window_note": self.triton_note,
                "max_selected_blocks": self.max_selected,
                "open_compiles": self.open_compiles, "stage_compiles": self.stage_compiles,
                "stage_compile_failures": self.stage_compile_failures}

    def _decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, nb: int, tail: int,
                window: torch.Tensor | None, path: str, why: str | None) -> None:
        """The first `nb` records of the byte slot rows of `heads` dequantised into slot tokens
        [0, nb * group): by one call over `window` (the byte slot's leading records, a fixed shape)
        where given, counted as `path` (the sparse WINDOW by the Triton kernel where it runs, else,
        and the FULL slot always, compiled), else eagerly in passes of DECODE_VALUES,
        counted with the reason `why`; then `tail` exact tokens from the GPU tail right after them."""
        lo, g = self.s.layout, self.g
        n = lo.resident[layer]
        j0, j1 = heads[0] - base, heads[-1] - base + 1
        B, J = lo.batch, j1 - j0
        dst = self.s.slots[slot][:, j0:j1]                              # [B, J, S_cap, 2, D]
        if not nb:
            self.calls[EMPTY] += 1
        elif window is not None:
            self.calls[path] += 1
            seen, seen_t = dynamo_frames(), quant_triton.compiled_variants()
            if self.triton_decode and path == WINDOW:
                quant_triton.decode_window(self.codec, window, self.s.slots[slot], j0, j1)
            else:
                fused_decode()(self.codec, window, self.s.slots[slot], j0, j1)
            got = dynamo_frames()
            self.stage_compiles += got[1] - seen[1] + quant_triton.compiled_variants() - seen_t
            self.stage_compile_failures += (got[0] - seen[0]) - (got[1] - seen[1])
        else:
            assert why is not None, (path, nb)       # eager only where unfused or past the window
            self.calls[EAGER] += 1
            self.eager_why[why] += 1
            rec = self.qslots[slot][:, j0:j1, :nb * self.rec].view(B, J, nb, self.rec)
            out = dst[:, :, :nb * g].view(B, J, nb, g, 2, lo.head_dim)
            step = max(1, DECODE_VALUES // (B * J * g * 2 * lo.head_dim))   # blocks per pass
            for c in range(0, nb, step):
                self.codec.decode(rec[:, :, c:c + step], out[:, :, c:c + step])
        if tail:
            dst[:, :, nb * g:nb * g + tail].copy_(self.tail[layer][:, heads[0] - n:heads[-1] - n + 1, :tail])
