"""Exact chunked attention for one head group: the cached prefix and the chunk itself are attended
separately by fused kernels that return the log-sum-exp, and the two partial results are
merged exactly by log-sum-exp; no T x (P+T) score or mask matrix is ever materialised.

Kernels (chosen by device, dtype and shape, never by where the bytes live):
  CPU  float32 / float64 / bfloat16 / float16  aten._scaled_dot_product_flash_attention_for_cpu
  CUDA bfloat16 / float16, sm90+ (Hopper on),   aten._scaled_dot_product_cudnn_attention (cuDNN >= 9;
       chunks of >= CUDNN_MIN_ROWS tokens       faster than FA2 there: docs/PERFORMANCE.md)
  CUDA bfloat16 / float16, otherwise (decode,   aten._scaled_dot_product_flash_attention (FA2)
       small chunks, Ampere/Ada)
  CUDA float32                                aten._scaled_dot_product_efficient_attention
  CUDA float64                                none fused: rejected with a ValueError
All return the log-sum-exp in natural-log units, one value per (batch, head, query row).
The environment variable KVPIPE_ATTN=auto|flash|cudnn overrides the bf16/fp16 CUDA choice
(`flash`: FA2 always; `cudnn`: cuDNN always, an error where cuDNN attention is unavailable).
Decode and short chunks stay on FA2 in `auto`: cuDNN builds one execution plan per new shape
(host time: docs/PERFORMANCE.md), which a long chunk repays and a chat turn's few new tokens do
not. The choice counts the chunk's tokens, not the query rows of the prefix call (the GQA heads
folded into them), as pipeline/cost.py models it.

`attend_decode` is the decode kernel of graph replay (executor/replay/capture.py): a split-KV Triton
kernel pair (executor/layers/decode_triton.py; FA2's varlen forward where it cannot run) over an
interleaved KV buffer, the number of keys read from a device tensor and the capacity only an
upper bound, so one captured launch serves every prefix length. It attends the step's own K/V in
the same call (written into the buffer first), so its bits differ from the eager prefix + own +
merge path (same function, other rounding); both are exact in placement.
"""

import functools
import os
from typing import NamedTuple

import torch

from kvpipe.executor.layers import decode_triton

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_FLASH_DTYPES = (torch.bfloat16, torch.float16)
CUDA_KERNELS = ("auto", "flash", "cudnn")
CUDNN_MIN_ROWS = 256  # chunk tokens from which `auto` uses cuDNN: long prefill chunks, never decode steps


def cuda_kernel_setting() -> str:
    """KVPIPE_ATTN, validated (auto when unset)."""
    name = os.environ.get("KVPIPE_ATTN", "auto").strip().lower() or "auto"
    if name not in CUDA_KERNELS:
        raise ValueError(f"KVPIPE_ATTN={name!r}: expected one of {', '.join(CUDA_KERNELS)}")
    return name


@functools.lru_cache(maxsize=None)
def _cudnn_support(device_index: int) -> tuple[bool, bool]:
    """(usable, preferred by `auto`) for cuDNN fused attention on this GPU, looked up once: usable
    needs cuDNN 9 and sm80+; preferred needs sm90+ (Hopper on), where it was measured faster than
    FA2; on Ampere/Ada `auto` keeps FA2 (cuDNN unmeasured there)."""
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return False, False
    cap = torch.cuda.get_device_capability(device_index)
    return cap >= (8, 0), cap >= (9, 0)


def _cudnn_for(device: torch.device, name: str) -> bool:
    """Whether bf16/fp16 prefill chunks on `device` go to cuDNN under the setting `name`."""
    usable, preferred = _cudnn_support(device.index if device.index is not None else torch.cuda.current_device())
    if name == "cudnn" and not usable:
        raise ValueError("KVPIPE_ATTN=cudnn: cuDNN fused attention needs cuDNN >= 9 and an sm80+ GPU")
    return preferred if name == "auto" else name == "cudnn"


def kernel_label(device: torch.device, dtype: torch.dtype) -> str:
    """Which fused kernels serve attention on this device and dtype, for reports (validates KVPIPE_ATTN)."""
    name = cuda_kernel_setting()
    if device.type == "cpu":
        return "cpu flash"
    if dtype == torch.float32:
        return "memory-efficient"
    if not _cudnn_for(device, name):
        return "FA2"
    return f"cuDNN (chunks >= {CUDNN_MIN_ROWS} tokens), FA2 (decode, short chunks)" if name == "auto" else "cuDNN"


