"""Host issue cost and graph replay cost, probed on small runs where the host binds: a 2-layer
model with Llama-3-8B layer shapes decodes under four plans (groups 1 and 8, all resident or none),
whose GPU work per step is a fraction of a millisecond, so a step takes the host's time. Least
squares of step seconds = a * stages + b * ops gives the per-stage and per-launch issue costs;
the same runs replayed give the host's cost of one replayed step; a captured graph of tiny kernels
gives the GPU cost of one graph node. `stage_costs` times every stage's own issue (`Span.host_s`)
and each phase's host wall in prefill and eager decode, the record the profile's per-phase
compute pair, copy pair and prefill gap are fitted from (pipeline/calibration.host_issue_fields).
`host_issue` and `host_stage_costs` are `kvpipe calibrate`'s steps over them."""
from __future__ import annotations

import statistics
import sys

import torch

from kvpipe.pipeline.calibration import Calibration, host_issue_fields, issue_spread


def step_counts(graph) -> tuple[float, float]:
    """Stages and ops of one decode step (the mean over the graph's decode steps)."""
    from kvpipe.pipeline.stage import Phase
    dec = [s for s in graph.stages if s.phase is Phase.DECODE]
    n = len({s.step for s in dec})
    return len(dec) / n, sum(s.ops for s in dec) / n


def run_plans(replay: str, log=lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.layers.loader import random_model
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.report import timing_from_trace
    from kvpipe.pipeline.stage import Phase
    from kvpipe.pipeline.workload import Workload
    cfg = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=8192, tie_word_embeddings=False)
    model = random_model(cfg, "cuda", torch.bfloat16, 0)
    spec = HFAdapter(model).spec()
    work = Workload(1024, 16, 1)
    ids = torch.randint(0, 1024, (1, 1024), generator=torch.Generator().manual_seed(0))
    rows = []
    for group, resident in ((1, spec.units), (8, spec.units), (1, 0), (8, 0)):
        plan = Plan(Method.HEADWISE, PhasePlan(group, 1024, 2), PhasePlan(group, 1, 2), resident, 0)
        graph = build(spec, work, plan)
        execute(graph, model, ids, "cuda", replay=replay)   # warm
        res = execute(graph, model, ids, "cuda", replay=replay)
        t = timing_from_trace(res.trace)
        stages, ops = step_counts(graph)
        heads = [sp.host_s for sp in res.trace.spans
                 if graph.stages[sp.stage].phase is Phase.DECODE and graph.stages[sp.stage].tag == "head"]
        rows.append({"group": group, "resident": resident, "stages_per_step": stages, "ops_per_step": ops,
                     "decode_s_per_token": t.decode_s_per_token, "decode_issue": res.decode_issue,
                     "host_s_per_step": statistics.median(heads[1:]) if res.decode_issue == "graph" else None})
        log(rows[-1])
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares of t = a * stages + b * ops (2x2 normal equations)."""
    xs = [(r["stages_per_step"], r["ops_per_step"], r["decode_s_per_token"]) for r in rows]
    saa = sum(s * s for s, _, _ in xs); sab = sum(s * o for s, o, _ in xs); sbb = sum(o * o for _, o, _ in xs)
    sat = sum(s * t for s, _, t in xs); sbt = sum(o * t for _, o, t in xs)
    det = saa * sbb - sab * sab
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def graph_node_s(nodes: int = 2000) -> float:
    x = torch.zeros(1, device="cuda")
    for _ in range(3):
        x.add_(1)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / nodes)
    return statistics.median(times[1:])


# The stage-cost probe's model: Llama-3-8B layer shapes, 2 layers (few layers: its GPU work stays small).
PROBE_CONFIG = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    tie_word_embeddings=False)
# (KV heads per group, resident units as a fraction of all): the plans cover every stage kind.
PROBE_PLANS = ((1, 1.0), (2, 0.5), (8, 0.0), (1, 0.0))


def stage_costs(model, device: str, context: int = 2048, chunk: int = 512, decode: int = 8,
                plans=PROBE_PLANS, replay: str = "off") -> dict:
    """Host seconds the executor spends issuing each stage of `model` (an HF model on `device`):
    per plan (group, resident fraction) one warm run, then one timed run whose `stage_hook` stamps
    the host clock at each stage's issue (after its dependency waits). Returns the
    `host_stage_costs` record: `per_kind`, the median `Span.host_s` per (phase, tag, kind, ops,
    small_ops) group; `runs`, per plan the whole run's wall and summed host seconds and, per phase,
    its host wall (first issue to the end of the last), its stages' summed host seconds and count;
    `fits`, least squares of host_s = a + b * ops over each phase's stages (kept in the record)."""
    import time

    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    spec = HFAdapter(model).spec()
    work = Workload(context, decode, 1)
    ids = torch.randint(0, spec.vocab, (1, context), generator=torch.Generator().manual_seed(0))
    cuda = torch.device(device).type == "cuda"
    per: dict[tuple, list[float]] = {}
    runs = []
    for group, frac in plans:
        resident = round(spec.units * frac)
        plan = Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0)
        graph = build(spec, work, plan)
        execute(graph, model, ids, device, replay=replay)            # warm: kernels, plans, allocator
        if cuda:
            torch.cuda.synchronize()
        stamps = [0.0] * len(graph.stages)

        def hook(s, stamps=stamps) -> None:
            stamps[s.id] = time.perf_counter()
        t0 = time.perf_counter()
        res = execute(graph, model, ids, device, stage_hook=hook, replay=replay)
        wall = time.perf_counter() - t0
        run = {"group": group, "resident": resident, "stages": len(graph.stages),
               "ops": sum(st.ops for st in graph.stages), "wall_s": wall,
               "host_s_sum": sum(sp.host_s for sp in res.trace.spans), "decode_issue": res.decode_issue}
        for phase in ("prefill", "decode"):
            spans = [sp for sp in res.trace.spans if graph.stages[sp.stage].phase.value == phase
                     and (phase == "prefill" or res.decode_issue == "eager")]
            run.update(_phase_record(phase, spans, stamps, graph))
            for sp in spans:
                st = graph.stages[sp.stage]
                per.setdefault((phase, st.tag, st.kind.value, st.ops, st.small_ops), []).append(sp.host_s)
        runs.append(run)
    fits = {phase: f for phase in ("prefill", "decode")
            if (f := _ops_fit([(k[3], h) for k, v in per.items() if k[0] == phase for h in v])) is not None}
    per_kind = [{"phase": k[0], "tag": k[1], "kind": k[2], "ops": k[3], "small_ops": k[4], "n": len(v),
                 "median_s": statistics.median(v)} for k, v in sorted(per.items())]
    return {"per_kind": per_kind, "fits": fits, "runs": runs, "context": context, "chunk": chunk,
            "decode_tokens": decode, "device": str(device)}


