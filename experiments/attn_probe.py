"""Where kvpipe's chunked prefill stands against HF's one-pass prefill: one layer of Llama-3-8B
attention at 128K (bf16, H200), full causal SDPA per backend vs kvpipe's chunked attention (prefix +
chunk, LSE merge) with K/V contiguous or interleaved per token as the KV store lays them out, on
each CUDA kernel kvpipe can use (KVPIPE_ATTN=flash|cudnn).
Prints TFLOP/s per variant (causal FLOPs: 4*D*Hq*S^2/2), the first (cold) pass of the cuDNN
chunked variant (one cuDNN plan per new shape), and the error of the chunked result against full
SDPA, and writes JSON to $OUT or ./."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvpipe.executor.layers.attention import attend_chunk, attend_part
from kvpipe.executor.calibrate.timing import cuda_median_s

S, D, HQ, HKV = 131072, 128, 32, 8
FLOPS = 4 * D * HQ * S * S / 2


def timed(fn, reps: int = 3) -> float:
    return cuda_median_s(fn, reps)


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
    os.environ["KVPIPE_ATTN"] = "cudnn"        # first: the cold pass builds a cuDNN plan per shape
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    chunked(q, ki, vi, 4096)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
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
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    for kernel in ("cudnn", "flash"):
        os.environ["KVPIPE_ATTN"] = kernel
        res[f"{kernel}_op_full_causal"] = timed(lambda: attend_part(q, kr, vr, D ** -0.5, True))
        res[f"kvpipe_{kernel}_chunk4096_contig"] = timed(lambda: chunked(q, k, v, 4096))
        res[f"kvpipe_{kernel}_chunk4096_interleaved"] = timed(lambda: chunked(q, ki, vi, 4096))
        res[f"kvpipe_{kernel}_chunk4096_prefix_only"] = timed(lambda: chunked(q, k, v, 4096, prefix_only=True))
        res[f"kvpipe_{kernel}_chunk16384_interleaved"] = timed(lambda: chunked(q, ki, vi, 16384))
    out = {n: {"s": t, "tflops": FLOPS / t / 1e12} if isinstance(t, float) else t for n, t in res.items()}
    out["kvpipe_cudnn_chunk4096_interleaved_cold_s"] = cold
    try:   # the last 2048 queries (the longest prefix) against fp32 SDPA of the same bf16 values
        ref = F.scaled_dot_product_attention(q[:, :, -2048:].float(), k.float().repeat_interleave(4, 1),
                                             v.float().repeat_interleave(4, 1),
                                             attn_mask=torch.ones(2048, S, dtype=torch.bool, device="cuda").tril(S - 2048))
        for kernel in ("cudnn", "flash"):
            os.environ["KVPIPE_ATTN"] = kernel
            o = attend_chunk(q[:, :, -2048:].contiguous(), ki[:, :, :-2048], vi[:, :, :-2048],
                             ki[:, :, -2048:], vi[:, :, -2048:], D ** -0.5).float()
            out[f"kvpipe_{kernel}_rel_err_vs_fp32"] = ((o - ref).norm() / ref.norm()).item()
    except Exception as e:  # report, keep the timings
        out["rel_err_error"] = str(e).splitlines()[0][:200]
    out["torch"] = torch.__version__
    out["cudnn"] = torch.backends.cudnn.version()
    for n, r in out.items():
        print(f"{n:42} {r['s'] * 1e3:9.1f} ms {r['tflops']:7.1f} TFLOP/s" if isinstance(r, dict) else f"{n:42} {r}")
    with open(os.path.join(os.environ.get("OUT", "."), "attn_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
