"""The small kernels of each compute stage: what the executor runs besides its GEMMs and fused
attention (HF's RMSNorm in fp32, RoPE, SiLU * up, residual adds, casts, copies, concatenations,
the exact LSE merge of a chunk's two attention parts), as a kernel count and the bytes those
kernels read plus write. Closed forms of the executor's code path for the Llama family (Llama,
Mistral, Qwen2, Qwen3) and where Gemma 2/3 (their (1 + w) norms around attention and MLP both,
the scaled embedding, Gemma 2's final logit softcap) and Phi-3 (RoPE's pass-through cat) differ,
counted op by op; tests/test_layer_ops.py holds every form against the
aten ops that the real HF modules and the executor's attention dispatch on CPU
(executor/calibrate/op_inventory.py), which are the ops they launch on the GPU.

Each form returns `SmallOps(kernels, bytes)` for one stage of `tokens` query tokens (batch
included); pipeline/cost.py turns them into seconds (bytes at the elementwise HBM rate, each
kernel at least the profile's per-kernel floor).

The `fused_*` forms count a replayed decode step with fused elementwise work (executor/layers/fused.py,
the default where it runs): each compiled function is the kernels inductor emits for it with
Triton, a fused kernel reading its inputs and writing its outputs once (intermediates stay in
registers). The counts follow the fused code's structure (stated per function below; a row-wise
norm is one persistent-reduction kernel, `cat`/`stack` lower to pointwise reads on CUDA);
tests/test_layer_ops.py holds them against inductor's kernels on CPU, which does not fuse a
reduction's pointwise epilogue (one more kernel per norm), and, marked gpu, against Triton's."""
from __future__ import annotations

from dataclasses import dataclass

from .model import ModelSpec

FP32 = 4       # HF's RMSNorm and the LSE merge compute in float32
INDEX = 8      # int64 token ids and positions


@dataclass(frozen=True)
class SmallOps:
    kernels: int
    bytes: float

    def __add__(self, other: "SmallOps") -> "SmallOps":
        return SmallOps(self.kernels + other.kernels, self.bytes + other.bytes)


NONE = SmallOps(0, 0.0)


def _cast(e: int) -> int:
    """Kernels of a cast to or from float32 (none when the model already is float32)."""
    return 0 if e == FP32 else 1


def _rms_row(width: int, e: int) -> float:
    """Bytes per row of the RMS part both norm forms share: to fp32, pow, mean, + eps, rsqrt,
    x * rsqrt, back to the model dtype (4 + 2 cast kernels)."""
    c = _cast(e)
    return (c * (e + FP32) * width            # to float32 (read e, write 4)
            + 2 * FP32 * width                # pow
            + FP32 * width + FP32             # mean
            + 2 * FP32 + 2 * FP32             # + eps, rsqrt (one value a row)
            + 2 * FP32 * width + FP32         # x * rsqrt
            + c * (FP32 + e) * width)         # back to the model dtype


def rms_norm(rows: float, width: int, e: int) -> SmallOps:
    """HF's RMSNorm over `rows` rows: to fp32, pow, mean, + eps, rsqrt, *, to dtype, * weight."""
    per_row = _rms_row(width, e) + 2 * e * width   # * weight (read x, write)
    return SmallOps(6 + 2 * _cast(e), rows * per_row + e * width)   # the weight is read once


def gemma_norm(rows: float, width: int, e: int) -> SmallOps:
    """Gemma's RMSNorm over `rows` rows: to fp32, pow, mean, + eps, rsqrt, *, then * (1 + w) in
    fp32 before the cast back (the weight's cast to fp32 and its + 1 once, not per row)."""
    c = _cast(e)
    per_row = _rms_row(width, e) + 2 * FP32 * width   # * (1 + w): read x, write
    once = c * (e + FP32) * width + 2 * FP32 * width + FP32 * width   # weight to fp32, + 1, read by *
    return SmallOps(7 + 3 * c, rows * per_row + once)


def norm(m: ModelSpec, rows: float, width: int) -> SmallOps:
    """The family's RMSNorm (Gemma's, or HF's Llama form)."""
    return (gemma_norm if _gemma(m) else rms_norm)(rows, width, m.dtype_bytes)


def _gemma(m: ModelSpec) -> bool:
    return m.family in ("gemma2", "gemma3")


