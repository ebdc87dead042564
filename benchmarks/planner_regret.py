"""Planner regret on a real GPU: for each workload, measure the planner's pick, its
runners-up and hand-chosen others (benchmarks/regret_plans.py says how they are chosen), all in
ONE process (benchmarks/measure.py: the model built once, each row run as `kvpipe run` runs it).
The regret of the pick is its measured objective over the best measured one; the issue's target
is 5%. Llama-3-8B shapes, random bf16 weights, batch 1, --gpu-mem 24GB. Objective: total time of
prefill + D decode tokens (D per workload: 8K 32, 32K 32, 128K 16, 256K 8), the planner asked
for the same objective and workload.

  python -m benchmarks.planner_regret --estimate --host-mem 125GiB --out P.json   # here: rows, est. seconds
  python -m benchmarks.planner_regret --plans P.json --budget-s 420 --part 1/2     # on the GPU
  python -m benchmarks.planner_regret --table A.json B.json [--out J.json]        # here: saved parts (joined)

The planner runs where --estimate runs (its plans do not depend on the machine beyond the budgets
given); --plans replays that file's rows so GPU time goes to measuring only.

Rows run strongest first across the call's workloads (every pick, then every first runner-up,
...); with --budget-s a row whose estimated wall (the simulator's total plus set-up seconds fitted
to earlier H200 rows, scaled by this run's measured/estimated ratio) would pass the budget is
skipped and recorded as such. JSON after every row; a table (workload, plan, predicted, measured,
vs best, regret of the pick) prints last."""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.regret_plans import OBJECTIVE_KEY, WORKLOADS, candidates
from benchmarks.regret_table import regret, table

GPU_BUDGET = "24GB"
PRIOR_FILES = str(Path(__file__).parent / "results" / "h200-*.json")   # earlier rows with wall_s


def setup_prior(spec, pattern: str = PRIOR_FILES) -> dict:
    """Seconds a row spends outside its measured prefill and decode (warm-up, pinned KV homes,
    capture) as a + b * GiB offloaded, least squares over earlier H200 rows with `wall_s` (all
    Llama-3-8B; another model gets no prior)."""
    pts, files = [], []
    for f in sorted(glob.glob(pattern)) if spec.name == "llama-3-8b" else ():
        rows = json.loads(Path(f).read_text()).get("rows")
        for r in rows.values() if isinstance(rows, dict) else ():
            m = r.get("measured", {})
            if not (m.get("prefill_s") and r.get("wall_s") and isinstance(r.get("plan"), dict)):
                continue
            gib = (spec.units - r["plan"]["resident"]) * r["context"] * spec.kv_unit_bytes_per_token / 2**30
            pts.append((gib, r["wall_s"] - m["prefill_s"] - (m["decode_s_per_token"] or 0) * r["decode_tokens"]))
            files.append(f)
    if len({x for x, _ in pts}) < 2:
        return {"a_s": 0.0, "b_s_per_gib": 0.0, "points": len(pts), "files": [], "note": "no prior rows"}
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return {"a_s": my - b * mx, "b_s_per_gib": b, "points": len(pts), "files": sorted(set(files))}


def base_estimate(spec, work, cand, prior: dict) -> float:
    gib = (spec.units - cand.plan.resident) * work.context * spec.kv_unit_bytes_per_token / 2**30
    return cand.predicted["total_s"] + max(0.0, prior["a_s"] + prior["b_s_per_gib"] * gib)


def parse_part(text: str | None) -> tuple[int, int]:
    if text is None:
        return 1, 1
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise ValueError(f"part: expected I/N with 1 <= I <= N, got {text!r}")
    return int(i), int(n)


def parse_ranks(text: str | None) -> tuple[int, int]:
    if text is None:
        return 0, 10**9
    a, _, b = text.partition("-")
    if not (a.isdigit() and b.isdigit() and int(a) <= int(b)):
        raise ValueError(f"ranks: expected FIRST-LAST (e.g. 0-5), got {text!r}")
    return int(a), int(b)


def split(costs: dict[str, float], n: int) -> list[list[str]]:
    """Workloads into n parts of about equal estimated seconds (largest first, to the lightest part)."""
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for name in sorted(costs, key=costs.get, reverse=True):
        k = load.index(min(load))
        parts[k].append(name)
        load[k] += costs[name]
    return parts


def workloads(args) -> dict[str, tuple[int, int]]:
    from kvpipe.pipeline.units import parse_tokens
    out = {}
    for label in args.contexts:
        ctx, d = WORKLOADS.get(label.upper(), (parse_tokens(label, "contexts"), 16))
        out[label.upper()] = (ctx, args.decode_tokens if args.decode_tokens is not None else d)
    return out


