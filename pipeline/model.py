"""The model as the planner sees it: shapes of a decoder-only transformer (Llama, Mistral, Qwen2/3,
Gemma 2/3, Phi-3/4), the attention kind of each layer (full, or a sliding window) and the FLOPs and
bytes they imply. Built from a Hugging Face `config.json` or a named preset."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .layer_kinds import kind_names, layer_kinds, refuse_model_type

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# HF `model_type` -> the adapter family that runs it.
FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
_NORMS = {"gemma2": 4, "gemma3": 4}   # RMSNorms per layer (Gemma: around attention and MLP both)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one decoder-only model; all derived costs are properties."""

    name: str
    family: str            # one of FAMILIES' values
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str = "bf16"
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    tie_embeddings: bool = False
    # Positions the model was trained for (HF `max_position_embeddings`); None when unknown
    # (presets). Not part of the shapes: two specs with equal shapes compare equal.
    max_positions: int | None = field(default=None, compare=False)
    # Tokens each layer attends to (its own included), 0 for full attention; () when every layer
    # is full. A window layer's units keep a ring of what the window still sees (windows.rings).
    windows: tuple[int, ...] = ()
    softcap: float = 0.0   # attention logit softcap (Gemma 2), 0.0 for none
    final_softcap: float = 0.0   # final logit softcap (Gemma 2: three more kernels on the logits)
    rope: str = field(default="default", compare=False)   # HF rope type (layer_kinds.EXACT_ROPE)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES.values():
            raise ValueError(f"model.family: unsupported {self.family!r} "
                             f"(supported: {', '.join(sorted(FAMILIES))})")
        for f in ("layers", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model.{f}: must be a positive integer, got {v!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"model.kv_heads: {self.kv_heads} does not divide q_heads {self.q_heads}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype: {self.dtype!r} not one of {sorted(DTYPE_BYTES)}")
        if self.windows and (len(self.windows) != self.layers or any(type(w) is not int or w < 0 for w in self.windows)):
            raise ValueError(f"model.windows: {self.layers} window sizes >= 0 expected, got {self.windows!r}")
        if self.max_positions is not None and (type(self.max_positions) is not int or self.max_positions <= 0):
            raise ValueError(f"model.max_positions: must be a positive integer, got {self.max_positions!r}")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def gqa_ratio(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections, MLP, norms, biases)."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        extra = _NORMS.get(self.family, 2) * self.hidden + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        return attn + mlp + extra

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return embed + head + self.layers * self.layer_params + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def layer_weight_bytes(self) -> int:
        return self.layer_params * self.dtype_bytes

    @property
    def head_weight_bytes(self) -> int:
        """lm_head (or the tied embedding) read once per logits computation."""
        return self.vocab * self.hidden * self.dtype_bytes

    @property
    def kv_unit_bytes_per_token(self) -> int:
        """K and V of one (layer, KV head) unit for one token."""
        return 2 * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of all layers and heads for one token (Llama-3-8B bf16: 131072)."""
        return self.layers * self.kv_heads * self.kv_unit_bytes_per_token

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's kind: 'full' or 'sliding W'."""
        return kind_names(self.windows, self.layers)

    def eager_reason(self, capacity: int) -> str | None:
        """Why decode of this model to `capacity` tokens cannot be replayed as a CUDA graph (its
        FA2 call attends the keys it is given uncapped, at fixed frequencies), or None. Window
        layers replay: their window is gathered in position order (executor/replay/window_step.py)."""
        if self.softcap:
            return "runs eagerly for softcapped attention"
        if self.rope == "longrope":
            return "runs eagerly for longrope (its frequencies follow the position)"
        return None

    @property
    def units(self) -> int:
        """Number of (layer, KV head) units the KV cache is split into."""
        return self.layers * self.kv_heads

    # ---- FLOPs -------------------------------------------------------------------------
    @property
    def qkv_flops_per_token(self) -> int:
        return 2 * self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp_flops_per_token(self) -> int:
        """o_proj plus the gated MLP, per token per layer."""
        return 2 * self.q_heads * self.head_dim * self.hidden + 6 * self.hidden * self.intermediate

    @property
    def dense_flops_per_token(self) -> int:
        """Projections and MLP of all layers per token (no attention, no lm_head)."""
        return self.layers * (self.qkv_flops_per_token + self.mlp_flops_per_token)

    @property
    def head_flops_per_token(self) -> int:
        return 2 * self.hidden * self.vocab

    def attn_flops(self, q_start: int, q_end: int, k_end: int, q_heads: int | None = None) -> int:
        """FLOPs of causal attention of queries [q_start, q_end) over keys [0, k_end) for one layer
        (QK^T and PV, 4*D per allowed pair and query head); `q_heads` defaults to all."""
        h = self.q_heads if q_heads is None else q_heads
        return 4 * self.head_dim * h * causal_pairs(q_start, q_end, k_end)

    def attn_work(self, layer: int, start: int, n: int, q_heads: int | None = None) -> tuple[int, int]:
        """(FLOPs, keys read per head) of the executor's attention of the chunk [start, start+n) at
        `layer`: the causal pairs over [0, start+n) for a full layer (or a window none of its
        queries outgrows); for a window layer the visible keys from the chunk's first query on and
        the band's pairs, each query's W keys (the GPU's windowed FA2 call skips the tiles outside
        the band; executor/layers/banded.py)."""
        w = self.windows[layer] if self.windows else 0
        if not w or start + n <= w:
            return self.attn_flops(start, start + n, start + n, q_heads), start + n
        h = self.q_heads if q_heads is None else q_heads
        keys = start + n - max(0, start - w + 1)
        return 4 * self.head_dim * h * band_pairs(start, n, w), keys

    def attn_work_floor(self, start: int, n: int, q_heads: int | None = None) -> tuple[int, int]:
        """The least attn_work of any layer kind (a bound for estimates that cost every layer alike)."""
        firsts = {w: i for i, w in reversed(list(enumerate(self.windows)))} if self.windows else {0: 0}
        works = [self.attn_work(i, start, n, q_heads) for i in firsts.values()]
        return min(f for f, _ in works), min(k for _, k in works)


def band_pairs(start: int, n: int, window: int) -> int:
    """Number of (i, j) with start <= i < start + n and i - window < j <= i, j >= 0."""
    edge = min(start + n, window - 1)   # queries before it see i + 1 keys, the rest `window`
    short = (edge * (edge + 1) - start * (start + 1)) // 2 if edge > start else 0
    return short + (start + n - max(start, edge)) * window


def causal_pairs(q_start: int, q_end: int, k_end: int) -> int:
    """Number of (i, j) with q_start <= i < q_end, 0 <= j < k_end, j <= i."""
    if q_end <= q_start or k_end <= 0:
        return 0
    # Query i sees min(i + 1, k_end) keys.
    full_from = max(q_start, k_end - 1)          # i >= k_end-1 sees k_end keys
    tri_end = min(q_end, full_from)              # i in [q_start, tri_end) sees i+1 keys
    tri = (tri_end * (tri_end + 1) - q_start * (q_start + 1)) // 2 if tri_end > q_start else 0
    full = max(0, q_end - max(q_start, full_from)) * k_end
    return tri + full


_LLAMA3 = dict(family="llama", vocab=128256, head_dim=128)


def _every(layers: int, period: int, window: int) -> tuple[int, ...]:
    """Windows of a local:global pattern: every `period`-th layer full, the others `window` (HF's)."""
    return tuple(0 if (i + 1) % period == 0 else window for i in range(layers))


PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("llama-3-8b", layers=32, hidden=4096, q_heads=32, kv_heads=8,
                            intermediate=14336, **_LLAMA3),
    "llama-3-70b": ModelSpec("llama-3-70b", layers=80, hidden=8192, q_heads=64, kv_heads=8,
                             intermediate=28672, **_LLAMA3),
    "llama-2-7b": ModelSpec("llama-2-7b", "llama", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-2-13b": ModelSpec("llama-2-13b", "llama", 40, 5120, 40, 40, 128, 13824, 32000),
    "mistral-7b": ModelSpec("mistral-7b", "mistral", 32, 4096, 32, 8, 128, 14336, 32000),
    "qwen2-7b": ModelSpec("qwen2-7b", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True),
    "longchat-7b-32k": ModelSpec("longchat-7b-32k", "llama", 32, 4096, 32, 32, 128, 11008, 32000),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", layers=32, hidden=4096, q_heads=32, kv_heads=8,
                              intermediate=14336, rope="llama3", **_LLAMA3),
    "mistral-7b-v0.1": ModelSpec("mistral-7b-v0.1", "mistral", 32, 4096, 32, 8, 128, 14336, 32000,
                                 windows=(4096,) * 32),
    "gemma-2-2b": ModelSpec("gemma-2-2b", "gemma2", 26, 2304, 8, 4, 256, 9216, 256000, softcap=50.0, final_softcap=30.0,
                            windows=_every(26, 2, 4096), tie_embeddings=True),
    "gemma-2-9b": ModelSpec("gemma-2-9b", "gemma2", 42, 3584, 16, 8, 256, 14336, 256000, softcap=50.0, final_softcap=30.0,
                            windows=_every(42, 2, 4096), tie_embeddings=True),
    "gemma-3-4b": ModelSpec("gemma-3-4b", "gemma3", 34, 2560, 8, 4, 256, 10240, 262208, qk_norm=True,
                            windows=_every(34, 6, 1024), tie_embeddings=True),
    "gemma-3-12b": ModelSpec("gemma-3-12b", "gemma3", 48, 3840, 16, 8, 256, 15360, 262208, qk_norm=True,
                             windows=_every(48, 6, 1024), tie_embeddings=True),
    "phi-3-mini-128k": ModelSpec("phi-3-mini-128k", "phi3", 32, 3072, 32, 32, 96, 8192, 32064, rope="longrope"),
    "phi-4": ModelSpec("phi-4", "phi3", 40, 5120, 40, 10, 128, 17920, 100352),
}


