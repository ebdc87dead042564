"""The block records of executor/quant/store.py (LOSSY storage of offloaded KV): one `group`-token block
of K and V encoded on store, decoded after the fetch. The bounds are computed here in float64 from
the data, independently of executor/quant/quantize.py."""
from __future__ import annotations

import pytest
import torch

from kvpipe.executor.quant.blocks import BlockCodec


@pytest.mark.parametrize("bits,group,dtype,vgroup", [(8, 64, torch.float32, None), (4, 32, torch.float32, None),
                                                     (4, 32, torch.bfloat16, None), (8, 32, torch.float16, None),
                                                     (4, 32, torch.bfloat16, 64), (4, 16, torch.bfloat16, 32)])
def test_block_round_trip_is_within_half_a_step_on_the_right_axis(bits, group, dtype, vgroup):
    """Faults: K grouped along channels instead of tokens (or V along tokens), a field read at
    the wrong offset of the record, nibbles swapped. Each K value must be within half a step of
    its (block, channel) range and each V value within half a step of its (token, channel group)
    range, plus the metadata's rounding; an outlier channel of K must not widen the other
    channels' error (it would if K were grouped along channels)."""
    D, N = 64, 5
    gen = torch.Generator().manual_seed(bits * group)
    kv = torch.randn(N, group, 2, D, generator=gen).to(dtype)
    kv[:, :, 0, 7] *= 40                                       # an outlier channel of K
    codec = BlockCodec(bits, group, D, dtype, vgroup)
    assert codec.gv == (vgroup or group)                        # V groups of `vgroup` channels when given
    rec = codec.encode(kv)
    assert rec.shape == (N, codec.record) and rec.dtype == torch.uint8
    out = torch.empty_like(kv)
    codec.decode(rec, out)
    x, y = kv.double(), out.double()
    levels = 2 ** bits - 1
    k, v = x[:, :, 0], x[:, :, 1]                              # [N, group, D]
    k_step = (k.amax(1, keepdim=True) - k.amin(1, keepdim=True)) / levels       # per block, channel
    gv = codec.gv
    vg = v.view(N, group, D // gv, gv)
    v_step = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels).expand_as(vg).reshape(N, group, D)
    out_ulp = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10}[dtype]
    meta = 2 ** -10 if dtype != torch.float32 else 2 ** -23
    slack = lambda t: (out_ulp + 2 * meta) * (t.abs() + 1e-30)
    k_err, v_err = (y[:, :, 0] - k).abs(), (y[:, :, 1] - v).abs()
    assert bool((k_err <= 0.5 * k_step * (1 + 1e-2) + slack(k) + meta * k.abs().amax(1, keepdim=True)).all())
    assert bool((v_err <= 0.5 * v_step * (1 + 1e-2) + slack(v) + meta * v.abs().amax(-1, keepdim=True)).all())
    others = [c for c in range(D) if c != 7]
    assert float(k_err[:, :, others].max()) < 0.6 * float(k_step[:, :, others].max()) + 1e-2


def test_empty_encode_and_record_size():
    """Faults: a step that fills no block crashing; a record larger than the exact block it stands
    for (no saving on the link)."""
    codec = BlockCodec(4, 32, 128, torch.bfloat16)
    assert codec.encode(torch.empty(0, 32, 2, 128, dtype=torch.bfloat16)).shape == (0, codec.record)
    exact = 32 * 2 * 128 * 2
    assert codec.record / exact == pytest.approx(0.3125, abs=0.01)     # int4, group 32, V groups of 32
    assert BlockCodec(4, 32, 128, torch.bfloat16, 64).record / exact == pytest.approx(152 / 512, abs=0.01)
    assert BlockCodec(8, 64, 128, torch.bfloat16).record / (64 * 2 * 128 * 2) == pytest.approx(0.53125, abs=0.01)


