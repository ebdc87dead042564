"""Lossless compression on PCIe, measured in a run: the same head-wise plan (everything streamed)
executed raw and with the GPU codec `nvcomp-ans-planes` on h2d (executor/codecs/h2d_store.py), in ONE
process with one random-weight model: decode s/token of each, the raw-PCIe floor (raw K/V bytes
one decode step fetches / the pinned H2D rate measured in this process), the ratio measured on
the run's own K/V, the simulator's prediction beside each measurement, and whether the output
digests are equal (the codec is lossless: they must be).

  python -m benchmarks.codec_run                       # H200: Llama-3-8B shapes, 128K, 8 decode tokens, 24 GB
  python -m benchmarks.codec_run --model tiny.json --context 512 --chunk 128 --group 2 \
      --device cpu --gpu-mem 4GB --decode-tokens 2     # CPU smoke test: the raw row only (nvCOMP needs CUDA)

Both runs are issued eagerly (`replay off`: the codec's stages cannot sit in a CUDA graph), each
after the usual untimed warm-up. Random weights: the ratio is on random-weight K/V (a trained
model's K/V has other statistics). JSON to benchmarks/results/<machine>-<date>-codec-run.json (or --out);
the table is printed last."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

CODEC = "nvcomp-ans-planes"
RANDOM_KV = "ratio on K/V of a random-weight model (a trained model's K/V has other statistics)"


def h2d_rate(device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Pinned host -> GPU bytes/s of one large copy, median of `reps` (benchmarks.link.copy_rate)."""
    import torch

    from benchmarks.link import copy_rate
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rate = copy_rate(src, dst, reps)
    del src, dst
    return rate


def run_row(codec: str, spec, work, hw, hf, ids, dev, budget: int, args) -> dict:
    import torch

    from kvpipe.executor.engine.session import run_graph
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.memory import breakdown
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.report import timing_from_trace
    from kvpipe.pipeline.stage import Phase
    from kvpipe.sim.simulate import simulate
    cs = (("h2d", codec),)
    plan = Plan(Method.HEADWISE, PhasePlan(args.group, args.chunk, 2, cs), PhasePlan(args.group, 1, 2, cs), 0)
    row = {"codec": codec, "plan": plan.describe()}
    t0 = time.time()
    try:
        if codec != "none":
            from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
            check_available(codec, dev)
        mem = breakdown(spec, work, plan)
        if mem.gpu > budget:
            raise ValueError(f"gpu-mem: the plan needs {mem.gpu} bytes of the {budget} budget")
        pred = simulate(spec, work, plan, hw, replay=False).report.timing
        graph = build(spec, work, plan)
        measured = run_graph(graph, hf, ids, dev, budget, progress=False, warmup=True, replay="off")
    except (ValueError, RuntimeError) as e:   # one failed row (no nvCOMP, out of memory) is a row
        return {**row, "error": str(e).splitlines()[0], "wall_s": time.time() - t0}
    finally:
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res = measured.result
    t = timing_from_trace(res.trace)
    fetches = [s for s in graph.stages if s.tag == "kv_fetch" and s.phase is Phase.DECODE]
    steps = max(1, work.decode_tokens)
    return {**row, "decode_s_per_token": t.decode_s_per_token, "prefill_s": t.prefill_s,
            "predicted_decode_s_per_token": pred.decode_s_per_token, "predicted_prefill_s": pred.prefill_s,
            "raw_fetch_bytes_per_step": sum(s.bytes for s in fetches) / steps,
            "moved_fetch_bytes_per_step": sum(res.moved_bytes[s.id] for s in fetches) / steps,
            "peak_gpu_bytes": res.peak_gpu_bytes, "digest": measured.digest, "h2d_codec": res.h2d_codec,
            "wall_s": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b", help="a preset or a config.json (random weights)")
    ap.add_argument("--context", default="128K")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--hw", default="h200-testbox", help="profile of the prediction")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import torch

    from kvpipe.executor.engine.session import TORCH_DTYPES, load_hf_model, prompt_tensor, resolve_device
    from kvpipe.hw_profiles import load_profile
    from kvpipe.inputs import budget
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.workload import Workload
    try:
        dev = resolve_device(a.device)
        spec = load_model(a.model)
        work = Workload.parse(a.context, a.decode_tokens, 1)
        gpu_budget = budget(a.gpu_mem, 0, "gpu-mem")
        hw = load_profile(a.hw)
    except ValueError as e:
        print(f"codec_run: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    hf = load_hf_model(a.model, True, dev, TORCH_DTYPES[spec.dtype], a.seed)
    ids = prompt_tensor(None, 1, work.context, spec.vocab, a.seed)
    rate = h2d_rate(dev) if dev.type == "cuda" else None
    rows = []
    for codec in ("none", CODEC):
        rows.append(run_row(codec, spec, work, hw, hf, ids, dev, gpu_budget, a))
        print(f"codec_run: {codec}: " + json.dumps({k: rows[-1].get(k) for k in
              ("decode_s_per_token", "prefill_s", "error", "wall_s")}), file=sys.stderr, flush=True)
    raw = rows[0]
    floor = raw["raw_fetch_bytes_per_step"] / rate if rate and "error" not in raw else None
    digests = {r["digest"] for r in rows if "digest" in r}
    out = {"command": " ".join([sys.executable, "-m", "benchmarks.codec_run", *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": spec.name,
           "context": work.context, "decode_tokens": work.decode_tokens, "gpu_mem": gpu_budget,
           "weights": "random (seeded); " + RANDOM_KV, "h2d_bytes_per_s_measured": rate,
           "raw_pcie_floor_s_per_token": floor,
           "digests_equal": len(digests) == 1 and len(rows) == len([r for r in rows if "digest" in r]),
           "rows": rows, "wall_s": time.time() - t0}
    from benchmarks.result_file import result_file
    path = Path(a.out) if a.out else result_file("codec-run", dev.type)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}; wall {out['wall_s']:.0f} s")
    print(f"{spec.name}, {work.context} tokens all streamed, group {a.group}, {work.decode_tokens} decode tokens; "
          f"H2D measured {'-' if rate is None else f'{rate / 1e9:.1f} GB/s'}; raw-PCIe floor "
          f"{'-' if floor is None else f'{floor:.3f} s/token'}; digests equal: {out['digests_equal']}")
    print(f"{'codec':18} {'decode s/tok':>12} {'predicted':>10} {'x floor':>8} {'prefill s':>10} {'pred':>7} "
          f"{'ratio':>6} {'fetch GB/step':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['codec']:18} FAILED: {r['error']}")
            continue
        ratio = (r["h2d_codec"] or {}).get("ratio")
        vs_floor = "-" if floor is None else f"{r['decode_s_per_token'] / floor:.2f}x"
        ratio_s = "-" if ratio is None else f"{ratio:.3f}"
        print(f"{r['codec']:18} {r['decode_s_per_token']:12.4f} {r['predicted_decode_s_per_token']:10.4f} "
              f"{vs_floor:>8} {r['prefill_s']:10.2f} {r['predicted_prefill_s']:7.2f} {ratio_s:>6} "
              f"{r['moved_fetch_bytes_per_step'] / 1e9:14.2f}" + ("" if ratio is None else "  [random-weight K/V]"))
    return 0 if all("error" not in r for r in rows) and out["digests_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
