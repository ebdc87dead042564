"""The simulator against real runs with a profile this process measured itself: `kvpipe calibrate
--quick` first (to a temp profile, kept beside the JSON), then exact rows (prefill 8K-128K: the
planner's default, all resident, streamed groups 1-8; their decode: streamed 32K-128K, resident
8K/32K) and LOSSY rows at 128K (int8, int4, sparse 0.2, sparse 0.2 + int4; 512K with --with-512k),
each run as `kvpipe run` runs it (untimed warm-up, median of repeats to 32K) and predicted with
that profile, never the bundled one. Llama-3-8B shapes, random bf16 weights, batch 1, allocator
capped at --gpu-mem. JSON after every row; a table of errors per row last, with median |err|,
max |err| and median signed error for prefill and decode of the exact rows, and the lossy max.

  python -m benchmarks.calibrated_check --out OUT.json                   # H200: ~6 min
  python -m benchmarks.calibrated_check --out A.json --set exact          # split: the exact rows ...
  python -m benchmarks.calibrated_check --out B.json --set lossy --profile A.toml   # ... then lossy on A's profile
  python -m benchmarks.calibrated_check --model tiny --device cpu --out T.json   # CPU smoke: tiny model, small contexts

On a CPU, calibrate's CUDA steps cannot run: the run-shape steps (executor/calibrate/machine.run_shape_steps)
run at the tiny model's shapes over the h200-testbox profile instead, so every code path but the
CUDA timers is exercised."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.sim_check import DECODE, repeats_of

K = 1024
# name -> (context, --group, --resident, lossy, sparse)
EXACT = {
    **{f"{c}k-default": (c * K, "auto", "auto", None, None) for c in (8, 32, 64, 128)},
    **{f"{c}k-resident": (c * K, "8", "all" if c <= 32 else "max", None, None) for c in (8, 32, 128)},
    **{f"{c}k-g{g}-none": (c * K, str(g), "none", None, None) for c, g in
       ((8, 1), (8, 8), (16, 4), (32, 1), (32, 2), (32, 4), (32, 8), (64, 2), (64, 8), (128, 4), (128, 8))},
}
LOSSY = {"128k-int8": (128 * K, "8", "none", "int8", None), "128k-int4": (128 * K, "8", "none", "int4", None),
         "128k-sparse0.2": (128 * K, "8", "none", None, 0.2),
         "128k-sparse0.2-int4": (128 * K, "8", "none", "int4", 0.2)}
LONG = {"512k-sparse0.2-int4": (512 * K, "4", "none", "int4", 0.2)}
TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192,
        "torch_dtype": "float32"}
TINY_SCALE = 64   # --model tiny: every context / 64 (128K -> 2K), so each path runs in seconds on a CPU


def rows_of(args) -> dict:
    table = {"exact": EXACT, "lossy": LOSSY, "all": {**EXACT, **LOSSY}}[args.set]
    if args.with_512k:
        table = {**table, **LONG}
    if args.rows:
        every = {**EXACT, **LOSSY, **LONG}
        unknown = [n for n in args.rows.split(",") if n not in every]
        if unknown:
            raise ValueError(f"--rows: unknown row {unknown[0]!r} (known: {', '.join(every)})")
        table = {n: every[n] for n in args.rows.split(",")}
    table = dict(sorted(table.items(), key=lambda kv: (kv[1][0], bool(kv[1][3] or kv[1][4]))))   # by context:
    # a row of the previous row's context reuses its pinned blocks (benchmarks/measure.Bench)
    if args.model == "tiny":
        table = {n: (max(512, c // TINY_SCALE), "1" if g not in ("auto", "1") and int(g) > 2 else g, r, q, s)
                 for n, (c, g, r, q, s) in table.items()}
    return table


def calibrate_profile(args, dev, out_toml: Path) -> tuple[str, float]:
    """Run `kvpipe calibrate --quick` (CUDA) or its run-shape steps over h200-testbox (CPU) and write the
    profile, and beside it as OUT.calibrate.json the measurements behind its fits (as `kvpipe calibrate`
    writes them) with the steps' times."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.calibration import to_toml
    t0, steps = time.perf_counter(), []

    def progress(line: str) -> None:
        steps.append(line)
        print(line, file=sys.stderr, flush=True)
    if dev.type == "cuda":
        from kvpipe.executor.calibrate.machine import calibrate
        cal = calibrate(load_profile("h200"), "calibrated-session", tempfile.gettempdir(), quick=True, progress=progress)
    else:
        cal = cpu_calibration(dev)
    out_toml.write_text(to_toml(cal))
    out_toml.with_suffix(".calibrate.json").write_text(json.dumps(
        {"source": cal.source, "steps": steps, "values": cal.values, "notes": cal.notes, "extra": cal.extra},
        indent=1, default=str))
    seq = cal.extra.get("prefill_stages")
    if seq:   # each point's timed stages must have run back to back (the busy work covered the host)
        worst = max(seq["points"], key=lambda r: r["idle_s"])
        print(f"prefill stages in sequence: {len(seq['points'])} points; compute lane idle between timed stages "
              f"at most {worst['idle_s'] * 1e3:.3f} ms (group {worst['group']}, chunk {worst['chunk']}, prefix "
              f"{worst['prefix']}); {len(seq['clamped'])} kernel times clamped", file=sys.stderr, flush=True)
    load_profile(str(out_toml))   # fails here, not at the first prediction
    return str(out_toml), time.perf_counter() - t0


