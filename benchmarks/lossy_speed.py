"""`kvpipe run` decode speed of the LOSSY options against the exact run, all in ONE invocation (one
process, the same machine state): the same plan knobs, run once per variant, whole model steps
(weights, every layer's KV fetch, dequantise, attention), timed by the run's CUDA-event trace.

  python -m benchmarks.lossy_speed                          # H200: Llama-3-8B, 128K, exact int8 int4
  python -m benchmarks.lossy_speed --model tiny.json --context 512 --chunk 128 --device cpu \
      --gpu-mem 4GB --decode-tokens 2                     # CPU smoke test of the code path

Variants: `exact` (no --lossy), `int8`, `int4` (--lossy; executor/quant/store.py); `--sparse F` adds a
`sparse` row (kvpipe run --sparse F: executor/sparse/homes.py), e.g.
  python -m benchmarks.lossy_speed --context 128K --sparse 0.2 --variants exact
and `sparse-int4` (a variant to name; it needs --sparse F) runs --sparse F with --lossy int4 (whole
int4 blocks selected, their records gathered and dequantised), e.g. at 128K:
  python -m benchmarks.lossy_speed --context 128K --decode-tokens 6 --gpu-mem 24GB --group 8 \
      --resident none --hw h200-testbox --device cuda --sparse 0.2 --variants exact int4 sparse-int4
Each row: measured decode seconds per token next to the simulator's prediction for the same plan
(the quantised rows predicted as they run: eagerly issued, the dequantise one compiled call), its
speed-up over the exact row of this invocation (measured and predicted), prefill seconds, and the
error the lossy run measured on its own activations (random weights: not a task accuracy): `attn
rel err` quantisation's prefill probe, `sparse err` the sparse probe of the first decode step (with
int4: against the whole dequantised prefix).
JSON (command, date, device, rows) to benchmarks/results/<machine>-<date>-lossy-speed.json or
--out; the table is printed last."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"exact": None, "int8": "int8", "int4": "int4", "sparse-int4": "int4"}
SPARSE_VARIANTS = ("sparse", "sparse-int4")      # run with --sparse F


def run_variant(name: str, args) -> dict:
    import torch

    import kvpipe
    t0 = time.time()
    try:
        res = kvpipe.run(model=args.model, random_weights=True, context=args.context,
                         decode_tokens=args.decode_tokens, gpu_mem=args.gpu_mem, group=args.group,
                         resident=args.resident, chunk=args.chunk, device=args.device, hw=args.hw,
                         progress=False, lossy=VARIANTS.get(name), seed=args.seed,
                         sparse=args.sparse if name in SPARSE_VARIANTS else None)
    except (ValueError, RuntimeError) as e:     # one failed variant (e.g. out of memory) is a row
        return {"variant": name, "error": str(e).splitlines()[0], "wall_s": time.time() - t0}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    j = res.to_json()
    t = j["measured"]
    return {"variant": name, "decode_s_per_token": t["decode_s_per_token"], "prefill_s": t["prefill_s"],
            "predicted_decode_s_per_token": j["predicted"]["decode_s_per_token"],
            "peak_bytes": t["peak_bytes"], "plan": j["plan"], "lossy": j["lossy"],
            "tokens": j["tokens"], "digest": j["output_digest"], "wall_s": time.time() - t0,
            "decode_issue": (j.get("decode_issue") or {}).get("mode"), "warnings": j.get("warnings")}


def speedups(rows: list[dict]) -> None:
    """Each row's measured and predicted speed-up over the exact row (the first), in place."""
    exact, pred_exact = rows[0].get("decode_s_per_token"), rows[0].get("predicted_decode_s_per_token")
    for r in rows:
        r["decode_speedup"] = exact / r["decode_s_per_token"] if exact and r.get("decode_s_per_token") else None
        p = r.get("predicted_decode_s_per_token")
        r["predicted_speedup"] = pred_exact / p if pred_exact and p else None


def medians(runs: list[dict], order: list[str]) -> list[dict]:
    """One row per variant (in `order`) from its runs: the run with the median decode time
    (statistics.median_low: a run that happened, its prefill, prediction and errors with it) and
    `rounds`, every run's decode seconds per token; a variant with no run that ended is its last
    failed run."""
    rows = []
    for name in order:
        mine = [r for r in runs if r["variant"] == name]
        ok = [r for r in mine if "error" not in r and r.get("decode_s_per_token") is not None]
        if not ok:
            if mine:
                rows.append(dict(mine[-1]))
            continue
        mid = statistics.median_low(r["decode_s_per_token"] for r in ok)
        row = dict(next(r for r in ok if r["decode_s_per_token"] == mid))
        if len(mine) > 1:
            row["rounds"] = [r.get("decode_s_per_token") for r in mine]
        rows.append(row)
    return rows


