"""Fused decode pieces (executor/layers/fused.py) and the fuse setting (pipeline/fusion.py): on CPU, each
piece against the HF modules it replaces (float64 uncompiled: the same math; bf16 compiled by
inductor: within bf16 rounding), the setting's parsing and refusals, `--fuse` on plan and run, and
auto's fallback when torch.compile fails (a real failing compiler); on CUDA, fused decode replay:
offloaded == resident bit for bit, replay == the same fused steps issued without a graph, fused
within bf16 rounding of the unfused and eager paths, and auto fusing by default."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.fused import FUSE_ENV, FusedDecode, make_fused
from kvpipe.pipeline.fusion import decode_fused, fuse_mode, refuse_unfusable
from kvpipe.executor.layers.loader import random_model
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


@pytest.mark.parametrize("family,over", [("llama", {"mlp_bias": True}), ("qwen2", {})])
def test_fused_projections_keep_every_module_call(family, over):
    """Fault caught: the one-GEMM q/k/v and gate/up buffers (fused.fuse_projections) changing what
    the modules compute (rows joined in another order, a view at the wrong offset), losing a bias
    (Qwen2's q/k/v, Llama's mlp_bias), or kept stale after a module's weight is replaced."""
    m = tiny(family, torch.float64, **over)
    with torch.no_grad():   # HF initialises biases to zero, which would hide a lost one
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(len(name))))
    a = HFAdapter(m)
    x = torch.randn(1, 3, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mods = lambda L: [L.self_attn.q_proj, L.self_attn.k_proj, L.self_attn.v_proj, L.mlp.gate_proj, L.mlp.up_proj]  # noqa: E731
    with torch.no_grad():
        before = [[mod(x) for mod in mods(L)] for L in a.body.layers]
        FusedDecode(a, compile=False)
        for L, ref in zip(a.body.layers, before):
            got = [mod(x) for mod in mods(L)]
            assert all(torch.equal(g, r) for g, r in zip(got, ref))      # prefill's calls: unchanged bits
            w, b, wgu, bgu = L._kvpipe_fused
            torch.testing.assert_close(torch.nn.functional.linear(x, w, b), torch.cat(ref[:3], -1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.nn.functional.linear(x, wgu, bgu), torch.cat(ref[3:], -1), rtol=1e-12, atol=1e-12)
        L = a.body.layers[0]
        L.self_attn.k_proj.weight = torch.nn.Parameter(2 * L.self_attn.k_proj.weight.detach().clone())
        want = L.self_attn.k_proj(x)
        w, b = FusedDecode(a, compile=False).weights[0][:2]
        nq, nkv = L.self_attn.q_proj.weight.shape[0], L.self_attn.k_proj.weight.shape[0]
        torch.testing.assert_close(torch.nn.functional.linear(x, w, b)[..., nq:nq + nkv], want, rtol=1e-12, atol=1e-12)


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


def test_setting_and_refusals():
    """Fault caught: a typo in --fuse or KVPIPE_FUSE silently running unfused (or fused), the
    environment overriding an explicit flag, a default other than auto, `on` accepted where decode
    is not replayed (it would silently run unfused), or a model whose activation has no fused form
    run with SiLU anyway."""
    for v, want in (("1", "on"), ("on", "on"), ("TRUE", "on"), ("0", "off"), ("off", "off"), ("auto", "auto"),
                    ("", "auto"), (" ", "auto")):
        assert fuse_mode(None, {FUSE_ENV: v}) == want, v
    assert fuse_mode(None, {}) == "auto"
    assert fuse_mode("off", {FUSE_ENV: "1"}) == "off" and fuse_mode("AUTO", {FUSE_ENV: "0"}) == "auto"
    with pytest.raises(ValueError, match=FUSE_ENV):
        fuse_mode(None, {FUSE_ENV: "yes please"})
    with pytest.raises(ValueError, match="^fuse: "):
        fuse_mode("1", {})          # the flag takes the three words only
    assert [decode_fused(m, r) for m in ("auto", "on", "off") for r in (True, False)] == \
        [True, False, True, False, False, False]
    refuse_unfusable("auto", False)
    refuse_unfusable("on", True)
    with pytest.raises(ValueError, match="^fuse: on needs decode steps replayed"):
        refuse_unfusable("on", False)
    m = tiny("llama", torch.float32, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        FusedDecode(HFAdapter(m), compile=False)
    # where the pieces cannot run: auto says why and runs unfused, on is refused
    for model in (m, tiny("llama", torch.float32)):           # gelu; and a CPU model
        fused, note = make_fused(HFAdapter(model), "auto")
        assert fused is None and note.startswith("fuse: auto runs decode unfused: ")
        with pytest.raises(ValueError, match="^fuse: on cannot run here"):
            make_fused(HFAdapter(model), "on")
    assert make_fused(HFAdapter(m), "off") == (None, None)


_FAILING_COMPILE = """
import json, sys, torch
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.fused import FusedDecode, warm_or_fall_back
from test_fused import tiny
f = FusedDecode(HFAdapter(tiny("llama", torch.bfloat16)), compile=True)
with torch.inference_mode():
    seconds, note = warm_or_fall_back(f, "auto", torch.zeros(1, dtype=torch.long))
    print(json.dumps(note))
    try:
        warm_or_fall_back(f, "on", torch.zeros(1, dtype=torch.long))
        print("on: no error")
    except ValueError as e:
        print("on:", str(e).splitlines()[0])
"""


def test_auto_falls_back_unfused_when_compile_fails():
    """Fault caught: a torch.compile failure under auto surfacing as a traceback (or as a half-
    compiled step) instead of one line saying decode runs unfused; and `on` swallowing it. The
    failure is real: inductor on CPU pointed at a C++ compiler that does not exist (CXX)."""
    env = dict(os.environ, CXX="/nonexistent/g++", PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", _FAILING_COMPILE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line, on = out.stdout.strip().splitlines()[-2:]
    note = json.loads(line)
    assert note.startswith("fuse: torch.compile of the fused decode pieces failed (") and "\n" not in note, note
    assert note.endswith("decode runs unfused") and "C++ compiler" in note, note
    assert on.startswith("on: fuse: torch.compile of the fused decode pieces failed"), on


def test_fuse_flag_on_plan_and_run(tiny_config, capsys):
    """Fault caught: --fuse not reaching the prediction (fused and unfused predicted alike, or the
    compile time missing), a bad value accepted or refused with a traceback, `on` accepted on the
    CPU (whose decode is never replayed, so it would silently run unfused), and auto fusing on the
    CPU instead of falling back to the unfused eager decode."""
    from kvpipe.cli import main

    def plan(*extra):
        rc = main(["plan", "--model", "llama-3-8b", "--hw", "h200", "--context", "8K", "--decode-tokens", "4",
                   "--group", "8", "--resident", "all", "--gpu-mem", "24GB", "--json", *extra])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out)
    auto_json, off_json = plan(), plan("--fuse", "off")
    auto, off = auto_json["predicted"], off_json["predicted"]
    assert "decode fused (one-time compile 5.4 s" in auto_json["planner"]["reason"]
    assert "decode fused" not in off_json["planner"]["reason"]
    assert auto["fused_decode"] is True and auto["compile_s"] == 5.4
    assert off["fused_decode"] is False and off["compile_s"] == 0.0
    assert auto["decode_s_per_token"] < off["decode_s_per_token"] and auto["prefill_s"] == off["prefill_s"]
    for cmd in (["plan"], ["run", "--device", "cpu", "--model", tiny_config, "--random-weights", "--context", "64"]):
        rc = main(cmd + ["--fuse", "sometimes"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "--fuse" in err[0] and "invalid choice" in err[0], (cmd, err)
    common = ["run", "--device", "cpu", "--no-progress", "--model", tiny_config, "--random-weights",
              "--context", "64", "--decode-tokens", "2"]
    rc = main(common + ["--fuse", "on"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvpipe: error: --fuse: on needs decode steps replayed"), err
    rc = main(common + ["--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(out)
    assert res["decode_issue"]["fuse"] == "auto" and res["decode_issue"]["fused"] is False
    assert res["predicted"] is None and res["decode_issue"]["compile_s"] == 0.0   # no profile predicts a CPU


# ---- CUDA: fused decode under replay -------------------------------------------------------------
def fused_run(model, case, replay, fuse, plan=None):
    res = run(model, case, replay, plan=plan, fuse="on" if fuse and replay != "off" else "off")
    assert res.fused is (fuse and replay != "off")
    return res


@pytest.mark.gpu
def test_auto_fuses_replayed_decode_by_default(tiny_model, monkeypatch):
    """Fault caught: the default (no --fuse, no KVPIPE_FUSE) not fusing a replayed CUDA decode, or
    fusing an eager one; KVPIPE_FUSE=0 not turning it off."""
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.workload import Workload
    from test_replay import headwise
    monkeypatch.delenv(FUSE_ENV, raising=False)
    model = cuda_model(tiny_model)
    spec = HFAdapter(model).spec()
    w = Workload(40, 3, 1)
    g = build(spec, w, headwise(1, 16, 2, 0, 1, 2))
    ids = torch.randint(0, spec.vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    assert execute(g, model, ids, "cuda", replay="auto").fused is True
    assert execute(g, model, ids, "cuda", replay="off").fused is False
    monkeypatch.setenv(FUSE_ENV, "0")
    assert execute(g, model, ids, "cuda", replay="auto").fused is False


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
