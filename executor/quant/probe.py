"""LOSSY runs measure their own error, once, where it is cheap: on the first prefill chunk's first
offloaded layer, the blocks just quantised are decoded again and compared with the exact K/V they
came from, and the chunk's last query attends the chunk's keys both ways (exact K/V, and the K/V
the run will actually read back: dequantised full blocks, exact tail) in float64. These figures
are of this run's (random or real) activations, not a task accuracy."""
from __future__ import annotations

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = torch.linalg.vector_norm(b)
    return float(torch.linalg.vector_norm(a - b) / den) if float(den) > 0 else float(torch.linalg.vector_norm(a))


def _last_query_attention(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hk*r, D] (one query per head), kv [B, Hk, T, 2, D] -> [B, Hk*r, D] float64; the
    query sees every key (it is the last of the chunk)."""
    B, Hq, D = q.shape
    Hk = kv.shape[1]
    qd = q.double().view(B, Hk, Hq // Hk, D)
    k, v = kv[..., 0, :].double(), kv[..., 1, :].double()                 # [B, Hk, T, D]
    w = torch.softmax(torch.einsum("bhrd,bhtd->bhrt", qd, k) * scale, -1)
    return torch.einsum("bhrt,bhtd->bhrd", w, v).reshape(B, Hq, D)


def measure(codec, q: torch.Tensor, new: torch.Tensor, full: torch.Tensor, recs: torch.Tensor,
            scale: float) -> dict[str, float]:
    """`q` [B, n_off*r, T, D] the chunk's queries of the offloaded heads, `new` [B, n_off, T, 2, D]
    their exact K/V from position 0, `full` [B, n_off, nb, group, 2, D] its full blocks and
    `recs` [B, n_off, nb, record] their records. Returns relative errors (float64 norms)."""
    B, H, nb, g = full.shape[:4]
    dq = torch.empty_like(full)
    codec.decode(recs.reshape(-1, recs.shape[-1]), dq.view(-1, g, *full.shape[4:]))
    lossy = new.clone()
    lossy[:, :, :nb * g] = dq.view(B, H, nb * g, *full.shape[4:])
    exact = _last_query_attention(q[:, :, -1], new, scale)
    approx = _last_query_attention(q[:, :, -1], lossy, scale)
    return {"k_rel_err": _rel(dq[..., 0, :], full[..., 0, :]), "v_rel_err": _rel(dq[..., 1, :], full[..., 1, :]),
            "attn_rel_err": _rel(approx, exact), "probe_tokens": float(new.shape[2])}
