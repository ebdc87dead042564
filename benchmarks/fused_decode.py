"""Fused decode at its default (`--fuse auto`) against `--fuse off` (executor/layers/fused.py):
Llama-3-8B shapes, random bf16 weights, group 8, decode steps replayed as CUDA graphs,
kvpipe's allocator capped at 24 GB: 8K and 32K with every head resident (against the HBM floor:
weights + the KV attended, over the HBM read rate measured in this process) and 64K and 128K
streamed (no head resident, against the PCIe floor: the offloaded KV over the H2D rate measured
here), each row beside the simulator's prediction for the same plan and setting (profile
h200-testbox by default: its numbers come from `kvpipe calibrate`, never from these rows), and
the fused row's last logits against the unfused row's.

  python -m benchmarks.fused_decode [--decode 16] [--rows 8k,32k,64k,128k] [--out FILE.json]   # H200: ~2 minutes

One process (benchmarks/measure.py's Bench: the model built once, each row run as `kvpipe run`
does); the fused pieces are compiled once (timed: the cold compile, inductor's on-disk cache as
the machine has it), and each compiled function's Triton
kernels are counted against pipeline/layer_ops.py's fused forms. The table prints last; JSON
with the command and date goes to --out after every row."""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from benchmarks.measure import Bench, note
from benchmarks.regimes import GPU_BUDGET, MODEL, floor_of, floor_rates, plan_for
from benchmarks.result_file import result_file
from kvpipe.api import default_alloc_conf

# name -> (context, --resident, what the floor is)
ROWS = {"8k": (8192, "all", "resident"), "32k": (32768, "all", "resident"),
        "64k": (65536, "none", "streamed"), "128k": (131072, "none", "streamed")}
GROUP = "8"
TARGET = {"resident": 1.5, "streamed": 1.05}   # the aim: x the HBM floor / the PCIe floor
SETTINGS = ("auto", "off")


def cold_compile_s(torch, hf) -> float:
    """Seconds to compile and warm the fused pieces the first time in this process."""
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.layers.fused import FusedDecode
    with torch.inference_mode():
        return FusedDecode(HFAdapter(hf)).warm(torch.zeros(1, dtype=torch.long, device=hf.device))


def triton_kernels(torch, spec) -> dict:
    """Each fused function compiled afresh on CUDA (inductor's graph cache off): the kernels
    inductor emits, beside the count layer_ops' fused form gives (the simulator's)."""
    import torch._inductor.metrics as metrics

    from kvpipe.executor.layers import fused
    from kvpipe.pipeline import layer_ops
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    m, D = spec, spec.head_dim
    args = {"norm": (r(1, 1, m.hidden), r(m.hidden), 1e-5),
            "add_norm": (r(1, 1, m.hidden), r(1, 1, m.hidden), r(m.hidden), 1e-5),
            "rope": (r(1, 1, m.q_heads, D), r(1, 1, m.kv_heads, D), r(1, 1, m.kv_heads, D), r(1, 1, D), r(1, 1, D), None),
            "act_mul": (r(1, 1, m.intermediate), r(1, 1, m.intermediate), "silu")}
    out = {}
    for name in layer_ops.FUSED_FUNCTIONS:
        torch._dynamo.reset()
        metrics.reset()
        fn = torch.compile(fused._MATH[name], fullgraph=True, dynamic=False,
                           options={"emulate_precision_casts": True, "fx_graph_cache": False})
        with torch.inference_mode():
            fn(*args[name])
        out[name] = {"triton": metrics.generated_kernel_count,
                     "form": layer_ops.fused_function(name, spec, 1).kernels}
    torch._dynamo.reset()
    return out


def predict(spec, row: dict, hw) -> dict:
    """The simulator's prediction of a measured row: its plan, workload, decode issue and fusion."""
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    work = Workload(row["context"], row["decode_tokens"], 1)
    p = simulate(spec, work, Plan.from_json(row["plan"]), hw, replay=row["decode_issue"] == "graph",
                 fuse=row["fused"])
    return {"prefill_s": p.report.timing.prefill_s, "decode_s_per_token": p.report.timing.decode_s_per_token,
            "fused": p.fused, "compile_s": p.compile_s}


