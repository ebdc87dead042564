"""Attention over left-padded batches: the causal chunk attention with the padded keys of each
sequence masked out. Used only when generate()'s attention_mask holds zeros; un-padded batches
keep the executor's chunked attention (executor/layers/attention.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def padding_mask(attention_mask: torch.Tensor, kv_length: int, kv_offset: int = 0) -> torch.Tensor:
    """generate()'s 2-D mask [B, >= kv] -> bool [B, kv_length] of the keys attended (True: a token)."""
    m = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if m.shape[1] < kv_length:   # keys past the mask's end are new tokens, never padding
        m = torch.cat([m, m.new_ones(m.shape[0], kv_length - m.shape[1])], dim=1)
    return m


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] of the last T positions, k/v [B, Hkv, S, D] (prefix then the T new keys),
    valid [B, S] -> [B, T, Hq, D]. A padded query also sees itself, so that its row is finite (it
    is never read: a padded key is masked for every real query)."""
    B, Hq, T, D = q.shape
    S, r = k.shape[2], Hq // k.shape[1]
    qpos = torch.arange(S - T, S, device=q.device)[:, None]          # [T, 1]
    kpos = torch.arange(S, device=q.device)[None, :]                  # [1, S]
    allowed = ((kpos <= qpos) & valid[:, None, :]) | (kpos == qpos)   # [B, T, S]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)
    return out.transpose(1, 2)
