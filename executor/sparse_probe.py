"""LOSSY, `--sparse F`: the error a sparse run measures on its own activations, once, at its first
decode step, on the first layer with offloaded units: for each offloaded unit and each of its
query heads, the exact attention mass on the tokens the selection named (recall) and the relative
L2 error of the attention output over those tokens against the output over the whole prefix, both
in float64 (the step's own token left out of both). Random weights: not a task accuracy."""
from __future__ import annotations

import torch


def measure(q: torch.Tensor, prefix: torch.Tensor, sel: torch.Tensor, scale: float) -> dict[str, float]:
    """q [B, n_off, r, D] of the step's queries; prefix [B, n_off, P, 2, D] the units' K/V (any
    device: read one unit at a time onto q's); sel [B, n_off, N] the selected tokens."""
    B, n_off, r, D = q.shape
    recall, rel = [], []
    for b in range(B):
        for j in range(n_off):
            kv = prefix[b, j].to(q.device, torch.float64)                  # [P, 2, D]
            w = torch.softmax((q[b, j].double() @ kv[:, 0].T) * scale, -1)  # [r, P]
            keep = torch.zeros(kv.shape[0], dtype=torch.bool, device=q.device)
            keep[sel[b, j]] = True
            mass = (w * keep).sum(-1)                                       # [r]
            ws = torch.where(keep, w, 0) / mass[:, None]
            full, part = w @ kv[:, 1], ws @ kv[:, 1]                        # [r, D]
            recall.append(mass)
            rel.append((part - full).norm(dim=-1) / full.norm(dim=-1))
    recall, rel = torch.cat(recall), torch.cat(rel)
    return {"sparse_recall_mean": recall.mean().item(), "sparse_recall_min": recall.min().item(),
            "sparse_attn_rel_err": rel.mean().item(), "sparse_attn_rel_err_max": rel.max().item(),
            "probe_tokens": float(prefix.shape[2]), "fetched_tokens": float(sel.shape[-1])}
