"""LOSSY (`--lossy int8|int4`): one `group`-token block of one unit <-> a fixed-size byte record
(`BlockCodec`), and the decode of a byte slot's records into the exact transfer slot.

A full block is quantised on the GPU (executor/quant/quantize.py: K per channel with its group
along the block's tokens, V per token with groups of gcd(group, head_dim) channels) into one
record: metadata first, then K codes, V codes, padded to 16 bytes.

On CUDA with float16 metadata (bf16/fp16 models) the decode is ONE torch.compile'd call
(`fused_decode`: unpack, scale, shift, round, write into the slot; no float32 temporaries in
memory) over a fixed view of the byte slot, so its shapes never change and it compiles once per
slot layout. Only the records and the slot rows they fill enter the compiled region
(`records_decode`; `slot_decode` slices before it): compiled with the whole slot as an input
written through a slice, AOTAutograd makes the write a slice_scatter over the whole slot and a
copy back, so every call would read and write all S_cap tokens of it. It equals the eager
`dequantize` bit for bit: a code (<= 255, 8 bits) times a float16 scale (11 significant bits) is
exact in float32, so a fused multiply-add (which the compiler may emit) and eager's
multiply-then-add round the same sum once; one rounding to the model dtype follows. Float32
metadata (fp32 models) has no such guarantee and stays eager, as does the CPU."""
from __future__ import annotations

import functools
import math

import torch

from kvpipe.executor.engine.compiling import compile_fn
from kvpipe.executor.quant.quantize import LEVELS, Quantized, dequant_math, dequantize, quantize


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


def records_decode(codec: BlockCodec, rec: torch.Tensor, out: torch.Tensor) -> None:
    """Records rec [B, J, nb, record] uint8 -> out [B, J, nb, group, 2, D]: the region
    `fused_decode` compiles; its inputs are exactly the records it decodes and the slot rows they
    fill (views, cut by `slot_decode` before the call), so a call moves those bytes and no others."""
    block_decode(*codec.fields(rec), out, codec.bits)


def slot_decode(codec: BlockCodec, qslot: torch.Tensor, slot: torch.Tensor, j0: int, j1: int,
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
    compiled region (module docstring: compiled whole, every call would rewrite the whole slot)."""
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