def _phase_record(phase: str, spans, stamps: list[float], graph) -> dict:
    """One phase's part of a `stage_costs` run: its host wall (first issue to the end of the last),
    its stages' summed host seconds, and its stages, ops and steps; {} where it issued none."""
    if not spans:
        return {}
    first = min(stamps[sp.stage] for sp in spans)
    last = max(stamps[sp.stage] + sp.host_s for sp in spans)
    return {f"{phase}_wall_s": last - first, f"{phase}_host_s": sum(sp.host_s for sp in spans),
            f"{phase}_stages": len(spans), f"{phase}_ops": sum(graph.stages[sp.stage].ops for sp in spans),
            f"{phase}_steps": len({graph.stages[sp.stage].step for sp in spans})}


def _ops_fit(pts: list[tuple[int, float]]) -> dict | None:
    """Least squares of host_s = a + b * ops over (ops, host_s) points; None with fewer than two op counts."""
    if len({o for o, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(o for o, _ in pts) / n, sum(h for _, h in pts) / n
    b = sum((o - mx) * (h - my) for o, h in pts) / sum((o - mx) ** 2 for o, _ in pts)
    return {"per_stage_s": my - b * mx, "per_op_s": b, "points": n}


def probe_model(device: str = "cuda", layers: int = 2, **overrides):
    """The probe's random bf16 model (PROBE_CONFIG with `layers` and any `overrides`) on `device`."""
    from kvpipe.executor.layers.loader import random_model
    cfg = dict(PROBE_CONFIG, num_hidden_layers=layers, **overrides)
    cfg.setdefault("max_position_embeddings", 8192)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return random_model(cfg, device, dtype, 0)


def host_issue(cal: Calibration) -> None:
    """Per-stage and per-launch host issue cost of the executor, host cost of a replayed decode
    step, GPU cost of a graph node (`run_plans`, `graph_node_s`: small runs where the host binds)."""
    eager = run_plans("off", log=lambda s: None)
    per_stage, per_op = fit(eager)
    how = "least squares of decode step time = a*stages + b*ops over 4 eager plans of a 2-layer Llama-3-8B-shaped model"
    cal.set("host.issue_s_per_stage", max(0.0, per_stage), how + " (a)")
    cal.set("host.issue_s_per_op", max(0.0, per_op), how + " (b)")
    cal.set("gpu.graph_node_s", graph_node_s(), "a captured graph of 2000 tiny kernels replayed, GPU time per node")
    replay = run_plans("on", log=lambda s: None)
    cal.set("host.graph_replay_s", statistics.median(r["host_s_per_step"] for r in replay if r["resident"]),
            "host seconds of one replayed decode step (same model, resident plans), median")
    cal.extra["issue_probe"] = {"eager": eager, "replay": replay}


SPREAD_RUNS = 10   # timed runs of one host-bound plan for the issue spread


def host_spread(cal: Calibration, runs: int = SPREAD_RUNS) -> None:
    """The host's issue spread (`host.issue_p90`): one host-bound eager plan of the probe model
    (group 1, every unit resident: a step takes the host's time) decoded `runs` times in this
    process, the p90 step time over the median. It sees this machine's jitter during the
    calibration only; a shared machine's run-to-run spread can be larger (docs/PERFORMANCE.md)."""
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.report import timing_from_trace
    from kvpipe.pipeline.workload import Workload
    model = probe_model("cuda")
    spec = HFAdapter(model).spec()
    graph = build(spec, Workload(1024, 16, 1), Plan(Method.HEADWISE, PhasePlan(1, 1024, 2), PhasePlan(1, 1, 2),
                                                     spec.units, 0))
    ids = torch.randint(0, spec.vocab, (1, 1024), generator=torch.Generator().manual_seed(0))
    execute(graph, model, ids, "cuda", replay="off")   # warm
    steps = [timing_from_trace(execute(graph, model, ids, "cuda", replay="off").trace).decode_s_per_token
             for _ in range(runs)]
    cal.set("host.issue_p90", issue_spread(steps), f"p90 over the median decode step of {runs} eager runs of a "
            "host-bound plan (2-layer Llama-3-8B-shaped model, group 1, all resident) in this calibration")
    cal.extra["host_spread_steps_s"] = steps


def host_stage_costs(cal: Calibration, context: int = 2048, chunk: int = 512) -> None:
    """Host seconds the executor spends issuing each stage (the lane actor's perf_counter around
    the stage's issue, `Span.host_s`), prefill and eager decode, for a 2-layer Llama-3-8B-shaped
    model under plans that cover the stage kinds (groups 1 / 2 / 8; all resident, half, none),
    with each phase's host wall (executor/calibrate/host_issue.stage_costs; the JSON record's
    `host_stage_costs`). Sets the copy pair, the prefill compute pair (per stage + per kernel
    launch) and the prefill gap between issues (pipeline/calibration.host_issue_fields)."""
    rec = stage_costs(probe_model("cuda"), "cuda", context, chunk)
    cal.extra["host_stage_costs"] = rec
    fields = host_issue_fields(rec)
    how = ("host seconds of the executor's {what} issued one by one (Span.host_s) in a 2-layer Llama-3-8B-shaped "
           "model's prefill and eager decode under 4 plans (executor/calibrate/host_issue.stage_costs); least squares "
           "of the median per group = a + b * {x} (pipeline/calibration.{fit})")
    copy = how.format(what="h2d / d2h stages", x="copy calls", fit="copy_issue_fit")
    cal.set("host.copy_s_per_stage", fields["host_copy_s_per_stage"], copy + " (a)")
    cal.set("host.copy_s_per_op", fields["host_copy_s_per_op"], copy + " (b)")
    pre = how.format(what="prefill compute stages", x="kernel launches (ops + small_ops)", fit="compute_issue_fit")
    cal.set("host.prefill_issue_s_per_stage", fields["host_prefill_issue_s_per_stage"], pre + " (a)")
    cal.set("host.prefill_issue_s_per_launch", fields["host_prefill_issue_s_per_launch"], pre + " (b)")
    cal.set("host.prefill_issue_gap_s", fields["host_prefill_issue_gap_s"],
            "the same runs: each prefill's host wall (first issue to the end of the last) minus its stages' "
            "summed issue seconds, per stage, pooled over the 4 plans (pipeline/calibration.issue_gap)")
