"""LOSSY, `--sparse F`: the error a sparse run measures on its own activations, once, at its first
decode step, on the first layer with offloaded units: for each offloaded unit and each of its
query heads, the exact attention mass on the tokens the selection named (recall) and the relative
L2 error of the attention output over those tokens against the output over the whole prefix, both
in float64 (the step's own token left out of both). Random weights: not a task accuracy."""
from __future__ import annotations

import torch


BLOCK = 1 << 16   # prefix tokens converted to float64 at a time: 64 MiB of K or V at D = 128, so the
                  # probe never holds a whole unit in float64 (1 GiB at 512K, more than a run's margin)


def measure(q: torch.Tensor, prefix: torch.Tensor, sel: torch.Tensor, scale: float,
            block: int = BLOCK) -> dict[str, float]:
    """q [B, n_off, r, D] of the step's queries; prefix [B, n_off, P, 2, D] the units' K/V (any
    device: read one unit, `block` tokens at a time, onto q's); sel [B, n_off, N] the selected tokens."""
    B, n_off, r, D = q.shape
    P = prefix.shape[2]
    recall, rel = [], []
    for b in range(B):
        for j in range(n_off):
            qd = q[b, j].double()
            parts = range(0, P, block)
            logits = torch.cat([(qd @ prefix[b, j, i:i + block, 0].to(q.device, torch.float64).T) * scale
                                for i in parts], -1)                        # [r, P]
            w = torch.softmax(logits, -1)
            keep = torch.zeros(P, dtype=torch.bool, device=q.device)
            keep[sel[b, j]] = True
            mass = (w * keep).sum(-1)                                       # [r]
            ws = torch.where(keep, w, 0) / mass[:, None]
            full = torch.zeros(r, D, dtype=torch.float64, device=q.device)
            part = torch.zeros_like(full)
            for i in parts:
                v = prefix[b, j, i:i + block, 1].to(q.device, torch.float64)   # [<=block, D]
                full += w[:, i:i + block] @ v
                part += ws[:, i:i + block] @ v
            recall.append(mass)
            rel.append((part - full).norm(dim=-1) / full.norm(dim=-1))
    recall, rel = torch.cat(recall), torch.cat(rel)
    return {"sparse_recall_mean": recall.mean().item(), "sparse_recall_min": recall.min().item(),
            "sparse_attn_rel_err": rel.mean().item(), "sparse_attn_rel_err_max": rel.max().item(),
            "probe_tokens": float(P), "fetched_tokens": float(sel.shape[-1])}
