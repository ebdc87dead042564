"""kvpipe's attention as a transformers attention implementation, `kvpipe_headwise`, registered
through transformers' public `AttentionInterface` and `AttentionMaskInterface`.

HF's attention modules call `cache.update(k, v, layer)` and hand whatever it returns to the
attention function as `key`/`value`. A kvpipe cache returns a `PendingKV` there (the layer's new
K/V and the stream that holds the prefix), and `headwise_attention` attends head group by head
group through that stream. Given plain tensors instead (no cache, or HF's own caches), it runs
the same exact chunked attention over them: the last T keys are the chunk, the rest its prefix.
Un-padded, no mask is materialised: attention is causal by construction. A left-padded batch gets
its key padding mask [B, kv] from `headwise_mask` (executor/hf/masked.py attends with it). A
sliding window that covers every key is full attention; `headwise_mask` refuses what it cannot
express (a window smaller than the keys, custom or packed masks) with a ValueError."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from kvpipe.executor.layers.attention import attend_chunk
from kvpipe.executor.layers.banded import attend_kind
from kvpipe.executor.hf.headstream import HeadStream
from kvpipe.executor.hf.masked import attend_padded

IMPLEMENTATION = "kvpipe_headwise"
# Set by generate() given an all-ones mask: no step checks the mask again (a host sync per token).
UNPADDED = contextvars.ContextVar("kvpipe_unpadded", default=False)


@dataclass(frozen=True)
class PendingKV:
    """A layer's new K/V, kv [B, H, T, 2, D] (k roped), already written to `stream` at `layer`."""

    stream: HeadStream
    layer: int
    kv: torch.Tensor


def headwise_attention(module: torch.nn.Module, query: torch.Tensor, key, value, attention_mask,
                       dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D] -> ([B, T, Hq, D], None), as transformers' attention functions return."""
    if module.training or dropout:
        raise ValueError(f"{IMPLEMENTATION}: inference only (dropout={dropout}, training={module.training})")
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 2):
        raise ValueError(f"{IMPLEMENTATION}: attention_mask: a prepared {attention_mask.dim()}-D mask was "
                         "passed; only causal attention with a 2-D padding mask is supported")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(key, PendingKV):
        assert key is value, "update() returns the same PendingKV as key and value"
        if softcap:   # the stream's group-by-group attention has no capped form: refused, never ignored
            raise ValueError(f"{IMPLEMENTATION}: softcap: attention logit softcapping ({softcap}) is not "
                             "supported through HeadwiseCache; run the model with kvpipe run/generate")
        return key.stream.attend(key.layer, query, key.kv, scale, attention_mask), None
    T, S = query.shape[2], key.shape[2]          # plain tensors: key, value [B, Hkv, S, D]
    if sliding_window is not None and sliding_window < S:
        raise ValueError(f"sliding_window: {sliding_window} < {S} keys; not supported")
    if S < T:
        raise ValueError(f"{IMPLEMENTATION}: {S} keys for {T} queries")
    q = query.contiguous()
    k, v = key.contiguous(), value.contiguous()
    if attention_mask is not None and softcap:
        raise ValueError(f"{IMPLEMENTATION}: softcap with a padding mask is not supported; pass unpadded prompts")
    if attention_mask is not None:
        return attend_padded(q, k, v, attention_mask, scale).contiguous(), None
    if softcap:   # Gemma 2: the capped scores (executor/layers/banded.py)
        out = attend_kind(q, k[:, :, :S - T], v[:, :, :S - T], k[:, :, S - T:], v[:, :, S - T:], scale, 0, softcap)
        return out.transpose(1, 2).contiguous(), None
    out = attend_chunk(q, k[:, :, :S - T], v[:, :, :S - T], k[:, :, S - T:], v[:, :, S - T:], scale)
    return out.transpose(1, 2).contiguous(), None


def headwise_mask(batch_size: int, q_length: int | None = None, kv_length: int = 0, q_offset=0, kv_offset: int = 0,
                  mask_function=None, attention_mask: torch.Tensor | None = None, local_size=None,
                  **kwargs) -> torch.Tensor | None:
    """The mask for `kvpipe_headwise`: None (causal is built in), or the keys' padding mask
    [B, kv_length] of a left-padded batch. A sliding window counts as full attention when it covers
    all kv_length keys; smaller windows, custom and packed masks are refused."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        if local_size is None:
            raise ValueError(f"{IMPLEMENTATION}: only the causal mask (or a sliding window covering "
                             "the whole cache) is supported; got a custom or packed mask function")
        if local_size < kv_length:
            raise ValueError(f"sliding_window: {local_size} < {kv_length} keys; HeadwiseCache attends "
                             "to the whole cache (sliding windows are not supported)")
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask   # a prepared mask is refused by the attention function
    if UNPADDED.get():
        return None
    from kvpipe.executor.hf.masked import padding_mask

    valid = padding_mask(attention_mask, kv_length, kv_offset)
    return None if bool(valid.all()) else valid


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, headwise_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, headwise_mask)
    return IMPLEMENTATION
