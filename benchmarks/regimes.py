"""kvpipe in every regime, with HF and the floors measured in the same process: resident decode
at 8K/32K against the HBM floor and HF's eager decode, streamed decode at 32K/64K/128K for
groups 1, 2, 4, 8 against the PCIe floor, mixed decode at 128K against its offloaded bytes,
prefill at 8K/32K/128K against HF all-on-GPU; each row beside the simulator's prediction.

  python -m benchmarks.regimes                  # all rows (H200: ~4 minutes)
  python -m benchmarks.regimes --rows 8k-default,32k-g8-none --decode 8
  python -m benchmarks.regimes --repredict FILE.json [--hw P]   # predictions again from a saved run (no GPU)

Llama-3-8B shapes, random bf16 weights, batch 1, kvpipe's allocator capped at 24 GB. One process:
the model is built once, HF runs first without the cap. The table (measured, floor, ratio,
predicted, error) prints last; JSON with the command and date goes to
benchmarks/results/<machine>-<date>-regimes.json (or --out). Predictions use `--hw` (default
h200-testbox, the test machine's calibrated profile; the plans are still the planner's on h200,
as `kvpipe run` picks them)."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from kvpipe.api import default_alloc_conf

GPU_BUDGET = 24_000_000_000
MODEL = "llama-3-8b"
HW = "h200-testbox"   # the profile predictions use unless --hw says otherwise
# name -> (context, --group, --resident, what is compared)
ROWS = {
    "8k-default": (8192, "auto", "auto", "resident"),
    "8k-g8-all": (8192, "8", "all", "resident"),
    "32k-default": (32768, "auto", "auto", "resident"),
    "32k-g8-all": (32768, "8", "all", "resident"),
    **{f"{c}k-g{g}-none": (c * 1024, str(g), "none", "streamed") for c in (32, 64, 128) for g in (1, 2, 4, 8)},
    "128k-g8-max": (131072, "8", "max", "mixed"),
    "128k-default": (131072, "auto", "auto", "prefill"),
}


def plan_for(spec, work, group: str, resident: str, budgets: dict):
    """The plan `kvpipe run --group G --resident R` would run: the planner's pick on the h200
    profile with those knobs pinned ("auto": searched)."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.options import PlanOptions
    from kvpipe.sim.decide import pins_of
    from kvpipe.sim.planner import search
    pins = pins_of(PlanOptions(group=group, resident=resident).request(spec))
    return search(spec, work, load_profile("h200"), budgets, pins, "total").best.plan