def rope(tokens: float, heads: int, d: int, e: int, passthrough: bool = False) -> SmallOps:
    """apply_rotary_pos_emb on one of q, k: x*cos, -x2, cat, rotate*sin, add (cos, sin per token);
    `passthrough` (Phi-3): the roped part concatenated with the unroped rest, one more copy."""
    x = heads * d
    ops = SmallOps(5, tokens * e * (10 * x + 2 * d))
    return ops + SmallOps(1, tokens * 2 * e * x) if passthrough else ops


def embed(m: ModelSpec, tokens: float) -> SmallOps:
    """Embedding gather and the rotary table of the step's positions (HF's rotary_emb)."""
    e, d = m.dtype_bytes, m.head_dim
    c = _cast(e)
    per_token = (2 * e * m.hidden + INDEX        # gather: ids and rows read, rows written
                 + INDEX + INDEX + FP32          # arange, positions to float
                 + FP32 + 2 * d + 8 * d          # inv_freq * positions, cat
                 + 4 * 8 * d                     # cos, * scaling, sin, * scaling
                 + c * 2 * (FP32 + e) * d)       # cos, sin to the model dtype
    ops = SmallOps(9 + 2 * c, tokens * per_token + 2 * d)
    return ops + SmallOps(1, tokens * 2 * e * m.hidden + e) if _gemma(m) else ops   # Gemma: * sqrt(hidden)


def qkv(m: ModelSpec, tokens: float, resident: int) -> SmallOps:
    """Input norm, (Qwen3, Gemma 3: q/k norms), RoPE on q and k, q made contiguous (more than one token),
    K/V stacked, the resident heads' K/V written home."""
    e, d, cat = m.dtype_bytes, m.head_dim, m.family == "phi3"
    ops = norm(m, tokens, m.hidden) + rope(tokens, m.q_heads, d, e, cat) + rope(tokens, m.kv_heads, d, e, cat)
    if m.qk_norm:
        ops = ops + norm(m, tokens * m.q_heads, d) + norm(m, tokens * m.kv_heads, d)
    if tokens > 1 and not cat:   # Phi-3's cat already leaves q contiguous
        ops = ops + SmallOps(1, tokens * 2 * e * m.q_heads * d)
    ops = ops + SmallOps(1, tokens * 4 * e * m.kv_heads * d)
    if resident:
        ops = ops + SmallOps(1, tokens * 4 * e * resident * d)
    return ops


def attn(m: ModelSpec, tokens: float, group: int, prefix: int, replayed: bool = False) -> SmallOps:
    """Around one head group's fused attention: K/V of the chunk repeated to its query heads
    (groups of more than one KV head), the LSE merge of the prefix and chunk parts (a prefix),
    the group's output copied into the step's output. A replayed decode step attends prefix and
    token in one call: only the output copy remains."""
    e, d = m.dtype_bytes, m.head_dim
    hq = group * m.gqa_ratio
    out = SmallOps(1, tokens * 2 * e * hq * d)
    if replayed:
        return out
    ops = out
    if group > 1 and m.gqa_ratio > 1:
        ops = ops + SmallOps(2, tokens * 2 * e * group * d * (1 + m.gqa_ratio))
    if prefix:
        c = _cast(e)
        lse = 3 * FP32 * hq + 3 * FP32 * hq + 2 * FP32 * hq + 3 * FP32 * hq + 2 * FP32 * hq
        outs = (2 * c * (e + FP32) * hq * d          # both parts to float32
                + 2 * (2 * FP32 * hq * d + FP32 * hq)  # * weight
                + 3 * FP32 * hq * d                  # add
                + c * (FP32 + e) * hq * d)           # back to the model dtype
        ops = ops + SmallOps(8 + 3 * c, tokens * (lse + outs))
    return ops


def mlp(m: ModelSpec, tokens: float) -> SmallOps:
    """Residual add after o_proj, post-attention norm, act(gate) * up, residual add; Gemma also
    norms o_proj's output before its add and the MLP's output before its own (three norms)."""
    e = m.dtype_bytes
    norms = norm(m, tokens, m.hidden)
    if _gemma(m):
        norms = norms + norm(m, tokens, m.hidden) + norm(m, tokens, m.hidden)
    return norms + SmallOps(4, tokens * e * (6 * m.hidden + 5 * m.intermediate))


def _head_tail(m: ModelSpec, batch: int) -> SmallOps:
    """After the final norm and lm_head: (a final logit softcap: / cap, tanh, * cap), logits to
    float32, greedy argmax, the token written."""
    e = m.dtype_bytes
    c = _cast(e)
    cap = SmallOps(3, batch * 3 * 2 * e * m.vocab) if m.final_softcap else NONE
    return cap + SmallOps(2 + c, batch * (c * (e + FP32) * m.vocab + FP32 * m.vocab + 3 * INDEX))