def run_child(name: str, argv: list[str] | None) -> dict:
    """`name` run in a fresh process (what one `kvpipe run` sees: no earlier variant's pinned
    blocks, streams or compiled code), its row read back; a child that dies is a failed row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "benchmarks.lossy_speed", *(sys.argv[1:] if argv is None else argv),
               "--child", name, "--child-out", str(out)]
        t0 = time.time()
        rc = subprocess.run(cmd).returncode
        if rc or not out.exists():
            return {"variant": name, "error": f"its process exited with {rc}", "wall_s": time.time() - t0}
        return json.loads(out.read_text())


def table(rows: list[dict]) -> list[str]:
    """The printed table, one line per variant; a failed row says why, and a row whose reference
    (the exact row) failed prints no speed-up."""
    lines = [f"{'variant':11} {'decode ms/tok':>14} {'predicted':>10} {'meas/pred':>10} {'speed-up':>9} "
             f"{'pred. s-up':>10} {'prefill s':>10} {'attn rel err':>13} {'sparse err':>11} {'decode':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:11} FAILED: {r['error']}")
            continue
        errs = (r["lossy"] or {}).get("measured_error") or {}
        err, serr = errs.get("attn_rel_err"), errs.get("sparse_attn_rel_err")   # quant's probe; sparse's
        p = r["predicted_decode_s_per_token"]
        x = lambda v: "-" if v is None else f"{v:.2f}x"   # no speed-up where the exact row failed
        lines.append(f"{r['variant']:11} {1e3 * r['decode_s_per_token']:14.1f} {1e3 * p:10.1f} "
                     f"{r['decode_s_per_token'] / p:10.2f} {x(r['decode_speedup']):>9} {x(r['predicted_speedup']):>10} "
                     f"{r['prefill_s']:10.2f} {'-' if err is None else f'{err:.2e}':>13} "
                     f"{'-' if serr is None else f'{serr:.2e}':>11} {r.get('decode_issue') or '-':>7}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--context", default="128K")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--group", default="8")
    ap.add_argument("--resident", default="none")
    ap.add_argument("--chunk", default=None)
    ap.add_argument("--hw", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=["exact", "int8", "int4"], choices=list(VARIANTS))
    ap.add_argument("--no-sparse-row", action="store_true",
                    help="with --sparse, run only the variants named (no `sparse` row; e.g. sparse-int4 alone)")
    ap.add_argument("--sparse", type=float, metavar="F", help="also run `sparse`: kvpipe run --sparse F (LOSSY)")
    ap.add_argument("--rounds", type=int, default=1, help="run the variants this many times, round-robin; each "
                    "row is the variant's median run (an eager lossy step is host-bound: the H200 ran the same sparse "
                    "plan at 88 and 138 ms/token in two processes)")
    ap.add_argument("--out")
    ap.add_argument("--in-process", action="store_true",
                    help="run every variant in this process (default: each in its own, as `kvpipe run` runs: "
                         "on the H200 int8 after exact in one process ran 203 ms/token, alone 167)")
    ap.add_argument("--child", choices=[*VARIANTS, "sparse"], help=argparse.SUPPRESS)   # one variant, row JSON to --child-out
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(run_variant(args.child, args)))
        return 0
    if args.rounds < 1:
        ap.error(f"rounds: {args.rounds} is not a positive count")
    if "exact" not in args.variants:
        ap.error("variants: the exact run is the reference of the speed-up; keep it")
    if "sparse-int4" in args.variants and not args.sparse:
        ap.error("variants: sparse-int4 needs --sparse F (the fraction of tokens fetched)")
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict] = []
    out = {"command": " ".join([sys.executable, "-m", "benchmarks.lossy_speed", *(argv or sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "note": "random weights; errors are of this run's activations, not task accuracy",
           "isolation": "one process for all variants" if args.in_process else "one process per variant",
           "rows": rows}
    from benchmarks.result_file import result_file
    path = Path(args.out) if args.out else result_file("lossy-speed", device)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = ["exact"] + [v for v in args.variants if v != "exact"] + (["sparse"] if args.sparse and not args.no_sparse_row else [])
    runs: list[dict] = []
    if args.rounds > 1:
        out["runs"] = runs
    for rnd in range(args.rounds):   # round-robin: each round runs every variant once, exact first
        for name in order:
            runs.append(dict(run_variant(name, args) if args.in_process else run_child(name, argv), round=rnd))
            print(f"lossy_speed: {name}: {json.dumps({k: runs[-1].get(k) for k in ('round', 'decode_s_per_token', 'prefill_s', 'error', 'wall_s')})}",
                  file=sys.stderr, flush=True)
            rows[:] = medians(runs, order)
            speedups(rows)
            path.write_text(json.dumps(out, indent=1))   # after every variant: a run cut short keeps its rows
    print(f"wrote {path}")
    print("\n".join(table(rows)))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
