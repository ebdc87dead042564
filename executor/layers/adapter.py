"""The model adapter: runs a Hugging Face decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3)
piece by piece, in the pieces the stage graph names (embed, qkv, attention per head group, mlp,
head), by calling the model's own modules. It never changes a parameter or a class."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace

import torch

from kvpipe.pipeline.model import ModelSpec, from_hf_config

from kvpipe.executor.layers.attention import attend_chunk

# HF class name -> family (extension: one line here, if the family's modules match these names).
FAMILIES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # inv_freq depends on the sequence seen so far
_SPEC_FIELDS = ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "vocab")
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
        if any(k in rope for k in _POSITION_DEPENDENT_ROPE):
            raise ValueError(f"rope_type: {rope!r} depends on the sequence length; not supported")
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            window = attn.sliding_window if hasattr(attn, "sliding_window") else \
                getattr(self.model.config, "sliding_window", None)
            if window is not None and window < tokens:
                raise ValueError(f"sliding_window: layer {i} attends to {window} tokens, "
                                 f"the workload holds {tokens}; sliding windows are not supported")

    # ---- pieces ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, start: int, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """ids [B, T] -> hidden [B, T, hidden] and the rotary (cos, sin) [1, T, D] of the positions
        [start, start+T), or of `positions` [1, T] (a device tensor: graph replay) when given."""
        hidden = self.body.embed_tokens(ids)
        pos = positions if positions is not None else \
            torch.arange(start, start + ids.shape[1], device=ids.device)[None]  # [1, T]
        return hidden, self.body.rotary_emb(hidden, pos)

    def qkv(self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [B, Hq, T, D] contiguous, roped; new K/V [B, Hkv, T, 2, D] contiguous, k roped."""
        mod = self.body.layers[layer]
        attn = mod.self_attn
        B, T, _ = hidden.shape
        x = mod.input_layernorm(hidden)
        q = attn.q_proj(x).view(B, T, -1, self.head_dim)  # [B, T, Hq, D]
        k = attn.k_proj(x).view(B, T, -1, self.head_dim)  # [B, T, Hkv, D]
        v = attn.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope
        q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.contiguous(), torch.stack((k, v), dim=3)  # [B, Hq, T, D], [B, Hkv, T, 2, D]

    def attend(self, layer: int, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
               k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """One head group: q [B, G*r, T, D], prefix [B, G, P, D], new [B, G, T, D] -> [B, G*r, T, D]."""
        scale = self.body.layers[layer].self_attn.scaling
        return attend_chunk(q, k_prefix, v_prefix, k_new, v_new, scale)

    def mlp(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """attn_out [B, T, Hq, D] -> o_proj, residual, post-attention norm, MLP, residual."""
        mod = self.body.layers[layer]
        B, T = attn_out.shape[:2]
        hidden = hidden + mod.self_attn.o_proj(attn_out.reshape(B, T, -1))
        return hidden + mod.mlp(mod.post_attention_layernorm(hidden))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head of the last position only: hidden [B, T, h] -> fp32 logits [B, V]."""
        last = self.body.norm(hidden[:, -1:])  # [B, 1, h]
        return self.model.lm_head(last)[:, 0].float()


def spec_dtype(dtype: torch.dtype) -> str:
    """The ModelSpec dtype name closest to a torch dtype (float64 counts as fp32)."""
    return _HF_TO_SPEC_DTYPE.get(dtype, "fp32")
