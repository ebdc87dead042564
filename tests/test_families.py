"""The families beyond Llama/Mistral/Qwen, each through HF's own modules on a tiny random config:
Gemma 2 (alternating local/global layers, logit softcaps, query_pre_attn_scalar, tied scaled
embeddings), Gemma 3 (local and global rope bases, q/k norms), Phi-3/4 (fused qkv and gate-up,
longrope, partial rotary), Llama 3.1 `llama3` rope past its original positions. Tokens equal HF's
greedy, offloaded == resident bit for bit; presets rebuild their layer kinds; plans per layer kind."""
import json

import pytest
import torch

from kvpipe.executor.layers.loader import random_model
from kvpipe.pipeline.model import PRESETS, from_hf_config
from kvpipe.pipeline.replay import blocker
from kvpipe.pipeline.workload import Workload

from test_end_to_end import TOL, headwise, hf_greedy, run_kvpipe

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=1)
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "gemma2": dict(model_type="gemma2", sliding_window=4, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0),
    "gemma3": dict(model_type="gemma3_text", sliding_window=4, query_pre_attn_scalar=12,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3-longrope": dict(model_type="phi3", max_position_embeddings=64, original_max_position_embeddings=16,
                          rope_parameters=dict(
        _LONGROPE, short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.3 * i for i in range(8)])),
    "phi4-mini-partial-rotary": dict(model_type="phi3", max_position_embeddings=64, tie_word_embeddings=True,
                                     original_max_position_embeddings=16,
                                     rope_parameters=dict(_LONGROPE, partial_rotary_factor=0.5,
                                                          short_factor=[1.0] * 4, long_factor=[3.0, 2.5, 2.0, 1.5])),
    "llama3-rope": dict(model_type="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
}
CONTEXT, DECODE, CHUNK = 23, 9, 5   # positions to 31: past every original_max_position_embeddings above
PLANS = [headwise(2, CONTEXT, 1, 6), headwise(1, CHUNK, 2, 2, decode_group=2),
         headwise(2, CHUNK, 3, 0, decode_group=1, decode_depth=1)]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_hf_greedy_and_placement(name):
    """Fault (each seen failing): Gemma's post-attention/feed-forward norms skipped, its attention
    softcap or final softcap dropped, Gemma 3's global layers given the local rope base, Phi's
    fused qkv split in the wrong order, longrope's factor picked per prefill chunk instead of by
    the prompt's last position (HF's call), or a placement-dependent bit."""
    model = random_model(dict(BASE, **FAMILIES[name]), "cpu", torch.float32, seed=7)
    ids = torch.randint(2, 128, (1, CONTEXT), generator=torch.Generator().manual_seed(11))
    ref_logits, ref_tokens = hf_greedy(model, ids, DECODE)
    runs = [run_kvpipe(model, ids, DECODE, plan) for plan in PLANS]
    for plan, res in zip(PLANS, runs):
        torch.testing.assert_close(res.step_logits, ref_logits, **TOL[torch.float32])
        assert torch.equal(res.tokens, ref_tokens), plan.describe()
    assert torch.equal(runs[1].step_logits, runs[2].step_logits)


NEW_PRESETS = ["llama-3.1-8b", "mistral-7b-v0.1", "gemma-2-2b", "gemma-2-9b", "gemma-3-4b", "gemma-3-12b",
               "phi-3-mini-128k", "phi-4"]


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_preset_rebuilds_its_layer_kinds(name):
    """Fault: a preset's random-weights config (session.preset_config) losing its windows,
    softcap, q/k norms, family model type or rope (the run would then be refused as another model,
    or run another model), or a preset outside FAMILIES."""
    from kvpipe.executor.engine.session import preset_config
    spec = PRESETS[name]
    cfg = preset_config(spec)
    back = from_hf_config(cfg, name=name)
    assert back == spec and back.rope == spec.rope, (back, spec)


