"""Reads the stage traces experiments/diag.py wrote for sim_check rows (diag.json, `stage_rows`) and
sets each stage's measurement beside what the cost model NOW predicts for it on a profile (the
rows' graphs rebuilt from their plans; pipeline/cost.py), per prefill chunk and decode step:
GPU-lane spans per tag, host issue seconds (measured: the lane actor's issue of the stage;
predicted: cost.host_issue_seconds), kernel GPU time per category, and the GPU lane's idle time
inside the step (its extent minus its spans: waits on the host or on copies).

  python -m experiments.diag_report DIAG.json [--hw h200-testbox] [--rows a,b]"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from benchmarks import sim_check
from experiments.kernel_split import CATEGORIES

TAGS = ("embed", "qkv", "attn", "mlp", "head", "h2d", "d2h")


def rows_table(name: str, row: dict, hw) -> list[str]:
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.cost import host_issue_seconds, stage_seconds
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    spec = load_model(sim_check.MODEL)
    graph = build(spec, Workload(row["context"], row["decode_tokens"], 1), Plan.from_json(row["plan"]))
    replayed = row.get("decode_issue") == "graph"
    acc: dict[tuple, dict] = {}
    for s, m in zip(graph.stages, row["stages"]):
        if (s.tag, s.layer, s.step) != (m["tag"], m["layer"], m["step"]):
            raise ValueError(f"{name}: stage {s.id} is {s.name} here but {m['tag']} L{m['layer']} in the file")
        a = acc.setdefault((m["phase"], m["step"]), {"m": defaultdict(float), "p": defaultdict(float), "host_m": 0.0,
                                                     "host_p": 0.0, "k": defaultdict(float), "lo": None, "hi": 0.0})
        tag = m["tag"] if m["kind"] == "compute" else m["kind"]
        dec = m["phase"] == "decode" and replayed
        a["m"][tag] += m["measured_s"]
        a["p"][tag] += stage_seconds(s, hw, spec.dtype, dec and s.kind.value != "d2h")
        a["host_m"] += m["host_s"]
        a["host_p"] += 0.0 if dec else host_issue_seconds(s, hw)
        for c, (sec, _) in (m.get("kernels") or {}).items():
            a["k"][c] += sec
        if m["kind"] == "compute":
            a["lo"] = m["start_s"] if a["lo"] is None else min(a["lo"], m["start_s"])
            a["hi"] = max(a["hi"], m["start_s"] + m["measured_s"])
    lines = [f"{name}: measured prefill {row['measured']['prefill_s']:.3f} s, decode "
             f"{(row['measured']['decode_s_per_token'] or 0) * 1e3:.2f} ms; allocator {row.get('allocator_pass_a')}",
             "  step     " + " ".join(f"{t:>13}" for t in TAGS) + "   host m/p      idle  kernels " + "/".join(CATEGORIES)]
    for (phase, step), a in acc.items():
        gpu = sum(a["m"][t] for t in ("embed", "qkv", "attn", "mlp", "head"))
        idle = (a["hi"] - a["lo"] - gpu) if a["lo"] is not None else 0.0
        cells = " ".join(f"{a['m'][t] * 1e3:6.1f}/{a['p'][t] * 1e3:6.1f}" for t in TAGS)
        lines.append(f"  {phase[:3]} {step:>3} {cells} {a['host_m'] * 1e3:6.1f}/{a['host_p'] * 1e3:6.1f} "
                     f"{idle * 1e3:7.1f}  " + "/".join(f"{a['k'][c] * 1e3:.1f}" for c in CATEGORIES))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("diag")
    ap.add_argument("--hw", default="h200-testbox")
    ap.add_argument("--rows", default=None)
    args = ap.parse_args()
    from kvpipe.hw_profiles import load_profile
    rows = json.load(open(args.diag)).get("stage_rows", {})
    names = args.rows.split(",") if args.rows else list(rows)
    hw = load_profile(args.hw)
    print(f"ms measured/predicted (profile {args.hw}); a replayed decode step is all on its head stage")
    for n in names:
        if n not in rows or "stages" not in rows[n]:
            print(f"{n}: {rows.get(n, {}).get('error', 'not in the file')}", file=sys.stderr)
            continue
        print("\n".join(rows_table(n, rows[n], hw)))


if __name__ == "__main__":
    main()
