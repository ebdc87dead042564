"""End to end: kvpipe's executor against the HF model run with its own cache (logits within the
dtype's tolerance, greedy tokens identical), and the loaders (random and local directory)."""

import inspect

import pytest
import torch

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.loader import load_pretrained, random_model
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.report import timing_from_trace
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float32: dict(rtol=1e-4, atol=2e-5), torch.float64: dict(rtol=1e-9, atol=1e-11),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def hf_greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: HF prefill over the whole prompt, then `steps` one-token steps with its
    own cache. Returns fp32 logits [steps + 1, B, V] and greedy tokens [B, steps + 1]."""
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    logits, tokens, cache = [], [], None
    with torch.inference_mode():
        x = ids
        for _ in range(steps + 1):
            out = model(x, use_cache=True, **({kw: cache} if cache is not None else {}))
            cache = getattr(out, kw)
            logits.append(out.logits[:, -1].float())
            tokens.append(logits[-1].argmax(-1))
            x = tokens[-1][:, None]
    return torch.stack(logits), torch.stack(tokens, dim=1)


def run_kvpipe(model, ids, decode, plan, device=None):
    spec = HFAdapter(model).spec()
    graph = build(spec, Workload(ids.shape[1], decode, ids.shape[0]), plan)
    return execute(graph, model, ids, device, keep_logits=True)


def headwise(group, chunk, depth, resident, decode_group=None, decode_depth=None):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth),
                PhasePlan(decode_group or group, 1, decode_depth or depth), resident)


CASES = [  # family, kv heads, q heads, head_dim, layers, dtype
    ("llama", 2, 8, 16, 3, torch.float32),
    ("llama", 8, 8, 16, 2, torch.float64),
    ("mistral", 4, 8, 16, 2, torch.float32),
    ("qwen2", 2, 4, 32, 2, torch.float32),
    ("qwen2", 1, 4, 16, 2, torch.float64),
    ("qwen3", 2, 8, 16, 2, torch.float32),
]


@pytest.mark.parametrize("family,kv,q,d,layers,dtype", CASES)
def test_matches_hf_with_its_cache(tiny_model, family, kv, q, d, layers, dtype):
    model = tiny_model(family, kv_heads=kv, q_heads=q, head_dim=d, layers=layers, dtype=dtype)
    ids = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(kv * 31 + d))
    decode = 9
    ref_logits, ref_tokens = hf_greedy(model, ids, decode)
    units = layers * kv
    plans = [headwise(kv, 29, 1, units),                               # standard: all resident, one pass
             headwise(1, 7, 2, units // 3, decode_group=kv),            # offloaded, chunked
             headwise(kv, 5, 3, 0, decode_group=1, decode_depth=1)]
    if kv >= 4:   # groups of several heads, several groups per layer, one of them half resident
        plans.append(headwise(kv // 2, 6, 2, layers * kv // 2 - 1, decode_group=kv // 2))
    for plan in plans:
        res = run_kvpipe(model, ids, decode, plan)
        torch.testing.assert_close(res.step_logits, ref_logits, **TOL[dtype])
        assert torch.equal(res.tokens, ref_tokens), (plan.describe(), res.tokens, ref_tokens)
    # The production path keeps no per-step logits: its last logits (what the output digest
    # hashes) must be the last step's, and keep_logits must change no bit.
    lean = execute(build(HFAdapter(model).spec(), Workload(29, decode, 2), plans[-1]), model, ids)
    assert lean.step_logits is None and torch.equal(lean.last_logits, res.step_logits[-1])
    torch.testing.assert_close(lean.last_logits, ref_logits[-1], **TOL[dtype])


def test_prefill_only_and_single_token_prompt(tiny_model):
    """Fault caught: the edge workloads (no decode step; a one-token prompt) leaving HF's logits or
    tokens."""
    model = tiny_model("llama", kv_heads=2)
    for ctx, decode in ((13, 0), (1, 4)):
        ids = torch.randint(0, 128, (1, ctx), generator=torch.Generator().manual_seed(ctx))
        ref_logits, ref_tokens = hf_greedy(model, ids, decode)
        res = run_kvpipe(model, ids, decode, headwise(1, max(1, ctx // 2), 2, 1))
        torch.testing.assert_close(res.step_logits, ref_logits, **TOL[torch.float32])
        assert torch.equal(res.tokens, ref_tokens)
        assert res.tokens.shape == (1, decode + 1)


def test_trace_is_measured_and_reportable(tiny_model):
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    res = run_kvpipe(model, ids, 4, headwise(1, 8, 2, 1))
    tr = res.trace
    assert tr.source == "real" and len(tr.spans) == len(tr.graph.stages)
    assert [sp.stage for sp in tr.spans] == list(range(len(tr.graph.stages)))
    assert all(0 <= sp.start_s <= sp.end_s and sp.host_s >= 0 for sp in tr.spans)
    for s in tr.graph.stages:  # a stage starts after its dependencies ended (host clock on CPU)
        assert all(tr.spans[d].end_s <= tr.spans[s.id].start_s for d in s.deps)
    t = timing_from_trace(tr)
    assert 0 < t.ttft_s <= t.total_s and t.decode_s_per_token > 0
    assert res.peak_gpu_bytes == 0 and res.host_pinned_bytes > 0


def test_random_model_is_seeded_and_leaves_the_rng_alone():
    """Fault caught: random weights that depend on global RNG state, or that disturb it."""
    cfg = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    state = torch.get_rng_state()
    a, b = random_model(cfg, seed=3), random_model(cfg, seed=3)
    c = random_model(cfg, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert random_model(cfg, dtype=torch.float64).model.embed_tokens.weight.dtype == torch.float64


def test_unsupported_architectures_are_named():
    """Fault caught: an unsupported model run anyway, or refused without naming it and the supported
    list."""
    with pytest.raises(ValueError, match="gpt2.*supported: gemma2, gemma3_text, llama, mistral, phi3, qwen2, qwen3"):
        random_model(dict(model_type="gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        HFAdapter(gpt2)


def test_load_pretrained_from_a_local_directory(tiny_model, tmp_path):
    model = tiny_model("qwen2", kv_heads=2, q_heads=4, head_dim=16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    loaded = load_pretrained(tmp_path, "cpu", torch.float32)
    for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), name
    ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(5))
    plan = headwise(1, 4, 2, 1)
    # The weights are meant to be equal, and are compared bitwise above. The logits are not
    # compared bitwise: safetensors hands back tensors that may sit off a 64-byte boundary, and
    # on AVX-512 CPUs a 1-row matmul then takes another kernel path that changes the last bits.
    # Fault caught: a loader that drops, transposes or re-casts a weight (tokens/logits diverge).
    a, b = run_kvpipe(model, ids, 3, plan), run_kvpipe(loaded, ids, 3, plan)
    torch.testing.assert_close(a.step_logits, b.step_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.tokens, b.tokens)
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(tmp_path / "missing")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_matches_hf_cuda_fp32(tiny_model, family):
    """CUDA fp32 (memory-efficient attention kernel) against HF with its own cache."""
    model = tiny_model(family, kv_heads=4, q_heads=8, head_dim=64, layers=2, device="cuda")
    ids = torch.randint(0, 128, (2, 67), generator=torch.Generator().manual_seed(1)).cuda()
    ref_logits, ref_tokens = hf_greedy(model, ids, 8)
    res = run_kvpipe(model, ids, 8, headwise(2, 16, 3, 3, decode_group=1))
    torch.testing.assert_close(res.step_logits, ref_logits, rtol=1e-3, atol=1e-4)
    assert torch.equal(res.tokens, ref_tokens)
