"""Property tests for executor/layers/attention.py: chunked equals full, placement changes no bit, decode.
The reference is tests/reference.py (float64 softmax written out, its own GQA mapping), never a
helper of the module under test."""

import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvpipe.executor.layers.attention import (CUDNN_MIN_ROWS, attend_chunk, attend_part, canonical_unit_strides,
                                       cuda_kernel_setting, kernel_label)
from reference import dense_causal_attention

CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16)
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}
LSE_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-3}  # absolute, natural log
GQA_RATIOS = (1, 2, 4, 7, 8)
HEAD_DIMS = (64, 128)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(shape, dtype, gen, device="cpu", amp=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * amp).to(device=device, dtype=dtype)


@st.composite
def chunk_sizes(draw, seq_len):
    """A split of seq_len tokens into at most 16 chunks of arbitrary sizes."""
    cuts = draw(st.sets(st.integers(1, seq_len - 1), max_size=15)) if seq_len > 1 else set()
    bounds = [0, *sorted(cuts), seq_len]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def run_chunked(q, k, v, sizes, scale, s_max):
    """Prefill q/k/v [B, H, S, D] chunk by chunk through a preallocated cache [B, Hkv, s_max, D]."""
    B, Hkv, S, D = k.shape
    k_cache = torch.zeros(B, Hkv, s_max, D, dtype=k.dtype, device=k.device)  # [B, Hkv, S_max, D]
    v_cache = torch.zeros_like(k_cache)
    outs, p = [], 0
    for t in sizes:
        k_cache[:, :, p : p + t] = k[:, :, p : p + t]
        v_cache[:, :, p : p + t] = v[:, :, p : p + t]
        outs.append(
            attend_chunk(
                q[:, :, p : p + t],
                k_cache[:, :, :p],  # strided view of the prefix, P = p
                v_cache[:, :, :p],
                k_cache[:, :, p : p + t],
                v_cache[:, :, p : p + t],
                scale,
            )
        )
        p += t
    return torch.cat(outs, dim=2)  # [B, Hq, S, D]


