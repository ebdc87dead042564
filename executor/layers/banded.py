"""Exact attention for the layer kinds the fused chunk kernels cannot express by themselves: a
sliding window (query i sees the keys j with i - W < j <= i, HF's `sliding_window_overlay` on the
causal mask, its own key included) and an attention logit softcap (Gemma 2: the scaled score s
becomes cap * tanh(s / cap) before the softmax, as HF's eager attention does).

Where every query of the chunk sees a suffix of the keys (a decode step, a window no row's reach
exceeds) the fused chunked path runs on the visible part of the prefix. Otherwise, on CUDA in
bf16/fp16 without a softcap, one FA2 call over the visible keys (prefix tail and chunk) with FA2's
own sliding window, which skips the tiles outside the band; elsewhere masked calls over the
visible keys in blocks of BANDED_ROWS queries. The bits depend only on the values, shapes, dtype
and device, never on where the prefix lives: the same code runs for a resident and a fetched one."""
from __future__ import annotations

import torch

from kvpipe.pipeline.layer_kinds import first_visible

from kvpipe.executor.layers.attention import attend_chunk

BANDED_ROWS = 4096         # queries per masked call of a window layer's chunk off the GPU
SCORE_ELEMENTS = 1 << 25   # softcapped scores held at once (fp32: 128 MiB); query rows are tiled to it


def attend_kind(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_new: torch.Tensor,
                v_new: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                first: int = 0) -> torch.Tensor:
    """As attention.attend_chunk (q [B, Hq, T, D], prefix [B, Hkv, P - first, D] at positions
    [first, P), new [B, Hkv, T, D] at [P, P+T)) for a layer with a sliding `window` (0: full) and a
    logit `softcap` (0.0: none); `first` may be no later than the first key the chunk sees (a
    window unit's store keeps only those). Returns [B, Hq, T, D] in q.dtype. A window layer's
    chunk runs in blocks of BANDED_ROWS queries, each over its own visible keys: its mask and keys
    stay within BANDED_ROWS x (W - 1 + BANDED_ROWS) however long the chunk."""
    B, Hq, T, D = q.shape
    P = first + k_prefix.shape[2]
    lo = first_visible(P, window)
    assert first <= lo or P == first, (first, lo, P)
    at = max(0, lo - first)   # the first key the chunk's first query sees, in the prefix
    if not softcap and (T == 1 or P + T <= window or not window):
        return attend_chunk(q, k_prefix[:, :, at:], v_prefix[:, :, at:], k_new, v_new, scale)
    if not softcap and q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return _windowed_flash(q, k_prefix[:, :, at:], v_prefix[:, :, at:], k_new, v_new, scale, window)
    rows = BANDED_ROWS if window else T
    if rows >= T:
        return _banded(q, k_prefix, v_prefix, k_new, v_new, P, first, scale, window, softcap)
    out = q.new_empty(B, Hq, T, D)
    for a in range(0, T, rows):
        b = min(T, a + rows)
        out[:, :, a:b] = _banded(q[:, :, a:b], k_prefix, v_prefix, k_new, v_new, P + a, first, scale, window, softcap)
    return out


def _windowed_flash(q: torch.Tensor, k_tail: torch.Tensor, v_tail: torch.Tensor, k_new: torch.Tensor,
                    v_new: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """One FA2 call of the chunk's T queries over the prefix tail its first query sees and the
    chunk's keys (tail then chunk: [B, Hkv, L + T, D]), causal aligned to the last key and `window`
    keys deep (left W - 1, right 0): query t sees keys L + t - W < j <= L + t. FA2 takes GQA heads
    and [B, S, H, D] views, so only the tail and chunk K/V are copied (into one tensor)."""
    k, v = (torch.cat(p, 2).transpose(1, 2) for p in ((k_tail, k_new), (v_tail, v_new)))   # [B, S, Hkv, D]
    res = torch.ops.aten._flash_attention_forward(q.transpose(1, 2), k, v, None, None, q.shape[2], k.shape[1],
                                                  0.0, True, False, scale=scale, window_size_left=window - 1,
                                                  window_size_right=0)
    return res[0].transpose(1, 2)   # [B, T, Hq, D] -> [B, Hq, T, D]


def _banded(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_new: torch.Tensor,
            v_new: torch.Tensor, s0: int, first: int, scale: float, window: int, softcap: float) -> torch.Tensor:
    """One masked call: the n queries q [B, Hq, n, D] at positions [s0, s0+n) of the chunk over
    the keys from the first one they see (prefix tail, then the chunk's keys up to s0+n); the
    prefix holds positions [first, P)."""
    B, Hq, n, D = q.shape
    Hkv, P = k_prefix.shape[1], first + k_prefix.shape[2]
    lo = first_visible(s0, window)
    new = slice(max(0, lo - P), s0 + n - P)
    at = min(max(lo, first), P) - first
    parts = [(k_prefix[:, :, at:], v_prefix[:, :, at:]), (k_new[:, :, new], v_new[:, :, new])]
    qpos = torch.arange(s0, s0 + n, device=q.device)[:, None]   # [n, 1]
    kpos = torch.arange(lo, s0 + n, device=q.device)[None]      # [1, S]
    see = kpos <= qpos
    if window:
        see &= kpos > qpos - window
    r = Hq // Hkv
    q_fold = q.reshape(B, Hkv, r * n, D)     # row rr*n + t: query head h*r + rr, token t
    mask = see.repeat(r, 1)                   # [r*n, S]
    if softcap:   # the parts apart: a global layer's prefix is never copied
        out = _softcapped(q_fold, parts, mask, scale, softcap)
    else:         # a window's keys: at most W - 1 + BANDED_ROWS, copied into one call
        k, v = (torch.cat([p[i] for p in parts], 2) for i in (0, 1))   # [B, Hkv, S, D]: keys at [lo, s0+n)
        out = torch.nn.functional.scaled_dot_product_attention(q_fold, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, n, D)


def _softcapped(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                scale: float, cap: float) -> torch.Tensor:
    """Masked softmax attention of q [B, H, R, D] over the keys of `parts` (k, v [B, H, S_i, D],
    in order) with the scores capped: scores in the inputs' dtype, capped and normalised in
    float32 (float64 for float64), the weights back in the inputs' dtype for the value product
    (HF's eager order); query rows in tiles of at most SCORE_ELEMENTS scores."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, R, D = q.shape
    S = sum(k.shape[2] for k, _ in parts)
    rows = max(1, SCORE_ELEMENTS // max(1, B * H * S))
    out = q.new_empty(B, H, R, D)
    for a in range(0, R, rows):
        b = min(R, a + rows)
        s = torch.cat([torch.matmul(q[:, :, a:b], k.transpose(-1, -2)) for k, _ in parts], -1).to(acc) * scale
        s = torch.tanh(s / cap) * cap
        w = torch.softmax(s.masked_fill(~mask[a:b], float("-inf")), -1).to(q.dtype)   # [B, H, rows, S]
        o, at = 0, 0
        for _, v in parts:
            o = o + torch.matmul(w[..., at:at + v.shape[2]], v).to(acc)
            at += v.shape[2]
        out[:, :, a:b] = o.to(q.dtype)
    return out