def cpu_calibration(dev):
    """The h200-testbox profile with the run-shape steps measured at the tiny model's shapes."""
    try:
        import tomllib
    except ModuleNotFoundError:   # Python < 3.11
        import tomli as tomllib
    from kvpipe.hw_profiles import _HERE, _flatten, load_profile
    from kvpipe.pipeline.calibration import Calibration
    from kvpipe.executor.calibrate.machine import run_shape_steps
    cal = Calibration("calibrated-session-cpu", "h200-testbox with run-shape steps measured on a CPU", "calibrated_check")
    for k, v in _flatten(tomllib.loads((_HERE / "h200-testbox.toml").read_text())).items():
        if k not in ("name", "description"):
            cal.set(k, v, "from profile h200-testbox", measured=False)
    dims = {"hidden": TINY["hidden_size"], "inner": TINY["intermediate_size"], "q_dim": 64, "kv_dim": 32}
    grids = dict(d=16, rows=(256, 1024), keys=(256, 2048), groups=(1, 2))
    for label, step in run_shape_steps(cal, dev, load_profile("h200-testbox"), dims, grids, chunks=(256, 1024)):
        step()
    return cal


def predict(spec, row: dict, hw) -> dict:
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    rep = simulate(spec, Workload(row["context"], row["decode_tokens"], 1), Plan.from_json(row["plan"]), hw,
                   replay=row.get("decode_issue", "graph") == "graph", fuse=row.get("fused", False)).report
    return {"prefill_s": rep.timing.prefill_s, "decode_s_per_token": rep.timing.decode_s_per_token}


def plan_of(spec, work, hw, budgets, knobs, device: str):
    """The plan `kvpipe run --group G --resident R [--lossy Q] [--sparse F]` runs, decided on `hw`."""
    from kvpipe.options import PlanOptions
    from kvpipe.sim.decide import Target, decide
    _, group, resident, quant, sparse = knobs
    req = PlanOptions(group=group, resident=resident, lossy=quant, sparse=sparse).request(spec)
    return decide(spec, work, hw, budgets, req, Target(device=device, h2d_codecs=False)).plan


def errors(res: dict, lossy: bool, which: str = "predicted") -> dict[str, list[float]]:
    out = {"prefill_s": [], "decode_s_per_token": []}
    for r in res["rows"].values():
        if r.get("lossy_row") != lossy:
            continue
        for key in out:
            m, p = r.get("measured", {}).get(key), r.get(which, {}).get(key)
            if m and isinstance(p, float):
                out[key].append(p / m - 1)
    return out


