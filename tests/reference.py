"""Independent reference for attention tests: dense causal attention in float64 written out here
(scores, max-shifted exp, normalise, weighted sum), with its own GQA mapping. It shares no code
with executor/layers/attention.py, so a bug there cannot hide in the reference."""
import torch


def kv_head_of(q_head: int, q_heads: int, kv_heads: int) -> int:
    """The KV head that query head `q_head` reads: consecutive blocks of q_heads // kv_heads query
    heads share one KV head (HF's repeat_kv layout: q heads 0..r-1 -> kv 0, r..2r-1 -> kv 1, ...)."""
    return q_head // (q_heads // kv_heads)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, T, D] are the LAST T of the S positions of k, v [B, Hkv, S, D]; query row i sits at
    position S - T + i and sees keys 0 .. S - T + i. Returns float64 [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv or T > S or k.shape != (B, Hkv, S, D) or v.shape != k.shape:
        raise ValueError(f"reference: bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    q64, k64, v64 = q.double().cpu(), k.double().cpu(), v.double().cpu()
    pos_q = torch.arange(S - T, S, dtype=torch.long)[:, None]     # [T, 1]
    pos_k = torch.arange(S, dtype=torch.long)[None, :]            # [1, S]
    allowed = pos_k <= pos_q                                      # [T, S]
    out = torch.empty(B, Hq, T, D, dtype=torch.float64)
    for h in range(Hq):
        j = kv_head_of(h, Hq, Hkv)
        scores = torch.einsum("btd,bsd->bts", q64[:, h], k64[:, j]) * scale   # [B, T, S]
        scores = torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=torch.float64))
        shifted = scores - scores.amax(dim=-1, keepdim=True)                   # max row entry -> 0
        weights = torch.exp(shifted)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[:, h] = torch.einsum("bts,bsd->btd", weights, v64[:, j])
    return out.to(q.device)