def plan_rows(args, spec, hw, budgets) -> tuple[dict, dict, dict]:
    """Per workload its rows (label, rank, plan, predicted, estimated wall) before measuring; the
    candidates by (workload, rank); the set-up prior."""
    from kvpipe.pipeline.workload import Workload
    prior = setup_prior(spec)
    res, cands = {}, {}
    for name, (ctx, d) in workloads(args).items():
        work = Workload(ctx, d, 1)
        rows = []
        for c in candidates(spec, work, hw, budgets, args.objective):
            rows.append({"label": c.label, "rank": c.rank, "how": c.how, "replay": c.replay,
                         "plan": c.plan.to_json(spec), "predicted": c.predicted,
                         "estimated_wall_s": base_estimate(spec, work, c, prior)})
            cands[name, c.rank] = c
        res[name] = {"context": ctx, "decode_tokens": d, "rows": rows}
    return res, cands, prior


def run_rows(res: dict, key: str, budget_s: float | None, started: float, measure, save,
             order: str = "rank", clock=time.monotonic, ranks: tuple[int, int] = (0, 10**9)) -> None:
    """Measure rows rank by rank across the workloads (`order` "cheap": workload by workload,
    shortest context first); skip a row whose scaled estimate would pass the budget (scale: median
    measured/estimated wall of the rows so far), and rows outside `ranks` (another call's share).
    Saves after every row."""
    rows = [(r["rank"], res["workloads"][w]["context"], w, r) for w in res["workloads"]
            for r in res["workloads"][w]["rows"]]
    rows.sort(key=lambda t: t[:2] if order == "rank" else (t[1], t[0]))
    ratios = []
    for rank, _, name, row in rows:
        scale = statistics.median(ratios) if ratios else 1.0
        left = None if budget_s is None else budget_s - (clock() - started)
        if not ranks[0] <= rank <= ranks[1]:
            row["skipped"] = f"ranks: outside {ranks[0]}-{ranks[1]} (another call's)"
        elif left is not None and row["estimated_wall_s"] * scale > left:
            row["skipped"] = f"budget: about {row['estimated_wall_s'] * scale:.0f} s, {max(left, 0):.0f} s left"
        else:
            row.update(measure(name, row))
            if "measured" in row:
                ratios.append(row["wall_s"] / row["estimated_wall_s"])
        regret(res["workloads"][name], key)
        save()


