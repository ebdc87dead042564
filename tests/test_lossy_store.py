"""The block records of executor/qstore.py (LOSSY storage of offloaded KV): one `group`-token block
of K and V encoded on store, decoded after the fetch. The bounds are computed here in float64 from
the data, independently of executor/quant.py."""
from __future__ import annotations

import pytest
import torch

from kvpipe.executor.qstore import BlockCodec


@pytest.mark.parametrize("bits,group,dtype", [(8, 64, torch.float32), (4, 32, torch.float32),
                                              (4, 32, torch.bfloat16), (8, 32, torch.float16)])
def test_block_round_trip_is_within_half_a_step_on_the_right_axis(bits, group, dtype):
    """Faults: K grouped along channels instead of tokens (or V along tokens), a field read at
    the wrong offset of the record, nibbles swapped. Each K value must be within half a step of
    its (block, channel) range and each V value within half a step of its (token, channel group)
    range, plus the metadata's rounding; an outlier channel of K must not widen the other
    channels' error (it would if K were grouped along channels)."""
    D, N = 64, 5
    gen = torch.Generator().manual_seed(bits * group)
    kv = torch.randn(N, group, 2, D, generator=gen).to(dtype)
    kv[:, :, 0, 7] *= 40                                       # an outlier channel of K
    codec = BlockCodec(bits, group, D, dtype)
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
    assert codec.record / exact == pytest.approx(0.3125, abs=0.01)     # int4, group 32: pipeline/lossy.py ratio
    assert BlockCodec(8, 64, 128, torch.bfloat16).record / (64 * 2 * 128 * 2) == pytest.approx(0.53125, abs=0.01)
