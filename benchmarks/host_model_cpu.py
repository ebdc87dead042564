"""The host issue model checked on this CPU. The executor runs tiny
random Llama models on device cpu, where every stage is host work: the host-stage probe
(executor/calibrate/host_issue.stage_costs) calibrates on ONE tiny model and the simulator predicts OTHER
models and plans (held apart: other layer counts, widths, groups, chunks, contexts), measured here.

  python -m benchmarks.host_model_cpu [--reps 3] [--out benchmarks/results/cpu-DATE-host-model.json]

Predictions: prefill from the probe's prefill compute pair (per stage + per kernel launch), copy
pair and gap between issues (pipeline/calibration.host_issue_fields), decode (eager) from the
decode-step fit `a * stages + b * ops` over the probe runs' eager decode walls (executor/calibrate/host_issue.fit,
the form the GPU profile's host.issue_s_* pair has), and, beside it, the stage sum a per-phase decode
pair would give (compute_issue_fit on the decode groups, the copy pair, the decode gap).
What this can and cannot show: on a CPU the "GPU work" (GEMMs, attention, copies) runs inside each
stage's issue, so the probe's per-stage seconds include it; at these widths (hidden 32-128,
head_dim 8-16, contexts <= 512) it is a small part, but it grows with width and context where
launch cost does not (at hidden 128, head_dim 16 and 512 tokens a prefill attention stage took
1.9 ms against 0.3 ms for its neighbour: compute, not issue). It checks the model's STRUCTURE (stage
counts, launches per stage, the gap between issues, the simulator's host lane) on another host; it
does not validate the H200 figures. Prints a table last and writes JSON."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

# The calibration model and the held-apart targets: (name, layers, hidden, heads, kv heads, head_dim,
# intermediate, context, chunk, group, resident fraction). Calibration: 2 layers, the probe's plans.
CAL = dict(layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
           intermediate_size=128)
CAL_WORK = (256, 64, 8)   # context, chunk, decode steps
TARGETS = (
    ("in-sample: probe g1 all", 2, 64, 8, 8, 8, 128, 256, 64, 1, 1.0),   # the calibration model and plan itself
    ("4L-g1-all-c128", 4, 64, 8, 4, 8, 128, 512, 128, 1, 1.0),
    ("4L-g2-none-c256", 4, 64, 8, 4, 8, 128, 512, 256, 2, 0.0),
    ("6L-w128-g4-some-c128", 6, 128, 8, 4, 16, 256, 384, 128, 4, 0.5),
    ("3L-g1-none-c64", 3, 64, 4, 2, 16, 128, 512, 64, 1, 0.0),
    ("8L-w32-g1-some-c128", 8, 32, 4, 2, 8, 64, 256, 128, 1, 0.25),
)
DECODE = 8


def cpu_profile(fields: dict, step_a: float, step_b: float):
    """A profile of this CPU as the simulator sees the executor on it: host issue from the probe;
    every device rate so large that the lanes other than the host cost nothing (their work is
    inside each stage's issue here), no cuDNN plans (CPU attention builds none)."""
    from kvpipe.pipeline.hardware import HardwareProfile
    huge = 1e18
    return HardwareProfile(
        name="cpu-host", description="this CPU: host issue measured by executor/calibrate/host_issue.stage_costs; "
        "device lanes free (their work runs inside the issue)", gpu_mem_bytes=1 << 40,
        hbm_peak_bytes_per_s=huge, hbm_eff_bytes_per_s=huge, flops_peak_per_s={"fp32": huge, "bf16": huge},
        flops_eff_per_s={"fp32": huge, "bf16": huge}, small_shape_half_flops=0.0, attention_efficiency=1.0,
        launch_overhead_s=0.0, attention_plan_s=0.0, h2d_alpha_s=0.0, h2d_bytes_per_s=huge, d2h_alpha_s=0.0,
        d2h_bytes_per_s=huge, pcie_duplex=True, host_mem_bytes=1 << 40, disk_read_bytes_per_s=huge,
        disk_write_bytes_per_s=huge, disk_alpha_s=0.0, disk_bytes=1 << 40, cpu_codec_bytes_per_s=huge,
        host_issue_s_per_stage=max(0.0, step_a), host_issue_s_per_op=max(0.0, step_b), graph_replay_s=0.0,
        graph_node_s=0.0, launch_queue_ops=1e9, **fields)


def decode_stage_sum(graph, rec: dict) -> float:
    """Host seconds of one eager decode step as a per-phase decode pair would charge it."""
    from kvpipe.pipeline.calibration import compute_issue_fit, copy_issue_fit, issue_gap
    from kvpipe.pipeline.stage import Kind, Phase
    a, b = compute_issue_fit(rec["per_kind"], "decode")
    ca, cb = copy_issue_fit(rec["per_kind"])
    gap = issue_gap(rec["runs"], "decode")
    dec = [s for s in graph.stages if s.phase is Phase.DECODE]
    total = sum(gap + (ca + cb * s.ops if s.kind in (Kind.H2D, Kind.D2H) else a + b * (s.ops + s.small_ops))
                for s in dec)
    return total / len({s.step for s in dec})


def measure(model, graph, ids, reps: int) -> dict:
    """The fastest prefill seconds and decode seconds per token of `reps` runs after a warm one
    (each the least disturbed by other processes on a shared machine), with every run's figures."""
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.report import timing_from_trace
    execute(graph, model, ids, "cpu")
    got = [timing_from_trace(execute(graph, model, ids, "cpu").trace) for _ in range(reps)]
    return {"prefill_s": min(t.prefill_s for t in got), "decode_s_per_token": min(t.decode_s_per_token for t in got),
            "prefill_runs_s": [t.prefill_s for t in got], "decode_runs_s": [t.decode_s_per_token for t in got]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5, help="timed runs per target (the fastest is kept)")
    ap.add_argument("--cal-reps", type=int, default=3, help="probe passes (the least disturbed is kept)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.calibrate.host_issue import fit, probe_model, stage_costs
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.calibration import host_issue_fields
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    torch.manual_seed(0)
    torch.set_num_threads(1)   # one thread: no intra-op pool waking per tiny kernel (2 cores here)
    today = datetime.date.today().isoformat()
    out_path = Path(args.out or Path(__file__).resolve().parent / "results" / f"cpu-{today}-host-model.json")
    context, chunk, decode = CAL_WORK
    cal_model = probe_model("cpu", **CAL)
    # a shared machine (other jobs on its cores): the probe runs `cal_reps`
    # times and the pass with the least prefill host time (the least disturbed) is kept, as each
    # target keeps its fastest run
    recs = [stage_costs(cal_model, "cpu", context, chunk, decode) for _ in range(args.cal_reps)]
    rec = min(recs, key=lambda r: sum(x["prefill_host_s"] for x in r["runs"]))
    fields = host_issue_fields(rec)
    steps = [{"stages_per_step": r["decode_stages"] / r["decode_steps"], "ops_per_step": r["decode_ops"] / r["decode_steps"],
              "decode_s_per_token": r["decode_wall_s"] / r["decode_steps"]} for r in rec["runs"]]
    step_a, step_b = fit(steps)
    hw = cpu_profile(fields, step_a, step_b)
    res = {"command": "python -m benchmarks.host_model_cpu " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
                      f"{len(os.sched_getaffinity(0))} cores",
           "torch": torch.__version__, "calibration_model": CAL, "calibration_work": CAL_WORK,
           "host_stage_costs": rec, "probe_passes_prefill_host_s": [sum(x["prefill_host_s"] for x in r["runs"]) for r in recs],
           "fields": fields, "decode_step_fit": {"per_stage_s": step_a, "per_op_s": step_b},
           "rows": {}}
    for name, layers, hidden, heads, kv, hd, inter, ctx, ch, group, frac in TARGETS:
        model = probe_model("cpu", layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            num_key_value_heads=kv, head_dim=hd, intermediate_size=inter)
        spec = HFAdapter(model).spec()
        work = Workload(ctx, DECODE, 1)
        plan = Plan(Method.HEADWISE, PhasePlan(group, ch, 2), PhasePlan(group, 1, 2), round(spec.units * frac), 0)
        graph = build(spec, work, plan)
        ids = torch.randint(0, spec.vocab, (1, ctx), generator=torch.Generator().manual_seed(1))
        m = measure(model, graph, ids, args.reps)
        rep = simulate(spec, work, plan, hw, replay=False).report
        res["rows"][name] = {"plan": plan.to_json(), "context": ctx, "measured": m,
                             "predicted": {"prefill_s": rep.timing.prefill_s, "decode_s_per_token": rep.timing.decode_s_per_token,
                                           "decode_stage_sum_s": decode_stage_sum(graph, rec)}}
        out_path.write_text(json.dumps(res, indent=2))
    lines = [f"calibrated on {CAL['layers']}-layer hidden {CAL['hidden_size']} (context {context}, chunk {chunk}): "
             f"prefill {fields['host_prefill_issue_s_per_stage'] * 1e6:.1f} us + {fields['host_prefill_issue_s_per_launch'] * 1e6:.2f} us/launch, "
             f"gap {fields['host_prefill_issue_gap_s'] * 1e6:.1f} us, copy {fields['host_copy_s_per_stage'] * 1e6:.1f} + "
             f"{fields['host_copy_s_per_op'] * 1e6:.1f} us/call; decode step fit {step_a * 1e6:.1f} us/stage + {step_b * 1e6:.2f} us/op",
             f"{'row (held apart)':24}{'prefill ms':>11}{'pred':>8}{'err':>6}{'decode ms':>11}{'pred':>8}{'err':>6}{'stage sum':>10}{'err':>6}"]
    errs = {"prefill": [], "decode": [], "decode_sum": []}
    for name, r in res["rows"].items():
        m, p = r["measured"], r["predicted"]
        e = [(p["prefill_s"] - m["prefill_s"]) / m["prefill_s"], (p["decode_s_per_token"] - m["decode_s_per_token"]) / m["decode_s_per_token"],
             (p["decode_stage_sum_s"] - m["decode_s_per_token"]) / m["decode_s_per_token"]]
        for k, v in zip(errs, e):
            errs[k].append(abs(v))
        lines.append(f"{name:24}{m['prefill_s'] * 1e3:11.1f}{p['prefill_s'] * 1e3:8.1f}{e[0]:+6.0%}"
                     f"{m['decode_s_per_token'] * 1e3:11.2f}{p['decode_s_per_token'] * 1e3:8.2f}{e[1]:+6.0%}"
                     f"{p['decode_stage_sum_s'] * 1e3:10.2f}{e[2]:+6.0%}")
    res["summary"] = {k: {"median_abs": statistics.median(v), "max_abs": max(v)} for k, v in errs.items()}
    out_path.write_text(json.dumps(res, indent=2))
    lines.append("median / max |error|: " + "; ".join(f"{k} {s['median_abs']:.1%} / {s['max_abs']:.1%}"
                                                    for k, s in res["summary"].items()))
    lines.append(f"written: {out_path}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
