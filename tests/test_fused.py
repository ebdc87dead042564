"""Fused decode pieces (executor/fused.py): on CPU, each piece against the HF modules it replaces
(float64 uncompiled: the same math; bf16 compiled by inductor: within bf16 rounding); on CUDA,
decode replay with KVPIPE_FUSE=1: offloaded == resident bit for bit, replay == the same fused
steps issued without a graph, and fused within bf16 rounding of the unfused and eager paths."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.adapter import HFAdapter
from kvpipe.executor.fused import FUSE_ENV, FusedDecode, fuse_setting
from kvpipe.executor.loader import random_model
from test_replay import cases, cuda_model, headwise, run

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny(family, dtype, seed=7, **over):
    """A tiny model whose norm weights are random too (HF initialises them to ones, which would
    hide a norm that forgets its weight)."""
    cfg = dict(model_type=family, vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               initializer_range=0.1, rms_norm_eps=1e-5, tie_word_embeddings=False, **over)
    if family == "mistral":
        cfg["sliding_window"] = None
    m = random_model(cfg, device="cpu", dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    return m


def pieces_hf(a, ids, pos, attn_out):
    """Every decode piece of the HF modules (through the adapter), chained over all layers with
    the given attention outputs [layers][1, 1, Hq, D] -> (q, K/V per layer), logits."""
    hidden, rope = a.embed(ids, 0, positions=pos)
    qs = []
    for i, out in enumerate(attn_out):
        qs.append(a.qkv(i, hidden, rope))
        hidden = a.mlp(i, hidden, out)
    return qs, a.head(hidden)


def pieces_fused(f, a, ids, pos, attn_out):
    """The same chain through FusedDecode (the residual carried as hidden + pending)."""
    hidden, rope = a.embed(ids, 0, positions=pos)
    qs, pending = [], None
    for i, out in enumerate(attn_out):
        hidden, q, kv = f.qkv(i, hidden, pending, rope)
        qs.append((q, kv))
        hidden, pending = f.mlp(i, hidden, out)
    return qs, f.head(hidden, pending)


def inputs(a, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (1, 1), generator=gen)
    pos = torch.randint(0, 500, (1, 1), generator=gen)
    outs = [torch.randn(1, 1, a.q_heads, a.head_dim, generator=gen, dtype=torch.float64).to(dtype)
            for _ in a.body.layers]
    return ids, pos, outs


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_math_is_hf_math_in_float64(family):
    """Fault caught: fused math that is not HF's: rotate_half's sign or halves swapped, cos/sin
    broadcast over the wrong dim, a norm without its weight or with another eps, Qwen3's q/k norm
    skipped, act and up swapped, a K/V layout other than [B, Hkv, T, 2, D], or the deferred residual
    add dropped or added twice (checked through every layer to the logits)."""
    m = tiny(family, torch.float64)
    a = HFAdapter(m)
    f = FusedDecode(a, compile=False)
    with torch.inference_mode():
        for seed in range(3):
            ids, pos, outs = inputs(a, torch.float64, seed)
            ref_qs, ref_logits = pieces_hf(a, ids, pos, outs)
            got_qs, got_logits = pieces_fused(f, a, ids, pos, outs)
            for (rq, rkv), (gq, gkv) in zip(ref_qs, got_qs):
                assert gq.shape == rq.shape and gkv.shape == rkv.shape and gq.is_contiguous()
                torch.testing.assert_close(gq, rq, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(gkv, rkv, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got_logits, ref_logits, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor on CPU compiles C++: no C++ compiler on this machine")
def test_compiled_pieces_match_hf_in_bf16(single_thread):
    """Fault caught: inductor's code (C++ on CPU; the same graphs go to Triton on CUDA) computing
    another function than HF's bf16 modules, e.g. a cast or the deferred add fused away: q, K/V and
    logits of a bf16 model through every layer stay within bf16 rounding (measured here: equal)."""
    m = tiny("qwen3", torch.bfloat16, seed=3)   # qwen3: the q/k norm path compiles too
    a = HFAdapter(m)
    f = FusedDecode(a, compile=True)
    with torch.inference_mode():
        f.warm(torch.zeros(1, dtype=torch.long))
        ids, pos, outs = inputs(a, torch.bfloat16, 11)
        ref_qs, ref_logits = pieces_hf(a, ids, pos, outs)
        got_qs, got_logits = pieces_fused(f, a, ids, pos, outs)
    for (rq, rkv), (gq, gkv) in zip(ref_qs, got_qs):
        for got, ref in ((gq, rq), (gkv, rkv)):
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-2, err
    err = ((got_logits.double() - ref_logits.double()).norm() / ref_logits.double().norm()).item()
    assert err < 1e-2, err


def test_setting_and_refusals(monkeypatch):
    """Fault caught: a typo in KVPIPE_FUSE silently running unfused (or fused), or a model whose
    activation has no fused form run with SiLU anyway."""
    for v, want in (("1", True), ("on", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv(FUSE_ENV, v)
        assert fuse_setting() is want, v
    monkeypatch.delenv(FUSE_ENV)
    assert fuse_setting() is False
    monkeypatch.setenv(FUSE_ENV, "yes please")
    with pytest.raises(ValueError, match=FUSE_ENV):
        fuse_setting()
    m = tiny("llama", torch.float32, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        FusedDecode(HFAdapter(m), compile=False)


# ---- CUDA: fused decode under replay -------------------------------------------------------------
def fused_run(model, case, replay, fuse, plan=None):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FUSE_ENV, "1" if fuse else "0")
        res = run(model, case, replay, plan=plan)
    assert res.fused is (fuse and replay != "off")
    return res


@pytest.mark.gpu
@settings(max_examples=10, deadline=None)
@given(case=cases(), family=st.sampled_from(["llama", "qwen3"]))
def test_fused_replay_offloaded_equals_resident_bitwise(tiny_model, case, family):
    """Fault caught: placement leaking into the bits of the fused step (e.g. the resident path
    taking the one-group output shortcut and a slot path not, or a compiled piece recompiled with
    other code for another placement's strides)."""
    model = cuda_model(tiny_model, family)
    spec = HFAdapter(model).spec()
    off = fused_run(model, case, "on", True)
    plan = headwise(case["group"], case["chunk"], case["depth"], spec.units, case["decode_group"],
                    case["decode_depth"])
    ref = fused_run(model, case, "on", True, plan=plan)
    assert torch.equal(off.step_logits, ref.step_logits), case
    assert torch.equal(off.tokens, ref.tokens), case


@pytest.mark.gpu
@settings(max_examples=8, deadline=None)
@given(case=cases())
def test_fused_replay_equals_fused_issue(tiny_model, case):
    """Fault caught: a fused piece that is not capturable as replayed (compiled inside the capture,
    a host value baked in, the pending residual kept from the captured step): replay must equal the
    same fused steps issued without a graph bit for bit."""
    model = cuda_model(tiny_model)
    graph, issued = fused_run(model, case, "on", True), fused_run(model, case, "issue", True)
    assert torch.equal(graph.step_logits, issued.step_logits), case
    assert torch.equal(graph.tokens, issued.tokens), case


@pytest.mark.gpu
@settings(max_examples=8, deadline=None)
@given(case=cases(), against=st.sampled_from(["unfused", "eager"]))
def test_fused_within_bf16_rounding_of_unfused_and_eager(tiny_model, case, against):
    """Fault caught: fused decode computing another function (a wrong rope position or sign, a
    residual lost): its logits stay within bf16 rounding (relative 2e-2) of the unfused replay and
    of the eager path, and greedy tokens agree until a step whose top-2 gap is within the difference."""
    model = cuda_model(tiny_model)
    fused = fused_run(model, case, "on", True)
    ref = fused_run(model, case, "on", False) if against == "unfused" else fused_run(model, case, "off", False)
    assert torch.equal(fused.step_logits[0], ref.step_logits[0])   # the prefill is never fused
    for k in range(1, case["decode"] + 1):
        a, b = fused.step_logits[k].double(), ref.step_logits[k].double()
        err = ((a - b).norm() / b.norm()).item()
        assert err < 2e-2, (k, err, case)
        if not torch.equal(fused.tokens[:, k], ref.tokens[:, k]):
            top2 = b.topk(2, dim=-1).values[0]
            assert (top2[0] - top2[1]).item() <= 2 * (a - b).abs().max().item(), (k, case)
            break


def test_run_refuses_a_bad_fuse_setting_with_one_line(monkeypatch, capsys):
    """Fault caught: a bad KVPIPE_FUSE accepted, or refused with a traceback after the model loads
    instead of one line and exit 2 before."""
    from kvpipe.cli import main
    monkeypatch.setenv(FUSE_ENV, "maybe")
    code = main(["run", "--model", "llama-3-8b", "--context", "16", "--decode-tokens", "1",
                 "--device", "cpu", "--random-weights", "--gpu-mem", "100GB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and FUSE_ENV in err[0], (code, err)
