"""The attention kind of every layer of a Hugging Face config, read from config.json alone (no
transformers, no torch): full causal attention or a sliding window of W tokens, the attention
logit softcap and the rope type. What kvpipe cannot run exactly (state-space, linear-attention or
other non-softmax layers, a rope whose frequencies change with the tokens seen so far in a way a
chunked run cannot reproduce) is refused here, on one line naming it, before any work."""
from __future__ import annotations

from dataclasses import dataclass

# HF model types whose layers are not softmax attention over a KV cache (or not all of them).
NOT_SOFTMAX = {
    "mamba": "state-space", "mamba2": "state-space", "falcon_mamba": "state-space",
    "jamba": "state-space + attention hybrid", "zamba": "state-space + attention hybrid",
    "zamba2": "state-space + attention hybrid", "falcon_h1": "state-space + attention hybrid",
    "bamba": "state-space + attention hybrid", "granitemoehybrid": "state-space + attention hybrid",
    "nemotron_h": "state-space + attention hybrid", "recurrent_gemma": "recurrent + local attention",
    "rwkv": "linear-attention (RWKV)", "qwen3_next": "linear-attention (gated DeltaNet) hybrid",
    "lfm2": "convolution + attention hybrid", "minimax": "linear-attention hybrid",
    "olmo_hybrid": "linear-attention hybrid", "gemma3n": "per-layer embedding, KV-sharing",
}
ATTENTION_KINDS = ("full_attention", "sliding_attention")
SOFTCAP_DEFAULTS = {"gemma2": (50.0, 30.0)}   # Gemma2Config's attention and final logit softcaps
# Rope types the executor reproduces exactly: their frequencies are fixed ('default', 'linear',
# 'llama3', 'yarn') or depend only on the largest position of each forward call ('longrope').
EXACT_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class LayerKinds:
    """`windows[i]`: tokens layer i attends to (its own included), 0 for full attention;
    `softcap`: the attention logit softcap (0.0: none); `final_softcap`: the final logits' cap;
    `rope`: the rope type."""

    windows: tuple[int, ...]
    softcap: float
    rope: str
    final_softcap: float = 0.0


def refuse_model_type(mtype) -> None:
    """ValueError naming a model type whose layers are not softmax attention."""
    if mtype in NOT_SOFTMAX:
        raise ValueError(f"model_type: {mtype!r} has {NOT_SOFTMAX[mtype]} layers; kvpipe runs softmax "
                         "attention over a KV cache only and cannot run it exactly")


# HF's config defaults where config.json has no sliding_window field (a key set to null is no window)
_DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096, "gemma2": 4096, "gemma3_text": 4096}


def _window(cfg: dict, mtype: str):
    return cfg["sliding_window"] if "sliding_window" in cfg else _DEFAULT_WINDOW.get(mtype)


def _types(cfg: dict, mtype: str, layers: int) -> list[str]:
    """Each layer's attention kind as HF's config class derives it when config.json omits it."""
    types = cfg.get("layer_types")
    if types is not None:
        return list(types)
    window = _window(cfg, mtype)
    if mtype == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if mtype == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if mtype in ("qwen2", "qwen3"):
        on = window is not None and cfg.get("use_sliding_window", False)
        first = cfg.get("max_window_layers", layers)
        return ["sliding_attention" if on and i >= first else "full_attention" for i in range(layers)]
    return ["sliding_attention" if window is not None else "full_attention"] * layers


def rope_type(cfg: dict) -> str:
    """The rope type of `cfg` (rope_parameters, or the older rope_scaling; per layer kind: the first
    that is not 'default')."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        kinds = [p.get("rope_type", p.get("type", "default")) for p in params.values()]
        return next((k for k in kinds if k != "default"), "default")
    if not isinstance(params, dict):
        return "default"
    return params.get("rope_type", params.get("type", "default")) or "default"


def layer_kinds(cfg: dict, mtype: str, layers: int) -> LayerKinds:
    """The kinds of `cfg`'s layers; ValueError naming a layer kind or rope type kvpipe cannot run."""
    types = _types(cfg, mtype, layers)
    odd = sorted({t for t in types if t not in ATTENTION_KINDS})
    if odd:
        at = [i for i, t in enumerate(types) if t == odd[0]]
        raise ValueError(f"layer_types: {odd[0]!r} layers ({', '.join(map(str, at[:4]))}{'..' if len(at) > 4 else ''}) "
                         "are not softmax attention; kvpipe cannot run them exactly")
    if len(types) != layers:
        raise ValueError(f"layer_types: {len(types)} entries for {layers} layers")
    window = _window(cfg, mtype)
    if "sliding_attention" in types and (type(window) is not int or window <= 0):
        raise ValueError(f"sliding_window: must be a positive integer for sliding layers, got {window!r}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    rope = rope_type(cfg)
    if rope not in EXACT_ROPE:
        raise ValueError(f"rope_type: {rope!r} changes the frequencies with the tokens seen so far; "
                         f"kvpipe cannot run it exactly (exact: {', '.join(EXACT_ROPE)})")
    attn, final = SOFTCAP_DEFAULTS.get(mtype, (None, None))   # HF's defaults where config.json leaves them out
    softcap, final = cfg.get("attn_logit_softcapping", attn) or 0.0, cfg.get("final_logit_softcapping", final) or 0.0
    return LayerKinds(windows if any(windows) else (), float(softcap), rope, float(final))


# Tokens a window layer keeps past what its window still sees, so that a kept conversation can
# step back over the few decode steps run past its end (engine/decoding.LAG) and re-run its last one.
REWIND_TOKENS = 4


def first_visible(start: int, window: int) -> int:
    """The first key position the query at `start` sees (0 for full attention, window 0)."""
    return max(0, start - window + 1) if window else 0


def ring_tokens(window: int, capacity: int) -> int:
    """Tokens a unit of a layer with `window` keeps in a ring (position p at row p mod R) when it
    holds fewer than `capacity`: the W - 1 keys the next query still sees and REWIND_TOKENS; 0 where
    a ring would hold no fewer than the whole capacity (full attention, or a window as long)."""
    ring = window - 1 + REWIND_TOKENS if window else 0
    return ring if 0 < ring < capacity else 0


def kind_names(windows: tuple[int, ...], layers: int) -> list[str]:
    """Each layer's kind as reports name it: 'full' or 'sliding W'."""
    return [f"sliding {w}" if w else "full" for w in (windows or (0,) * layers)]


def hf_fields(spec) -> dict:
    """The Hugging Face config fields beyond the shapes that rebuild `spec`'s layer kinds (a
    preset run with random weights): model type, layer types, window, softcaps, rope."""
    out: dict = {}
    family = spec.family
    if family in ("gemma2", "gemma3"):
        out.update(model_type="gemma2" if family == "gemma2" else "gemma3_text",
                   query_pre_attn_scalar=spec.head_dim, hidden_activation="gelu_pytorch_tanh",
                   attn_logit_softcapping=spec.softcap or None,
                   final_logit_softcapping=spec.final_softcap or None)
    if family in ("gemma2", "gemma3", "qwen2", "qwen3") or any(spec.windows):
        windows = spec.windows or (0,) * spec.layers
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
        out["sliding_window"] = max(windows) or None
        if family in ("qwen2", "qwen3"):
            out.update(use_sliding_window=any(windows), max_window_layers=0)
    elif family == "mistral":
        out["sliding_window"] = None
    if spec.rope == "longrope":
        half = spec.head_dim // 2
        out["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                                  "long_factor": [4.0] * half, "original_max_position_embeddings": 4096}
    if spec.rope == "llama3":
        out["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return out
