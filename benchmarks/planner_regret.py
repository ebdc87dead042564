"""Planner regret on a real GPU: for each workload, `kvpipe run` the planner's pick, its two
runners-up and at least eight hand-made plans (knobs), all measured; the regret of the pick is
its measured objective over the best measured one. Llama-3-8B shapes, random bf16 weights, batch
1, a 24 GB GPU budget (the issue's target: the pick within 5% of the best).

  python -m benchmarks.planner_regret                      # 8K, 32K, 128K, 256K
  python -m benchmarks.planner_regret --contexts 8K 32K    # a subset
  python -m benchmarks.planner_regret --objective decode

Each plan runs in its own process. Results (commands, plans, predicted and measured reports)
go to benchmarks/results/planner-regret-<date>.json (or --out) after every run; a table is
printed last."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPU_BUDGET = "24GB"
# (label, knobs): the rule's plan (HeadInfer's setting), layer-like groups, all or as many heads
# resident as fit, and chunk sizes from 2K to 32K. Knobs not given are filled in by the planner.
OTHERS = [
    ("rule: g1 none 4K", ["--group", "1", "--resident", "none", "--chunk", "4K"]),
    ("g8 none 4K", ["--group", "8", "--resident", "none", "--chunk", "4K"]),
    ("g4 none 8K", ["--group", "4", "--resident", "none", "--chunk", "8K"]),
    ("g8 all 4K", ["--group", "8", "--resident", "all", "--chunk", "4K"]),
    ("g8 max 32K", ["--group", "8", "--resident", "max", "--chunk", "32K"]),
    ("g4 max 16K", ["--group", "4", "--resident", "max", "--chunk", "16K"]),
    ("g2 max 8K", ["--group", "2", "--resident", "max", "--chunk", "8K"]),
    ("g1 max 2K", ["--group", "1", "--resident", "max", "--chunk", "2K"]),
    ("g1 128 4K", ["--group", "1", "--resident", "128", "--chunk", "4K"]),
]
OBJECTIVE_KEY = {"total": "total_s", "ttft": "ttft_s", "decode": "decode_s_per_token"}


def run(opts, context: str, knobs: list[str]) -> dict:
    """One `kvpipe run --json`; on failure a dict with `error` (e.g. a plan over the budget)."""
    args = [sys.executable, "-m", "kvpipe", "run", "--model", opts.model, "--random-weights",
            "--context", context, "--decode-tokens", str(opts.decode_tokens), "--gpu-mem", opts.gpu_mem,
            "--hw", opts.hw, "--device", opts.device, "--objective", opts.objective, "--json", "--no-progress",
            *knobs]
    timeout = opts.timeout
    t0 = time.time()
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s", "command": " ".join(args)}
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {r.returncode}", "command": " ".join(args)}
    out = json.loads(r.stdout)
    out["command"], out["wall_s"] = " ".join(args), time.time() - t0
    return out


def workload(opts, context: str, tmp: Path) -> list[dict]:
    rows = []
    pick = run(opts, context, [])
    rows.append({"label": "planner pick", **pick})
    if "error" in pick:
        return rows
    for i, alt in enumerate(pick.get("alternatives", []), 1):
        path = tmp / f"{context}-alt{i}.json"
        path.write_text(json.dumps(alt["plan"]))
        rows.append({"label": f"runner-up {i}", **run(opts, context, ["--plan", str(path)])})
    for label, knobs in OTHERS:
        rows.append({"label": label, **run(opts, context, knobs)})
    return rows


def value(row: dict, side: str, key: str) -> float | None:
    return row.get(side, {}).get(key) if "error" not in row else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", default=["8K", "32K", "128K", "256K"])
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--objective", default="total", choices=sorted(OBJECTIVE_KEY))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--model", default="llama-3-8b", help="(a tiny config.json and --device cpu smoke-test the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hw", default="h200", help="profile the predictions use")
    ap.add_argument("--gpu-mem", default=GPU_BUDGET)
    ap.add_argument("--out", default=f"benchmarks/results/planner-regret-{datetime.date.today()}.json")
    args = ap.parse_args(argv)
    key = OBJECTIVE_KEY[args.objective]
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
              "gpu_budget": args.gpu_mem, "model": args.model, "device": args.device, "hw": args.hw, "objective": args.objective, "workloads": {}}
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for ctx in args.contexts:
            rows = workload(args, ctx, Path(tmp))
            measured = [value(r, "measured", key) for r in rows]
            best = min((m for m in measured if m is not None), default=None)
            pick = measured[0]
            regret = (pick / best - 1) if pick is not None and best else None
            result["workloads"][ctx] = {"rows": rows, "best_measured": best, "pick_regret": regret}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
            for r, m in zip(rows, measured):
                p = value(r, "predicted", key)
                table.append((ctx, r["label"], p, m, (m / best - 1) if m is not None and best else None,
                              r.get("error", "")))
            table.append((ctx, "=> pick regret", None, None, regret, "within 5%" if regret is not None
                          and regret <= 0.05 else "MISSES 5%" if regret is not None else "no pick"))
    print(f"\nplanner regret, objective {args.objective} ({key}), {args.model} random weights on {args.device}, "
          f"--gpu-mem {args.gpu_mem}")
    print(f"{'context':>8} {'plan':<18} {'predicted':>11} {'measured':>11} {'vs best':>9}  note")
    fmt = lambda x: "-" if x is None else f"{x:.4g}"
    for ctx, label, p, m, reg, note in table:
        print(f"{ctx:>8} {label:<18} {fmt(p):>11} {fmt(m):>11} {'-' if reg is None else f'{reg:+.1%}':>9}  {note[:60]}")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