def auto_kernel(tokens: int) -> str:
    """`auto`'s kernel where cuDNN is preferred, for a call over a chunk of `tokens` new tokens."""
    return "cudnn" if tokens >= CUDNN_MIN_ROWS else "flash"


def cuda_kernel(q: torch.Tensor, tokens: int | None = None) -> str:
    """`cudnn` or `flash` for a bf16/fp16 CUDA call, from the setting, the GPU and the chunk's
    `tokens` (default: q's query rows) alone."""
    name = cuda_kernel_setting()
    if not _cudnn_for(q.device, name):
        return "flash"
    return "cudnn" if name == "cudnn" else auto_kernel(q.shape[2] if tokens is None else tokens)


class Partial(NamedTuple):
    """Attention over a subset of the keys, normalised within that subset."""

    out: torch.Tensor  # [B, H, T, D] in the input dtype
    lse: torch.Tensor  # [B, H, T] log-sum-exp of the scaled scores, natural log, float32 (float64 for float64)


def attend_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                tokens: int | None = None) -> Partial:
    """One fused kernel call with as many query heads as kv heads; causal is top-left aligned (use it with T == S).
    `tokens`: the chunk's new tokens whose queries q holds (GQA heads folded into its rows), which
    pick the CUDA kernel (default: q's rows)."""
    B, H, T, D = q.shape  # [B, H, T, D]
    if k.shape != v.shape or k.shape[:2] != (B, H) or k.shape[3] != D:
        raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    S = k.shape[2]  # k, v: [B, H, S, D]
    if T < 1 or S < 1:
        raise ValueError(f"q, k: empty attention T={T} S={S} (the CPU kernel crashes on S == 0)")
    if causal and T != S:
        raise ValueError(f"causal: needs T == S, got T={T} S={S}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtype: q {q.dtype}, k {k.dtype}, v {v.dtype} differ")
    if not q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        raise ValueError("q, k, v: the last dim must be contiguous")
    if q.device.type == "cpu":
        if q.dtype not in _CPU_DTYPES:
            raise ValueError(f"dtype={q.dtype} has no fused CPU attention kernel")
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    elif q.device.type == "cuda" and q.dtype in _CUDA_FLASH_DTYPES and cuda_kernel(q, tokens) == "cudnn":
        q, k, v = (canonical_unit_strides(x) for x in (q, k, v))
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1].reshape(B, H, T)  # the LSE comes as [B, H, T, 1]
    elif q.device.type == "cuda" and q.dtype in _CUDA_FLASH_DTYPES:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif q.device.type == "cuda" and q.dtype == torch.float32:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        out, lse = res[0], res[1]
    else:
        raise ValueError(f"dtype={q.dtype} on device={q.device} has no fused attention kernel")
    lse = lse[..., :T]  # some kernels pad the query dim of the LSE (memory-efficient: to a multiple of 32)
    assert out.shape == (B, H, T, D) and lse.shape == (B, H, T), (out.shape, lse.shape)
    return Partial(out, lse)


def canonical_unit_strides(x: torch.Tensor) -> torch.Tensor:
    """The same view with the strides of size-1 batch/head dims set from the dims inside them.
    torch caches one cuDNN execution plan per (shape, strides); a stride over a dim of size 1 never
    addresses anything, but it differs between the KV store's buffers (a layer's resident heads vs
    a transfer slot), and every distinct one would cost a plan build (gpu.attention_plan_s)."""
    B, H = x.shape[:2]
    if B != 1 and H != 1:
        return x
    st = list(x.stride())
    if H == 1:
        st[1] = x.shape[2] * st[2]
    if B == 1:
        st[0] = H * st[1]
    return x.as_strided(x.shape, st)


def merge_partials(a: Partial, b: Partial, out_dtype: torch.dtype) -> torch.Tensor:
    """Exact softmax over the union of two disjoint key sets, in float32 (float64 for float64 inputs)."""
    assert a.out.shape == b.out.shape and a.lse.shape == b.lse.shape, (a.out.shape, b.out.shape)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    lse_a, lse_b = a.lse.to(acc), b.lse.to(acc)  # [B, H, T]
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, T]
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)  # [B, H, T, 1]
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (a.out.to(acc) * w_a + b.out.to(acc) * w_b).to(out_dtype)  # [B, H, T, D]


