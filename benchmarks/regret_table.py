"""The regret benchmark's verdict: per workload the best measured row, the pick's regret over it
and how many rows were measured; saved parts of one run joined; the table printed last."""
from __future__ import annotations

import json

from benchmarks.regret_plans import OBJECTIVE_KEY


def regret(wl: dict, key: str) -> None:
    """Best measured value, the pick's regret and the count of measured rows, into `wl`."""
    vals = [r["measured"][key] for r in wl["rows"] if r.get("measured", {}).get(key) is not None]
    pick = next((r for r in wl["rows"] if r["rank"] == 0), {}).get("measured", {}).get(key)
    wl["best_measured"] = min(vals, default=None)
    wl["measured_rows"] = len(vals)
    wl["pick_regret"] = pick / wl["best_measured"] - 1 if pick is not None and wl["best_measured"] else None


def merge(results: list[dict]) -> list[dict]:
    """Saved parts as one result per objective and model: a workload's rows from every part, a
    measured row taking the place of the same rank skipped elsewhere; regrets recomputed."""
    out: dict[tuple, dict] = {}
    for res in results:
        k = (res["objective"], res["model"], res["gpu_budget"])
        if k not in out:
            out[k] = dict(res, workloads={}, part=res.get("part"))
        else:
            out[k]["part"] = f"{out[k]['part']} + {res.get('part')}"
        for name, wl in res["workloads"].items():
            have = out[k]["workloads"].setdefault(name, dict(wl, rows=[]))
            rows = {r["rank"]: r for r in have["rows"]}
            for r in wl["rows"]:
                if r["rank"] not in rows or ("measured" in r and "measured" not in rows[r["rank"]]):
                    rows[r["rank"]] = r
            have["rows"] = [rows[i] for i in sorted(rows)]
    for res in out.values():
        for wl in res["workloads"].values():
            regret(wl, OBJECTIVE_KEY[res["objective"]])
    return list(out.values())


def table(results: list[dict]) -> list[str]:
    from kvpipe.pipeline.units import fmt_tokens
    fmt = lambda x: "-" if x is None else f"{x:.4g}"
    lines = []
    for res in merge(results):
        key = OBJECTIVE_KEY[res["objective"]]
        lines.append(f"planner regret, objective {res['objective']} ({key}, s), {res['model']} random weights on "
                     f"{res.get('device_name', res['device'])}, --gpu-mem {res['gpu_budget']}, part {res.get('part')}")
        lines.append(f"{'workload':>8} {'plan':<18} {'g/c/res/rep':<20} {'predicted':>10} {'measured':>10} "
                     f"{'vs best':>8}  note")
        for name, wl in res["workloads"].items():
            best = wl.get("best_measured")
            for r in wl["rows"]:
                p = r["plan"]
                knobs = (f"{p['prefill']['group']}/{p['decode']['group']} {fmt_tokens(p['prefill']['chunk'])} "
                         f"r{p['resident']}{' eager' if r['replay'] == 'off' else ''}")
                m = r.get("measured", {}).get(key)
                vs = "-" if m is None or not best else f"{m / best - 1:+.1%}"
                note = r.get("error") or r.get("skipped") or ""
                lines.append(f"{name:>8} {r['label']:<18} {knobs:<20} {fmt(r['predicted'].get(key)):>10} "
                             f"{fmt(m):>10} {vs:>8}  {note[:70]}")
            reg, n = wl.get("pick_regret"), wl.get("measured_rows", 0)
            verdict = ("no pick measured" if reg is None else "within 5%" if reg <= 0.05 else "MISSES 5%")
            short = "" if n >= 9 else f"; only {n} measured (issue: the pick and >= 8 others)"
            lines.append(f"{name:>8} => pick regret {'-' if reg is None else f'{reg:+.1%}'} over {n} measured: "
                         f"{verdict}{short}")
    return lines


def _eager(row: dict) -> bool:
    """The row's decode ran eagerly: run with --replay off, or a plan that chose eager decode."""
    return row.get("replay") == "off" or row["plan"].get("replay") is False


def _knobs(plan: dict) -> str:
    return json.dumps({k: plan.get(k) for k in ("method", "prefill", "decode", "resident", "disk")}, sort_keys=True)


def current_picks(results: list[dict], plans: dict) -> list[str]:
    """The regret of TODAY's planner picks (`plans`: a planner_regret --estimate file) over saved
    measurements made earlier: per workload, the measured row whose plan has the pick's knobs and
    decode mode (replayed or eager) is the pick's measurement, judged against the best of every
    measured row of that workload (saved parts joined by merge). A pick no row measured says so."""
    lines = []
    for res in merge(results):
        key = OBJECTIVE_KEY[res["objective"]]
        for name, wl in res["workloads"].items():
            if name not in plans["workloads"]:
                continue
            pick = plans["workloads"][name]["rows"][0]
            want = (_knobs(pick["plan"]), _eager(pick))
            same = [r for r in wl["rows"] if r.get("measured", {}).get(key) is not None
                    and (_knobs(r["plan"]), _eager(r)) == want]
            best, n = wl.get("best_measured"), wl.get("measured_rows", 0)
            if not same or not best:
                lines.append(f"{name:>8} => today's pick ({'eager' if want[1] else 'replayed'}) was not measured")
                continue
            m = same[0]["measured"][key]
            reg = m / best - 1
            lines.append(f"{name:>8} => today's pick = measured row {same[0]['label']!r} ({m:.4g} s): regret "
                         f"{reg:+.1%} over {n} measured: {'within 5%' if reg <= 0.05 else 'MISSES 5%'}")
    return lines