@st.composite
def chunked_case(draw, max_len):
    seq_len = draw(st.integers(1, max_len))
    return dict(
        dtype=draw(st.sampled_from(CPU_DTYPES)),
        r=draw(st.sampled_from(GQA_RATIOS)),
        hkv=draw(st.integers(1, 2)),
        d=draw(st.sampled_from(HEAD_DIMS)),
        b=draw(st.integers(1, 2)),
        sizes=draw(chunk_sizes(seq_len)),
        slack=draw(st.integers(0, 5)),
        amp=draw(st.sampled_from([1.0, 3.0])),
        # None: the usual D**-0.5; the others catch a half that ignores `scale` (Qwen-style
        # models and user configs may set attention scaling to anything).
        scale=draw(st.sampled_from([None, 0.05, 0.3, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_chunked_equals_full(case, device="cpu"):
    gen = torch.Generator().manual_seed(case["seed"])
    B, Hkv, r, D, dtype = case["b"], case["hkv"], case["r"], case["d"], case["dtype"]
    S = sum(case["sizes"])
    q = randn((B, Hkv * r, S, D), dtype, gen, device, case["amp"])  # [B, Hq, S, D]
    k = randn((B, Hkv, S, D), dtype, gen, device, case["amp"])  # [B, Hkv, S, D]
    v = randn((B, Hkv, S, D), dtype, gen, device)
    scale = D**-0.5 if case.get("scale") is None else case["scale"]
    out = run_chunked(q, k, v, case["sizes"], scale, S + case["slack"])
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, dense_causal_attention(q, k, v, scale)) <= REL_TOL[dtype]


@settings(max_examples=100, deadline=None)
@given(case=chunked_case(max_len=80))
def test_chunked_equals_full(case):
    """Fault caught: a chunked result that differs from dense causal attention (wrong mask offset,
    prefix/chunk split, GQA mapping, scale or merge) for any chunking."""
    check_chunked_equals_full(case)


@settings(max_examples=12, deadline=None)
@given(case=chunked_case(max_len=40), first=st.integers(500, 1040))
def test_chunked_equals_full_long_prefix(case, first):
    """Prefixes past 512 tokens, where the CPU kernel splits the keys into several blocks."""
    check_chunked_equals_full(dict(case, sizes=[first, *case["sizes"]]))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(CPU_DTYPES),
    r=st.sampled_from(GQA_RATIOS),
    hkv=st.integers(1, 3),
    d=st.sampled_from(HEAD_DIMS),
    b=st.integers(1, 2),
    p=st.one_of(st.integers(0, 40), st.integers(500, 700)),
    scale=st.sampled_from([None, 0.07, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_decode_equals_reference(dtype, r, hkv, d, b, p, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = d**-0.5 if scale is None else scale
    q = randn((b, hkv * r, 1, d), dtype, gen)  # [B, Hq, 1, D]
    k = randn((b, hkv, p + 1, d), dtype, gen)  # [B, Hkv, P+1, D]
    v = randn((b, hkv, p + 1, d), dtype, gen)
    out = attend_chunk(q, k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:], scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, dense_causal_attention(q, k, v, scale)) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
def test_scale_applies_to_prefix_and_chunk(dtype, scale):
    """Fault caught: one half (prefix or chunk) scaled by D**-0.5 instead of `scale`; every model
    of the other tests uses D**-0.5, so only a different scale can tell them apart."""
    gen = torch.Generator().manual_seed(7)
    B, Hkv, r, P, T, D = 1, 2, 3, 9, 4, 64
    q = randn((B, Hkv * r, T, D), dtype, gen)   # [B, Hq, T, D]
    k = randn((B, Hkv, P + T, D), dtype, gen)   # [B, Hkv, P+T, D]
    v = randn((B, Hkv, P + T, D), dtype, gen)
    out = attend_chunk(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], scale)
    assert rel_err(out, dense_causal_attention(q, k, v, scale)) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("p,t", [(37, 5), (600, 1), (20, 33)])
def test_merge_survives_huge_log_sum_exp(dtype, p, t):
    """Every score shifted by +1000 (q and k share a large component along dim 0): softmax does
    not change, but exp(lse) overflows float32 and float64 (> 709). Fault caught: a merge of
    the two halves as log(exp(a) + exp(b)) without subtracting the max (gives inf -> 0 or NaN);
    the property tests keep the log-sum-exp far below that."""
    gen = torch.Generator().manual_seed(p * 100 + t)
    B, Hkv, r, D = 1, 2, 2, 64
    scale = D**-0.5
    shift = 1000.0
    c = (shift / scale) ** 0.5                       # c * c * scale == shift
    q = torch.randn(B, Hkv * r, t, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, p + t, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, p + t, D, generator=gen, dtype=torch.float64)
    q[..., 0], k[..., 0] = c, c
    q, k, v = (x.to(dtype) for x in (q, k, v))
    out = attend_chunk(q, k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:], scale)
    tol = 1e-9 if dtype == torch.float64 else 2e-2  # scores near 1000 carry ~1e-3 of fp32 rounding
    assert torch.isfinite(out).all()
    assert rel_err(out, dense_causal_attention(q, k, v, scale)) <= tol


def placement_variants(big: torch.Tensor, h0: int, g: int, p: int) -> dict[str, torch.Tensor]:
    """The same prefix values [B, g, P, D] of heads h0..h0+g, held in different places and layouts."""
    B, _, s_max, D = big.shape
    view = big[:, h0 : h0 + g, :p]  # strided view into the all-heads buffer
    pin = big.device.type == "cuda"
    staged = torch.empty(B, g, s_max + 3, D, dtype=big.dtype, pin_memory=pin)  # host staging buffer
    staged[:, :, :p].copy_(view.cpu().clone())
    back = torch.empty(B, g, s_max, D, dtype=big.dtype, device=big.device)
    back[:, :, :p].copy_(staged[:, :, :p], non_blocking=pin)
    token_major = torch.empty(B, s_max, g, D, dtype=big.dtype, device=big.device)  # [B, S, g, D]
    token_major[:, :p].copy_(view.transpose(1, 2))
    group_only = torch.empty(B, g, s_max, D, dtype=big.dtype, device=big.device)  # only this group
    group_only.copy_(big[:, h0 : h0 + g])
    return {
        "view": view,
        "contiguous": view.contiguous().clone(),
        "via_host": back[:, :, :p],
        "token_major": token_major[:, :p].transpose(1, 2),
        "group_only": group_only[:, :, :p],
    }


@st.composite
def placement_case(draw, dtypes):
    g = draw(st.integers(1, 3))
    return dict(
        dtype=draw(st.sampled_from(dtypes)),
        b=draw(st.integers(1, 2)),
        g=g,
        h0=draw(st.integers(0, 2)),
        extra_heads=draw(st.integers(0, 2)),
        r=draw(st.sampled_from(GQA_RATIOS)),
        d=draw(st.sampled_from(HEAD_DIMS)),
        p=draw(st.one_of(st.integers(1, 64), st.integers(500, 1100))),
        t=draw(st.integers(1, 33)),
        slack=draw(st.integers(0, 7)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def check_placement_bitwise(case, device="cpu"):
    gen = torch.Generator().manual_seed(case["seed"])
    B, g, h0, r, D, P, T, dtype = (case[n] for n in ("b", "g", "h0", "r", "d", "p", "t", "dtype"))
    h_all, s_max = h0 + g + case["extra_heads"], P + T + case["slack"]
    k_big = randn((B, h_all, s_max, D), dtype, gen, device)  # [B, H_all, S_max, D]
    v_big = randn((B, h_all, s_max, D), dtype, gen, device)
    q = randn((B, g * r, T, D), dtype, gen, device)  # [B, Hq, T, D]
    k_new = randn((B, g, T, D), dtype, gen, device)  # [B, g, T, D]
    v_new = randn((B, g, T, D), dtype, gen, device)
    ks = placement_variants(k_big, h0, g, P)
    vs = placement_variants(v_big, h0, g, P)
    outs = {name: attend_chunk(q, ks[name], vs[name], k_new, v_new, D**-0.5) for name in ks}
    for name, out in outs.items():
        assert torch.equal(out, outs["view"]), f"{name} differs from the in-buffer view"


@settings(max_examples=60, deadline=None)
@given(case=placement_case(CPU_DTYPES))
def test_placement_is_bitwise_invariant(case):
    """Fault caught: bits that depend on where or how the prefix is held (strided view, copy, via
    host, token-major, group-only buffer)."""
    check_placement_bitwise(case)


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(CPU_DTYPES),
    d=st.sampled_from(HEAD_DIMS),
    t=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_lse_is_natural_log_per_row(dtype, d, t, seed):
    """Fault caught: a kernel LSE in log2 units, another layout, or padded rows, which the merge
    would misweight."""
    check_lse(dtype, d, t, seed)


def check_lse(dtype, d, t, seed, device="cpu"):
    """The merge relies on the kernel's LSE being ln(sum(exp(scale * q.k))) with layout [B, H, T]."""
    gen = torch.Generator().manual_seed(seed)
    q = randn((2, 3, t, d), dtype, gen, device)
    k = randn((2, 3, t, d), dtype, gen, device)
    v = randn((2, 3, t, d), dtype, gen, device)
    scale = d**-0.5
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale  # [B, H, T, T], test only
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    for is_causal, expect in ((False, scores), (True, scores.masked_fill(~causal, float("-inf")))):
        part = attend_part(q, k, v, scale, causal=is_causal)
        assert part.lse.shape == (2, 3, t)
        lse_err = (part.lse.double() - torch.logsumexp(expect, dim=-1)).abs().max().item()
        assert lse_err <= LSE_TOL[dtype], lse_err


class _RecordShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.numels = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        flat = result if isinstance(result, (tuple, list)) else (result,)
        self.numels += [x.numel() for x in flat if isinstance(x, torch.Tensor)]
        return result


@settings(max_examples=10, deadline=None)
@given(r=st.sampled_from(GQA_RATIOS), t=st.integers(1, 16), p=st.integers(0, 300))
def test_never_materialises_scores_or_copies_prefix(r, t, p):
    """Every tensor the executor path creates is at most [B, Hq, T, D] (D = 8 << P + T), so no
    T x (P + T) score or mask matrix, and no copy of the prefix, is ever made."""
    B, Hkv, D = 1, 2, 8
    gen = torch.Generator().manual_seed(p)
    q = randn((B, Hkv * r, t, D), torch.float32, gen)
    k = randn((B, Hkv, p + t, D), torch.float32, gen)
    v = randn((B, Hkv, p + t, D), torch.float32, gen)
    k_prefix, v_prefix, k_new, v_new = k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:]
    with _RecordShapes() as rec:
        attend_chunk(q, k_prefix, v_prefix, k_new, v_new, 0.3)
    assert any("flash_attention" in op for op in rec.ops), rec.ops
    assert max(rec.numels) <= B * Hkv * r * t * D, (rec.ops, rec.numels)


def test_rejects_mismatched_shapes():
    """Fault caught: shape checks written as `assert` (gone under python -O, where a bad call
    would attend with the wrong heads instead of failing)."""
    q = torch.randn(1, 6, 2, 64)
    kv = torch.randn(1, 4, 3, 64)  # Hq = 6 is not a multiple of Hkv = 4
    with pytest.raises(ValueError, match="Hq=6"):
        attend_chunk(q, kv, kv, kv[:, :, :2], kv[:, :, :2], 0.125)
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="k_new"):   # new K/V of 3 tokens for a 2-token chunk
        attend_chunk(q, kv, kv, kv, kv, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        attend_chunk(q, kv, kv, kv[:, :, :2].double(), kv[:, :, :2], 0.125)


def test_kernel_setting_is_validated(monkeypatch):
    """Fault caught: an unknown KVPIPE_ATTN value silently falling back to a kernel."""
    monkeypatch.setenv("KVPIPE_ATTN", "fastest")
    with pytest.raises(ValueError, match="KVPIPE_ATTN='fastest': expected one of auto, flash, cudnn"):
        cuda_kernel_setting()
    monkeypatch.setenv("KVPIPE_ATTN", " CuDNN ")
    assert cuda_kernel_setting() == "cudnn"
    monkeypatch.delenv("KVPIPE_ATTN")
    assert cuda_kernel_setting() == "auto"


# ---- CUDA: every property again, per kernel (bf16 runs on FA2 or cuDNN; fp32 on memory-efficient) ----
CUDA_CASES = [(torch.bfloat16, "flash"), (torch.bfloat16, "cudnn"), (torch.float32, "auto")]


def cuda_case_id(case):
    return f"{str(case[0]).split('.')[-1]}-{case[1]}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kernel", CUDA_CASES, ids=map(cuda_case_id, CUDA_CASES))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_placement_is_bitwise_invariant_cuda(dtype, kernel, data):
    """Fault caught: on CUDA, placement-dependent bits per kernel (FA2, cuDNN, memory-efficient)."""
    with mock.patch.dict(os.environ, {"KVPIPE_ATTN": kernel}):
        check_placement_bitwise(data.draw(placement_case((dtype,))), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kernel", CUDA_CASES, ids=map(cuda_case_id, CUDA_CASES))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_chunked_equals_full_cuda(dtype, kernel, data):
    """Fault caught: a CUDA kernel path whose chunked result leaves the dense reference."""
    case = data.draw(chunked_case(max_len=80))
    with mock.patch.dict(os.environ, {"KVPIPE_ATTN": kernel}):
        check_chunked_equals_full(dict(case, dtype=dtype), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kernel", CUDA_CASES, ids=map(cuda_case_id, CUDA_CASES))
@settings(max_examples=10, deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), t=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_kernel_lse_is_natural_log_per_row_cuda(dtype, kernel, d, t, seed):
    """Fault caught: a CUDA kernel's LSE in other units or layout (cuDNN returns [B, H, T, 1])."""
    with mock.patch.dict(os.environ, {"KVPIPE_ATTN": kernel}):
        check_lse(dtype, d, t, seed, device="cuda")


@pytest.mark.gpu
def test_auto_uses_cudnn_for_prefill_chunks_and_flash_for_decode():
    """`auto` on bf16: a chunk of CUDNN_MIN_ROWS tokens (and its folded prefix) goes to cuDNN, a
    decode step and a 65-token chunk (260 folded prefix rows) to FA2."""
    if kernel_label(torch.device("cuda"), torch.bfloat16) == "FA2":
        pytest.skip("auto keeps FA2 on this GPU (pre-Hopper or no cuDNN 9)")
    gen = torch.Generator().manual_seed(0)
    # 65 tokens of 4 query heads per KV head: 260 folded prefix rows, still a short chunk (FA2)
    for t, want in ((CUDNN_MIN_ROWS, "cudnn_attention"), (1, "flash_attention"), (65, "flash_attention")):
        q = randn((1, 8, t, 128), torch.bfloat16, gen, "cuda")
        kv = randn((1, 2, 600 + t, 128), torch.bfloat16, gen, "cuda")
        with mock.patch.dict(os.environ, {"KVPIPE_ATTN": "auto"}), _RecordShapes() as rec:
            attend_chunk(q, kv[:, :, :600], kv[:, :, :600], kv[:, :, 600:], kv[:, :, 600:], 128**-0.5)
        kernels = [op for op in rec.ops if "scaled_dot_product" in op]
        assert kernels and all(want in op for op in kernels), (t, kernels)


def test_canonical_unit_strides_keeps_values_and_unifies_keys():
    """Two views of the same [1, 1, P, D] values held in buffers of different head counts get
    equal strides (one cuDNN plan), and the values are untouched."""
    gen = torch.Generator().manual_seed(0)
    wide = randn((1, 5, 40, 2, 16), torch.float32, gen)     # a layer's resident heads, K/V interleaved
    slot = torch.empty(1, 1, 40, 2, 16)                      # a one-head transfer slot
    slot.copy_(wide[:, 3:4])
    a, b = wide[:, 3:4, :30, 0], slot[:, :, :30, 0]          # K of head 3, both [1, 1, 30, 16]
    assert a.stride() != b.stride()
    ca, cb = canonical_unit_strides(a), canonical_unit_strides(b)
    assert ca.stride() == cb.stride() and torch.equal(ca, a) and torch.equal(cb, b)
    two = wide[:, 1:3, :30, 1]                               # sizes > 1 keep their strides
    assert canonical_unit_strides(two).stride()[1:] == two.stride()[1:]


def test_short_chunk_picks_its_kernel_by_its_tokens_not_its_folded_rows():
    """Fault caught: a chunk of 64-255 tokens of a GQA model (4 query heads per KV head folded into
    >= 256 query rows of the prefix call) sent to cuDNN, which builds a new execution plan for it
    (a chat turn's or a question's few new tokens), where pipeline/cost.py counts FA2 and no plan."""
    from kvpipe.executor.layers import attention as att
    assert att.auto_kernel(CUDNN_MIN_ROWS) == "cudnn" and att.auto_kernel(CUDNN_MIN_ROWS - 1) == "flash"
    gen = torch.Generator().manual_seed(0)
    q = randn((1, 8, 65, 16), torch.float32, gen)
    kv = randn((1, 2, 100 + 65, 16), torch.float32, gen)
    with mock.patch.object(att, "attend_part", wraps=att.attend_part) as spy:
        att.attend_chunk(q, kv[:, :, :100], kv[:, :, :100], kv[:, :, 100:], kv[:, :, 100:], 0.25)
    picked = [att.auto_kernel(c.kwargs.get("tokens") or c.args[0].shape[2]) for c in spy.call_args_list]
    assert picked == ["flash", "flash"], picked
