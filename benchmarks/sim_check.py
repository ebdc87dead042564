"""The simulator against real runs: 18 explicit plans spanning contexts 4K-512K,
groups 1/2/4/8, resident none/some/all and prefill chunks 2K-32K, each run on the GPU after an
untimed warm-up (prefill and a few decode steps, replayed as `kvpipe run --replay auto` does; the
median of 5 timed runs to 16K, 3 at 32K, 1 beyond: `repeats_of`) and predicted by the
simulator with a profile whose numbers are measurements (`kvpipe calibrate`), never fitted to
these rows. Llama-3-8B shapes, random bf16 weights, batch 1, allocator capped at 24 GB; one
process builds the model once (~2 minutes of H200 time for the rows to 128K, ~4 more for 512K).
Before the rows, the same process
measures what varies between machines and calls: the small-kernel floor and elementwise rate
(calibrate's micro-benchmark), the host's issue cost per stage (executor/calibrate/host_issue.stage_costs
on a 2-layer model that is no row) and the host time of a cuDNN plan build (calibrate's
attention_plan, on its own tensors), recorded beside the rows. The official report predicts with
the profile as bundled (every field from an earlier `kvpipe calibrate`, none fitted to these
rows); `--session-small` / `--session-host` predict with the same process's figures instead, as
diagnostics.

  python -m benchmarks.sim_check --measure OUT.json           # on the GPU (predicts too if simpy is there)
  python -m benchmarks.sim_check --report OUT.json [--hw P]   # here: predictions, table, plot (PNG)

The report prints, last, a table of every row and median / max |error| for prefill and decode
separately, writes the predictions back into the JSON and a predicted-vs-measured plot beside it
(OUT.png, if matplotlib is installed). Rows 8k-g8-all-c8k, 32k-g8-all-c8k and 32k-g8-some-c16k
are the rows used to DIAGNOSE the small-kernel model (pipeline/layer_ops.py); no number was fitted
to them or to any other row."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

GPU_BUDGET = 24_000_000_000
MODEL = "llama-3-8b"
DECODE = 6
# name -> (context, group, prefill chunk, resident units of 256)
ROWS = {
    "4k-g1-all-c2k": (4096, 1, 2048, 256),
    "4k-g8-none-c4k": (4096, 8, 4096, 0),
    "8k-g8-all-c8k": (8192, 8, 8192, 256),
    "8k-g2-some-c2k": (8192, 2, 2048, 128),
    "8k-g4-none-c8k": (8192, 4, 8192, 0),
    "8k-g1-none-c4k": (8192, 1, 4096, 0),
    "16k-g1-all-c16k": (16384, 1, 16384, 256),
    "16k-g8-none-c4k": (16384, 8, 4096, 0),
    "16k-g4-some-c8k": (16384, 4, 8192, 64),
    "32k-g8-all-c8k": (32768, 8, 8192, 256),
    "32k-g8-some-c16k": (32768, 8, 16384, 165),
    "32k-g2-none-c32k": (32768, 2, 32768, 0),
    "32k-g1-none-c8k": (32768, 1, 8192, 0),
    "64k-g8-none-c16k": (65536, 8, 16384, 0),
    "64k-g4-some-c32k": (65536, 4, 32768, 64),
    "128k-g8-none-c32k": (131072, 8, 32768, 0),
    "128k-g2-some-c16k": (131072, 2, 16384, 72),   # 80 units: 23.98 GB predicted, OOM at the 24 GB cap twice (allocator slack)
    "512k-g4-none-c16k": (524288, 4, 16384, 0),   # ~4 min and 64 GiB pinned
}
DIAGNOSED = ("8k-g8-all-c8k", "32k-g8-all-c8k", "32k-g8-some-c16k")


def repeats_of(context: int) -> int:
    """Timed runs of a row after its warm-up; the row's figure is their median (warm up, repeat,
    take the median: one run of a short host-bound row varies up to 1.6x between processes).
    Long rows stay at one run (a 128K prefill is 12 s, a 512K one over 2 minutes)."""
    return 5 if context <= 16384 else 3 if context <= 32768 else 1


def plan_of(name: str):
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    _, group, chunk, resident = ROWS[name]
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0)


def profile(hw_name: str, res: dict, session_small: bool = True, session_host: bool = True):
    """The profile predictions use: `hw_name`, with the small-kernel floor and elementwise rate
    measured in the same process as the rows (`--measure` runs `kvpipe calibrate`'s micro-benchmark
    first) when the file holds them and `session_small`; and with the host issue figures of the
    same process's host-stage probe (`calibration.host_stage_costs`: the prefill compute pair, the
    copy pair, the prefill gap, fitted from the recorded probe by pipeline/calibration.host_issue_fields)
    when the file holds it and `session_host`. The probe runs a 2-layer model that is no row."""
    from dataclasses import replace

    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.calibration import host_issue_fields
    hw = load_profile(hw_name)
    cal = res.get("calibration") or {}
    label = f"{hw_name}"
    if session_small and "small_kernel_s" in cal:
        eff = min(1.0, cal["elementwise_bytes_per_s"] / hw.hbm_eff_bytes_per_s)
        hw = replace(hw, small_kernel_s=cal["small_kernel_s"], elementwise_efficiency=eff)
        label += (f" with the same process's small_kernel_s {hw.small_kernel_s:.3g} s and "
                  f"elementwise_efficiency {eff:.3f} (calibrate micro-benchmark, same run)")
    if session_host and "host_stage_costs" in cal:
        try:
            fields = host_issue_fields(cal["host_stage_costs"])
        except (KeyError, ValueError) as e:   # a record this report cannot fit: say which and why
            raise ValueError(f"calibration.host_stage_costs: cannot fit the recorded probe ({e})") from None
        hw = replace(hw, **fields)
        label += ("; host issue from the same run's probe: " +
                  ", ".join(f"{k.removeprefix('host_')} {v * 1e6:.1f} us" for k, v in fields.items()))
    if session_host and "attention_plan_s" in cal:
        hw = replace(hw, attention_plan_s=cal["attention_plan_s"])
        label += f"; attention_plan_s {hw.attention_plan_s * 1e3:.1f} ms (same run)"
    return hw, label


def predict(row: dict, hw) -> dict:
    """The simulator's prediction of a saved row (its plan, workload and decode issue mode) on profile `hw`."""
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    work = Workload(row["context"], row["decode_tokens"], 1)
    rep = simulate(load_model(MODEL), work, Plan.from_json(row["plan"]), hw,
                   replay=row.get("decode_issue", "graph") == "graph", fuse=row.get("fused", False)).report
    return {"prefill_s": rep.timing.prefill_s, "decode_s_per_token": rep.timing.decode_s_per_token}


