"""Offline evidence for the per-phase host issue model (issue 8 §3, issue 10 §4):
the H200 sim_check rows of one session predicted with the host issue figures of `kvpipe calibrate`
records from OTHER device calls (which record belongs to the rows' host is unknown: this shows the
direction, not a validation), and the records' whole-run walls against their per-stage sums.

  python -m experiments.host_evidence [--rows SIM_CHECK.json] [--records A.json,B.json] [--out OUT.json]

Records written before the probe kept `small_ops` per group lack it: it is
rebuilt here from the probe's own graphs (executor/issue_probe PROBE_CONFIG / PROBE_PLANS, the
pipeline builder, no GPU), each old (phase, tag, kind, ops) group given the mean small-kernel
count of its stages. Their gap between issues comes from the whole runs (calibration.run_gap_fit:
slope over stage counts; set-up and the final sync go to the intercept), as they have no
per-phase walls. Prints a table last and writes JSON."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = RESULTS / "h200-2026-11-30-sim_check-s4.json"
RECORDS = (RESULTS / "h200-2026-11-30-calibrated-s4.json", RESULTS / "h200-2026-11-30-calibrated-s4b.json",
           RESULTS / "h200-2026-11-30-calibrate-simcal3.json",   # h200-testbox's own host record
           RESULTS / "h200-2026-11-30-calibrated-s5.json")       # the fifth session's (no sim_check rows of its own)
OTHER_ROWS = (RESULTS / "h200-2026-11-30-sim_check.json", RESULTS / "h200-2026-11-30-sim_check-s3.json")
HOST_BOUND = ("4k-g1-all-c2k", "8k-g2-some-c2k", "8k-g1-none-c4k")


def probe_small_ops(record: dict) -> dict[tuple, float]:
    """Mean small kernels per (phase, tag, kind, ops) group of the probe's graphs (as calibrate ran
    them before the per-phase probe (fifth session): 2-layer Llama-3-8B-shaped model, the record's context, chunk 512, 8
    decode steps, the four probe plans)."""
    from kvpipe.executor.calibrate.host_issue import PROBE_CONFIG, PROBE_PLANS
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.model import from_hf_config
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    context = record.get("context", 2048)
    spec = from_hf_config(dict(PROBE_CONFIG, max_position_embeddings=2 * context))
    found: dict[tuple, list[int]] = {}
    for group, frac in PROBE_PLANS:
        plan = Plan(Method.HEADWISE, PhasePlan(group, record.get("chunk", 512), 2), PhasePlan(group, 1, 2),
                    round(spec.units * frac), 0)
        for s in build(spec, Workload(context, record.get("decode_tokens", 8), 1), plan).stages:
            found.setdefault((s.phase.value, s.tag, s.kind.value, s.ops), []).append(s.small_ops)
    return {k: statistics.fmean(v) for k, v in found.items()}


def with_small_ops(record: dict) -> dict:
    """`record` with `small_ops` in every group (rebuilt from the probe's graphs where missing)."""
    if all("small_ops" in k for k in record["per_kind"]):
        return record
    small = probe_small_ops(record)
    kinds = [dict(k, small_ops=small[(k["phase"], k["tag"], k["kind"], k["ops"])]) for k in record["per_kind"]]
    return dict(record, per_kind=kinds)


def eager_decode_check(extra: dict, rec: dict) -> list[dict]:
    """Eager decode steps of calibrate's OTHER probe (`issue_probe`: 2 layers, context 1024, 16
    steps, groups 1 / 8, all resident or none; step times measured whole) against two models:
    the stage sum a per-phase decode pair would give (compute_issue_fit on the stage probe's decode
    groups, its copy pair, and its run gap per stage; the stage probe is a different run) and the
    profile's decode-step fit (host.issue_s_per_stage / per_op: FITTED on these very steps, so it
    has the advantage)."""
    from kvpipe.executor.calibrate.host_issue import PROBE_CONFIG
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.calibration import compute_issue_fit, copy_issue_fit, run_gap_fit
    from kvpipe.pipeline.model import from_hf_config
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.stage import Kind, Phase
    from kvpipe.pipeline.workload import Workload
    a, b = compute_issue_fit(rec["per_kind"], "decode")
    ca, cb = copy_issue_fit(rec["per_kind"])
    gap = run_gap_fit(rec["runs"])[1]
    step_a, step_b = extra["values"]["host.issue_s_per_stage"], extra["values"]["host.issue_s_per_op"]
    spec = from_hf_config(dict(PROBE_CONFIG, max_position_embeddings=8192))
    out = []
    for row in extra["extra"]["issue_probe"]["eager"]:
        plan = Plan(Method.HEADWISE, PhasePlan(row["group"], 1024, 2), PhasePlan(row["group"], 1, 2), row["resident"], 0)
        dec = [s for s in build(spec, Workload(1024, 16, 1), plan).stages if s.phase is Phase.DECODE]
        steps = len({s.step for s in dec})
        stage_sum = sum(gap + (ca + cb * s.ops if s.kind in (Kind.H2D, Kind.D2H) else a + b * (s.ops + s.small_ops))
                        for s in dec) / steps
        fit = step_a * len(dec) / steps + step_b * sum(s.ops for s in dec) / steps
        out.append({"group": row["group"], "resident": row["resident"], "measured_s": row["decode_s_per_token"],
                    "stage_sum_s": stage_sum, "step_fit_s": fit})
    return out


DIAG = RESULTS / "h200-2026-11-30-diag-prefill-s4.json"


def diag_gaps(path: Path = DIAG) -> dict[str, dict]:
    """Diagnosis (nothing fitted): in each 32-layer row of a `experiments.diag` record, the prefill's
    measured seconds beside its stages' summed issue seconds (`host_s`, cuDNN plan builds included)
    and the excess per stage: where the host binds, the gap between issues in the real rows."""
    doc = json.loads(path.read_text())
    out = {}
    for name, r in doc["stage_rows"].items():
        st = [s for s in r["stages"] if s["phase"] == "prefill"]
        host = sum(s["host_s"] for s in st)
        out[name] = {"prefill_s": r["measured"]["prefill_s"], "host_s_sum": host, "stages": len(st),
                     "gpu_span_sum_s": sum(s["measured_s"] for s in st),
                     "excess_per_stage_s": (r["measured"]["prefill_s"] - host) / len(st)}
    return out


def session_check(path: Path, hw_name: str, variants: dict[str, dict]) -> dict:
    """Another session's sim_check rows (no host probe recorded) predicted with each variant's
    host fields: prefill median / max |error| and the host-bound rows' errors."""
    from benchmarks import sim_check as sc
    rows = json.loads(path.read_text())
    base, _ = sc.profile(hw_name, rows)
    out = {}
    for v, fields in variants.items():
        errs = {}
        for name, row in rows["rows"].items():
            if "measured" in row:
                p = sc.predict(row, replace(base, **fields))["prefill_s"]
                errs[name] = (p - row["measured"]["prefill_s"]) / row["measured"]["prefill_s"]
        out[v] = {"median_abs": statistics.median(abs(e) for e in errs.values()), "max_abs": max(abs(e) for e in errs.values()),
                  "host_bound": {n: errs[n] for n in HOST_BOUND if n in errs}}
    return out


def run_walls(record: dict) -> list[dict]:
    """Each run's wall beside its stages' summed issue seconds, and the excess per stage."""
    return [{"group": r["group"], "resident": r["resident"], "stages": r["stages"], "wall_s": r["wall_s"],
             "host_s_sum": r["host_s_sum"], "excess_s": r["wall_s"] - r["host_s_sum"],
             "excess_per_stage_s": (r["wall_s"] - r["host_s_sum"]) / r["stages"]} for r in record["runs"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=str(ROWS), help="a sim_check JSON with measured rows")
    ap.add_argument("--records", default=",".join(str(p) for p in RECORDS), help="calibrate JSON records, comma-separated")
    ap.add_argument("--other-rows", default=",".join(str(p) for p in OTHER_ROWS),
                    help="other sessions' sim_check JSONs (prefill summary per record)")
    ap.add_argument("--hw", default="h200-testbox")
    ap.add_argument("--out", default=str(RESULTS / "host-evidence-2026-11-30.json"))
    args = ap.parse_args()
    from benchmarks import sim_check as sc
    from kvpipe.pipeline.calibration import host_issue_fields, run_gap_fit
    rows = json.loads(Path(args.rows).read_text())
    base, label = sc.profile(args.hw, rows)
    variants: dict[str, dict] = {"profile": {}}
    out = {"command": "python -m experiments.host_evidence " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "rows_file": args.rows, "base_profile": label, "records": {}, "rows": {}}
    for path in args.records.split(","):
        name = Path(path).stem
        doc = json.loads(Path(path).read_text())
        rec = with_small_ops(doc["extra"]["host_stage_costs"])
        fields = host_issue_fields(rec)
        variants[name + " no gap"] = {k: v for k, v in fields.items() if k != "host_prefill_issue_gap_s"}
        variants[name] = fields
        fixed, per_stage = run_gap_fit(rec["runs"])
        out["records"][name] = {"fields": fields, "runs": run_walls(rec), "run_gap_fixed_s": fixed,
                                "run_gap_per_stage_s": per_stage, "eager_decode": eager_decode_check(doc, rec)}
    errs: dict[str, dict[str, list[float]]] = {v: {"prefill_s": [], "decode_s_per_token": []} for v in variants}
    for row_name, row in rows["rows"].items():
        if "measured" not in row:
            continue
        got = out["rows"][row_name] = {"measured": {k: row["measured"][k] for k in ("prefill_s", "decode_s_per_token")}}
        for v, fields in variants.items():
            p = sc.predict(row, replace(base, **fields))
            got[v] = p
            for key in errs[v]:
                errs[v][key].append((p[key] - row["measured"][key]) / row["measured"][key])
    out["summary"] = {v: {k: {"median_abs": statistics.median(abs(e) for e in es), "max_abs": max(abs(e) for e in es)}
                          for k, es in e.items()} for v, e in errs.items()}
    lines = []
    for name, r in out["records"].items():
        f = r["fields"]
        lines.append(f"{name}: prefill compute {f['host_prefill_issue_s_per_stage'] * 1e6:.0f} us + "
                     f"{f['host_prefill_issue_s_per_launch'] * 1e6:.1f} us/launch, gap {f['host_prefill_issue_gap_s'] * 1e6:.1f} us/stage, "
                     f"copy {f['host_copy_s_per_stage'] * 1e6:.1f} + {f['host_copy_s_per_op'] * 1e6:.1f} us/call")
        lines.append("  runs (wall - summed issue s): " + ", ".join(
            f"g{w['group']} res {w['resident']}: {w['excess_s'] * 1e3:.1f} ms / {w['stages']} stages" for w in r["runs"])
            + f"; fit {r['run_gap_fixed_s'] * 1e3:.1f} ms + {r['run_gap_per_stage_s'] * 1e6:.1f} us/stage")
        lines.append("  eager decode ms/step (issue_probe, held apart): measured / stage sum with a decode pair / "
                     "decode-step fit (fitted on these steps): " + ", ".join(
                         f"g{e['group']} res {e['resident']}: {e['measured_s'] * 1e3:.2f} / {e['stage_sum_s'] * 1e3:.2f} "
                         f"({(e['stage_sum_s'] - e['measured_s']) / e['measured_s']:+.0%}) / {e['step_fit_s'] * 1e3:.2f} "
                         f"({(e['step_fit_s'] - e['measured_s']) / e['measured_s']:+.0%})" for e in r["eager_decode"]))
    out["diag_rows"] = diag_gaps()
    lines.append(f"32-layer rows of {DIAG.name} (another call; diagnosis): prefill / summed issue s / excess per stage: " + ", ".join(
        f"{n} {d['prefill_s']:.3f} / {d['host_s_sum']:.3f} s / {d['excess_per_stage_s'] * 1e6:.0f} us"
        for n, d in out["diag_rows"].items()))
    names = list(variants)
    for key, scale in (("prefill_s", 1.0), ("decode_s_per_token", 1e3)):
        lines.append(f"{key} ({'s' if scale == 1 else 'ms'}); columns: measured, then predicted and error with " + ", ".join(names))
        for row_name, got in out["rows"].items():
            m = got["measured"][key]
            cells = "".join(f"{got[v][key] * scale:9.3f}{(got[v][key] - m) / m:+5.0%}" for v in names)
            lines.append(f"  {row_name:18}{m * scale:9.3f}{cells}")
        lines.append("  median / max |error|: " + "; ".join(
            f"{v} {out['summary'][v][key]['median_abs']:.1%} / {out['summary'][v][key]['max_abs']:.1%}" for v in names))
    out["other_sessions"] = {}
    for path in filter(None, args.other_rows.split(",")):
        got = out["other_sessions"][Path(path).name] = session_check(Path(path), args.hw, variants)
        lines.append(f"prefill of {Path(path).name} (another session; {', '.join(HOST_BOUND)}): " + "; ".join(
            f"{v} {g['median_abs']:.1%} / {g['max_abs']:.1%} (" + ", ".join(f"{e:+.0%}" for e in g["host_bound"].values()) + ")"
            for v, g in got.items() if not v.endswith("no gap")))
    Path(args.out).write_text(json.dumps(out, indent=2))
    lines.append(f"written: {args.out}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