def _slot_case(bits: int, group: int, dtype: torch.dtype, device: str, heads: int = 6, blocks: int = 5,
               vgroup: int | None = None):
    """A byte slot of `heads` rows of `blocks` records (K with an outlier channel, values spanning
    1e-4..1e2 so that float16 scales include tiny ones) and an exact slot to decode into."""
    gen = torch.Generator().manual_seed(bits + group)
    D = 128
    kv = torch.randn(2 * heads * blocks, group, 2, D, generator=gen) * torch.logspace(-4, 2, D)
    kv[:, :, 0, 3] += 30.0
    codec = BlockCodec(bits, group, D, dtype, vgroup)
    rec = codec.encode(kv.to(dtype).to(device)).view(2, heads, blocks * codec.record)
    slot = torch.full((2, heads, blocks * group + 3, 2, D), float("nan"), dtype=dtype, device=device)
    return codec, rec, slot


def _assert_fused_equals_eager(bits, group, dtype, device, vgroup=None):
    from kvpipe.executor.quant.blocks import fused_decode
    codec, rec, slot = _slot_case(bits, group, dtype, device, vgroup=vgroup)
    j0, j1 = 1, 5                                             # a group of rows inside the slot
    fused_decode()(codec, rec, slot, j0, j1)
    B, J, nb = rec.shape[0], j1 - j0, rec.shape[2] // codec.record
    ref = torch.empty(B, J, nb, group, 2, codec.D, dtype=dtype, device=device)
    codec.decode(rec[:, j0:j1].reshape(B, J, nb, codec.record), ref)      # eager dequantize
    got = slot[:, j0:j1, :nb * group].reshape(ref.shape)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))        # bit for bit, NaN-safe
    assert bool(slot[:, :j0].isnan().all()) and bool(slot[:, j1:].isnan().all())   # other rows untouched


def test_fused_decode_equals_eager_dequantize_bit_for_bit_on_cpu():
    """Faults: the torch.compile'd decode computing another function than eager `dequantize` (a
    contracted multiply-add rounding differently, nibble order, a field read at a wrong offset, K
    not transposed back), or writing rows outside its head range. Bits compared, not values.
    One codec only on CPU (an inductor C++ compile takes tens of seconds); the GPU test covers more."""
    _assert_fused_equals_eager(4, 32, torch.bfloat16, "cpu", vgroup=64)   # int4's default layout


def test_fused_decode_refuses_float32_metadata():
    """Fault: float32 models (float32 scales: products not exact, so no bit-exactness argument)
    taking the fused path."""
    assert not BlockCodec(4, 32, 128, torch.float32).fusable
    assert BlockCodec(4, 32, 128, torch.bfloat16).fusable and BlockCodec(8, 64, 128, torch.float16).fusable


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,dtype,vgroup", [(4, 32, torch.bfloat16, 64), (4, 32, torch.bfloat16, None),
                                                     (8, 64, torch.bfloat16, None), (4, 16, torch.float16, None)])
def test_fused_decode_equals_eager_dequantize_bit_for_bit_on_cuda(bits, group, dtype, vgroup):
    """Faults: Triton's fused multiply-add (or any reordering) changing a bit of the dequantised KV
    against eager CUDA `dequantize`; a CUDA result that differs from the CPU's eager decode."""
    _assert_fused_equals_eager(bits, group, dtype, "cuda", vgroup)
    codec, rec, _ = _slot_case(bits, group, dtype, "cuda", vgroup=vgroup)
    on_gpu, on_cpu = (torch.empty(*rec.shape[:2], rec.shape[2] // codec.record, group, 2, 128, dtype=dtype,
                                  device=d) for d in ("cuda", "cpu"))
    codec.decode(rec.view(*rec.shape[:2], -1, codec.record), on_gpu)
    codec.decode(rec.cpu().view(*rec.shape[:2], -1, codec.record), on_cpu)
    assert torch.equal(on_gpu.cpu().view(torch.int16), on_cpu.view(torch.int16))
