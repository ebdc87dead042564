"""Lossless codecs on the PCIe link: does compressing the streamed K/V pay at 128K? Measures, on the K/V of a real prefill, each codec's ratio
and encode/decode rates, and sets them beside what the simulator and planner say.

  python -m benchmarks.codec_link                     # on the GPU: 128K tokens, 2 layers, nvCOMP if installed
  python -m benchmarks.codec_link --device cpu --tokens 2048 --sample-mib 8     # smoke test of the CPU parts

K/V: a prefill of `--tokens` through `--layers` Llama-3-8B-shaped layers with seeded random bf16
weights (executor.layers.loader.random_model). Random weights give K/V whose statistics differ from a
trained model's: every ratio here is on random-weight K/V and says so.

Codecs: zstd-planes (the project's disk codec, CPU, 1 and N threads over 1 MiB blocks), zstd
level 1 on the raw bytes (CPU reference), and on CUDA the nvCOMP algorithms of the
`nvidia-nvcomp-cu13` Python API when it imports (whole buffer, and ANS on the high byte plane
only, the GPU analogue of zstd-planes), each in its own worker process
(benchmarks/nvcomp_isolated.py: a CUDA fault in one codec kills only its process; the row then
says the stage and size it died in). Every round trip is checked bit for bit.

Beside each GPU codec: the simulator's decode s/token at 128K with everything streamed (raw
h2d) and a lane-floor estimate with the codec on h2d — per step max(h2d busy / ratio, gpu busy +
raw bytes / GPU decode rate, other lanes), from the simulator's per-lane busy seconds. It is an
estimate, not a simulation, of the codec in isolation; `planner_h2d` shows the planner's h2d
candidates on the `h200` profile (the measured `[codec.nvcomp-ans-planes]` rates live in
`h200-testbox`). The codec in the stage graph and in a run (gpu_compress / gpu_decompress on the
gpu lane, executor/codecs/h2d_store.py) is measured by benchmarks/codec_run.py.
JSON to benchmarks/results/<machine>-<date>-codec-link.json (or --out); a short table is printed last."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.nvcomp_isolated import ALGOS, run_isolated

RANDOM_KV = "ratio on K/V of a random-weight model (a trained model's K/V has other statistics)"
BLOCK = 1 << 20
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 attn_implementation="sdpa")   # eager attention would build 128K x 128K scores


def prefill_kv(tokens: int, layers: int, device: str, seed: int) -> torch.Tensor:
    """The K and V of every layer after a prefill of `tokens` random ids, flat bf16 bytes (uint8)."""
    from kvpipe.executor.layers.loader import random_model
    model = random_model({**LLAMA3_8B, "num_hidden_layers": layers}, device, torch.bfloat16, seed)
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():   # the base model: no lm_head (128K x 128K-vocab logits would not fit)
        cache = model.model(ids.to(device), use_cache=True).past_key_values
    parts = []
    for layer in cache.layers:
        parts += [layer.keys.contiguous().view(torch.uint8).flatten(), layer.values.contiguous().view(torch.uint8).flatten()]
    del model, cache
    return torch.cat(parts)


def spread_sample(kv: torch.Tensor, mib: int) -> bytes:
    """`mib` 1 MiB blocks spread evenly over the K/V (every layer, K and V, all heads), as bytes."""
    blocks = kv[: kv.numel() // BLOCK * BLOCK].view(-1, BLOCK)
    idx = torch.linspace(0, len(blocks) - 1, min(mib, len(blocks))).round().long().unique()
    return blocks[idx.to(kv.device)].cpu().numpy().tobytes()


def _blocks(raw: bytes) -> list[memoryview]:
    view = memoryview(raw)
    return [view[i:i + BLOCK] for i in range(0, len(view), BLOCK)]


def cpu_codec(name: str, raw: bytes, threads: int) -> dict:
    """Ratio and raw bytes/s each way over 1 MiB blocks, on 1 and on `threads` threads."""
    import zstandard
    if name == "zstd-planes":
        from kvpipe.executor.codecs.zstd_planes import Codec
        codec = Codec()
        enc = lambda b: codec.encode(b, 2)
        dec = lambda f, out: codec.decode(memoryview(f), out)
    else:   # zstd level 1 on the raw bytes
        enc = lambda b: zstandard.ZstdCompressor(level=1).compress(b)
        dec = lambda f, out: out.__setitem__(slice(None), zstandard.ZstdDecompressor().decompress(f))
    blocks = _blocks(raw)
    out = {"codec": name, "where": "cpu", "raw_bytes": len(raw), "ratio_note": RANDOM_KV}
    for n in sorted({1, threads}):
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            frames = list(pool.map(enc, blocks))
            t1 = time.perf_counter()
            back = bytearray(len(raw))
            bv = memoryview(back)
            list(pool.map(lambda i: dec(frames[i], bv[i * BLOCK:i * BLOCK + len(blocks[i])]), range(len(blocks))))
            t2 = time.perf_counter()
        if bytes(back) != raw:
            raise AssertionError(f"{name}: round trip changed a byte")
        out["ratio"] = len(raw) / sum(len(f) for f in frames)
        out[f"encode_bytes_per_s_{n}t"] = len(raw) / (t1 - t0)
        out[f"decode_bytes_per_s_{n}t"] = len(raw) / (t2 - t1)
    return out


def gpu_codecs(kv: torch.Tensor, algos: tuple[str, ...] = ALGOS, timeout_s: float = 600.0) -> list[dict]:
    """nvCOMP algorithms on the whole K/V, and ANS on its high byte plane only, each in its own
    process (benchmarks/nvcomp_isolated.py): one codec's CUDA fault cannot poison the next.
    The workers read the same K/V bytes from a temporary file."""
    rows = []
    torch.cuda.empty_cache()   # the prefill's cached blocks: the workers share this GPU
    with tempfile.TemporaryDirectory(prefix="codec-link-") as tmp:
        path = Path(tmp) / "kv.u8"
        kv.cpu().numpy().tofile(path)
        for algo in algos:
            row = {"codec": f"nvcomp-{algo}", "where": "gpu", "raw_bytes": kv.numel(), "ratio_note": RANDOM_KV,
                   "process": "isolated"}
            row.update(run_isolated(algo, str(path), timeout_s))
            rows.append(row)
    return rows


def predictions(context: str) -> dict:
    """The simulator's 128K decode with everything streamed (H200 profile, 24 GB GPU) and what the
    planner would choose on h2d."""
    import kvpipe
    from kvpipe.hw_profiles import load_profile
    from kvpipe.sim.codec_choice import candidates, choose_codec
    res = kvpipe.plan(model="llama-3-8b", hw="h200", context=context, decode_tokens=8, gpu_mem="24GB",
                      resident="none")
    rep, spec, work = res.predicted.report, res.model, res.workload
    hw = load_profile("h200")
    _, choice = choose_codec(spec, work, res.plan, hw, "h2d")
    steps = work.decode_tokens
    return {"plan": res.plan.describe(), "decode_s_per_token": rep.timing.decode_s_per_token,
            "decode_busy_s_per_step": {k: v / steps for k, v in rep.phase_busy_s["decode"].items()},
            "h2d_bytes_per_step": work.context * spec.units * 2 * spec.head_dim * 2,
            "planner_h2d": {"candidates": candidates("h2d", hw), "chosen": choice.chosen}}


def estimate(pred: dict, row: dict) -> float | None:
    """Lane-floor decode s/token with the codec on h2d (see the module docstring)."""
    if "ratio" not in row or row["where"] != "gpu":
        return None
    busy = pred["decode_busy_s_per_step"]
    gpu = busy["gpu"] + pred["h2d_bytes_per_step"] / row["decode_bytes_per_s"]
    return max([busy["h2d"] / row["ratio"], gpu] + [v for k, v in busy.items() if k not in ("h2d", "gpu")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sample-mib", type=int, default=64, help="MiB of K/V the CPU codecs see (spread over it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-codecs", default=",".join(ALGOS), help=f"comma list of nvCOMP codecs, of {','.join(ALGOS)}")
    ap.add_argument("--codec-timeout-s", type=float, default=600.0, help="wall limit of each codec's worker process")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<machine>-<date>-codec-link.json)")
    a = ap.parse_args(argv)
    algos = tuple(x for x in a.gpu_codecs.split(",") if x)
    bad = [x for x in algos if x not in ALGOS]
    if bad or a.codec_timeout_s <= 0:
        print(f"codec_link: --gpu-codecs: unknown {bad} (known: {', '.join(ALGOS)})" if bad else
              f"codec_link: --codec-timeout-s: {a.codec_timeout_s} is not positive", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    kv = prefill_kv(a.tokens, a.layers, a.device, a.seed)
    prefill_s = time.perf_counter() - t0
    sample = spread_sample(kv, a.sample_mib)
    rows = [cpu_codec(name, sample, a.threads) for name in ("zstd-planes", "zstd-1")]
    if kv.is_cuda:
        rows += gpu_codecs(kv, algos, a.codec_timeout_s)
    pred = predictions("128K")
    for row in rows:
        row["est_decode_s_per_token_h2d"] = estimate(pred, row)
    result = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if kv.is_cuda else "cpu", "tokens": a.tokens,
              "layers": a.layers, "kv_bytes": kv.numel(), "prefill_s": prefill_s, "threads": a.threads,
              "weights": "random (seeded); " + RANDOM_KV, "prediction_128k": pred, "codecs": rows,
              "wall_s": time.perf_counter() - t0}
    if a.out is None:
        from benchmarks.result_file import result_file
        a.out = str(result_file("codec-link", "cuda" if kv.is_cuda else "cpu"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    raw = pred["decode_s_per_token"]
    print(f"K/V of {a.tokens} tokens x {a.layers} layers (random weights: {RANDOM_KV}); simulator, 128K streamed, "
          f"raw h2d: {raw:.3f} s/token (h2d floor {pred['decode_busy_s_per_step']['h2d']:.3f}); planner on h2d: "
          f"{pred['planner_h2d']['chosen']} of {pred['planner_h2d']['candidates']}")
    print(f"{'codec':20} {'ratio':>6} {'enc GB/s':>14} {'dec GB/s':>14} {'est s/tok h2d':>14}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['codec']:20} {r['error']}")
            continue
        rate = lambda k: (f"{r[k + '_1t'] / 1e9:.2f}/{r[f'{k}_{a.threads}t'] / 1e9:.2f}" if r["where"] == "cpu"
                          else f"{r[k] / 1e9:.1f}")
        est = r["est_decode_s_per_token_h2d"]
        note = ("cpu: decodes before the link, cannot serve h2d; rates 1/N threads" if r["where"] == "cpu"
                else ("exact" if r["exact"] and all(p["exact"] for p in r.get("probes", [])) else "NOT EXACT"))
        print(f"{r['codec']:20} {r['ratio']:6.3f} {rate('encode_bytes_per_s'):>14} {rate('decode_bytes_per_s'):>14} "
              f"{'-' if est is None else f'{est:.3f} ({est / raw:.2f}x)':>14}  {note} [random-weight K/V]")
    print(f"wrote {a.out}; wall {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