def preset(spec: str) -> ModelSpec | None:
    """The preset named `spec`, case-insensitively (`Llama-3-8B` is `llama-3-8b`); None if none."""
    return PRESETS.get(spec.strip().lower())


def from_hf_config(cfg: dict, name: str = "config") -> ModelSpec:
    """ModelSpec from a parsed Hugging Face config.json (one of FAMILIES' model types)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{name}: expected a JSON object of config fields, got a {type(cfg).__name__}")
    mtype = cfg.get("model_type")
    refuse_model_type(mtype)
    if mtype == "gemma3" and isinstance(cfg.get("text_config"), dict):   # the multimodal checkpoint's text model
        raise ValueError("model_type: 'gemma3' is the image-text model; pass its text_config as a "
                         "config.json with model_type 'gemma3_text' (the gemma-3-* presets have its shapes)")
    if mtype not in FAMILIES:
        raise ValueError(f"model_type: unsupported architecture {mtype!r} "
                         f"(supported: {', '.join(sorted(FAMILIES))})")

    def count(key: str, default=None):
        """A positive integer field; `default` when absent (or null), missing is an error without one."""
        value = cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"{name}: field {key!r} is missing")
            return default
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name}: field {key!r} must be a positive integer, got {value!r}")
        return value

    hidden, q_heads = count("hidden_size"), count("num_attention_heads")
    head_dim = count("head_dim", hidden // q_heads)
    dtype = _HF_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    max_pos = cfg.get("max_position_embeddings")
    layers = count("num_hidden_layers")
    kinds = layer_kinds(cfg, mtype, layers)
    return ModelSpec(
        name=name, family=FAMILIES[mtype], layers=layers, hidden=hidden,
        q_heads=q_heads, kv_heads=count("num_key_value_heads", q_heads), head_dim=head_dim,
        intermediate=count("intermediate_size"), vocab=count("vocab_size"), dtype=dtype,
        qkv_bias=bool(cfg.get("attention_bias", mtype == "qwen2")), qk_norm=mtype in ("qwen3", "gemma3_text"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", mtype in ("gemma2", "gemma3_text"))),
        max_positions=count("max_position_embeddings") if max_pos is not None else None,
        windows=kinds.windows, softcap=kinds.softcap, final_softcap=kinds.final_softcap, rope=kinds.rope,
    )


def load_model(spec: str, dtype: str | None = None) -> ModelSpec:
    """A preset name (any case), a config.json path, or a directory holding config.json."""
    model = preset(spec)
    if model is None:
        path = Path(spec)
        folder = path.is_dir()   # an existing folder is never taken for a preset name
        if folder:
            path = path / "config.json"
        if not path.is_file():
            if folder or "/" in spec or spec.endswith(".json"):
                raise ValueError(f"model: no config.json at {spec!r}")
            raise ValueError(f"model: unknown preset {spec!r} (known: {', '.join(PRESETS)}; "
                             "or a config.json / model directory)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {str(path)!r} is not valid JSON ({e.msg}, line {e.lineno})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"model: cannot read {str(path)!r} ({e})") from None
        if not isinstance(cfg, dict):
            kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(cfg), "null")
            raise ValueError(f"model: {str(path)!r} holds a JSON {kind}, "
                             "expected an object of config fields (a Hugging Face config.json)")
        model = from_hf_config(cfg, name=str(spec))
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} not one of {', '.join(DTYPE_BYTES)}")
    return replace(model, dtype=dtype) if dtype else model
