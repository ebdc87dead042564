"""Group-wise asymmetric min-max quantisation of KV to int8 or int4 (FlexGen, LeoAM): every `group`
consecutive values along one axis share a scale and a zero-point (the group minimum), stored in
float16 (float32 for float32/float64 input); int4 codes are packed two per byte, the even element
in the low nibble. Lossy: `dequantize(quantize(x))` differs from x by at most half a step per
value (plus the metadata's float16 rounding of the minimum). Device-agnostic torch; quantise and
dequantise run wherever the tensor lives. `dequant_math` is dequantize's arithmetic alone, the
function executor/quant/store.py compiles into one kernel (see its bit-exactness argument there).

The axis matters for K: its outlier channels (analysis/needles.py) widen every per-token group
they fall in, so KIVI quantises K per channel (groups along tokens) and V per token."""
from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = {8: 255, 4: 15}
_META = {torch.bfloat16: torch.float16, torch.float16: torch.float16,
         torch.float32: torch.float32, torch.float64: torch.float32}
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class Quantized:
    """`codes` [..., groups, group * bits / 8] uint8; `scale`, `zero` [..., groups]. `shape` is the
    original shape with `axis` moved last; `length` the unpadded size of that axis."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    axis: int
    shape: tuple[int, ...]
    length: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes plus metadata (what crosses the link instead of the exact KV)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


OVERFLOW = "kv: values beyond the float16 range of the quantisation metadata"


def quantize(x: torch.Tensor, bits: int, group: int = 64, axis: int = -1,
             overflow: torch.Tensor | None = None) -> Quantized:
    """Quantise `x` in groups of `group` consecutive values along `axis` (the last group is padded
    by repeating the axis' last value). Values past the float16 metadata's range raise a
    ValueError; with `overflow` (a bool tensor on x's device, for a captured CUDA graph, which
    cannot wait on the GPU) they set it instead, for the caller to check after the graph ran."""
    if bits not in LEVELS:
        raise ValueError(f"bits: must be 8 or 4, got {bits!r}")
    if group <= 0 or group % 2:
        raise ValueError(f"group: must be a positive even integer, got {group!r}")
    if x.dtype not in _META:
        raise ValueError(f"dtype: cannot quantise {x.dtype}")
    meta = _META[x.dtype]
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    axis = axis % x.dim()
    y = x.movedim(axis, -1).to(work)
    shape, n = tuple(y.shape), y.shape[-1]
    if meta == torch.float16 and y.numel():
        if overflow is not None:
            overflow.logical_or_(y.abs().amax() > _FP16_MAX)
        elif y.abs().max() > _FP16_MAX:
            raise ValueError(OVERFLOW)
    pad = -n % group
    if pad:
        y = torch.cat([y, y[..., -1:].expand(*shape[:-1], pad)], -1)
    y = y.reshape(*shape[:-1], -1, group)                                   # [..., groups, group]
    lo, hi = y.amin(-1), y.amax(-1)
    zero = lo.to(meta)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (one ulp
    # off), which made CUDA's scales differ from CPU's; tensor / tensor is correctly rounded on both
    step = (hi - zero.to(work)) / torch.full_like(hi, LEVELS[bits])
    scale = step.to(meta)
    low = scale.to(work) < step                  # rounded down: bump so the top code still covers hi
    bump = step * (1 + 2.0 ** -9)
    if meta == torch.float16:   # a subnormal float16 scale (step < 2**-14) moves only by whole 2**-24
        bump = bump + 2.0 ** -24
    scale = torch.where(low, bump.to(meta), scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))           # constant group
    codes = torch.round((y - zero.to(work)[..., None]) / scale.to(work)[..., None])
    codes = codes.clamp_(0, LEVELS[bits]).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return Quantized(codes, scale, zero, bits, group, axis, shape, n, x.dtype)


def dequant_math(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 work: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., groups, group * bits / 8] uint8, scale, zero [..., groups] -> [..., groups, group]
    in `dtype`: code * scale + zero computed in `work` precision, then rounded once to `dtype`.
    Pure and shape-generic (torch.compile traces it; dequantize runs it eagerly)."""
    c = codes
    if bits == 4:
        c = torch.stack([c & 0xF, c >> 4], -1).flatten(-2)                   # even element: low nibble
    return (c.to(work) * scale.to(work)[..., None] + zero.to(work)[..., None]).to(dtype)


def dequantize(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor `q` stands for, in `dtype` (default: the original dtype), original shape."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    y = dequant_math(q.codes, q.scale, q.zero, q.bits, work, work)          # [..., groups, group]
    y = y.flatten(-2)[..., :q.length]
    return y.to(dtype or q.dtype).movedim(-1, q.axis)