def predict(row: dict, hw=HW) -> dict:
    """The simulator's prediction for a saved row (its plan, workload, decode issue mode and
    fusion) on `hw`, a profile name or a loaded HardwareProfile."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    spec, hw = load_model(MODEL), load_profile(hw) if isinstance(hw, str) else hw
    work = Workload(row["context"], row["decode_tokens"], 1)
    rep = simulate(spec, work, Plan.from_json(row["plan"]), hw, replay=row["decode_issue"] == "graph",
                   fuse=row.get("fused", False)).report   # a row saved without `fused` ran unfused
    return {"prefill_s": rep.timing.prefill_s, "decode_s_per_token": rep.timing.decode_s_per_token}


def hbm_read_rate(torch) -> float:
    """Bytes per second of a full read of 8 GiB of bf16 (a sum), median of 5."""
    x = torch.randn(1 << 32, device="cuda", dtype=torch.bfloat16)
    rates = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum(dtype=torch.float32)
        b.record()
        b.synchronize()
        rates.append(x.numel() * 2 / (a.elapsed_time(b) / 1e3))
    del x
    torch.cuda.empty_cache()
    return statistics.median(rates[1:])



def floor_rates(torch) -> dict:
    """The floors' denominators, measured in this process: pinned H2D over 1 GiB copies
    (benchmarks.link.copy_rate) and the HBM read rate."""
    from benchmarks.link import copy_rate
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = {"h2d_bytes_per_s": copy_rate(host, dev), "hbm_read_bytes_per_s": hbm_read_rate(torch)}
    del host, dev
    torch.cuda.empty_cache()
    return rates

def hf_run(torch, model, ids, decode_steps: int) -> dict:
    """HF's own inference, all on the GPU: one forward over the prompt, then greedy steps."""
    from transformers import DynamicCache

    from benchmarks.hf_baseline import timed

    with torch.inference_mode():
        model(ids[:, :512], past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        cache = DynamicCache(config=model.config)
        torch.cuda.reset_peak_memory_stats()
        out, prefill_s = timed(lambda: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1))
        tok, steps = out.logits[:, -1].argmax(-1, keepdim=True), []
        for _ in range(decode_steps):
            out, dt = timed(lambda: model(tok, past_key_values=cache, use_cache=True))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(dt)
        del cache, out
    res = {"prefill_s": prefill_s, "decode_s_per_token": statistics.median(steps) if steps else None,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    torch.cuda.empty_cache()
    return res


def floor_of(row: dict, spec, rates: dict) -> tuple[float | None, str]:
    """Seconds per decode step no version can beat, and which floor it is."""
    w = row["context"] + row["decode_tokens"] / 2
    offloaded = spec.units - row["plan"]["resident"]
    if row["kind"] == "resident":
        return (spec.weight_bytes + w * spec.kv_bytes_per_token) / rates["hbm_read_bytes_per_s"], "HBM"
    if row["kind"] in ("streamed", "mixed"):
        return offloaded * w * spec.kv_unit_bytes_per_token / rates["h2d_bytes_per_s"], "PCIe"
    return None, "-"


def table(res: dict) -> list[str]:
    lines = [f"{'row':16}{'metric':9}{'measured':>11}{'floor/HF':>11}{'ratio':>8}{'target':>8}"
             f"{'predicted':>11}{'error':>8}  issue"]
    for name, r in res["rows"].items():
        if "error" in r:
            lines.append(f"{name:16}failed: {r['error']}")
            continue
        for metric, key in (("decode", "decode_s_per_token"), ("dec/HF", "decode_s_per_token"),
                            ("prefill", "prefill_s")):
            m, p = r["measured"].get(key), r["predicted"].get(key) if isinstance(r["predicted"].get(key), float) else None
            ref, target = r["ratios"].get(metric, (None, None))
            if m is None or (metric == "dec/HF" and ref is None):
                continue
            ratio = m / ref if ref else None
            err = (p - m) / m if p else None
            lines.append(f"{name:16}{metric:9}{m * 1e3:9.1f}ms{(ref or 0) * 1e3:9.1f}ms"
                         f"{(ratio or 0):8.2f}{target or '':>8}{(p or 0) * 1e3:9.1f}ms"
                         f"{(err or 0) * 100:7.1f}%  {r.get('decode_issue', '')}")
    errs = [abs(e) for e in res.get("sim_errors", [])]
    if errs:
        lines.append(f"simulator |error| over {len(errs)} figures: median {statistics.median(errs) * 100:.1f}%, "
                     f"max {max(errs) * 100:.1f}%")
    return lines


def ratios(row: dict, spec, rates: dict, hf: dict) -> dict:
    floor, which = floor_of(row, spec, rates)
    out = {}
    if floor:
        out["decode"] = (floor, {"resident": "1.5x", "streamed": "1.05x", "mixed": "1.05x"}[row["kind"]])
    h = hf.get(str(row["context"]))
    if h and "prefill_s" in h:
        out["prefill"] = (h["prefill_s"], "1.05x")
        if row["kind"] == "resident" and h.get("decode_s_per_token"):
            out["dec/HF"] = (h["decode_s_per_token"], "0.35x")
    return out


def sim_errors(res: dict) -> list[float]:
    errs = []
    for r in res["rows"].values():
        for key in ("prefill_s", "decode_s_per_token"):
            m, p = r.get("measured", {}).get(key), r.get("predicted", {}).get(key)
            if m and p:
                errs.append((p - m) / m)
    return errs


def measure(args) -> dict:
    from benchmarks.measure import Bench, note
    default_alloc_conf()   # before torch starts CUDA
    import torch

    from kvpipe.pipeline.workload import Workload
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    res = {"command": "python -m benchmarks.regimes " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_budget": GPU_BUDGET,
           "rows": {}, "hf": {}, "predicted_on": args.hw}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=2))
    res["rates"] = floor_rates(torch)
    contexts = sorted({ROWS[n][0] for n in names})
    with Bench(MODEL, "cuda", GPU_BUDGET, max(contexts)) as bench:
        spec, device = bench.spec, bench.dev
        for c in contexts:
            if c > args.hf_max:
                continue
            try:
                res["hf"][str(c)] = hf_run(torch, bench.hf, bench.ids[:, :c].to(device), args.decode)
            except torch.OutOfMemoryError as e:
                res["hf"][str(c)] = {"error": str(e).splitlines()[0]}
            print(f"hf {c}: {res['hf'][str(c)]}", file=sys.stderr, flush=True)
            save()
        for name in names:
            context, group, resident, kind = ROWS[name]
            work = Workload(context, args.decode, 1)
            plan = plan_for(spec, work, group, resident, bench.budgets)
            row = {"context": context, "decode_tokens": args.decode, "kind": kind, "plan": plan.to_json(),
                   "knobs": {"group": group, "resident": resident}}
            got = bench.row(plan, work, replay=args.replay)
            row.update(got.json)
            note(name, got)
            if got.ok:
                try:
                    row["predicted"] = predict(row, args.hw)
                except ImportError as e:   # simpy missing on the GPU machine: --repredict the JSON elsewhere
                    row["predicted"] = {"error": f"{e}; run --repredict on this JSON"}
                row["ratios"] = ratios(row, spec, res["rates"], res["hf"])
            res["rows"][name] = row
            save()
    res["sim_errors"] = sim_errors(res)
    save()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="all", help=f"comma-separated, or all: {', '.join(ROWS)}")
    ap.add_argument("--decode", type=int, default=8, help="decode steps per row")
    ap.add_argument("--replay", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--hf-max", type=int, default=131072, help="largest context HF runs at")
    ap.add_argument("--out", default=None, help="JSON of a run")
    ap.add_argument("--hw", default=HW, help="profile the predictions use (name or TOML path)")
    ap.add_argument("--repredict", metavar="FILE.json", help="recompute predictions of a saved run (CPU)")
    args = ap.parse_args()
    if args.repredict:
        res = json.loads(Path(args.repredict).read_text())
        from kvpipe.pipeline.model import load_model
        spec = load_model(MODEL)
        for r in res["rows"].values():
            if "measured" in r:
                r["predicted"] = predict(r, args.hw)
                r["ratios"] = ratios(r, spec, res["rates"], res["hf"])
        res["sim_errors"] = sim_errors(res)
        res["repredicted"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        res["predicted_on"] = args.hw
        Path(args.out or args.repredict).write_text(json.dumps(res, indent=2))
    else:
        from benchmarks.result_file import result_file
        args.out = args.out or str(result_file("regimes", "cuda"))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        res = measure(args)
    print("\n".join(table(res)))
    print(f"results: {args.out or args.repredict}")


if __name__ == "__main__":
    main()
