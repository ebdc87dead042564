"""The model adapter: runs a Hugging Face decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3, Phi-3/4) piece by piece, in the pieces the stage graph names (embed, qkv, attention per head group, mlp,
head), by calling the model's own modules. It never changes a parameter or a class."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace

import torch

from kvpipe.pipeline.model import ModelSpec, from_hf_config

from kvpipe.executor.layers.attention import attend_chunk
from kvpipe.executor.layers.banded import attend_kind

# HF class name -> family (extension: one line here, if the family's modules match these names).
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
            "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
_POSITION_DEPENDENT_ROPE = ("dynamic",)  # inv_freq depends on every sequence seen so far
_SPEC_FIELDS = ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "vocab", "windows", "softcap")
_HF_TO_SPEC_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def check_supported(model: torch.nn.Module) -> str:
    """The family of `model`, or a ValueError naming it and the supported list."""
    name = type(model).__name__
    if name not in FAMILIES:
        raise ValueError(f"model: unsupported architecture {name!r} (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


class HFAdapter:
    """Pieces of one forward pass over a chunk of T tokens at positions [start, start+T)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.family = check_supported(model)
        self.model = model
        self.body = model.model
        cfg = model.config
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.r = self.q_heads // self.kv_heads
        # The modeling module's own rotary function, called as the HF attention calls it.
        self.apply_rope: Callable = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
        attns = [layer.self_attn for layer in self.body.layers]
        self.windows = [_window(a, cfg) for a in attns]             # 0: full attention
        self.softcaps = [float(getattr(a, "attn_logit_softcapping", None) or 0.0) for a in attns]
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        # Gemma 3: one rotary embedding per layer type (local and global bases), chosen per layer.
        self.rope_types = list(cfg.layer_types) if hasattr(self.body.rotary_emb, "layer_types") else None
        self.longrope = getattr(self.body.rotary_emb, "rope_type", None) == "longrope"

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.body.embed_tokens.weight.device

    def spec(self, name: str = "hf") -> ModelSpec:
        """The planner's view of this model (dtype: the weights', fp32 for float64)."""
        return replace(from_hf_config(self.model.config.to_dict(), name=name), dtype=spec_dtype(self.dtype))

    def check(self, spec: ModelSpec, tokens: int) -> None:
        """ValueError unless `spec` has this model's shapes and `tokens` positions run exactly."""
        mine = self.spec()
        for f in _SPEC_FIELDS:
            if getattr(spec, f) != getattr(mine, f):
                raise ValueError(f"model.{f}: the graph has {getattr(spec, f)}, the HF model {getattr(mine, f)}")
        rope = getattr(self.body.rotary_emb, "rope_type", "default")
        rope = next(iter(rope.values())) if isinstance(rope, dict) else rope
        if any(k in rope for k in _POSITION_DEPENDENT_ROPE):
            raise ValueError(f"rope_type: {rope!r} depends on every sequence seen so far; kvpipe cannot run it exactly")

    # ---- pieces ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, start: int, positions: torch.Tensor | None = None, seen: int | None = None):
        """ids [B, T] -> hidden [B, T, hidden] and the rotary (cos, sin) [1, T, D] of the positions
        [start, start+T), or of `positions` [1, T] (a device tensor: graph replay) when given; a
        dict of them by layer type where the model has one rotary embedding per type (Gemma 3).
        `seen`: the tokens of the HF forward call this chunk is part of (a prefill: the prompt),
        for longrope, whose factors HF picks by the largest position of the call."""
        hidden = self.body.embed_tokens(ids)   # Gemma's embedding module scales by sqrt(hidden) itself
        T = ids.shape[1]
        pos = positions if positions is not None else torch.arange(start, start + T, device=ids.device)[None]
        if self.longrope and seen is not None and seen > start + T:
            # cos/sin of each position are elementwise in it: the extra last position only sets the factor
            pos = torch.cat((pos, pos.new_full((1, 1), seen - 1)), 1)
        if self.rope_types is not None:
            return hidden, {t: tuple(x[:, :T] for x in self.body.rotary_emb(hidden, pos, t))
                            for t in set(self.rope_types)}
        return hidden, tuple(x[:, :T] for x in self.body.rotary_emb(hidden, pos))

    def qkv(self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [B, Hq, T, D] contiguous, roped; new K/V [B, Hkv, T, 2, D] contiguous, k roped."""
        mod = self.body.layers[layer]
        attn = mod.self_attn
        B, T, _ = hidden.shape
        x = mod.input_layernorm(hidden)
        if hasattr(attn, "qkv_proj"):   # Phi-3/4: one fused projection, q then k then v
            nq, nk = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = attn.qkv_proj(x).split((nq, nk, nk), dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.view(B, T, -1, self.head_dim)  # [B, T, Hq, D]
        k = k.view(B, T, -1, self.head_dim)  # [B, T, Hkv, D]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if hasattr(attn, "q_norm"):  # Qwen3, Gemma 3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope[self.rope_types[layer]] if self.rope_types is not None else rope
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.contiguous(), torch.stack((k, v), dim=3)  # [B, Hq, T, D], [B, Hkv, T, 2, D]

    def attend(self, layer: int, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
               k_new: torch.Tensor, v_new: torch.Tensor, first: int = 0) -> torch.Tensor:
        """One head group: q [B, G*r, T, D], prefix [B, G, P - first, D] (positions [first, P);
        `first` > 0 only for a window layer), new [B, G, T, D] -> [B, G*r, T, D]."""
        scale = self.body.layers[layer].self_attn.scaling
        window, cap = self.windows[layer], self.softcaps[layer]
        if window or cap:   # a sliding window, a logit softcap: the kinds' own path (banded.py)
            return attend_kind(q, k_prefix, v_prefix, k_new, v_new, scale, window, cap, first)
        assert first == 0, first
        return attend_chunk(q, k_prefix, v_prefix, k_new, v_new, scale)

    def mlp(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [B, T, Hq, D] -> o_proj, residual, post-attention norm, MLP, residual."""
        mod = self.body.layers[layer]
        B, T = attn_out.shape[:2]
        o = mod.self_attn.o_proj(attn_out.reshape(B, T, -1))
        if hasattr(mod, "pre_feedforward_layernorm"):   # Gemma: norms after attention and the MLP too
            hidden = hidden + mod.post_attention_layernorm(o)
            return hidden + mod.post_feedforward_layernorm(mod.mlp(mod.pre_feedforward_layernorm(hidden)))
        hidden = hidden + o
        return hidden + mod.mlp(mod.post_attention_layernorm(hidden))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head of the last position only: hidden [B, T, h] -> fp32 logits [B, V]."""
        last = self.body.norm(hidden[:, -1:])  # [B, 1, h]
        logits = self.model.lm_head(last)[:, 0]
        if self.final_softcap:   # Gemma 2: capped in the weights' dtype, as HF's forward does
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


def _window(attn: torch.nn.Module, cfg) -> int:
    """Tokens a layer attends to (0: all): its module's window where it has one (Qwen2, Gemma),
    else the config's, which HF passes to every layer (Mistral, Phi-3)."""
    w = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(cfg, "sliding_window", None)
    return int(w or 0)


def spec_dtype(dtype: torch.dtype) -> str:
    """The ModelSpec dtype name closest to a torch dtype (float64 counts as fp32)."""
    return _HF_TO_SPEC_DTYPE.get(dtype, "fp32")
