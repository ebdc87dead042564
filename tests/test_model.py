"""Tests of pipeline/model.py and pipeline/units.py: sizes and FLOPs against hand-computed values,
causal pair counts against brute force, Hugging Face configs, token-count parsing."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.pipeline.model import FAMILIES, PRESETS, ModelSpec, causal_pairs, from_hf_config
from kvpipe.pipeline.units import parse_tokens

LLAMA3_8B = PRESETS["llama-3-8b"]

# config.json of the released checkpoints (fields the planner reads, values as published).
LLAMA3_8B_CFG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "attention_bias": False, "rope_theta": 500000.0,
}
MISTRAL_7B_CFG = {
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "sliding_window": 4096,
}
QWEN2_7B_CFG = {  # no "attention_bias" key: Qwen2 has q/k/v biases regardless
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
QWEN3_8B_CFG = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "attention_bias": False,
}
QWEN3_0_6B_CFG = {  # head_dim 128 though hidden / heads = 64; tied embeddings
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "head_dim": 128,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    "attention_bias": False,
}


def tiny(**kw) -> ModelSpec:
    base = dict(name="tiny", family="llama", layers=2, hidden=32, q_heads=4, kv_heads=2,
                head_dim=8, intermediate=64, vocab=100)
    return ModelSpec(**{**base, **kw})


# ---- sizes -------------------------------------------------------------------------------
def test_llama3_8b_kv_bytes_per_token():
    # 32 layers x 8 KV heads x (K and V) x 128 dims x 2 bytes (bf16)
    assert LLAMA3_8B.kv_bytes_per_token == 32 * 8 * 2 * 128 * 2 == 131072
    assert LLAMA3_8B.kv_unit_bytes_per_token == 512
    assert LLAMA3_8B.units == 256


def test_llama3_8b_weights():
    # Per layer: q 4096x4096, k and v 4096x1024 each, o 4096x4096, MLP 3 x 4096x14336, 2 norms.
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA3_8B.layer_params == layer == 218_112_000
    # Embedding and untied lm_head (128256 x 4096 each), 32 layers, final norm.
    assert LLAMA3_8B.params == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    assert LLAMA3_8B.weight_bytes == 16_060_522_496
    assert LLAMA3_8B.layer_weight_bytes == 2 * layer
    assert LLAMA3_8B.head_weight_bytes == 128256 * 4096 * 2


def test_published_parameter_counts():
    # Parameter counts as the released checkpoints report them.
    assert PRESETS["mistral-7b"].params == 7_241_732_096
    assert PRESETS["qwen2-7b"].params == 7_615_616_512
    assert PRESETS["llama-2-7b"].params == 6_738_415_616
    assert PRESETS["llama-2-13b"].params == 13_015_864_320
    assert PRESETS["llama-3-70b"].params == 70_553_706_496


def test_llama3_8b_flops_per_token():
    # 2 FLOPs per multiply-add; q, k, v: 4096 x (4096 + 1024 + 1024).
    qkv = 2 * 4096 * (4096 + 1024 + 1024)
    assert LLAMA3_8B.qkv_flops_per_token == qkv == 50_331_648
    # o_proj 4096 x 4096 plus gate, up, down 4096 x 14336 each.
    mlp = 2 * 4096 * 4096 + 3 * 2 * 4096 * 14336
    assert LLAMA3_8B.mlp_flops_per_token == mlp == 385_875_968
    assert LLAMA3_8B.dense_flops_per_token == 32 * (qkv + mlp) == 13_958_643_712
    # ... which is 2 x the matmul weights of the layers (norm weights do no matmul).
    assert LLAMA3_8B.dense_flops_per_token == 2 * 32 * (LLAMA3_8B.layer_params - 2 * 4096)
    assert LLAMA3_8B.head_flops_per_token == 2 * 4096 * 128256


def test_attn_flops_small_case():
    m = tiny()  # 4 query heads, head_dim 8: 4 * 8 * 4 = 128 FLOPs per allowed (query, key) pair
    # Queries 2, 3, 4 over keys [0, 5), causal: they see 3 + 4 + 5 = 12 keys.
    assert m.attn_flops(2, 5, 5) == 128 * 12 == 1536
    # Queries 0..3 over keys [0, 2): they see 1, 2, 2, 2 keys.
    assert m.attn_flops(0, 4, 2) == 128 * 7
    # Two query heads only (one GQA group of this model).
    assert m.attn_flops(2, 5, 5, q_heads=2) == 4 * 8 * 2 * 12
    # A single decode query at position 9 over the 10 keys [0, 10).
    assert m.attn_flops(9, 10, 10) == 128 * 10
    assert m.attn_flops(3, 3, 5) == 0 and m.attn_flops(0, 3, 0) == 0


@settings(max_examples=200, deadline=None)
@given(q_start=st.integers(0, 40), n=st.integers(0, 40), k_end=st.integers(0, 90))
def test_causal_pairs_brute_force(q_start, n, k_end):
    """Fault caught: an off-by-one in the closed form of causal (query, key) pairs."""
    q_end = q_start + n
    brute = sum(1 for i in range(q_start, q_end) for j in range(k_end) if j <= i)
    assert causal_pairs(q_start, q_end, k_end) == brute


def test_causal_pairs_empty_ranges():
    """Fault caught: negative pair counts for empty ranges."""
    assert causal_pairs(5, 3, 10) == 0
    assert causal_pairs(0, 10, -1) == 0


# ---- validation --------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("layers", 0), ("hidden", -1), ("kv_heads", 3),
                                         ("dtype", "int8"), ("family", "gpt2")])
def test_bad_spec_names_the_field(field, value):
    """Fault caught: an invalid ModelSpec accepted or refused without naming the field."""
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


# ---- Hugging Face configs ----------------------------------------------------------------
def test_from_hf_config_llama():
    """Fault caught: a Llama config.json field misread (differs from the preset)."""
    m = from_hf_config(LLAMA3_8B_CFG, name="llama-3-8b")
    assert m == PRESETS["llama-3-8b"]


def test_from_hf_config_mistral():
    """Fault caught: a Mistral config.json field misread (v0.1: a 4096-token window on every
    layer; v0.2 on: sliding_window null, no window)."""
    m = from_hf_config(MISTRAL_7B_CFG, name="mistral-7b-v0.1")
    assert m == PRESETS["mistral-7b-v0.1"]
    assert from_hf_config(dict(MISTRAL_7B_CFG, sliding_window=None), name="mistral-7b") == PRESETS["mistral-7b"]
    assert m.family == "mistral"


def test_from_hf_config_qwen2():
    """Fault caught: Qwen2's implicit q/k/v biases missed."""
    m = from_hf_config(QWEN2_7B_CFG, name="qwen2-7b")
    assert m == PRESETS["qwen2-7b"]
    assert m.qkv_bias and not m.qk_norm and m.head_dim == 128


