"""The small kernels of each compute stage: what the executor runs besides its GEMMs and fused
attention (HF's RMSNorm in fp32, RoPE, SiLU * up, residual adds, casts, copies, concatenations,
the exact LSE merge of a chunk's two attention parts), as a kernel count and the bytes those
kernels read plus write. Closed forms of the executor's code path for the Llama family (Llama,
Mistral, Qwen2, Qwen3), counted op by op; tests/test_layer_ops.py holds every form against the
aten ops that the real HF modules and the executor's attention dispatch on CPU
(executor/op_inventory.py), which are the ops they launch on the GPU.

Each form returns `SmallOps(kernels, bytes)` for one stage of `tokens` query tokens (batch
included); pipeline/cost.py turns them into seconds (bytes at the elementwise HBM rate, each
kernel at least the profile's per-kernel floor)."""
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


def rms_norm(rows: float, width: int, e: int) -> SmallOps:
    """HF's RMSNorm over `rows` rows: to fp32, pow, mean, + eps, rsqrt, *, to dtype, * weight."""
    c = _cast(e)
    per_row = (c * (e + FP32) * width            # to float32 (read e, write 4)
               + 2 * FP32 * width                # pow
               + FP32 * width + FP32             # mean
               + 2 * FP32 + 2 * FP32             # + eps, rsqrt (one value a row)
               + 2 * FP32 * width + FP32         # x * rsqrt
               + c * (FP32 + e) * width          # back to the model dtype
               + 2 * e * width)                  # * weight (read x, write)
    return SmallOps(6 + 2 * c, rows * per_row + e * width)   # the weight is read once


def rope(tokens: float, heads: int, d: int, e: int) -> SmallOps:
    """apply_rotary_pos_emb on one of q, k: x*cos, -x2, cat, rotate*sin, add (cos, sin per token)."""
    x = heads * d
    return SmallOps(5, tokens * e * (10 * x + 2 * d))


def embed(m: ModelSpec, tokens: float) -> SmallOps:
    """Embedding gather and the rotary table of the step's positions (HF's rotary_emb)."""
    e, d = m.dtype_bytes, m.head_dim
    c = _cast(e)
    per_token = (2 * e * m.hidden + INDEX        # gather: ids and rows read, rows written
                 + INDEX + INDEX + FP32          # arange, positions to float
                 + FP32 + 2 * d + 8 * d          # inv_freq * positions, cat
                 + 4 * 8 * d                     # cos, * scaling, sin, * scaling
                 + c * 2 * (FP32 + e) * d)       # cos, sin to the model dtype
    return SmallOps(9 + 2 * c, tokens * per_token + 2 * d)


def qkv(m: ModelSpec, tokens: float, resident: int) -> SmallOps:
    """Input norm, (Qwen3: q/k norms), RoPE on q and k, q made contiguous (more than one token),
    K/V stacked, the resident heads' K/V written home."""
    e, d = m.dtype_bytes, m.head_dim
    ops = rms_norm(tokens, m.hidden, e) + rope(tokens, m.q_heads, d, e) + rope(tokens, m.kv_heads, d, e)
    if m.qk_norm:
        ops = ops + rms_norm(tokens * m.q_heads, d, e) + rms_norm(tokens * m.kv_heads, d, e)
    if tokens > 1:
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
    """Residual add after o_proj, post-attention norm, SiLU(gate) * up, residual add."""
    e = m.dtype_bytes
    return rms_norm(tokens, m.hidden, e) + SmallOps(4, tokens * e * (6 * m.hidden + 5 * m.intermediate))


def head(m: ModelSpec, batch: int) -> SmallOps:
    """Final norm of the last position, logits to float32, greedy argmax, the token written."""
    e = m.dtype_bytes
    c = _cast(e)
    return rms_norm(batch, m.hidden, e) + SmallOps(2 + c, batch * (c * (e + FP32) * m.vocab + FP32 * m.vocab
                                                                   + 3 * INDEX))
