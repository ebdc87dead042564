"""Host issue cost and graph replay cost, measured on small runs where the host binds (not fitted
to the regimes rows): the numbers behind `host_issue_s_per_stage`, `host_issue_s_per_op`,
`graph_replay_s` and `graph_node_s` in hw_profiles/*.toml.

  python -m benchmarks.issue_cost      # on a GPU; prints a table last, JSON to benchmarks/results/

1. Eager issue: a 2-layer model with Llama-3-8B layer shapes and a 1024-token vocabulary decodes
   16 steps under four plans (groups 1 and 8, all resident or none). Its GPU work per step is a
   fraction of a millisecond, so the step time is the host's: least squares over the plans of
   step seconds = a * stages + b * ops gives a (per stage) and b (per kernel launch or copy call,
   the builder's `ops`).
2. Replay: the same runs with `--replay on`; the host seconds per replayed step (refresh of the
   step buffers, the launch, the write-back calls) measured on the step's head span.
3. Graph nodes: a captured graph of 2000 tiny kernels replayed; GPU seconds per node.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path


def step_counts(graph) -> tuple[float, float]:
    """Stages and ops of one decode step (the mean over the graph's decode steps)."""
    from kvpipe.pipeline.stage import Phase
    dec = [s for s in graph.stages if s.phase is Phase.DECODE]
    n = len({s.step for s in dec})
    return len(dec) / n, sum(s.ops for s in dec) / n


def run_plans(torch, replay: str) -> list[dict]:
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
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares of t = a * stages + b * ops (2x2 normal equations)."""
    xs = [(r["stages_per_step"], r["ops_per_step"], r["decode_s_per_token"]) for r in rows]
    saa = sum(s * s for s, _, _ in xs); sab = sum(s * o for s, o, _ in xs); sbb = sum(o * o for _, o, _ in xs)
    sat = sum(s * t for s, _, t in xs); sbt = sum(o * t for _, o, t in xs)
    det = saa * sbb - sab * sab
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def graph_node_s(torch, nodes: int = 2000) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    res = {"command": "python -m benchmarks.issue_cost",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["eager"] = run_plans(torch, "off")
    a, b = fit(res["eager"])
    res["host_issue_s_per_stage"], res["host_issue_s_per_op"] = a, b
    res["graph_node_s"] = graph_node_s(torch)
    try:
        res["replay"] = run_plans(torch, "on")
        res["graph_replay_s"] = statistics.median(r["host_s_per_step"] for r in res["replay"] if r["resident"])
    except Exception as e:   # keep the eager figures
        res["replay"], res["graph_replay_s"] = [], float("nan")
        res["replay_error"] = f"{type(e).__name__}: {e}"
        print(res["replay_error"][:2000], file=sys.stderr)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
    out = Path(args.out or f"benchmarks/results/issue-cost-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"{'plan':16}{'issue':>7}{'stages':>8}{'ops':>7}{'ms/step':>9}{'host ms':>9}")
    for r in res["eager"] + res["replay"]:
        host = r["host_s_per_step"]
        print(f"g{r['group']} res {r['resident']:<8}{r['decode_issue']:>7}{r['stages_per_step']:8.0f}"
              f"{r['ops_per_step']:7.0f}{r['decode_s_per_token'] * 1e3:9.3f}{(host or 0) * 1e3:9.3f}")
    print(f"host_issue_s_per_stage {a:.3e}  host_issue_s_per_op {b:.3e}  graph_replay_s "
          f"{res['graph_replay_s']:.3e}  graph_node_s {res['graph_node_s']:.3e}")
    print(f"results: {out}")


if __name__ == "__main__":
    main()
