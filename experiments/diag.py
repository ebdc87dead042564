"""Diagnostics for the simulator's misses (issue 8/10): runs `kvpipe.run` on the GPU for the rows
the simulator got wrong, writes each run's predicted+measured Chrome trace and JSON, and a
torch.profiler kernel table of the resident decode rows (which kernels a replayed step spends
its time in, against the step's HBM floor).

  python -m experiments.diag --out DIR

Random bf16 weights, Llama-3-8B shapes, --gpu-mem 24GB. Prints a short table last.

Rows named as in benchmarks/sim_check.py (e.g. `--rows 8k-g2-some-c2k,16k-g8-none-c4k`) are traced
stage by stage instead (`stage_trace`): one model load for all of them; per row an untimed
warm-up, then (A) the plan run as sim_check runs it, every stage's measured span (CUDA events) and
host issue seconds kept; (B) its prefill alone under torch.profiler with one range per stage, each
stage's kernels split into GEMM / attention / small kernels / copies (experiments/kernel_split.py);
(C) the whole run again under the profiler, the decode steps' kernels split the same way. Written
to DIR/diag.json (`stage_rows`), with each stage's predicted device seconds (pipeline/cost.py on
the profile) beside its measured span; the table printed last sums them per prefill chunk."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
from pathlib import Path

ROWS = {   # name: (context, decode tokens, knobs, profile the run)
    "res8k_g8": ("8K", 16, dict(group="8", resident="all"), True),
    "res32k_g8": ("32K", 16, dict(group="8", resident="all"), True),
    "res8k_default": ("8K", 16, {}, False),
    "pre32k_default": ("32K", 4, {}, False),
    "pre32k_g8_none": ("32K", 4, dict(group="8", resident="none"), False),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--hw", default="h200-testbox", help="the profile the stage rows are predicted with (a name or a .toml)")
    ap.add_argument("--traces", action="store_true", help="also write each row's Chrome traces and run JSON "
                    "(the device returns at most 8 files)")
    args = ap.parse_args()
    import torch
    import kvpipe
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": "python -m experiments.diag " + " ".join(f"--{k} {v}" for k, v in vars(args).items())}
    names = args.rows.split(",")
    from benchmarks import sim_check
    unknown = [n for n in names if n not in ROWS and n not in sim_check.ROWS]
    if unknown:
        ap.error(f"rows: unknown row {unknown[0]!r}")
    staged = [n for n in names if n in sim_check.ROWS]
    if staged:
        from experiments.diag_stages import stage_trace
        summary["stage_rows"] = {}
        stage_trace(staged, summary["stage_rows"], args.hw, lambda: (out / "diag.json").write_text(json.dumps(summary, indent=1)))
    for name in (n for n in names if n in ROWS):
        ctx, dec, knobs, prof = ROWS[name]
        kw = dict(model="llama-3-8b", random_weights=True, context=ctx, decode_tokens=dec, gpu_mem="24GB",
                  hw="h200-testbox", progress=False, trace=out / f"{name}.trace.json" if args.traces else None, **knobs)
        if prof:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as p:
                r = kvpipe.run(**kw)
            (out / f"{name}.kernels.txt").write_text(
                p.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))
            if args.traces:
                p.export_chrome_trace(str(out / f"{name}.profile.json"))
        else:
            r = kvpipe.run(**kw)
        j = r.to_json()
        if args.traces:
            (out / f"{name}.json").write_text(json.dumps(j, indent=1))
        summary[name] = {"plan": j["plan"], "predicted": j["predicted"], "measured": j["measured"]}
        (out / "diag.json").write_text(json.dumps(summary, indent=1))
        m, p_ = j["measured"], j["predicted"]
        print(f"{name:16} prefill {m['prefill_s']:.3f}/{p_['prefill_s']:.3f} s  "
              f"decode {m['decode_s_per_token'] * 1e3:.2f}/{p_['decode_s_per_token'] * 1e3:.2f} ms (measured/predicted)",
              flush=True)
        del r
        gc.collect()
        torch.cuda.empty_cache()   # the next row loads its own model under the same 24 GB cap


if __name__ == "__main__":
    main()
