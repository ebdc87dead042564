"""Is a model family's small-kernel floor its own? `kvpipe calibrate` measures the per-kernel floor
(gpu.small_kernel_s) on one Llama-3-8B-shaped layer's small kernels at 1 token in a CUDA graph
(executor/calibrate/gpu.small_kernels); this measures the same on one layer of each family whose
small kernels differ (pipeline/layer_ops.py: Gemma 2/3's norms and casts, Phi's RoPE cat).

  python -m experiments.family_floors --out FILE.json     # on the GPU machine"""
from __future__ import annotations

import argparse
import json

from kvpipe.executor.calibrate.gpu import small_point
from kvpipe.executor.engine.session import preset_config
from kvpipe.pipeline.model import preset

PRESETS = ("llama-3-8b", "gemma-2-9b", "gemma-3-4b", "phi-4")


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
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {}
    for name in PRESETS:
        kernels, _, sec = small_point(one_layer(name), 1, args.reps)
        rows[name] = {"kernels": kernels, "seconds": sec, "per_kernel_s": sec / kernels}
        print(f"{name:<12} {kernels:>4} small kernels at 1 token: {sec * 1e6:7.1f} us, {sec / kernels * 1e6:.3f} us each")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