def summary(res: dict, which: str = "predicted") -> dict:
    """Errors of the exact rows per metric (median |err|, max |err|, median signed) and the lossy
    rows' max; `which`: "predicted" (the session's profile) or "predicted_bundled" (h200-testbox)."""
    s = {}
    for key, errs in errors(res, False, which).items():
        if errs:
            s[key] = {"rows": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                      "max_abs": max(abs(e) for e in errs), "median_signed": statistics.median(errs)}
    lossy = [e for v in errors(res, True, which).values() for e in v]
    if lossy:
        s["lossy"] = {"rows": len(lossy), "max_abs": max(abs(e) for e in lossy)}
    return s


def table(res: dict) -> list[str]:
    lines = [f"{'row':22}{'prefill s':>10}{'pred':>9}{'err':>8}{'decode ms':>11}{'pred':>9}{'err':>8}"]
    for name, r in res["rows"].items():
        if "measured" not in r:
            lines.append(f"{name:22}failed: {r.get('error')}")
            continue
        cells = ""
        for key, scale, w in (("prefill_s", 1, 10), ("decode_s_per_token", 1e3, 11)):
            m, p = r["measured"].get(key), r.get("predicted", {}).get(key)
            p = p if isinstance(p, float) else None
            cells += (f"{m * scale:{w}.3f}{p * scale:9.3f}{p / m - 1:+8.1%}" if m and isinstance(p, float)
                      else " " * (w + 9) + "       -")
        lines.append(f"{name:22}{cells}")
    for key, s in summary(res).items():
        extra = f", median signed {s['median_signed']:+.1%}" if "median_signed" in s else ""
        lines.append(f"{key + (' (exact)' if key != 'lossy' else ' (all lossy figures)'):34} {s['rows']} rows: "
                     + (f"median |err| {s['median_abs']:.1%}, " if "median_abs" in s else "")
                     + f"max |err| {s['max_abs']:.1%}{extra}")
    for key, s in summary(res, "predicted_bundled").items():   # the same rows on the bundled profile
        lines.append(f"  (h200-testbox as bundled: {key} max |err| {s['max_abs']:.1%}"
                     + (f", median |err| {s['median_abs']:.1%}, median signed {s['median_signed']:+.1%})"
                        if "median_abs" in s else ")"))
    return lines


def measure(args, rows: dict, out: Path) -> dict:
    from kvpipe.api import default_alloc_conf
    default_alloc_conf()   # before torch starts CUDA: fixed segments fragment the long rows
    import torch

    from benchmarks.measure import Bench, note
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.units import parse_bytes
    from kvpipe.pipeline.workload import Workload
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res = {"command": "python -m benchmarks.calibrated_check " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "gpu_budget": args.gpu_mem, "rows": {}}
    t_start = time.perf_counter()
    if args.profile:
        res["profile"], res["calibrate_s"] = args.profile, None
    else:
        res["profile"], res["calibrate_s"] = calibrate_profile(args, dev, out.with_suffix(".toml"))
    res["profile_toml"] = Path(res["profile"]).read_text()
    out.write_text(json.dumps(res, indent=2))
    hw, bundled = load_profile(res["profile"]), load_profile("h200-testbox")
    model = args.model
    if model == "tiny":
        model = str(out.with_suffix(".tiny-config.json"))
        Path(model).write_text(json.dumps(TINY))
    with Bench(model, dev.type, parse_bytes(args.gpu_mem, "--gpu-mem"), max(c for c, *_ in rows.values())) as bench:
        res["load_s"] = bench.load_s
        for name, knobs in rows.items():
            work = Workload(knobs[0], args.decode, 1)
            row = {"context": knobs[0], "decode_tokens": args.decode, "lossy_row": bool(knobs[3] or knobs[4])}
            try:
                plan = plan_of(bench.spec, work, hw, bench.budgets, knobs, dev.type)
            except ValueError as e:   # the planner refused the row (e.g. nothing fits): a row of its own
                row["error"] = f"plan: {e}"
                res["rows"][name] = row
                out.write_text(json.dumps(res, indent=2))
                continue
            row["plan"] = plan.to_json()
            got = bench.row(plan, work, replay="auto", repeats=repeats_of(knobs[0] * (TINY_SCALE if args.model == "tiny" else 1)))
            row.update(got.json)
            if got.ok:
                try:
                    row["predicted"] = predict(bench.spec, row, hw)
                    row["predicted_bundled"] = predict(bench.spec, row, bundled)   # beside it, a diagnostic
                except ImportError as e:   # no simpy on this machine: --report the JSON where it is
                    row["predicted"] = {"error": f"needs {e.name}: python -m benchmarks.calibrated_check --report OUT.json"}
            res["rows"][name] = row
            note(name, got)
            res["summary"], res["summary_bundled"] = summary(res), summary(res, "predicted_bundled")
            out.write_text(json.dumps(res, indent=2))
    res["total_s"] = time.perf_counter() - t_start
    out.write_text(json.dumps(res, indent=2))
    return res


