"""Where the model fingerprint's time goes (kvpipe/fingerprint.py, which a --load-kv
waits for): Llama-3-8B-shaped random bf16 weights on the GPU, the `lines` hash timed whole
(median of --reps after a warm-up), its kernels by GPU time (torch.profiler), and the floor: every
weight read once at the device-to-device copy rate.

  python -m experiments.fingerprint_rate --out FILE.json     # on the GPU machine

Prints a table last; JSON to --out."""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvpipe.fingerprint import fingerprint
from kvpipe.executor.layers.loader import random_model

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=8192, tie_word_embeddings=False)


def timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def copy_rate() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    sec = min(timed(lambda: dst.copy_(src), 5))
    return 2 * src.numel() / sec


def kernels(fn, top: int = 10) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev and e.count and not e.key.startswith("aten::"):
            rows.append({"kernel": e.key[:90], "calls": e.count, "gpu_ms": dev / 1e3})
    rows.sort(key=lambda r: -r["gpu_ms"])
    host = [{"op": e.key, "calls": e.count, "cpu_ms": e.cpu_time_total / 1e3}
            for e in prof.key_averages() if e.key.startswith("aten::")]
    host.sort(key=lambda r: -r["cpu_ms"])
    return {"kernels": rows[:top], "host_ops": host[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    model = random_model({**LLAMA3_8B, "num_hidden_layers": args.layers}, "cuda", torch.bfloat16, 0)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rate = copy_rate()
    whole = timed(lambda: fingerprint(model), args.reps)
    prof = kernels(lambda: fingerprint(model))
    res = {"weights_bytes": nbytes, "d2d_bytes_per_s": rate, "floor_s": nbytes / rate,
           "fingerprint_s": whole, **prof}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    for r in prof["host_ops"]:
        print(f"  host {r['op']:<40} {r['calls']:>6} {r['cpu_ms']:9.1f} ms")
    for r in prof["kernels"]:
        print(f"  gpu  {r['kernel']:<90} {r['calls']:>6} {r['gpu_ms']:9.1f} ms")
    med = sorted(whole)[len(whole) // 2]
    print(f"weights {nbytes / 1e9:.2f} GB, d2d {rate / 1e9:.0f} GB/s, floor {nbytes / rate * 1e3:.1f} ms; "
          f"fingerprint median {med * 1e3:.0f} ms ({med * rate / nbytes:.1f}x the floor)")


if __name__ == "__main__":
    main()
