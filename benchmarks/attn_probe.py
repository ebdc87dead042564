"""Where kvpipe's chunked prefill loses to HF's one-pass prefill: one layer of Llama-3-8B attention
at 128K (bf16, H200), full causal SDPA per backend vs kvpipe's chunked attention (prefix + chunk,
LSE merge) with K/V contiguous or interleaved per token as the KV store lays them out.
Prints TFLOP/s per variant (causal FLOPs: 4*D*Hq*S^2/2) and writes JSON to $OUT or ./."""
from __future__ import annotations

import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from executor.attention import attend_chunk, attend_part

S, D, HQ, HKV = 131072, 128, 32, 8
FLOPS = 4 * D * HQ * S * S / 2


def timed(fn, reps: int = 3) -> float:
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def chunked(q, k, v, chunk, prefix_only=False):
    scale = D ** -0.5
    for s in range(0, S, chunk):
        e = s + chunk
        if prefix_only:
            if s:
                r = HQ // HKV
                attend_part(q[:, :, s:e].reshape(1, HKV, r * chunk, D), k[:, :, :s], v[:, :, :s], scale, False)
        else:
            attend_chunk(q[:, :, s:e].contiguous(), k[:, :, :s], v[:, :, :s], k[:, :, s:e], v[:, :, s:e], scale)


def main() -> None:
    torch.manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(1, HQ, S, D, device="cuda", dtype=dt)
    k = torch.randn(1, HKV, S, D, device="cuda", dtype=dt)
    v = torch.randn(1, HKV, S, D, device="cuda", dtype=dt)
    kv = torch.stack((k, v), dim=3)            # [1, Hkv, S, 2, D] as the KV store holds it
    ki, vi = kv[..., 0, :], kv[..., 1, :]
    res = {}
    for name, be in (("sdpa_default", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(be=be):
            if be is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        try:
            res[name] = timed(run)
        except Exception as e:  # a backend that refuses these shapes
            res[name] = f"error: {str(e).splitlines()[0][:120]}"
    res["flash_op_full_causal"] = timed(lambda: attend_part(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), D ** -0.5, True))
    res["kvpipe_chunk4096_contig"] = timed(lambda: chunked(q, k, v, 4096))
    res["kvpipe_chunk4096_interleaved"] = timed(lambda: chunked(q, ki, vi, 4096))
    res["kvpipe_chunk4096_prefix_only"] = timed(lambda: chunked(q, k, v, 4096, prefix_only=True))
    res["kvpipe_chunk16384_contig"] = timed(lambda: chunked(q, k, v, 16384))
    out = {n: {"s": t, "tflops": FLOPS / t / 1e12} if isinstance(t, float) else t for n, t in res.items()}
    out["torch"] = torch.__version__
    for n, r in out.items():
        print(f"{n:32} {r['s'] * 1e3:9.1f} ms {r['tflops']:7.1f} TFLOP/s" if isinstance(r, dict) else f"{n:32} {r}")
    with open(os.path.join(os.environ.get("OUT", "."), "attn_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
