"""Sliding-window layers: which keys a query sees (HF's `kv > q - W`, its own key included) at
prefill chunk boundaries and in decode, against an independent float64 reference; Mistral and
Qwen2 window configs (window smaller than a prefill chunk, equal to it, larger than the context)
against HF's greedy tokens, offloaded == resident bit for bit; the KV per layer kind; refusals of
what kvpipe cannot run exactly, before any work."""
import json

import pytest
import torch

from kvpipe.executor.layers.banded import attend_kind
from kvpipe.executor.layers.loader import random_model
from kvpipe.pipeline.memory import kv_by_kind
from kvpipe.pipeline.model import PRESETS, from_hf_config
from kvpipe.pipeline.workload import Workload

from test_end_to_end import TOL, headwise, hf_greedy, run_kvpipe

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
CONTEXT, DECODE, CHUNK = 23, 9, 5


def windowed_reference(q, k, v, scale, window, softcap=0.0):
    """float64: query row t of q [B, Hq, T, D] sits at position S - T + t of k, v [B, Hkv, S, D]
    and sees key j iff j <= its position and (window 0 or j > position - window)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty(B, Hq, T, D, dtype=torch.float64)
    for h in range(Hq):
        kh = h // (Hq // Hkv)
        for t in range(T):
            i = S - T + t
            lo = 0 if not window else max(0, i - window + 1)
            s = q[:, h, t].double() @ k[:, kh, lo:i + 1].double().transpose(-1, -2) * scale   # [B, n]
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            out[:, h, t] = torch.softmax(s, -1) @ v[:, kh, lo:i + 1].double()
    return out


@pytest.mark.parametrize("P,T,W,cap", [(0, 7, 3, 0.0), (9, 5, 3, 0.0), (9, 5, 5, 0.0), (10, 5, 6, 0.0),
                                       (4, 5, 64, 0.0), (17, 1, 4, 0.0), (3, 1, 8, 0.0), (9, 5, 3, 4.0),
                                       (12, 1, 5, 4.0), (6, 4, 0, 4.0)])
def test_window_sees_what_hf_sees_at_chunk_boundaries(P, T, W, cap):
    """Fault: an off-by-one in the window (a query seeing W + 1 keys, or W - 1: `>=` for `>`, or
    first_visible without its + 1), a chunk's later rows cut at the first row's window start, or a
    softcap applied after the mask / not at all."""
    g = torch.Generator().manual_seed(P * 100 + T * 10 + W)
    q = torch.randn(1, 4, T, 8, generator=g)
    k, v = torch.randn(2, 1, 2, P + T, 8, generator=g)
    got = attend_kind(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], 0.3, W, cap)
    torch.testing.assert_close(got.double(), windowed_reference(q, k, v, 0.3, W, cap), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("P,T,W", [(0, 300, 8), (200, 300, 16), (1000, 257, 8), (40, 130, 64), (3, 90, 50)])
def test_windowed_flash_sees_what_hf_sees_on_cuda(P, T, W):
    """The GPU's windowed FA2 call (bf16) against the float64 reference. Fault (not seen failing on
    this CPU-only machine): FA2's left window W (each query one key too many) or W - 2, the causal
    alignment top-left instead of at the last key, or the prefix tail cut at the wrong first key."""
    g = torch.Generator().manual_seed(P + T + W)
    q = torch.randn(1, 4, T, 64, generator=g)
    k, v = torch.randn(2, 1, 2, P + T, 64, generator=g)
    dev = lambda x: x.to("cuda", torch.bfloat16)   # noqa: E731
    got = attend_kind(dev(q), dev(k[:, :, :P]), dev(v[:, :, :P]), dev(k[:, :, P:]), dev(v[:, :, P:]), 0.5, W)
    ref = windowed_reference(*(dev(x).cpu() for x in (q, k, v)), 0.5, W)
    assert (got.double().cpu() - ref).abs().max().item() < 2e-2, (P, T, W)


def _model(**cfg):
    return random_model(dict(BASE, **cfg), "cpu", torch.float32, seed=len(json.dumps(cfg)))


PLANS = [headwise(2, CONTEXT, 1, 4),                            # all resident, one prefill pass
         headwise(1, CHUNK, 2, 1, decode_group=2),               # chunked, mostly offloaded
         headwise(2, CHUNK, 3, 0, decode_group=1, decode_depth=1)]   # chunked, all offloaded


@pytest.mark.parametrize("cfg", [dict(model_type="mistral", sliding_window=3),          # < chunk
                                 dict(model_type="mistral", sliding_window=CHUNK),      # = chunk
                                 dict(model_type="mistral", sliding_window=64),         # > context
                                 dict(model_type="qwen2", sliding_window=4, use_sliding_window=True,
                                      max_window_layers=1)],                            # layer 0 full, 1 local
                         ids=["mistral-w3", "mistral-w5", "mistral-w64", "qwen2-mixed"])
def test_window_configs_match_hf_greedy_and_placement(cfg):
    """Fault: window layers attended in full (tokens differ from HF's once the context passes the
    window), the window applied to Qwen2's full layers, or a placement-dependent path (offloaded
    logits differ from resident ones in a bit)."""
    model = _model(**cfg)
    ids = torch.randint(0, 128, (1, CONTEXT), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_tokens = hf_greedy(model, ids, DECODE)
    runs = [run_kvpipe(model, ids, DECODE, plan) for plan in PLANS]
    for plan, res in zip(PLANS, runs):
        torch.testing.assert_close(res.step_logits, ref_logits, **TOL[torch.float32])
        assert torch.equal(res.tokens, ref_tokens), plan.describe()
    assert torch.equal(runs[1].step_logits, runs[2].step_logits)   # same chunks, other placement


def test_kv_per_layer_kind():
    """Fault: a window layer's KV counted at full length (the store keeps a ring of W - 1 + 4
    tokens), a kind missing from the breakdown, the window's floor not capped at the run's
    length, or a run shorter than the ring counted at the ring."""
    m = PRESETS["gemma-3-12b"]
    work = Workload(131072, 0)
    rows = {r["kind"]: r for r in kv_by_kind(m, work)}
    per_layer = m.kv_heads * m.kv_unit_bytes_per_token
    assert rows["full"]["layers"] == 8 and rows["sliding 1024"]["layers"] == 40
    assert rows["sliding 1024"]["kv_bytes"] == 40 * per_layer * (1024 - 1 + 4)
    assert rows["full"]["kv_bytes"] == 8 * per_layer * 131072
    assert rows["sliding 1024"]["window_bytes"] == 40 * per_layer * 1024
    assert sum(r["full_bytes"] for r in rows.values()) == m.kv_bytes_per_token * 131072
    short = {r["kind"]: r for r in kv_by_kind(m, Workload(500, 0))}
    assert short["sliding 1024"]["window_bytes"] == short["sliding 1024"]["kv_bytes"] == 40 * per_layer * 500


def test_hf_default_window_is_read_and_a_wide_window_runs(tmp_path, capsys):
    """Fault: a Mistral config.json without a sliding_window field planned without HF's default
    window (the graph's spec and the model's disagree and the run is refused), or a window wider
    than the run treated as unsupported."""
    from kvpipe.cli import main
    spec = from_hf_config(dict(BASE, model_type="mistral"))
    assert spec.windows == (4096, 4096)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, model_type="mistral", torch_dtype="float32")))
    rc = main(["run", "--device", "cpu", "--no-progress", "--model", str(path), "--random-weights",
               "--context", "40", "--decode-tokens", "2"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("cfg,named", [(dict(model_type="mamba"), "'mamba' has state-space layers"),
                                       (dict(model_type="qwen3_next"), "linear-attention"),
                                       (dict(model_type="qwen2", layer_types=["linear_attention", "full_attention"]),
                                        "'linear_attention' layers (0)"),
                                       (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                                        "'dynamic'")])
def test_what_cannot_run_exactly_is_refused_before_any_work(cfg, named, tmp_path, capsys):
    """Fault: a non-softmax model type or layer kind, or a dynamic rope, reaching the executor
    (refused only after 'executing N steps', or run inexactly), or refused on more than one line."""
    from kvpipe.cli import main
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BASE, **cfg)))
    rc = main(["run", "--device", "cpu", "--no-progress", "--model", str(path), "--random-weights",
               "--context", "40", "--decode-tokens", "2"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("kvpipe")]
    assert rc == 2 and len(lines) == 1 and named in lines[0] and "executing" not in err, err


def test_window_layers_cost_their_banded_call_and_the_estimate_stays_a_bound():
    """Fault: a window layer's attention costed over its whole prefix (the simulator over-predicts
    a 5:1 model's prefill several-fold), or the planner's estimate left at the full-attention cost
    while the simulation drops to the window's (its lower bound rises above the simulated time and
    pruning can discard the best plan)."""
    from dataclasses import replace

    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.sim.planner import OBJECTIVES, _Search, objective_value
    from kvpipe.sim.simulate import simulate

    m = replace(PRESETS["gemma-3-4b"], layers=6, windows=(1024,) * 5 + (0,))
    work = Workload(20000, 2)
    plan = Plan(Method.HEADWISE, PhasePlan(2, 4096, 2), PhasePlan(2, 1, 2), 6, 0)
    g = build(m, work, plan)
    attn = {(s.layer, s.tokens[0]): s for s in g.stages if s.tag == "attn" and s.phase.name == "PREFILL"}
    local, full = attn[(0, 16384)], attn[(5, 16384)]
    n = 20000 - 16384
    assert local.flops == 4 * m.head_dim * 2 * m.gqa_ratio * n * 1024   # every query sees its 1024 keys
    assert full.flops == m.attn_flops(16384, 20000, 20000, 2 * m.gqa_ratio)
    # the bound at 64K, all resident, where prefill attention sets the time
    work, hw = Workload(65536, 0), load_profile("rtx4090")
    plan = Plan(Method.HEADWISE, PhasePlan(4, 8192, 2), PhasePlan(4, 1, 2), 24, 0)
    s = _Search(m, work, hw, {"gpu": 2**50, "host": 2**50, "disk": 2**50})
    plan = s.stamped(plan)
    pred = simulate(m, work, plan, hw, full=True, replay=s.replays(plan), fuse=s.fuses(plan))
    est = s.estimate(plan)
    for objective in OBJECTIVES:
        assert est.lower_bound(objective) <= objective_value(pred, objective) * (1 + 1e-9), objective


@pytest.mark.parametrize("P,T,W,cap", [(9, 7, 3, 0.0), (0, 9, 4, 0.0), (5, 8, 6, 4.0)])
def test_long_chunks_run_in_row_blocks_each_over_its_own_keys(P, T, W, cap, monkeypatch):
    """Fault: a row block after the first masked at the chunk's first positions (its rows seeing
    keys their window dropped, or missing the chunk's keys before it); the cost model's pairs not
    summed per block (the GPU's windowed call counts the band's pairs: below)."""
    from dataclasses import replace

    import kvpipe.executor.layers.banded as banded
    monkeypatch.setattr(banded, "BANDED_ROWS", 3)
    g = torch.Generator().manual_seed(P + T + W)
    q = torch.randn(1, 4, T, 8, generator=g)
    k, v = torch.randn(2, 1, 2, P + T, 8, generator=g)
    got = attend_kind(q, k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], 0.3, W, cap)
    torch.testing.assert_close(got.double(), windowed_reference(q, k, v, 0.3, W, cap), rtol=1e-5, atol=1e-6)
    m = replace(PRESETS["gemma-3-4b"], layers=1, windows=(1024,))
    assert m.attn_work(0, 3000, 8192, 1)[0] == 4 * m.head_dim * 8192 * 1024
    # from position 0: query i < 1023 sees i + 1 keys (1023 * 1024 / 2 pairs), the other 1025 see 1024
    assert m.attn_work(0, 0, 2048, 1)[0] == 4 * m.head_dim * (1023 * 1024 // 2 + 1025 * 1024)