def test_gemma_2_9b_plans_per_layer_kind(capsys):
    """Fault: the plan's breakdown without the KV per layer kind, the kinds miscounted (Gemma 2
    alternates: 21 local, 21 global), or --max-context without an answer for a hybrid model."""
    from kvpipe.cli import main
    assert main("plan --model gemma-2-9b --hw rtx4090 --context 1M --json".split()) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {r["kind"]: r["layers"] for r in out["kv_per_layer_kind"]}
    assert kinds == {"sliding 4096": 21, "full": 21} and out["fits"]
    assert main("plan --model gemma-3-12b --hw rtx4090 --max-context --json".split()) == 0
    assert json.loads(capsys.readouterr().out)["max_context"] > 131072


def test_decode_replay_refused_for_kinds_its_kernel_cannot_express():
    """Fault: a softcap or longrope model replayed with the graph's FA2 call, which attends
    uncapped at fixed frequencies (wrong tokens on the GPU); window models replay (their window
    gathered, executor/replay/window_step.py; tests/test_window_replay.py)."""
    work = Workload(8192, 8)
    for name in ("gemma-2-9b", "phi-3-mini-128k"):
        assert "eagerly" in blocker(PRESETS[name], work), name
    for name in ("phi-4", "gemma-3-12b", "mistral-7b-v0.1"):
        assert blocker(PRESETS[name], work) is None, name
    assert blocker(PRESETS["mistral-7b-v0.1"], Workload(1000, 8)) is None   # window > the run: full


def test_softcapped_offload_is_refused_on_cuda():
    """The H200 saw offloaded != resident logits for Gemma 2's capped attention: such a plan is
    refused on CUDA on one line naming --resident, and runs with every unit resident (fault: the
    refusal dropped, so an inexact placement runs; or it refuses the resident plan too)."""
    from kvpipe.executor.engine.session import check_runnable
    spec = PRESETS["gemma-2-9b"]
    offloaded = headwise(2, 4096, 2, 0)
    with pytest.raises(ValueError, match="--resident"):
        check_runnable(offloaded, torch.device("cuda"), spec)
    check_runnable(offloaded.with_(resident=spec.units), torch.device("cuda"), spec)
    check_runnable(offloaded, torch.device("cpu"), spec)   # bit-exact on the CPU (the tests above)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma3", "phi3-longrope"])
def test_family_on_cuda(name):
    """CUDA: fp32 against HF's greedy tokens; bf16 (FA2/cuDNN chunks, the masked window call)
    offloaded == resident bit for bit. Fault: a kernel choice that depends on where the prefix
    lives, or a window/softcap path that differs from HF on the GPU."""
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(dict(BASE, **FAMILIES[name]), "cuda", dtype, seed=7)
        ids = torch.randint(2, 128, (1, CONTEXT), generator=torch.Generator().manual_seed(11)).cuda()
        runs = [run_kvpipe(model, ids, DECODE, plan) for plan in PLANS[1:]]
        assert torch.equal(runs[0].step_logits, runs[1].step_logits)
        if dtype == torch.float32:
            ref_logits, ref_tokens = hf_greedy(model, ids, DECODE)
            torch.testing.assert_close(runs[0].step_logits, ref_logits, rtol=1e-3, atol=1e-4)
            assert torch.equal(runs[0].tokens, ref_tokens)


def test_headwise_attention_caps_scores_or_refuses():
    """Fault: the `kvpipe_headwise` attention function ignoring Gemma 2's softcap (HF passes it as
    a keyword the function swallowed), on plain tensors or through HeadwiseCache's stream."""
    from kvpipe.executor.hf.attention import PendingKV, headwise_attention
    from test_sliding import windowed_reference
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    mod = torch.nn.Module().eval()
    out, _ = headwise_attention(mod, q, k, v, None, scaling=0.4, softcap=2.0)
    torch.testing.assert_close(out.transpose(1, 2).double(), windowed_reference(q, k, v, 0.4, 0, 2.0),
                               rtol=1e-5, atol=1e-6)
    pending = PendingKV(None, 0, torch.empty(0))
    with pytest.raises(ValueError, match="softcap"):
        headwise_attention(mod, q, pending, pending, None, scaling=0.4, softcap=2.0)
