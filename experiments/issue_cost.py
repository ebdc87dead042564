"""Host issue cost and graph replay cost, measured on small runs where the host binds (not fitted
to the regimes rows): the numbers behind `host_issue_s_per_stage`, `host_issue_s_per_op`,
`graph_replay_s` and `graph_node_s` in hw_profiles/*.toml.

  python -m experiments.issue_cost      # on a GPU; prints a table last, JSON to benchmarks/results/

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

from kvpipe.executor.calibrate.host_issue import fit, graph_node_s, run_plans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    res = {"command": "python -m experiments.issue_cost",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["eager"] = run_plans("off")
    a, b = fit(res["eager"])
    res["host_issue_s_per_stage"], res["host_issue_s_per_op"] = a, b
    res["graph_node_s"] = graph_node_s()
    try:
        res["replay"] = run_plans("on")
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
