"""The error a sparse run measures on itself (executor/sparse_probe.measure): recall of attention
mass on the selected tokens and the output's relative error, against a float64 softmax written
here. The probe reads the prefix in blocks of tokens (a whole unit in float64 is 1 GiB at 512K
and ran a 24 GB run out of memory on the H200); the blocks must not change the figures."""
import torch

from kvpipe.executor.sparse import probe as sparse_probe


def _reference(q, prefix, sel, scale):
    B, n_off, r, D = q.shape
    rec, rel = [], []
    for b in range(B):
        for j in range(n_off):
            k, v = prefix[b, j, :, 0].double(), prefix[b, j, :, 1].double()
            logits = q[b, j].double() @ k.T * scale
            w = torch.exp(logits - logits.max(-1, keepdim=True).values)
            w = w / w.sum(-1, keepdim=True)
            m = torch.zeros(k.shape[0], dtype=torch.float64)
            m[sel[b, j]] = 1.0
            mass = (w * m).sum(-1)
            full, part = w @ v, (w * m / mass[:, None]) @ v
            rec.append(mass)
            rel.append((part - full).norm(dim=-1) / full.norm(dim=-1))
    return torch.cat(rec), torch.cat(rel)


def test_blockwise_probe_equals_the_whole_prefix_reference():
    """Faults caught: a block's logits or values misplaced (offsets i:i+block), the last part
    block dropped (P = 103 is not a multiple of 16), softmax taken per block instead of over the
    whole prefix, the value sum started from the wrong block."""
    g = torch.Generator().manual_seed(0)
    B, n_off, r, D, P = 1, 3, 4, 16, 103
    q = torch.randn(B, n_off, r, D, generator=g).bfloat16()
    prefix = torch.randn(B, n_off, P, 2, D, generator=g).bfloat16()
    sel = torch.stack([torch.randperm(P, generator=g)[:30].sort().values for _ in range(n_off)])[None]
    rec, rel = _reference(q, prefix, sel, 0.25)
    for block in (16, 1 << 16):
        got = sparse_probe.measure(q, prefix, sel, 0.25, block=block)
        assert abs(got["sparse_recall_mean"] - rec.mean().item()) < 1e-12
        assert abs(got["sparse_recall_min"] - rec.min().item()) < 1e-12
        assert abs(got["sparse_attn_rel_err"] - rel.mean().item()) < 1e-12
        assert abs(got["sparse_attn_rel_err_max"] - rel.max().item()) < 1e-12
        assert got["probe_tokens"] == P and got["fetched_tokens"] == 30
