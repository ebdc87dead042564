"""The simulator against the eager rows measured on the H200 (docs/BASELINES.md,
"kvpipe across regimes", landed 0cfeb8a: decode issued stage by stage, one run each, 16 decode
tokens, --gpu-mem 24GB), predicted with the profile's host-issue figures (measured by
experiments/issue_cost.py on a 2-layer model, not fitted to these rows). Also prints what the
simulator predicts for the same rows under graph replay (no measurement yet). CPU only:

  python -m experiments.sim_baselines   (or: python -m benchmarks.sim_check --baselines)
"""
from __future__ import annotations

import statistics

# (context, --group, --resident) -> (decode ms/token, prefill s), measured (baselines.md)
MEASURED = {
    (8192, "auto", "auto"): (88.5, 0.69), (8192, "8", "all"): (32.5, 0.27),
    (32768, "auto", "auto"): (96.0, 1.55), (32768, "8", "all"): (33.9, 1.48),
    (32768, "1", "none"): (170, 1.75), (32768, "2", "none"): (146, 1.55),
    (32768, "4", "none"): (92.5, 1.50), (32768, "8", "none"): (78.3, 1.49),
    (65536, "1", "none"): (156, 4.05), (65536, "2", "none"): (157, 4.19),
    (65536, "4", "none"): (178, 3.96), (65536, "8", "none"): (156, 3.94),
    (131072, "1", "none"): (311, 12.05), (131072, "2", "none"): (311, 11.72),
    (131072, "4", "none"): (311, 11.70), (131072, "8", "none"): (311, 11.74),
    (131072, "8", "max"): (220, 11.82),
}


def main() -> None:
    from kvpipe.hw_profiles import load_profile
    from kvpipe.options import PlanOptions
    from kvpipe.sim.decide import rule_plan
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.simulate import simulate
    spec, hw = load_model("llama-3-8b"), load_profile("h200")
    budgets = {"gpu": 24_000_000_000, "host": hw.host_mem_bytes, "disk": 0}
    errs = []
    print(f"{'context':>8} {'group':>5} {'res':>5} {'decode ms':>10} {'pred':>7} {'err':>6} "
          f"{'prefill s':>10} {'pred':>7} {'err':>6} {'replay pred ms':>15}")
    for (ctx, group, resident), (dec, pre) in MEASURED.items():
        work = Workload(ctx, 16, 1)
        plan = rule_plan(spec, work, budgets, PlanOptions(method="headwise", group=group, resident=resident).request(spec))
        eager = simulate(spec, work, plan, hw, replay=False).report.timing
        replay = simulate(spec, work, plan, hw, replay=True).report.timing
        d, p = eager.decode_s_per_token * 1e3, eager.prefill_s
        errs += [(d - dec) / dec, (p - pre) / pre]
        print(f"{ctx:>8} {group:>5} {resident:>5} {dec:10.1f} {d:7.1f} {(d - dec) / dec:6.0%} "
              f"{pre:10.2f} {p:7.2f} {(p - pre) / pre:6.0%} {replay.decode_s_per_token * 1e3:15.1f}")
    a = [abs(e) for e in errs]
    print(f"simulator vs measured (eager), {len(a)} figures: median |error| {statistics.median(a):.1%}, "
          f"max {max(a):.1%}")


if __name__ == "__main__":
    main()