def head(m: ModelSpec, batch: int) -> SmallOps:
    """Final norm of the last position, logits to float32, greedy argmax, the token written."""
    return norm(m, batch, m.hidden) + _head_tail(m, batch)


# ---- fused decode (executor/layers/fused.py) ---------------------------------------------------------------
# One function each, as compiled: (rows or tokens) -> SmallOps of its Triton kernels.
def fused_norm(rows: float, width: int, e: int) -> SmallOps:
    """fused.rms_norm: one persistent-reduction kernel; reads x, writes the normed row, reads the
    weight once."""
    return SmallOps(1, rows * 2 * e * width + e * width)


def fused_add_norm(rows: float, width: int, e: int) -> SmallOps:
    """fused.add_norm: the residual add feeding the norm, one kernel; reads x and d, writes the sum
    and the normed row, reads the weight once."""
    return SmallOps(1, rows * 4 * e * width + e * width)


def fused_rope(m: ModelSpec, tokens: float) -> SmallOps:
    """fused.rope_layout: q roped into [B, Hq, T, D] and k roped with v stacked into
    [B, Hkv, T, 2, D] (rotate_half's cat read in place), each reading cos and sin. Triton emits
    THREE kernels for it (counted on the H200, with and without Qwen3's q/k norms),
    where the structure suggests two and inductor's C++ backend emits two on CPU (CPU_EXTRA -1 in
    tests/test_layer_ops.py); the bytes are the same."""
    e, d = m.dtype_bytes, m.head_dim
    q = tokens * e * (2 * m.q_heads * d + 2 * d)
    kv = tokens * e * (4 * m.kv_heads * d + 2 * d)
    return SmallOps(3, q + kv + (2 * e * d if m.qk_norm else 0))


def fused_act_mul(m: ModelSpec, tokens: float) -> SmallOps:
    """fused.act_mul: act(gate) * up, one pointwise kernel."""
    return SmallOps(1, tokens * 3 * m.dtype_bytes * m.intermediate)


FUSED_FUNCTIONS = ("norm", "add_norm", "rope", "act_mul")   # executor/layers/fused.py's compiled functions


def fused_function(name: str, m: ModelSpec, tokens: float) -> SmallOps:
    """One call of compiled function `name` over `tokens` rows of the model's hidden size (norms)."""
    e = m.dtype_bytes
    forms = {"norm": lambda: fused_norm(tokens, m.hidden, e), "add_norm": lambda: fused_add_norm(tokens, m.hidden, e),
             "rope": lambda: fused_rope(m, tokens), "act_mul": lambda: fused_act_mul(m, tokens)}
    if name not in forms:
        raise ValueError(f"fused function: unknown {name!r} (known: {', '.join(FUSED_FUNCTIONS)})")
    return forms[name]()


# A fused decode step defers each MLP's residual add into the next norm (the next layer's input
# norm, or the final norm): that kernel is counted once, in `fused_qkv` / `fused_head` as a plain
# norm, and the add's extra bytes (d read, the sum written) go to the `fused_mlp` that made d. So
# every layer's forms are the same, and a step sums to the kernels the executor runs.
def fused_qkv(m: ModelSpec, tokens: float, resident: int) -> SmallOps:
    """Input norm (with the deferred add), q/k roped and K/V stacked, the resident heads' new K/V
    written home (the same index copy as unfused)."""
    e, d = m.dtype_bytes, m.head_dim
    ops = fused_norm(tokens, m.hidden, e) + fused_rope(m, tokens)
    if resident:
        ops = ops + SmallOps(1, tokens * 4 * e * resident * d)
    return ops


def fused_mlp(m: ModelSpec, tokens: float) -> SmallOps:
    """Residual add after o_proj with the post-attention norm, the bytes of act(gate) * up read by
    the down projection's own loads (gemv_triton.gated_linear: no kernel of its own in the fused
    step, which runs on CUDA only), and those of the MLP's residual add (deferred into the next
    norm's kernel)."""
    e = m.dtype_bytes
    return (fused_add_norm(tokens, m.hidden, e) + SmallOps(0, tokens * 2 * e * m.intermediate)
            + SmallOps(0, tokens * 2 * e * m.hidden))


def fused_head(m: ModelSpec, batch: int) -> SmallOps:
    """Final norm (with the last deferred add) of the last position, then as `head`."""
    return fused_norm(batch, m.hidden, m.dtype_bytes) + _head_tail(m, batch)
