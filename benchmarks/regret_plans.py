"""The plans a regret run measures for one workload: the planner's pick, its runners-up, and
hand-chosen others that a wrong cost model would have preferred, each with the simulator's
prediction. No torch: `python -m benchmarks.planner_regret --estimate` lists them here.

How the others are chosen (real contenders, not strawmen): each moves ONE
dimension of the pick to its neighbours in the planner's space (prefill chunk /4, /2, x2; every
other head-group size; no or half the resident units; a deeper transfer ring; decode replay off,
or on where the planner chose it off),
so the pick loses to one of them exactly where the simulator misjudges that dimension; beside
them two fixed plans of another structure: the former rule (HeadInfer's setting: group 1, no
resident units, 4K chunks) and layer-like groups (group 8, chunk 16K, as many resident units as
the planner fits). Plans that do not fit the budgets, or repeat another row, are dropped."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.report import budget_problems
from kvpipe.pipeline.workload import Workload

# label -> (context, decode tokens D): D large enough that decode is a visible share of the total
WORKLOADS = {"8K": (8192, 32), "32K": (32768, 32), "128K": (131072, 16), "256K": (262144, 8)}
OBJECTIVE_KEY = {"total": "total_s", "ttft": "ttft_s", "decode": "decode_s_per_token"}
MIN_CHUNK, MAX_CHUNK = 1024, 32768   # the planner's chunk range (sim/planner.py CHUNKS)


@dataclass(frozen=True)
class Candidate:
    """One row to measure: `replay` "auto" (as `kvpipe run` without --replay: decode as the plan's
    replay choice says) or "off"; `rank` 0 the pick, 1.. the runners-up, then the others in order
    of predicted objective (the strongest first)."""

    label: str
    plan: Plan
    replay: str
    predicted: dict
    rank: int
    how: str

    def key(self) -> tuple:
        p = self.plan
        return (p.prefill, p.decode, p.resident, p.disk, self.replay, p.replay)


def predicted(spec: ModelSpec, work: Workload, plan: Plan, hw, replay: str, pred=None) -> dict:
    """The simulator's figures for `plan`, decode replayed as `kvpipe run --replay auto` would
    (the plan's replay choice where it has one; `replay` "off": issued stage by stage), and fused
    where replayed (`--fuse auto`, run's default)."""
    from kvpipe.pipeline.plan import decode_replayed
    from kvpipe.sim.simulate import simulate
    replayed = replay != "off" and decode_replayed(spec, work, plan)
    rep = (pred or simulate(spec, work, plan, hw, replay=replayed, fuse=replayed)).report
    t = rep.timing
    return {"prefill_s": t.prefill_s, "ttft_s": t.ttft_s, "decode_s_per_token": t.decode_s_per_token,
            "total_s": t.total_s, "peak_gpu_bytes": rep.peak_bytes["gpu"]}


def _with(plan: Plan, group: int | None = None, chunk: int | None = None, depth: int | None = None,
          **kw) -> Plan:
    p, d = plan.prefill, plan.decode
    p = replace(p, group=group or p.group, chunk=chunk or p.chunk, depth=depth or p.depth)
    d = replace(d, group=group or d.group, depth=depth or d.depth)
    return plan.with_(prefill=p, decode=d, source="regret: hand-chosen", **kw)


def variants(spec: ModelSpec, work: Workload, pick: Plan) -> list[tuple[str, Plan, str, str]]:
    """(label, plan, replay, how chosen) for the hand-chosen others, before fit and duplicate checks."""
    c, g, r, off = pick.prefill.chunk, pick.decode.group, pick.resident, pick.resident < spec.units
    out = []
    for f, name in ((4, "chunk /4"), (2, "chunk /2")):
        if c // f >= MIN_CHUNK:
            out.append((name, _with(pick, chunk=c // f), "auto", "one knob of the pick: the prefill chunk"))
    if c * 2 <= min(MAX_CHUNK, work.context):
        out.append(("chunk x2", _with(pick, chunk=c * 2), "auto", "one knob of the pick: the prefill chunk"))
    for other in (h for h in range(1, spec.kv_heads + 1) if spec.kv_heads % h == 0 and h != g):
        out.append((f"group {other}", _with(pick, group=other), "auto", "one knob of the pick: head-group size"))
    if r:
        out.append(("resident none", _with(pick, resident=0), "auto", "one knob of the pick: resident units"))
    if r > 1:
        out.append((f"resident {r // 2}", _with(pick, resident=r // 2), "auto",
                    "one knob of the pick: resident units"))
    if off:
        out.append(("depth 3", _with(pick, depth=3), "auto", "one knob of the pick: transfer ring depth"))
    if pick.replay is Replay.OFF:   # the planner chose eager decode: its neighbour is replayed
        out.append(("replay on", pick.with_(replay=Replay.ON), "auto", "the pick with decode steps replayed as CUDA graphs"))
    else:
        out.append(("replay off", pick.with_(replay=Replay.OFF if pick.replay is Replay.ON else Replay.AUTO), "off",
                    "the pick with decode steps issued stage by stage"))
    rule = Plan(Method.HEADWISE, PhasePlan(1, min(4096, work.context), 2), PhasePlan(1, 1, 2), 0, 0,
                "regret: the former rule (HeadInfer's setting)")
    out.append(("rule g1 none 4K", rule, "auto", "another structure: the former rule"))
    return out


def layerlike(spec: ModelSpec, work: Workload, hw, budgets: dict, objective: str) -> Plan | None:
    """Group 8 (whole layers' heads), chunk 16K, the planner's choice of the rest."""
    from kvpipe.sim.planner import NoPlanFits, Pins, search
    try:
        return search(spec, work, hw, budgets, Pins(group=spec.kv_heads, chunk=min(16384, work.context)),
                      objective).best.plan
    except NoPlanFits:
        return None


def fits(spec: ModelSpec, work: Workload, plan: Plan, budgets: dict) -> bool:
    try:
        plan.check(spec, work)
    except ValueError:
        return False
    return not budget_problems(breakdown(spec, work, plan), budgets)


def candidates(spec: ModelSpec, work: Workload, hw, budgets: dict, objective: str = "total") -> list[Candidate]:
    """The pick (the planner asked exactly as `kvpipe run --objective OBJECTIVE` asks it on a CUDA GPU
    with nvCOMP: the h2d codec tried), its runners-up, then the others strongest first; every one fits `budgets`, none
    repeats."""
    from kvpipe.sim.planner import search
    found = search(spec, work, hw, budgets, objective=objective)
    # `kvpipe run` executes a plan's replay choice; Bench.row takes it as its replay argument
    mode = lambda plan, replay="auto": "off" if plan.replay is Replay.OFF else replay
    rows = [Candidate("planner pick", found.best.plan, mode(found.best.plan),
                      predicted(spec, work, found.best.plan, hw, "auto", found.best.prediction), 0, "the planner")]
    for i, alt in enumerate(found.alternatives, 1):
        rows.append(Candidate(f"runner-up {i}", alt.plan, mode(alt.plan), predicted(spec, work, alt.plan, hw, "auto",
                                                                                   alt.prediction), i, "the planner"))
    others = variants(spec, work, found.best.plan)
    lay = layerlike(spec, work, hw, budgets, objective)
    if lay is not None:
        others.append(("g8 max 16K", lay.with_(source="regret: layer-like groups"), "auto",
                       "another structure: layer-like groups, the planner's resident count"))
    seen = {c.key() for c in rows}
    extra = []
    for label, plan, replay, how in others:
        cand = Candidate(label, plan, mode(plan, replay), {}, 0, how)
        if cand.key() in seen or not fits(spec, work, plan, budgets):
            continue
        seen.add(cand.key())
        extra.append(replace(cand, predicted=predicted(spec, work, plan, hw, replay)))
    key = OBJECTIVE_KEY[objective]
    extra.sort(key=lambda c: c.predicted[key] if c.predicted[key] is not None else float("inf"))
    return rows + [replace(c, rank=len(rows) + i) for i, c in enumerate(extra)]
