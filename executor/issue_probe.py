"""Host issue cost and graph replay cost, probed on small runs where the host binds: a 2-layer
model with Llama-3-8B layer shapes decodes under four plans (groups 1 and 8, all resident or none),
whose GPU work per step is a fraction of a millisecond, so a step takes the host's time. Least
squares of step seconds = a * stages + b * ops gives the per-stage and per-launch issue costs;
the same runs replayed give the host's cost of one replayed step; a captured graph of tiny kernels
gives the GPU cost of one graph node. Used by `kvpipe calibrate` and benchmarks/issue_cost.py."""
from __future__ import annotations

import statistics
import sys

import torch


def step_counts(graph) -> tuple[float, float]:
    """Stages and ops of one decode step (the mean over the graph's decode steps)."""
    from kvpipe.pipeline.stage import Phase
    dec = [s for s in graph.stages if s.phase is Phase.DECODE]
    n = len({s.step for s in dec})
    return len(dec) / n, sum(s.ops for s in dec) / n


def run_plans(replay: str, log=lambda s: print(s, file=sys.stderr, flush=True)) -> list[dict]:
    from kvpipe.executor.adapter import HFAdapter
    from kvpipe.executor.loader import random_model
    from kvpipe.executor.runner import execute
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