def measure(args) -> dict:
    default_alloc_conf()   # before torch starts CUDA
    import torch

    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.workload import Workload
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"fused_decode: unknown rows {unknown} (known: {', '.join(ROWS)})")
    hw = load_profile(args.hw)
    res = {"command": "python -m benchmarks.fused_decode " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_budget": GPU_BUDGET,
           "profile": hw.name, "rows": {}}
    out = Path(args.out)
    save = lambda: out.write_text(json.dumps(res, indent=2))
    res["rates"] = floor_rates(torch)
    bench = Bench(MODEL, "cuda", GPU_BUDGET, max(ROWS[n][0] for n in names)).open()   # the model, built once
    spec, hf, budgets = bench.spec, bench.hf, bench.budgets
    res["model_load_s"] = bench.load_s
    res["cold_compile_s"] = cold_compile_s(torch, hf)
    print(f"fused pieces compiled (cold) in {res['cold_compile_s']:.1f} s", file=sys.stderr, flush=True)
    for name in names:
        context, resident, kind = ROWS[name]
        work = Workload(context, args.decode, 1)
        plan = plan_for(spec, work, GROUP, resident, budgets)
        logits = {}
        for fuse in SETTINGS:
            key = f"{name}-{fuse}"
            row = {"context": context, "decode_tokens": args.decode, "kind": kind, "fuse": fuse, "plan": plan.to_json()}
            got = bench.row(plan, work, replay="auto", keep_logits=True, fuse=fuse)   # as `kvpipe run --fuse`
            r, m = got.json, got.json.get("measured", {})
            if got.ok:
                floor, which = floor_of(row, spec, res["rates"])
                row.update(decode_issue=r["decode_issue"], fused=r["fused"], fuse_note=r["fuse_note"],
                           graphs=r["graphs"], capture_s=r["capture_s"], compile_s=r["compile_s"],
                           wall_s=r["wall_s"], decode_s_per_token=m["decode_s_per_token"], prefill_s=m["prefill_s"],
                           floor_s=floor, floor_kind=which, ratio=m["decode_s_per_token"] / floor,
                           target=TARGET[kind], peak_gpu_bytes=m["peak_gpu_bytes"],
                           process_gpu_bytes=m["process_gpu_bytes"], tokens=r["tokens"])
                logits[fuse] = got.last_logits   # [1, V] fp32 (CPU), the last decode step
                try:
                    row["predicted"] = predict(spec, row, hw)
                    row["predicted_error"] = row["predicted"]["decode_s_per_token"] / row["decode_s_per_token"] - 1
                except ImportError as e:   # simpy missing on the GPU machine: predict from the JSON elsewhere
                    row["predicted"] = {"error": str(e)}
            else:
                row["error"] = r["error"]
            res["rows"][key] = row
            note(key, got)
            save()
        if len(logits) == 2:   # the last step's logits, fused vs unfused (same prompt, same plan)
            a, b = logits["auto"].double(), logits["off"].double()
            res["rows"][f"{name}-auto"]["last_logits_vs_off"] = {
                "rel_l2": ((a - b).norm() / b.norm()).item(), "max_abs": (a - b).abs().max().item(),
                "tokens_equal": res["rows"][f"{name}-auto"]["tokens"] == res["rows"][f"{name}-off"]["tokens"]}
        save()
    bench.close()
    res["kernels"] = triton_kernels(torch, spec)
    save()
    return res


def table(res: dict) -> list[str]:
    r = res["rates"]
    lines = [f"HBM read {r['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s, H2D {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s; "
             f"cold compile of the fused pieces {res.get('cold_compile_s', 0):.1f} s; predicted on {res['profile']}",
             f"{'row':14}{'fused':>6}{'ms/token':>10}{'floor ms':>10}{'ratio':>7}{'target':>7}{'pred ms':>9}"
             f"{'error':>8}{'logits rel diff':>17}"]
    for name, row in res["rows"].items():
        if "error" in row:
            lines.append(f"{name:14}failed: {row['error']}")
            continue
        p = row.get("predicted", {}).get("decode_s_per_token")
        diff = row.get("last_logits_vs_off", {}).get("rel_l2")
        lines.append(f"{name:14}{'yes' if row['fused'] else 'no':>6}{row['decode_s_per_token'] * 1e3:10.2f}"
                     f"{row['floor_s'] * 1e3:10.2f}{row['ratio']:7.2f}{row['target']:7.2f}"
                     f"{(p or 0) * 1e3:9.2f}{row.get('predicted_error', 0) * 100:7.1f}%"
                     f"{'' if diff is None else f'{diff:.2e}':>17}")
    k = res.get("kernels")
    if k:
        lines.append("fused kernels (Triton / simulator's form): "
                     + ", ".join(f"{n} {v['triton']}/{v['form']}" for n, v in k.items()))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=16, help="decode steps per row")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--hw", default="h200-testbox", help="profile the prediction uses")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.out = args.out or str(result_file("fused-decode", "cuda"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    res = measure(args)
    print("\n".join(table(res)))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
