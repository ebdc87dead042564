"""Fused decode on and off (KVPIPE_FUSE, executor/fused.py), issue 8's resident rows: Llama-3-8B
shapes, random bf16 weights, `--group 8 --resident all`, decode steps replayed as CUDA graphs,
8K and 32K, kvpipe's allocator capped at 24 GB; each row's ms/token against the HBM floor
(weights + the KV attended, over the HBM read rate measured in the same process, as
benchmarks/regimes.py computes it) and the fused row's logits against the unfused row's.

  python -m benchmarks.fuse_check [--decode 16] [--out FILE.json]     # H200: ~1-2 minutes

One process: the model is built once; the fused pieces are compiled once (timed: the cold
compile) before the rows. The table prints last; JSON with the command and date goes to --out."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from benchmarks.measure import Bench, note
from benchmarks.regimes import GPU_BUDGET, MODEL, floor_of, hbm_read_rate, plan_for
from kvpipe.api import default_alloc_conf

CONTEXTS = (8192, 32768)
TARGET = 1.5          # issue 8: resident decode <= 1.5x the HBM floor


def cold_compile_s(torch, hf) -> float:
    """Seconds to compile and warm the fused pieces the first time in this process."""
    from kvpipe.executor.adapter import HFAdapter
    from kvpipe.executor.fused import FusedDecode
    with torch.inference_mode():
        return FusedDecode(HFAdapter(hf)).warm(torch.zeros(1, dtype=torch.long, device=hf.device))


def measure(args) -> dict:
    default_alloc_conf()   # before torch starts CUDA
    import torch

    from kvpipe.executor.fused import FUSE_ENV
    from kvpipe.pipeline.workload import Workload
    res = {"command": "python -m benchmarks.fuse_check " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_budget": GPU_BUDGET,
           "rates": {"hbm_read_bytes_per_s": hbm_read_rate(torch)}, "rows": {}}
    bench = Bench(MODEL, "cuda", GPU_BUDGET, max(CONTEXTS)).open()   # the model, built once
    spec, hf, budgets = bench.spec, bench.hf, bench.budgets
    res["model_load_s"] = bench.load_s
    res["cold_compile_s"] = cold_compile_s(torch, hf)
    print(f"fused pieces compiled (cold) in {res['cold_compile_s']:.1f} s", file=sys.stderr, flush=True)
    for context in CONTEXTS:
        work = Workload(context, args.decode, 1)
        plan = plan_for(spec, work, "8", "all", budgets)
        logits = {}
        for fuse in (False, True):
            name = f"{context // 1024}k-{'fused' if fuse else 'unfused'}"
            row = {"context": context, "decode_tokens": args.decode, "kind": "resident", "fuse": fuse,
                   "plan": plan.to_json()}
            os.environ[FUSE_ENV] = "1" if fuse else "0"
            try:   # one row, measured as `kvpipe run` does; an error (OOM) ends only this row
                got = bench.row(plan, work, replay="on", keep_logits=True)
            finally:
                os.environ.pop(FUSE_ENV, None)
            r, m = got.json, got.json.get("measured", {})
            if got.ok and r["fused"] is fuse:
                floor, _ = floor_of(row, spec, res["rates"])
                row.update(decode_issue=r["decode_issue"], fused=r["fused"], graphs=r["graphs"],
                           capture_s=r["capture_s"], compile_s=r["compile_s"], wall_s=r["wall_s"],
                           decode_s_per_token=m["decode_s_per_token"], prefill_s=m["prefill_s"],
                           hbm_floor_s=floor, ratio=m["decode_s_per_token"] / floor,
                           peak_gpu_bytes=m["peak_gpu_bytes"], tokens=r["tokens"])
                logits[fuse] = got.last_logits   # [1, V] fp32 (CPU), the last decode step
            else:
                row["error"] = r.get("error") or f"asked fused={fuse}, the run says fused={r['fused']}"
            res["rows"][name] = row
            note(name, got)
        if len(logits) == 2:   # the last step's logits, fused vs unfused (same prompt, same plan)
            a, b = logits[True].double(), logits[False].double()
            res["rows"][f"{context // 1024}k-fused"]["last_logits_vs_unfused"] = {
                "rel_l2": ((a - b).norm() / b.norm()).item(), "max_abs": (a - b).abs().max().item(),
                "tokens_equal": res["rows"][f"{context // 1024}k-fused"]["tokens"]
                == res["rows"][f"{context // 1024}k-unfused"]["tokens"]}
        Path(args.out).write_text(json.dumps(res, indent=2))
    bench.close()
    return res


def table(res: dict) -> list[str]:
    lines = [f"HBM read {res['rates']['hbm_read_bytes_per_s'] / 1e12:.2f} TB/s; cold compile of the fused pieces "
             f"{res.get('cold_compile_s', 0):.1f} s; target <= {TARGET}x the floor",
             f"{'row':14}{'ms/token':>10}{'floor ms':>10}{'ratio':>7}{'capture s':>10}{'logits rel diff':>16}"]
    for name, r in res["rows"].items():
        if "error" in r:
            lines.append(f"{name:14}failed: {r['error']}")
            continue
        diff = r.get("last_logits_vs_unfused", {}).get("rel_l2")
        lines.append(f"{name:14}{r['decode_s_per_token'] * 1e3:10.2f}{r['hbm_floor_s'] * 1e3:10.2f}"
                     f"{r['ratio']:7.2f}{r['capture_s']:10.2f}{'' if diff is None else f'{diff:.2e}':>16}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=16, help="decode steps per row")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    args.out = args.out or f"benchmarks/results/fuse-check-{stamp}.json"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    res = measure(args)
    print("\n".join(table(res)))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