def measure_all(args, res: dict, cands: dict, started: float, out: Path) -> None:
    from benchmarks.measure import Bench, note
    from kvpipe.pipeline.workload import Workload
    ctx_max = max(wl["context"] for wl in res["workloads"].values())
    save = lambda: out.write_text(json.dumps(res, indent=2))
    with Bench(args.model, args.device, res["gpu_budget_bytes"], ctx_max, host_budget=res["host_budget_bytes"]) as bench:
        import torch
        res["load_s"] = bench.load_s
        res["device_name"] = torch.cuda.get_device_name() if bench.cuda else "cpu"
        res["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")

        def measure(name: str, row: dict) -> dict:
            wl = res["workloads"][name]
            cand = cands[name, row["rank"]]
            got = bench.row(cand.plan, Workload(wl["context"], wl["decode_tokens"], 1), replay=cand.replay)
            note(f"{name} {row['label']}", got)
            return got.json

        run_rows(res, OBJECTIVE_KEY[args.objective], args.budget_s, started, measure, save, args.order,
                 ranks=parse_ranks(args.ranks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", default=list(WORKLOADS), help="8K 32K 128K 256K, or token counts")
    ap.add_argument("--decode-tokens", type=int, default=None, help="D for every workload (default: per workload)")
    ap.add_argument("--objective", default="total", choices=sorted(OBJECTIVE_KEY))
    ap.add_argument("--model", default="llama-3-8b", help="(a tiny config.json and --device cpu smoke-test the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hw", default="h200", help="profile the planner and predictions use (run's on an H200)")
    ap.add_argument("--gpu-mem", default=GPU_BUDGET)
    ap.add_argument("--host-mem", default=None, help="host budget (default: this machine's RAM, as kvpipe run)")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds this process may take; rows that "
                    "would pass it are skipped, the strongest run first")
    ap.add_argument("--part", default=None, metavar="I/N", help="only part I of N (workloads split by estimated time)")
    ap.add_argument("--ranks", metavar="FIRST-LAST", help="only rows of these ranks (0 the pick): one workload's "
                    "rows over several calls; --table joins them")
    ap.add_argument("--estimate", action="store_true", help="no GPU: the rows, predictions and estimated seconds "
                    "(with --out: a file for --plans)")
    ap.add_argument("--plans", metavar="FILE.json", help="the rows of an --estimate file instead of planning here "
                    "(the same planner, run where no GPU waits)")
    ap.add_argument("--order", default="rank", choices=["rank", "cheap"], help="rank: every workload's pick, then "
                    "every first runner-up, ...; cheap: the cheapest workload's rows all, then the next")
    ap.add_argument("--table", nargs="+", metavar="FILE.json", help="print the table of saved results")
    ap.add_argument("--pick-plans", metavar="PLANS.json", help="with --table: where today's picks (an --estimate "
                    "file) are among the saved measurements, and their regret")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = time.monotonic()
    try:
        if args.table:
            saved = [json.loads(Path(f).read_text()) for f in args.table]
            print("\n".join(table(saved)))
            if args.out:   # the parts joined into one result (one per objective and model)
                from benchmarks.regret_table import merge
                joined = merge(saved)
                Path(args.out).write_text(json.dumps(joined[0] if len(joined) == 1 else joined, indent=2))
                print(f"joined: {args.out}")
            if args.pick_plans:
                from benchmarks.regret_table import current_picks
                print("\n".join(current_picks(saved, json.loads(Path(args.pick_plans).read_text()))))
            return 0
        return regret_run(args, started)
    except (ValueError, OSError) as e:
        print(f"planner_regret: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


def saved_rows(args, spec, budgets: dict) -> tuple[dict, dict, dict]:
    """plan_rows' answer from an --estimate file (planned here, so the GPU's time measures only)."""
    from benchmarks.regret_plans import Candidate
    from kvpipe.pipeline.plan import Plan
    saved = json.loads(Path(args.plans).read_text())
    for field, mine in (("model", args.model), ("objective", args.objective), ("hw", args.hw),
                        ("gpu_budget_bytes", budgets["gpu"])):
        if saved.get(field) != mine:
            raise ValueError(f"plans: {args.plans} was planned for {field} {saved.get(field)!r}, this run has {mine!r}")
    wls = {n: saved["workloads"][n] for n in workloads(args) if n in saved["workloads"]}
    if len(wls) < len(workloads(args)):
        raise ValueError(f"plans: {args.plans} has no rows for {sorted(set(workloads(args)) - set(wls))}")
    cands = {(n, r["rank"]): Candidate(r["label"], Plan.from_json(r["plan"], spec), r["replay"], r["predicted"],
                                       r["rank"], r["how"]) for n, wl in wls.items() for r in wl["rows"]}
    return wls, cands, saved["estimate_prior"]


def regret_run(args, started: float) -> int:
    from kvpipe.hw_profiles import load_profile
    from kvpipe.inputs import budget
    from kvpipe.pipeline.model import load_model
    part, nparts = parse_part(args.part)
    parse_ranks(args.ranks)
    if args.budget_s is not None and args.budget_s <= 0:
        raise ValueError(f"budget-s: must be positive, got {args.budget_s}")
    spec, hw = load_model(args.model), load_profile(args.hw)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budgets = {"gpu": budget(args.gpu_mem, 0, "gpu-mem"), "host": budget(args.host_mem, ram, "host-mem"), "disk": 0}
    wls, cands, prior = saved_rows(args, spec, budgets) if args.plans else plan_rows(args, spec, hw, budgets)
    costs = {n: sum(r["estimated_wall_s"] for r in wl["rows"]) for n, wl in wls.items()}
    parts = split(costs, nparts)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m benchmarks.planner_regret " + " ".join(sys.argv[1:]), "model": args.model,
           "device": args.device, "hw": args.hw, "objective": args.objective, "gpu_budget": args.gpu_mem,
           "gpu_budget_bytes": budgets["gpu"], "host_budget_bytes": budgets["host"], "budget_s": args.budget_s,
           "part": f"{part}/{nparts}: {' '.join(parts[part - 1])}{f' ranks {args.ranks}' if args.ranks else ''}",
           "estimate_prior": prior,
           "planning_s": time.monotonic() - started, "plans_from": args.plans or "planned in this process",
           "workloads": {n: wls[n] for n in wls if n in parts[part - 1]}}
    if args.estimate:
        for n, wl in wls.items():
            where = next(i for i, p in enumerate(parts, 1) if n in p)
            print(f"{n}: {len(wl['rows'])} rows, about {costs[n]:.0f} s (part {where}/{nparts}); by rank: "
                  + ", ".join(f"{r['label']} {r['estimated_wall_s']:.0f}" for r in wl["rows"]))
        print(f"prior: {prior['a_s']:.2f} s + {prior['b_s_per_gib']:.2f} s/GiB offloaded, from {prior['points']} rows; "
              f"planning took {res['planning_s']:.0f} s here; all rows about {sum(costs.values()):.0f} s")
        print("\n".join(table([res])))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
            print(f"plans: {args.out} (give it to --plans on the GPU)")
        return 0
    from benchmarks.result_file import result_file
    out = Path(args.out or result_file("planner-regret", args.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    measure_all(args, res, cands, started, out)
    print("\n".join(table([res])))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