def test_from_hf_config_qwen3():
    m = from_hf_config(QWEN3_8B_CFG)
    assert (m.family, m.layers, m.kv_heads, m.head_dim, m.qk_norm, m.qkv_bias) == \
        ("qwen3", 36, 8, 128, True, False)
    assert m.params == 8_190_735_360        # as the Qwen3-8B checkpoint reports
    small = from_hf_config(QWEN3_0_6B_CFG)
    assert small.head_dim == 128            # explicit head_dim wins over hidden / heads
    assert small.tie_embeddings
    assert small.params == 596_049_920      # Qwen3-0.6B, embedding counted once


def test_from_hf_config_defaults():
    """Fault caught: wrong defaults for a missing num_key_value_heads or torch_dtype."""
    cfg = {k: v for k, v in LLAMA3_8B_CFG.items() if k not in ("num_key_value_heads", "torch_dtype")}
    m = from_hf_config({**cfg, "torch_dtype": "float16"})
    assert m.dtype == "fp16"
    assert from_hf_config(cfg).kv_heads == 32 and from_hf_config(cfg).dtype == "bf16"


def test_from_hf_config_gemma2_softcaps_default_as_hf_does():
    """Fault caught: a Gemma 2 config.json without the softcap fields read as uncapped, where
    transformers' Gemma2Config (the reference here) caps the attention and final logits; an
    explicit null still means none."""
    from transformers import Gemma2Config
    ref = Gemma2Config()
    cfg = dict(model_type="gemma2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=96, num_hidden_layers=2, vocab_size=128)
    m = from_hf_config(cfg)
    assert (m.softcap, m.final_softcap) == (ref.attn_logit_softcapping, ref.final_logit_softcapping)
    none = from_hf_config(dict(cfg, attn_logit_softcapping=None, final_logit_softcapping=None))
    assert (none.softcap, none.final_softcap) == (0.0, 0.0)
    assert from_hf_config(dict(cfg, model_type="gemma3_text")).final_softcap == 0.0


def test_from_hf_config_unknown_type_lists_supported():
    """Fault caught: an unknown model_type refused without naming it and the supported ones."""
    with pytest.raises(ValueError) as e:
        from_hf_config({**LLAMA3_8B_CFG, "model_type": "gpt_neox"})
    msg = str(e.value)
    assert "gpt_neox" in msg and "model_type" in msg
    for family in FAMILIES:
        assert family in msg


def test_from_hf_config_missing_field():
    """Fault caught: a missing config field failing with a KeyError instead of naming it."""
    cfg = {k: v for k, v in LLAMA3_8B_CFG.items() if k != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size"):
        from_hf_config(cfg)


# ---- token counts ------------------------------------------------------------------------
@pytest.mark.parametrize("text,tokens", [("1M", 1048576), ("128K", 131072), ("131072", 131072),
                                         ("128k", 131072), (" 2M ", 2097152), ("0.5K", 512),
                                         (4096, 4096)])
def test_parse_tokens(text, tokens):
    """Fault caught: K/M suffixes, case or whitespace parsed wrongly (1K must be 1024)."""
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "abc", "1G", "1.5", "12 tokens", "1MB", "K"])
def test_parse_tokens_rejects(text):
    """Fault caught: malformed token counts accepted, or refused without naming the flag."""
    with pytest.raises(ValueError, match="^decode_tokens:"):
        parse_tokens(text, "decode_tokens")
    with pytest.raises(ValueError, match="^context:"):
        parse_tokens(text)


def test_an_existing_folder_without_config_is_not_called_an_unknown_preset(tmp_path, monkeypatch):
    """Fault caught: `--model notamodel`, a folder that exists but holds no config.json, answered
    "unknown preset 'notamodel'" (only `./notamodel` got "no config.json"): a user's own folder
    named as if they had mistyped a preset."""
    from kvpipe.pipeline.model import load_model
    (tmp_path / "notamodel").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^model: no config.json at 'notamodel'$"):
        load_model("notamodel")
    with pytest.raises(ValueError, match=r"^model: unknown preset 'nosuch'"):
        load_model("nosuch")
