"""A resident decode step's pieces at Llama-3-8B shapes, one token, timed in CUDA graphs over 8
layers' distinct weights (weights stream from HBM as in a real step, none stay in L2): the q/k/v
projections apart against one fused [6144, 4096] GEMM, gate and up apart against one [28672,
4096] GEMM, o and down, and decode attention (executor/layers/attention.attend_decode) against
the same call with the GQA group folded into query rows (each KV head read once, not once per
query head), each checked against float64 attention. Prints us per layer and the HBM bytes rate.

  python -m experiments.decode_pieces --contexts 8K,32K --out pieces.json      # H200"""
from __future__ import annotations

import argparse
import json
import sys

H, I, HQ, HKV, D, LAYERS = 4096, 14336, 32, 8, 128, 8


def graph_us(fn, reps: int = 20) -> float:
    """Device microseconds of one call of `fn` (which runs LAYERS calls), captured in a CUDA graph."""
    import torch
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps / LAYERS


def folded_decode(q, kv, lens, cu_q, cu_k, scale):
    """attend_decode with the query heads of one KV head as rows of one query sequence (cu_q = (0, r))."""
    import torch
    G, S = kv.shape[1], kv.shape[2]
    r = HQ // G
    qf = q[0, :, 0].view(G, r, D).transpose(0, 1).contiguous()   # [r, G, D]: row t, KV head g = q head g*r+t
    k = kv[0, :, :, 0].transpose(0, 1)
    v = kv[0, :, :, 1].transpose(0, 1)
    res = torch.ops.aten._flash_attention_forward(qf, k, v, cu_q, cu_k, r, S, 0.0, False, False,
                                                  scale=scale, seqused_k=lens)
    return res[0].transpose(0, 1).reshape(1, 1, HQ, D)


def reference(q, kv, n, scale):
    """float64 softmax attention of q [1, HQ, 1, D] over kv's first n keys -> [1, 1, HQ, D]."""
    import torch
    k = kv[0, :, :n, 0].double().repeat_interleave(HQ // HKV, 0)
    v = kv[0, :, :n, 1].double().repeat_interleave(HQ // HKV, 0)
    s = torch.einsum("hd,hsd->hs", q[0, :, 0].double(), k) * scale
    return torch.einsum("hs,hsd->hd", s.softmax(-1), v).view(1, 1, HQ, D)


def gemms(dev, dt) -> dict:
    import torch
    import torch.nn.functional as F
    w = lambda o, i: [torch.randn(o, i, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]  # noqa: E731
    x, xi = torch.randn(1, 1, H, device=dev, dtype=dt), torch.randn(1, 1, I, device=dev, dtype=dt)
    wq, wk, wv, wqkv = w(HQ * D, H), w(HKV * D, H), w(HKV * D, H), w((HQ + 2 * HKV) * D, H)
    wg, wu, wgu, wo, wd = w(I, H), w(I, H), w(2 * I, H), w(H, HQ * D), w(H, I)
    cases = {"q+k+v apart": (lambda: [(F.linear(x, wq[i]), F.linear(x, wk[i]), F.linear(x, wv[i])) for i in range(LAYERS)],
                             wq[0].numel() + 2 * wk[0].numel()),
             "qkv fused": (lambda: [F.linear(x, wqkv[i]) for i in range(LAYERS)], wqkv[0].numel()),
             "o": (lambda: [F.linear(x, wo[i]) for i in range(LAYERS)], wo[0].numel()),
             "gate+up apart": (lambda: [(F.linear(x, wg[i]), F.linear(x, wu[i])) for i in range(LAYERS)], 2 * wg[0].numel()),
             "gate-up fused": (lambda: [F.linear(x, wgu[i]) for i in range(LAYERS)], wgu[0].numel()),
             "down": (lambda: [F.linear(xi, wd[i]) for i in range(LAYERS)], wd[0].numel())}
    out = {}
    for name, (fn, n) in cases.items():
        us = graph_us(fn)
        out[name] = {"us": round(us, 2), "tb_s": round(2 * n / us / 1e6, 3)}
    fused_qkv = F.linear(x, torch.cat([wq[0], wk[0], wv[0]]))
    apart = torch.cat([F.linear(x, wq[0]), F.linear(x, wk[0]), F.linear(x, wv[0])], -1)
    out["qkv fused == apart (bitwise)"] = bool(torch.equal(fused_qkv, apart))
    return out


def attention(dev, dt, context: int) -> dict:
    import torch
    from kvpipe.executor.layers.attention import attend_decode
    S = context + 128
    kvs = [torch.randn(1, HKV, S, 2, D, device=dev, dtype=dt) for _ in range(LAYERS)]
    q = torch.randn(1, HQ, 1, D, device=dev, dtype=dt)
    lens = torch.tensor([context], dtype=torch.int32, device=dev)
    cu_q, cu_k = (torch.tensor(t, dtype=torch.int32, device=dev) for t in ([0, 1], [0, S]))
    scale = D ** -0.5
    cur = lambda: [attend_decode(q, kvs[i], lens, cu_q, cu_k, scale) for i in range(LAYERS)]  # noqa: E731
    cu_r = torch.tensor([0, HQ // HKV], dtype=torch.int32, device=dev)
    fold = lambda: [folded_decode(q, kvs[i], lens, cu_r, cu_k, scale) for i in range(LAYERS)]  # noqa: E731
    ref = reference(q, kvs[0], context, scale)
    a, b = attend_decode(q, kvs[0], lens, cu_q, cu_k, scale), folded_decode(q, kvs[0], lens, cu_r, cu_k, scale)
    kv_bytes = 2 * HKV * context * D * 2
    res = {}
    for name, fn, o in (("attend_decode", cur, a), ("folded GQA", fold, b)):
        us = graph_us(fn)
        res[name] = {"us": round(us, 2), "tb_s": round(kv_bytes / us / 1e6, 3),
                     "max_err_vs_f64": float((o.double() - ref).abs().max())}
    res["folded == attend_decode (bitwise)"] = bool(torch.equal(a, b))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8K,32K")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("decode_pieces: needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    doc = {"device": torch.cuda.get_device_name(), "gemms": gemms(dev, dt), "attention": {}}
    for c in args.contexts.split(","):
        n = int(c.rstrip("Kk")) * 1024
        doc["attention"][c] = attention(dev, dt, n)
    for name, r in doc["gemms"].items():
        print(f"{name:24s} {r}")
    for c, rows in doc["attention"].items():
        for name, r in rows.items():
            print(f"{c:4s} {name:36s} {r}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
