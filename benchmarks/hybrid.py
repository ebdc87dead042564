"""A hybrid local/global model on the GPU: Gemma 3 shapes (5 sliding-window layers to 1 global)
with random bf16 weights, kvpipe capped at a 24 GB GPU, against HF all on the GPU (uncapped,
where it fits), decode against the floor of the bytes it must move, the simulator against the
measurement. Gemma 3 12B's weights alone (23.5 GB) leave no room under 24 GB: the default model is
gemma-3-4b (7.8 GB of weights), the same layer kinds.

  python -m benchmarks.hybrid 128k             # link, HF all-on-GPU, kvpipe streamed and resident-max
  python -m benchmarks.hybrid long             # the longest context this machine's RAM and disk hold
                                               # (kvpipe plan --max-context), capped by --max-tokens
  python -m benchmarks.hybrid all --model gemma-3-12b --gpu-mem 40GB
  python -m benchmarks.hybrid 128k --model DIR --device cpu --context 96 --plan-args='--disk 6'
                                               # a CPU check of the paths (a tiny config.json in DIR)

Each measurement runs in its own process. The decode floor: the h2d bytes one step of this plan
moves (its graph's fetches: a window layer's offloaded heads fetch the W - 1 keys their window
sees, its units keep a ring of W - 1 + 4 tokens off disk), beside what full attention would
move. Disk bytes per layer kind: the memory model's (the run's kv_per_layer_kind, disk_bytes) beside
the disk file's (its rows per kind; file_bytes is its size on disk): a window layer's disk units
keep a ring of blocks, equal in both; a full layer's file holds its full blocks, the model counts
the partial last one too (it stays in RAM). Results:
benchmarks/results/<machine>-<date>-hybrid-<stage>.json."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from benchmarks.result_file import result_file
from kvpipe.pipeline.units import fmt_bytes
from benchmarks.vs_hf import sh


def kvpipe(model: str, context: int, decode: int, gpu_mem: str, *knobs: str, timeout: int = 560,
           device: str = "cuda", hw: str = "h200-testbox") -> dict:
    return sh([sys.executable, "-m", "kvpipe", "run", "--model", model, "--random-weights", "--context",
               str(context), "--decode-tokens", str(decode), "--gpu-mem", gpu_mem, "--device", device,
               "--hw", hw, "--json", "--no-progress", *knobs], timeout)


def disk_kinds(run: dict) -> dict:
    """Disk bytes per layer kind: predicted (the memory model's, the run's kv_per_layer_kind) and
    the file's (the run's disk tier: its rows per kind, and its size on disk)."""
    disk = run.get("disk") or {}
    return {"predicted": {r["kind"]: r.get("disk_bytes", 0) for r in run.get("kv_per_layer_kind", [])},
            "file": dict(disk.get("file_bytes_by_kind", {})), "file_bytes": disk.get("file_bytes", 0)}


def floors(model: str, run: dict, h2d: float | None) -> dict:
    """Decode floors (seconds per step at the run's mean decode position): the bytes the plan's
    graph moves over h2d in one step (pipeline/builder.py: a window layer's offloaded heads fetch
    only the W - 1 keys its window sees, a full layer's every token; disk units' reads are also
    counted, at the h2d rate, as they cross it too) or, where more, the bytes the GPU reads
    (weights, activations, resident keys) at the H200's peak HBM rate; beside it what full
    attention's offloaded units would move."""
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.hw_profiles import load_profile
    m = load_model(model)
    plan = Plan.from_json(run["plan"], m)
    w = run["workload"]
    step = w["decode_tokens"] // 2
    graph = build(m, Workload(w["context"], w["decode_tokens"], w["batch"]), plan, prefill=False,
                  decode=range(step, step + 1))
    by_tag = {}
    for s in graph.stages:
        by_tag[s.tag] = by_tag.get(s.tag, 0) + s.bytes
    moved = by_tag.get("kv_fetch", 0)
    # the GPU's share: weights, activations and the keys attention reads (resident heads' too)
    gpu_read = sum(s.mem_bytes for s in graph.stages if s.lane.value == "gpu")
    hbm = load_profile("h200").hbm_peak_bytes_per_s
    pos = w["context"] + step
    full = (m.units - min(plan.resident, m.units)) * w["batch"] * pos * m.kv_unit_bytes_per_token
    return {"bytes_per_step": moved, "disk_read_bytes_per_step": by_tag.get("kv_read", 0),
            "store_bytes_per_step": by_tag.get("kv_store", 0), "full_attention_bytes_per_step": full,
            "gpu_read_bytes_per_step": gpu_read, "hbm_floor_s": gpu_read / hbm,
            "floor_s": max(moved / h2d, gpu_read / hbm) if h2d else None,
            "full_attention_floor_s": full / h2d if h2d else None}


def hf_gpu(model: str, context: int, decode: int) -> dict:
    """HF's own forward and DynamicCache all on the GPU (a child process: clean peak counters)."""
    code = ("import json,statistics,time,torch;"
            "from transformers import AutoModelForCausalLM, DynamicCache, AutoConfig;"
            "from kvpipe.pipeline.model import load_model;"
            "from kvpipe.executor.engine.session import preset_config;"
            f"spec=load_model({model!r}); c=dict(preset_config(spec)); t=c.pop('model_type');"
            "cfg=AutoConfig.for_model(t, **c); cfg._attn_implementation='sdpa';"
            "torch.manual_seed(0);\n"
            "with torch.device('cuda'): m=AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()\n"
            f"ids=torch.randint(0, cfg.vocab_size, (1, {context}), device='cuda')\n"
            "def timed(f):\n torch.cuda.synchronize(); t0=time.perf_counter(); o=f(); torch.cuda.synchronize(); "
            "return o, time.perf_counter()-t0\n"
            "with torch.inference_mode():\n"
            " m(ids[:, :512], past_key_values=DynamicCache(config=cfg), use_cache=True, logits_to_keep=1)\n"
            " cache=DynamicCache(config=cfg); torch.cuda.reset_peak_memory_stats()\n"
            " out, pre=timed(lambda: m(ids, past_key_values=cache, use_cache=True, logits_to_keep=1))\n"
            " tok=out.logits[:, -1].argmax(-1, keepdim=True); steps=[]\n"
            f" for _ in range({decode}):\n"
            "  out, dt=timed(lambda: m(tok, past_key_values=cache, use_cache=True)); "
            "tok=out.logits[:, -1].argmax(-1, keepdim=True); steps.append(dt)\n"
            "print(json.dumps({'prefill_s': pre, 'decode_s_per_token': statistics.median(steps), "
            "'peak_gpu_bytes': torch.cuda.max_memory_allocated()}))\n")
    return sh([sys.executable, "-c", code], 560)


def summarise(name: str, run: dict, h2d: float | None, hf: dict | None, model: str) -> None:
    if "measured" not in run:
        print(f"{name}: {run.get('error')}")
        return
    m, p = run["measured"], run["predicted"] or {}   # no prediction for a CPU run
    run["floors"] = floors(model, run, h2d)
    run["disk_by_kind"] = disk_kinds(run)
    ratio = lambda a, b: a / b if a is not None and b else None   # noqa: E731
    run["ratios"] = {
        "prefill_sim_over_measured": ratio(p.get("prefill_s"), m["prefill_s"]),
        "decode_sim_over_measured": ratio(p.get("decode_s_per_token"), m["decode_s_per_token"]),
        "decode_over_floor": m["decode_s_per_token"] / run["floors"]["floor_s"] if run["floors"]["floor_s"] else None,
        "prefill_over_hf_gpu": m["prefill_s"] / hf["prefill_s"] if hf and "prefill_s" in hf else None,
    }
    r, f = run["ratios"], run["floors"]
    issued = (run.get("decode_issue") or {}).get("mode", "eager")   # graph: replayed as CUDA graphs
    sim = (f"sim {p['prefill_s']:.1f}, {r['prefill_sim_over_measured']:.3f}x" if p else "no prediction")
    sim_dec = (f"sim {p['decode_s_per_token'] * 1e3:.1f}, {r['decode_sim_over_measured']:.3f}x" if p else "no prediction")
    print(f"{name}: {run['workload']['context']} tokens, plan {run['plan']['resident']} resident units, "
          f"{run['plan']['disk']} on disk{'; window units first' if run['plan'].get('disk_windows_first') else ''}; "
          f"prefill {m['prefill_s']:.1f} s ({sim}), decode {m['decode_s_per_token'] * 1e3:.1f} ms/token "
          f"({sim_dec}; steps issued as {issued}); "
          f"floor {(f['floor_s'] or 0) * 1e3:.1f} ms ({f['bytes_per_step'] / 1e9:.2f} GB/step; full "
          f"attention would move {f['full_attention_bytes_per_step'] / 1e9:.2f} GB); "
          f"peak GPU {m['peak_bytes']['gpu'] / 1e9:.1f} GB" +
          (f"; prefill / HF all-on-GPU {r['prefill_over_hf_gpu']:.2f}" if r["prefill_over_hf_gpu"] else ""))
    d = run["disk_by_kind"]
    if d["file_bytes"] or any(d["predicted"].values()):
        print("  disk per layer kind (predicted / file): " + "; ".join(
            f"{k} {fmt_bytes(d['predicted'].get(k, 0))} / {fmt_bytes(d['file'].get(k, 0))}"
            for k in d["predicted"]) + f"; the file {fmt_bytes(d['file_bytes'])} on disk")


def link(res: dict, args) -> float | None:
    """The h2d rate measured on the GPU (None on a CPU check)."""
    if args.device == "cpu":
        return None
    res["link"] = res.get("link") or sh([sys.executable, "-m", "benchmarks.link"], 120)
    return res["link"].get("h2d_bytes_per_s")


def stage_128k(res: dict, save, args) -> None:
    h2d = link(res, args)
    ctx = args.context
    res["hf_gpu"] = hf_gpu(args.model, ctx, 4) if args.device != "cpu" else None
    save()
    run = lambda *knobs: kvpipe(args.model, ctx, 8, args.gpu_mem, *knobs, *args.plan_args, device=args.device,  # noqa: E731
                              hw=args.hw)
    res["kvpipe_stream"] = run("--resident", "none")
    save()
    res["kvpipe_planner"] = run()
    save()
    for key in ("kvpipe_stream", "kvpipe_planner"):
        summarise(key, res[key], h2d, res["hf_gpu"], args.model)
    print(f"hf_gpu: {res['hf_gpu']}")


def stage_long(res: dict, save, args) -> None:
    h2d = link(res, args)
    plan = sh([sys.executable, "-m", "kvpipe", "plan", "--model", args.model, "--hw", args.hw, "--gpu-mem",
               args.gpu_mem, "--max-context", "--json", *args.plan_args], 300)
    res["max_context_plan"] = {k: plan.get(k) for k in ("max_context", "plan", "kv_per_layer_kind",
                                                         "kv_vs_full_attention", "error")}
    ctx = min(plan.get("max_context") or 0, args.max_tokens)
    res["long_context"] = ctx
    save()
    if ctx:
        res["kvpipe_long"] = kvpipe(args.model, ctx, 4, args.gpu_mem, *args.plan_args, device=args.device, hw=args.hw)
        save()
        summarise("kvpipe_long", res["kvpipe_long"], h2d, None, args.model)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["128k", "long", "all"])
    ap.add_argument("--model", default="gemma-3-4b")
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--max-tokens", type=int, default=1 << 20, help="cap on the long stage's context")
    ap.add_argument("--context", type=int, default=131072, help="the 128k stage's context")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the paths (no link, no HF baseline)")
    ap.add_argument("--plan-args", default="", help="extra plan/run flags, one string (e.g. '--host-mem 100GB')")
    ap.add_argument("--hw", default="h200-testbox", help="the profile plans and predictions use (the test machine's)")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.plan_args = args.plan_args.split()
    res = {"command": "python -m benchmarks.hybrid " + " ".join(sys.argv[1:]), "model": args.model,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu_budget": args.gpu_mem}
    out = Path(args.out or result_file(f"hybrid-{args.stage}", args.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(res, indent=2))
    for stage in {"128k": [stage_128k], "long": [stage_long], "all": [stage_128k, stage_long]}[args.stage]:
        stage(res, save, args)
    save()
    print(f"results: {out}")


if __name__ == "__main__":
    main()