def errors(res: dict, first: bool = False) -> dict[str, list[float]]:
    """Relative errors (predicted - measured) / measured, per metric, over rows with both; `first`:
    against each row's first timed run instead of the median of its repeats (rows of one run:
    the same)."""
    out: dict[str, list[float]] = {"prefill_s": [], "decode_s_per_token": []}
    for r in res["rows"].values():
        for key in out:
            meas = r["samples"][0] if first and r.get("samples") else r.get("measured", {})
            m, p = meas.get(key), r.get("predicted", {}).get(key)
            if m and isinstance(p, float):
                out[key].append((p - m) / m)
    return out


def summary(errs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"rows": len(v), "median_abs": statistics.median(abs(e) for e in v),
                "max_abs": max(abs(e) for e in v)} for k, v in errs.items() if v}


def table(res: dict) -> list[str]:
    lines = [f"{'row':20}{'prefill s':>10}{'pred':>9}{'err':>7}{'decode ms':>11}{'pred':>9}{'err':>7}"]
    for name, r in res["rows"].items():
        if "measured" not in r:
            lines.append(f"{name:20}failed: {r.get('error')}")
            continue
        m, p = r["measured"], r.get("predicted", {})
        cells = []
        for key, scale, fmt in (("prefill_s", 1, "{:10.3f}{:9.3f}"), ("decode_s_per_token", 1e3, "{:11.2f}{:9.2f}")):
            mv, pv = m.get(key), p.get(key)
            if mv and isinstance(pv, float):
                cells.append(fmt.format(mv * scale, pv * scale) + f"{(pv - mv) / mv:+7.0%}")
            else:
                cells.append(" " * (19 if key == "prefill_s" else 20) + "      -")
        pre = [x["prefill_s"] for x in r.get("samples", []) if x.get("prefill_s")]
        spread = f"  n={len(pre)} {min(pre):.3f}-{max(pre):.3f}" if len(pre) > 1 else ""
        lines.append(f"{name:20}" + "".join(cells) + ("  (diagnosed)" if name in DIAGNOSED else "") + spread)
    for key, s in summary(errors(res)).items():
        lines.append(f"{key:20} {s['rows']} rows: median |error| {s['median_abs']:.1%}, max {s['max_abs']:.1%}")
    if any(r.get("repeats", 1) > 1 for r in res["rows"].values()):
        for key, s in summary(errors(res, first=True)).items():
            lines.append(f"{key + ' (1st run)':20} {s['rows']} rows: median |error| {s['median_abs']:.1%}, "
                         f"max {s['max_abs']:.1%} (each row's first timed run alone)")
    return lines


