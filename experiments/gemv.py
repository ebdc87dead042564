"""A decode step's one-token projections side by side: F.linear (cuBLAS) against the Triton kernel
of executor/layers/gemv_triton.py, each at Llama-3-8B's shapes over 8 distinct weights in a CUDA
graph (weights stream from HBM as in a real step), checked against float64; then the kernel's
constants swept. Bytes per second are the weight bytes one call reads.

  python -m experiments.gemv --out FILE.json      # on the GPU machine"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from experiments.decode_pieces import graph_us
from kvpipe.executor.layers import gemv_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SWEEP = {"BLOCK_N": (4, 8, 16), "BLOCK_K": (256, 512, 1024), "WARPS": (4, 8), "STAGES": (2, 4)}
LAYERS = 8


def weights(N: int, K: int) -> tuple[list, torch.Tensor]:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(LAYERS)]
    return ws, torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)


def timed(mm, ws, x) -> float:
    return graph_us(lambda: [mm(x, w) for w in ws])


def error(ws, x) -> dict:
    """Max |error| against float64 of cuBLAS and of the kernel, for the first weight."""
    ref = (x.double() @ ws[0].double().T)
    return {n: (mm(x, ws[0]).double() - ref).abs().max().item()
            for n, mm in (("cublas", F.linear), ("triton", gemv_triton.linear))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows, sweep = [], []
    for name, (N, K) in SHAPES.items():
        ws, x = weights(N, K)
        nbytes = N * K * 2
        a, b = timed(F.linear, ws, x), timed(gemv_triton.linear, ws, x)
        rows.append({"shape": name, "N": N, "K": K, "cublas_us": a, "triton_us": b, "bytes": nbytes, **error(ws, x)})
        print(f"{name:8} {N:>6}x{K:<6} cuBLAS {a:6.1f} us {nbytes / a / 1e6:.2f} TB/s | triton {b:6.1f} us "
              f"{nbytes / b / 1e6:.2f} TB/s | {b / a:.2f}x | err {rows[-1]['cublas']:.2e} / {rows[-1]['triton']:.2e}", flush=True)
        if args.no_sweep or name == "lm_head":
            continue
        base = {k: getattr(gemv_triton, k) for k in SWEEP}
        for values in itertools.product(*SWEEP.values()):
            for k, v in zip(SWEEP, values):
                setattr(gemv_triton, k, v)
            gemv_triton._warm.clear()
            try:
                us = timed(gemv_triton.linear, ws, x)
            except Exception as e:      # a config the compiler refuses (registers, shared memory)
                us = None
                print(f"  {dict(zip(SWEEP, values))}: {type(e).__name__}", flush=True)
            sweep.append({"shape": name, **dict(zip(SWEEP, values)), "us": us})
        for k, v in base.items():
            setattr(gemv_triton, k, v)
        gemv_triton._warm.clear()
        best = sorted((p for p in sweep if p["shape"] == name and p["us"]), key=lambda p: p["us"])[:3]
        for p in best:
            print(f"  best {p}  {nbytes / p['us'] / 1e6:.2f} TB/s", flush=True)
    best = None
    if sweep:     # the constants with the least time over a layer's four projections
        per = {}
        for p in sweep:
            if p["shape"] != "lm_head":
                key = tuple(p[k] for k in SWEEP)
                per[key] = per.get(key, 0.0) + (p["us"] if p["us"] else float("inf"))
        best = dict(zip(SWEEP, min(per, key=per.get)))
        print("best over a layer:", " ".join(f"{k}={v}" for k, v in best.items()), f"{min(per.values()):.1f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m experiments.gemv", "rows": rows, "sweep": sweep, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
