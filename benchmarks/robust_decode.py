"""Decode at the floor on every run, not on a good one: each row is `kvpipe run` in PROCESSES
separate processes (the planner's default pick: ranked on a p90 run), reporting the median and
the worst decode time per token against the floor measured in this process (streamed rows: the
offloaded KV over pinned H2D; resident rows: weights + KV over the HBM read rate), and the
predicted p50 / p90 against the measured median / worst.

  python -m benchmarks.robust_decode                      # every row, 5 processes each
  python -m benchmarks.robust_decode --rows 32k-g4-none --processes 3 --out FILE.json

Llama-3-8B shapes, random bf16 weights, batch 1, `--gpu-mem 24GB`, profile h200-testbox. The
table prints last; JSON to benchmarks/results/<machine>-<date>-robust-decode.json (or --out)."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks.regimes import MODEL, floor_of, floor_rates
from benchmarks.result_file import result_file

HW = "h200-testbox"
# name -> (context, --group, --resident, floor kind)
ROWS = {**{f"{c}k-g{g}-none": (c * 1024, str(g), "none", "streamed") for c in (32, 64, 128) for g in (1, 2, 4, 8)},
        "8k-max": (8192, "auto", "max", "resident"), "32k-max": (32768, "auto", "max", "resident")}
TARGET = {"streamed": (1.02, 1.05), "resident": (1.2, None)}   # (median, worst) x the floor
DECODE = 32


def one_run(context: int, group: str, resident: str, timeout: int) -> dict:
    """One `kvpipe run --json` in its own process: the fields this benchmark reads."""
    cmd = [sys.executable, "-m", "kvpipe", "run", "--model", MODEL, "--random-weights", "--context", str(context),
           "--decode-tokens", str(DECODE), "--gpu-mem", "24GB", "--hw", HW, "--group", group,
           "--resident", resident, "--no-progress", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    d = json.loads(p.stdout)
    m, pr = d["measured"], d["predicted"]
    return {"decode_s_per_token": m["decode_s_per_token"], "prefill_s": m["prefill_s"],
            "decode_steps": m.get("decode_steps"), "replay": d["plan"]["replay"], "plan": d["plan"],
            "predicted_p50_s": pr["decode_s_per_token"], "predicted_p90_s": pr["p90"]["decode_s_per_token"],
            "decode_issue": (d.get("decode_issue") or {}).get("mode")}


def row_result(name: str, runs: list[dict], spec, rates: dict) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], "runs": runs}
    context, _, _, kind = ROWS[name]
    times = [r["decode_s_per_token"] for r in ok]
    floor, which = floor_of({"context": context, "decode_tokens": DECODE, "plan": ok[0]["plan"], "kind": kind},
                            spec, rates)
    med, worst = statistics.median(times), max(times)
    return {"kind": kind, "runs": runs, "median_s": med, "worst_s": worst, "floor_s": floor, "floor": which,
            "median_x_floor": med / floor, "worst_x_floor": worst / floor,
            "p50_error": ok[0]["predicted_p50_s"] / med - 1, "p90_error": ok[0]["predicted_p90_s"] / worst - 1,
            "decode_issue": sorted({r["decode_issue"] for r in ok})}


def table(rows: dict) -> list[str]:
    out = [f"{'row':14}{'issue':>7}{'median ms':>10}{'worst ms':>9}{'floor ms':>9}{'med x':>7}{'worst x':>8}"
           f"{'target':>12}{'p50 err':>8}{'p90 err':>8}"]
    for name, r in rows.items():
        if "error" in r:
            out.append(f"{name:14}failed: {r['error']}")
            continue
        med_t, worst_t = TARGET[r["kind"]]
        target = f"{med_t}/{worst_t or '-'}"
        out.append(f"{name:14}{','.join(r['decode_issue']):>7}{r['median_s'] * 1e3:10.1f}{r['worst_s'] * 1e3:9.1f}"
                   f"{r['floor_s'] * 1e3:9.1f}{r['median_x_floor']:7.3f}{r['worst_x_floor']:8.3f}{target:>12}"
                   f"{r['p50_error']:+8.1%}{r['p90_error']:+8.1%}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per process")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    from kvpipe.pipeline.model import load_model
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown[0]!r}")
    rates, spec = floor_rates(torch), load_model(MODEL)
    path = args.out or result_file("robust-decode", "cuda")
    rows = {}
    for name in names:
        context, group, resident, _ = ROWS[name]
        runs = [one_run(context, group, resident, args.timeout) for _ in range(args.processes)]
        rows[name] = row_result(name, runs, spec, rates)
        print(table({name: rows[name]})[-1], flush=True)
        with open(path, "w") as f:   # after every row: a run cut off keeps the rows it finished
            json.dump({"command": " ".join(sys.argv), "rates": rates, "processes": args.processes, "rows": rows},
                      f, indent=1)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