def report(path: Path, model: str) -> dict:
    """Predict every measured row of a saved JSON again with the profile it holds (`profile_toml`)."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import load_model
    res = json.loads(path.read_text())
    toml = path.with_suffix(".report.toml")
    toml.write_text(res["profile_toml"])
    hw = load_profile(str(toml))
    spec = load_model(str(path.with_suffix(".tiny-config.json")) if model == "tiny" else model)
    for row in res["rows"].values():
        if "measured" in row:
            row["predicted"] = predict(spec, row, hw)
            row["predicted_bundled"] = predict(spec, row, load_profile("h200-testbox"))
    res["summary"], res["summary_bundled"] = summary(res), summary(res, "predicted_bundled")
    path.write_text(json.dumps(res, indent=2))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, metavar="OUT.json", help="the JSON (written after every row); the "
                    "calibrated profile goes beside it as OUT.toml, its measurements as OUT.calibrate.json")
    ap.add_argument("--set", default="all", choices=("all", "exact", "lossy"), help="which rows")
    ap.add_argument("--rows", default=None, help="comma-separated row names instead of --set: "
                    + ", ".join({**EXACT, **LOSSY, **LONG}))
    ap.add_argument("--with-512k", action="store_true", help="add the 512K sparse 0.2 + int4 row (~2.5 min on the H200)")
    ap.add_argument("--profile", default=None, metavar="FILE.toml", help="predict with this profile (an earlier "
                    "call's OUT.toml) instead of calibrating first")
    ap.add_argument("--model", default="llama-3-8b", help="llama-3-8b (random weights), or tiny: a 2-layer model "
                    "with contexts / 64 (a CPU check of every path)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    ap.add_argument("--gpu-mem", default="24GB", help="the allocator cap of every row")
    ap.add_argument("--decode", type=int, default=DECODE, help="decode steps per row")
    ap.add_argument("--report", action="store_true", help="predict the rows of --out again with the profile it "
                    "holds (where the measuring machine had no simpy); no measurement")
    args = ap.parse_args(argv)
    if args.report:
        res = report(Path(args.out), args.model)
        print("\n".join(table(res)))
        return 0
    try:
        rows = rows_of(args)
    except ValueError as e:
        print(f"calibrated_check: {e}", file=sys.stderr)
        return 2
    if args.profile and not Path(args.profile).is_file():
        print(f"calibrated_check: --profile: no file {args.profile!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = measure(args, rows, out)
    print(f"profile: {res['profile']} (calibrate {res['calibrate_s'] or 0:.1f} s, total {res['total_s']:.1f} s)")
    print("\n".join(table(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
