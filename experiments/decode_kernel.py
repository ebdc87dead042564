"""Decode attention kernels side by side: one `attend_decode` call (executor/layers/attention.py) by
FA2's varlen split-KV (KVPIPE_DECODE=flash) and by the Triton pair (executor/layers/decode_triton.py),
timed as `kvpipe calibrate` times it (executor/calibrate/attention.decode_attention_point: a CUDA
graph of calls over distinct cold buffers), per group size, key count and head dim; then the
Triton kernel's constants swept at a few points. Bytes per second are the K/V bytes one call reads.

  python -m experiments.decode_kernel --out FILE.json     # on the GPU machine"""
from __future__ import annotations

import argparse
import itertools
import json
import os

from kvpipe.executor.calibrate.attention import decode_attention_point
from kvpipe.executor.layers import decode_triton

SHAPES = [(128, 4), (256, 2)]          # (head dim, query heads a KV head): Llama-3-8B, Gemma 3 4B
SWEEP = {"SPLIT": (256, 512, 1024), "WARPS": (4, 8), "STAGES": (2, 3)}
SWEEP_AT = [(8, 8192), (8, 32768), (1, 32768), (2, 131072)]


def point(kernel: str, G: int, L: int, d: int, r: int) -> dict:
    os.environ["KVPIPE_DECODE"] = kernel
    nbytes, sec, calls = decode_attention_point(G, L, r=r, d=d)
    return {"kernel": kernel, "group": G, "keys": L, "head_dim": d, "rows": r, "kv_bytes": nbytes,
            "seconds": sec, "bytes_per_s": nbytes / sec, "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows, sweep = [], []
    for (d, r), G, L in itertools.product(SHAPES, map(int, args.groups.split(",")), map(int, args.lengths.split(","))):
        a, b = point("flash", G, L, d, r), point("auto", G, L, d, r)
        rows += [a, b]
        print(f"D {d} r {r} G {G} L {L:>6}: FA2 {a['seconds'] * 1e6:7.1f} us {a['bytes_per_s'] / 1e12:.2f} TB/s | "
              f"triton {b['seconds'] * 1e6:7.1f} us {b['bytes_per_s'] / 1e12:.2f} TB/s | {b['seconds'] / a['seconds']:.2f}x", flush=True)
    if not args.no_sweep:
        base = {k: getattr(decode_triton, k) for k in SWEEP}
        for values in itertools.product(*SWEEP.values()):
            for k, v in zip(SWEEP, values):
                setattr(decode_triton, k, v)
            for G, L in SWEEP_AT:
                p = {**point("auto", G, L, 128, 4), **dict(zip(SWEEP, values))}
                sweep.append(p)
                print(f"  {dict(zip(SWEEP, values))} G {G} L {L:>6}: {p['seconds'] * 1e6:7.1f} us", flush=True)
        for k, v in base.items():
            setattr(decode_triton, k, v)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m experiments.decode_kernel", "rows": rows, "sweep": sweep}, f, indent=1)


if __name__ == "__main__":
    main()