def repeat_kv(x: torch.Tensor, r: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv*r, S, D], kv head h repeated r times in a row (HF's repeat_kv)."""
    B, Hkv, S, D = x.shape
    if r == 1:
        return x
    return x[:, :, None].expand(B, Hkv, r, S, D).reshape(B, Hkv * r, S, D)


def attend_chunk(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of T new tokens of one head group over P cached tokens and themselves.

    q [B, Hq, T, D]; k_prefix, v_prefix [B, Hkv, P, D] (P may be 0, may be strided views, last dim
    contiguous); k_new, v_new [B, Hkv, T, D]. Query head h uses kv head h // (Hq // Hkv).
    Returns [B, Hq, T, D] in q.dtype. The bits depend only on the values, shapes, dtype, device
    (and, on CPU, the thread count), never on where the prefix lives.
    """
    B, Hq, T, D = q.shape  # [B, Hq, T, D]
    Hkv, P = k_prefix.shape[1], k_prefix.shape[2]  # [B, Hkv, P, D]
    if T < 1:
        raise ValueError(f"q: T={T}, a chunk has at least one token")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if not k_prefix.shape == v_prefix.shape == (B, Hkv, P, D):
        raise ValueError(f"k_prefix, v_prefix: shapes {tuple(k_prefix.shape)}, {tuple(v_prefix.shape)}, "
                         f"expected {(B, Hkv, P, D)}")
    if not k_new.shape == v_new.shape == (B, Hkv, T, D):
        raise ValueError(f"k_new, v_new: shapes {tuple(k_new.shape)}, {tuple(v_new.shape)}, expected {(B, Hkv, T, D)}")
    if len({t.dtype for t in (q, k_prefix, v_prefix, k_new, v_new)}) != 1:
        raise ValueError("dtype: q and the K/V tensors have mixed dtypes")
    if len({t.device for t in (q, k_prefix, v_prefix, k_new, v_new)}) != 1:
        raise ValueError("device: q and the K/V tensors are on mixed devices")
    r = Hq // Hkv

    # The chunk over itself, causal: its K/V are only T tokens, so expanding them to Hq heads is cheap.
    own = attend_part(q, repeat_kv(k_new, r), repeat_kv(v_new, r), scale, causal=True)  # [B, Hq, T, D]
    if P == 0:
        return own.out.to(q.dtype)

    # The chunk over the prefix, no mask: the r query heads of a kv head are r*T independent rows
    # against the same keys, so fold them into the query length and read K/V in place, uncopied.
    q_fold = q.reshape(B, Hkv, r * T, D)  # [B, Hkv, r*T, D], a view when q is contiguous
    pre = attend_part(q_fold, k_prefix, v_prefix, scale, causal=False, tokens=T)
    pre = Partial(pre.out.reshape(B, Hq, T, D), pre.lse.reshape(B, Hq, T))
    return merge_partials(pre, own, q.dtype)


def attend_decode(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token of one head group over its keys, the length read on the device.

    q [1, Hq, 1, D] (last dim contiguous); kv [1, G, S, 2, D] interleaved (a layer's resident heads
    or a transfer slot), the step's own K/V already at position lens-1; lens int32 [1] on the device,
    1 <= lens <= S; cu_q = (0, 1) and cu_k = (0, S) int32 on the device. Returns [1, 1, Hq, D].
    CUDA bf16/fp16 only: executor/layers/decode_triton.py's kernels where they run (splits at fixed
    key positions), else FA2 varlen with split-KV (its splits fixed by S, not by lens)."""
    B, Hq, T, D = q.shape
    G, S = kv.shape[1], kv.shape[2]
    assert B == 1 and T == 1 and kv.shape == (1, G, S, 2, D) and Hq % G == 0, (q.shape, kv.shape)
    assert q.device.type == "cuda" and q.dtype in _CUDA_FLASH_DTYPES and kv.dtype == q.dtype, (q.device, q.dtype)
    assert lens.dtype == cu_q.dtype == cu_k.dtype == torch.int32 and lens.shape == (1,), (lens.dtype, lens.shape)
    if decode_triton.unavailable(q, kv) is None:
        return decode_triton.attend(q, kv, lens, scale)
    k = kv[0, :, :, 0].transpose(0, 1)  # [S, G, D], strides (2D, S*2D, 1): read in place
    v = kv[0, :, :, 1].transpose(0, 1)
    res = torch.ops.aten._flash_attention_forward(q[0, :, 0].unsqueeze(0), k, v, cu_q, cu_k, 1, S, 0.0,
                                                  False, False, scale=scale, seqused_k=lens)
    return res[0].reshape(1, 1, Hq, D)  # [total_q=1, Hq, D] -> [B, T, Hq, D]