def plot(res: dict, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot (matplotlib is not installed)"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, unit, scale in ((axes[0], "prefill_s", "s", 1), (axes[1], "decode_s_per_token", "ms", 1e3)):
        pts = [(r["measured"][key] * scale, r["predicted"][key] * scale, n) for n, r in res["rows"].items()
               if r.get("measured", {}).get(key) and isinstance(r.get("predicted", {}).get(key), float)]
        if not pts:
            continue
        xs, ys, names = zip(*pts)
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="±15%")
        ax.scatter(xs, ys, s=14)
        for x, y, n in pts:
            ax.annotate(n, (x, y), fontsize=6)
        ax.set(xscale="log", yscale="log", xlabel=f"measured ({unit})", ylabel=f"predicted ({unit})",
               title=key.replace("_", " "))
        ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(f"kvpipe simulator vs measured, {res.get('device', '?')}\nprofile {res.get('profile', '?')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def host_probe() -> dict:
    """The host-stage probe (executor/calibrate/host_issue.stage_costs) on its 2-layer Llama-3-8B-shaped
    model, in this process before the rows: what this host spends issuing each stage now.
    The four plans `kvpipe calibrate` runs (every stage kind; copies of 1, 2, 4 and 8 calls),
    two runs each of a 2K context in 512-token chunks and 8 eager decode steps: seconds on the
    H200; the model is freed after."""
    import torch

    from kvpipe.executor.calibrate.host_issue import probe_model, stage_costs
    t0 = time.perf_counter()
    model = probe_model("cuda")
    rec = stage_costs(model, "cuda")
    del model
    torch.cuda.empty_cache()
    rec["probe_s"] = time.perf_counter() - t0
    return rec


def measure(out: Path, names: list[str], decode: int, warm_row: str | None = None) -> dict:
    from benchmarks.measure import Bench, note
    from kvpipe.api import default_alloc_conf
    default_alloc_conf()   # before torch starts CUDA: fixed segments fragment the long rows
    import torch

    from kvpipe.pipeline.workload import Workload
    res = {"command": "python -m benchmarks.sim_check " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gpu_budget": GPU_BUDGET,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "rows": {}}
    t_start = time.perf_counter()
    from kvpipe.executor.calibrate.gpu import hbm, small_kernels
    from kvpipe.pipeline.calibration import Calibration
    cal = Calibration("same-process", "sim_check", "sim_check")
    hbm(cal)
    small_kernels(cal)
    res["calibration"] = {"small_kernel_s": cal.values["gpu.small_kernel_s"],
                          "elementwise_bytes_per_s": cal.extra["elementwise_bytes_per_s"],
                          "hbm_copy_bytes_per_s": cal.values["gpu.hbm_eff_bytes_per_s"],
                          "how": {k: cal.notes[k] for k in ("gpu.small_kernel_s", "gpu.elementwise_efficiency")},
                          "inventory": cal.extra["small_kernels"]}
    res["calibration"]["host_stage_costs"] = host_probe()
    if torch.cuda.get_device_capability() >= (9, 0):   # cuDNN prefill attention: its plan build is host time too
        from kvpipe.executor.calibrate.attention import attention_plan
        attention_plan(cal)
        res["calibration"]["attention_plan_s"] = cal.values["gpu.attention_plan_s"]
        res["calibration"]["attention_plan_points"] = cal.extra["attention_plan_points"]
    torch.cuda.empty_cache()
    with Bench(MODEL, "cuda", GPU_BUDGET, max(ROWS[n][0] for n in names)) as bench:
        res["load_s"] = time.perf_counter() - t_start
        if warm_row:   # run once untimed, kept apart: the process's one-time costs (the fused pieces'
            # compile in the first row's warm-up) before any row is measured
            got = bench.row(plan_of(warm_row), Workload(ROWS[warm_row][0], decode, 1), replay="auto")
            res["warm_row"] = {"name": warm_row, **got.json}
        for name in names:
            context = ROWS[name][0]
            work, plan = Workload(context, decode, 1), plan_of(name)
            row = {"context": context, "decode_tokens": decode, "plan": plan.to_json()}
            got = bench.row(plan, work, replay="auto", repeats=repeats_of(context))
            row.update(got.json)
            res["rows"][name] = row
            note(name, got)
            out.write_text(json.dumps(res, indent=2))
    res["total_s"] = time.perf_counter() - t_start
    out.write_text(json.dumps(res, indent=2))
    return res


def report(res: dict, hw_name: str, out: Path, session_small: bool = False, session_host: bool = False) -> list[str]:
    """Predict every measured row of `res` on `hw_name` and summarise the errors. The official
    report is the default: the profile exactly as bundled, every field from an earlier `kvpipe
    calibrate` and none fitted to these rows, so the rows are predicted as a user's `kvpipe plan
    --hw` would predict them. `session_small` / `session_host` swap in the figures the --measure
    run's own micro-benchmark and host probe took (diagnostics)."""
    hw, res["profile"] = profile(hw_name, res, session_small, session_host)
    for r in res["rows"].values():
        if "measured" in r:
            r["predicted"] = predict(r, hw)
    res["summary"] = summary(errors(res))
    res["summary_first_run"] = summary(errors(res, first=True))
    res["predicted_on"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out.write_text(json.dumps(res, indent=2))
    return [plot(res, out.with_suffix(".png")), f"profile: {res['profile']}"] + table(res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", metavar="OUT.json", help="run the rows on this machine's GPU")
    ap.add_argument("--report", metavar="FILE.json", help="predict the rows of a measured file; table and plot")
    ap.add_argument("--rows", default="all", help=f"comma-separated, or all: {', '.join(ROWS)}")
    ap.add_argument("--decode", type=int, default=DECODE, help="decode steps per row")
    ap.add_argument("--hw", default="h200-testbox", help="profile the predictions use")
    ap.add_argument("--session-small", action="store_true", help="use the small-kernel fields the --measure run "
                    "calibrated in its own process instead of the profile's (a diagnostic, not the official report)")
    ap.add_argument("--warm-row", default=None, metavar="ROW", help="run this row once before the measured "
                    "rows and keep it apart (JSON `warm_row`): the first row of a process has measured up to 1.3x "
                    "its neighbours' prefill")
    ap.add_argument("--session-host", action="store_true", help="use the host issue fields (and cuDNN plan "
                    "build) the --measure run's probe measured in its own process instead of the profile's "
                    "(a diagnostic, not the official report)")
    args = ap.parse_args()
    names = list(ROWS) if args.rows == "all" else args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"sim_check: rows: unknown row {unknown[0]!r}", file=sys.stderr)
        sys.exit(2)
    if args.warm_row is not None and args.warm_row not in ROWS:
        print(f"sim_check: warm-row: unknown row {args.warm_row!r}", file=sys.stderr)
        sys.exit(2)
    if args.measure:
        out = Path(args.measure)
        res = measure(out, names, args.decode, args.warm_row)
        try:
            lines = report(res, args.hw, out, args.session_small, args.session_host)
        except ImportError as e:   # simpy missing on the GPU machine: --report the JSON elsewhere
            lines = [f"measured; predictions need {e.name}: run --report {out} where it is installed"]
        print("\n".join(lines))
        return
    if args.report:
        path = Path(args.report)
        try:
            lines = report(json.loads(path.read_text()), args.hw, path, args.session_small, args.session_host)
        except ValueError as e:
            print(f"sim_check: {e}", file=sys.stderr)
            sys.exit(2)
        print("\n".join(lines))
        return
    ap.print_usage(sys.stderr)
    print("sim_check: give --measure or --report", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
