"""Are a model family's small-kernel floor and elementwise rate its own? `kvpipe calibrate` measures
both on one Llama-3-8B-shaped layer's small kernels (executor/calibrate/gpu.small_kernels): the
per-kernel floor at 1 token in a CUDA graph (gpu.small_kernel_s), the bytes read + written per
second at 8192 tokens eagerly (gpu.elementwise_efficiency, over the copy rate). This measures the
same on one layer of each family whose small kernels differ (pipeline/layer_ops.py: Gemma 2/3's
norms and casts, Phi's RoPE cat), the rate also at --tokens (a run's prefill chunk).

  python -m experiments.family_floors --out FILE.json     # on the GPU machine"""
from __future__ import annotations

import argparse
import json

from kvpipe.executor.calibrate.gpu import small_point
from kvpipe.executor.engine.session import preset_config
from kvpipe.pipeline.model import preset

PRESETS = ("llama-3-8b", "gemma-2-9b", "gemma-3-4b", "phi-4")
# Gemma 2's softcapped attention computes its scores as small kernels, [heads, T, P + T] in fp32
# (8.6 GB each at 8K over 8K): its rate is not measured (the recorder keeps every one alive).
NO_RATE = ("gemma-2-9b",)


def one_layer(name: str) -> dict:
    """Layer 0 of preset `name` as an HF config (a small vocabulary: the floor is the layer's)."""
    spec = preset(name)
    cfg = {k: v[:1] if isinstance(v, list) and len(v) == spec.layers else v   # per-layer fields: layer 0's
           for k, v in preset_config(spec).items()}
    return {**cfg, "num_hidden_layers": 1, "vocab_size": 1024, "max_position_embeddings": 1 << 14,
            "pad_token_id": None, "eos_token_id": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", default="8192,32768", help="token counts the elementwise rate is measured at")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {}
    for name in PRESETS:
        cfg = one_layer(name)
        kernels, _, sec = small_point(cfg, 1, args.reps)
        row = rows[name] = {"kernels": kernels, "seconds": sec, "per_kernel_s": sec / kernels, "rate": {}}
        for T in (() if name in NO_RATE else (int(t) for t in args.tokens.split(","))):
            k, nbytes, s = small_point({**cfg, "max_position_embeddings": 2 * T + 8}, T, args.reps)
            row["rate"][T] = {"kernels": k, "bytes": nbytes, "seconds": s, "bytes_per_s": nbytes / s}
        rates = ", ".join(f"{T}: {r['bytes_per_s'] / 1e12:.2f} TB/s" for T, r in row["rate"].items())
        print(f"{name:<12} {kernels:>3} kernels at 1 token: {sec / kernels * 1e6:.3f} us each; elementwise {rates}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
