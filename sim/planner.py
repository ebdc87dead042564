"""The planner: searches head-wise plans (KV heads per group in each phase, prefill chunk, buffer
depth, resident units, host/disk split, decode graph replay on or off) under GPU, host and disk
budgets for the plan the simulator predicts best on an objective (total time, time to first token
or decode rate).

Coarse to fine: every plan of the space (sim/space.py) that fits is ranked by the closed-form lane estimate
(`sim/estimate.py`); plans are simulated in that order (branch and bound), skipping any whose lane
lower bound is already no better than the best simulated one, until `SIM_BUDGET` stages have been
simulated. Resident units: as many as the GPU holds, that count rounded down to whole head
groups, or none (every count up to the most for models of at most `EVERY_RESIDENT_UNITS` units);
disk units: the fewest the host budget allows. Knobs the user gives pin their dimension.

Graph replay: every plan whose decode a CUDA graph can hold (pipeline/replay.py `blocker`: no disk
units, codec or lossy KV) is searched with decode replayed first; then its eager twin (decode
issued stage by stage) gets its own branch-and-bound pass, pruned by the best value of both
passes, within `EAGER_SIM_BUDGET` stages, so a pick changes only where eager decode is predicted
better. A twin's estimate has the host as a lane (it issues every
decode stage: `estimate.decode_host_seconds`) and its bound the replayed twin's simulated first
token (decode issue does not move a prefill stage); its simulation reuses the twin's prefill
windows (`simulate(memo=)`). Eager decode wins where the replayed run's costs (the host's sync
after the prefill and the capture, each step waiting for the previous one and its write-backs)
exceed issuing the stages: fetch-bound steps, whose next fetches an eager host queues early.
It is not searched for the TTFT objective (decode issue does not move the first token; replay is
kept as the rule keeps it), nor with `--fuse on` (only replayed decode is fused); a pin
(`Pins.replay`, `--replay on|off`) fixes it. Plans that cannot replay keep `replay` AUTO. The
second pass adds CPU time only where decode can replay (none where the presets need disk units).
A lossless GPU codec on h2d is tried on the winner and its runners-up (`_h2d_codec`): simulated
with each one the profile rates, it replaces the winner where the simulator predicts it better
(the codec's decode runs eagerly). Fused decode is a setting, not a dimension: replayed decode is
fused as `kvpipe run` would (`--fuse auto`); the reason says when it is fused and what its
one-time compile costs (not in the objective: `run` pays it once per process, untimed)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import NoPlanFits  # noqa: F401  (raised here; callers import it from either)
from kvpipe.pipeline.replay import Replay, blocker
from kvpipe.pipeline.units import fmt_bytes
from kvpipe.pipeline.workload import Workload

from .simulate import Prediction, simulate
from .space import (CHUNKS, DEPTHS, EVERY_RESIDENT_UNITS, SOURCE, Pins, Space, _key, _Search,  # noqa: F401
                    _smallest_budget, fragmentation_room, max_context, sim_cost)

OBJECTIVES = ("total", "ttft", "decode")
SIM_BUDGET = 150_000                              # stages simulated before the search stops early
EAGER_SIM_BUDGET = 75_000                         # the same for the eager-decode pass
RUNNERS_UP = 2                                    # simulated besides the winner, to show beside it
TIE = 0.001                                       # estimates closer than this rank as equal


@dataclass(frozen=True)
class Scored:
    """A simulated plan and its value on the objective (seconds)."""

    plan: Plan
    prediction: Prediction
    value: float


@dataclass(frozen=True)
class PlannerResult:
    best: Scored
    alternatives: tuple[Scored, ...]   # the runners-up, best first
    reason: str
    objective: str
    fitting: int                       # plans of the space that fit the budgets (an eager twin is one)
    simulated: int
    pruned: int                        # skipped because their lower bound could not win
    unexplored: int = 0                # neither simulated nor pruned: the simulation budget ran out
    ranked_on: str = "p50"             # the run every simulation here is of (p90: the host's slow run)


def objective_value(pred: Prediction, objective: str, quantile: str = "p50") -> float:
    """`objective` of a prediction; a decision layer's prediction (sim/predicted.Predicted) at
    `quantile`, a simulation as it was run (the planner runs it at the quantile it ranks on)."""
    t = pred.timing_at(quantile) if hasattr(pred, "timing_at") else pred.report.timing
    if objective == "ttft":
        return t.ttft_s
    if objective == "decode" and t.decode_s_per_token is not None:
        return t.decode_s_per_token
    return t.total_s


def search(model: ModelSpec, work: Workload, hw: HardwareProfile, budgets: dict[str, int],
           pins: Pins = Pins(), objective: str = "total", *, sim_budget: int = SIM_BUDGET,
           full: bool = False, h2d_codecs: bool = True, fuse: str = "auto",
           eager_budget: int = EAGER_SIM_BUDGET, quantile: str = "p50", memo=None) -> PlannerResult:
    """The best plan the simulator finds for `objective`, with the two runners-up. Plans are
    simulated best estimate first until every other one is pruned by its lower bound or the
    stages simulated pass `sim_budget` (then the search is anytime, not exhaustive); then the
    eager-decode twins of the plans that can replay, the same way within `eager_budget` stages
    (the module docstring says when). `pins.replay` fixes replay instead (on: plans that cannot
    replay are left out). `h2d_codecs`: try the profile's lossless GPU codecs on h2d for the
    winner (`_h2d_codec`). `fuse`: the fuse setting (auto|on|off), applied to every plan whose
    decode is replayed. `quantile`: the run plans are simulated and ranked on (a median one, or
    one at the host's p90 issue speed: HardwareProfile.at_quantile), named in the reason. `memo`: a
    sim/memo.SimMemo shared with other searches (other budgets), which the plans' predictions reuse."""
    hw = hw.at_quantile(quantile)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    why = blocker(model, work) if work.decode_tokens else "there are no decode tokens"
    if pins.replay is Replay.ON and why:
        raise ValueError(f"replay: on, but {why} (use --replay off or auto)")
    s = _Search(model, work, hw, budgets, replay=pins.replay, fuse=fuse)
    if memo is not None:
        s.windows = memo.windows_for(model, work, hw)
    space = Space.of(model, work, pins)
    plans = s.candidates(space, pins, space.depths)
    if not plans:
        raise NoPlanFits(_smallest_budget(s, space, pins))
    done: dict[tuple, Scored] = {}
    pruned, _, unexplored = _branch_and_bound(s, plans, done, objective, sim_budget, full, memo=memo)
    eager_skip = _eager_skipped(s, objective)
    twins = [p.with_(replay=Replay.OFF) for p in plans if p.replay is Replay.ON] if eager_skip is None else []
    if twins:   # a second pass, so that eager decode changes a pick only where it is predicted better
        more, _, left = _branch_and_bound(s, twins, done, objective, eager_budget, full, _twin_ttft(done), memo)
        pruned, unexplored = pruned + more, unexplored + left
    order = sorted(done.values(), key=lambda c: (c.value, c.prediction.report.timing.total_s))
    best = order[0]
    rest = order[1:1 + RUNNERS_UP]
    if h2d_codecs:
        best = _h2d_codec(s, best, objective, full, rest)
    label = objective if hw.host_issue_p90 == 1 or quantile == "p50" else f"{objective} at {quantile}"
    reason = _reason(s, best, rest, label, _replay_note(s, best, done, label, eager_skip))
    return PlannerResult(best, tuple(rest), reason, objective, len(plans) + len(twins), len(done), pruned,
                         unexplored, "p50" if label == objective else quantile)


def _branch_and_bound(s: _Search, plans: list[Plan], done: dict, objective: str, budget: int,
                      full: bool, ttft=lambda plan: None, memo=None) -> tuple[int, int, int]:
    """Simulate `plans` best estimate first into `done` (key -> Scored; the best of it prunes),
    until each is pruned or `budget` stages are spent; returns (pruned, spent, unexplored).
    `ttft(plan)`: its first token's time where a simulation of the same prefill knows it, else None
    (`Estimate.lower_bound`)."""
    m, work = s.model, s.work
    bound = lambda p: s.estimate(p).lower_bound(objective, ttft(p))
    # Best estimate first; estimates within TIE of each other count as equal (the estimate is no
    # closer to the simulator than that), and among equals the cheaper to simulate goes first.
    tie = lambda x: math.floor(math.log(max(x, 1e-30)) / math.log1p(TIE))
    ranked = sorted(plans, key=lambda p: (tie(s.estimate(p).score(objective)),
                                          sim_cost(m, work, p, full), s.estimate(p).score(objective)))
    pruned, spent, unexplored = 0, 0, 0
    for i, plan in enumerate(ranked):
        best = min((c.value for c in done.values()), default=math.inf)
        if len(done) >= 1 + RUNNERS_UP and bound(plan) >= best:
            pruned += 1       # cannot beat the best: its lanes alone take longer
            continue
        if spent >= budget and len(done) >= 1 + RUNNERS_UP:
            unexplored = sum(bound(p) < best for p in ranked[i:])
            break             # anytime: the rest ranks worse on the estimate and may not be pruned
        if memo is None:
            pred = simulate(m, work, plan, s.hw, full=full, replay=s.replays(plan), fuse=s.fuses(plan), memo=s.windows)
        else:
            pred = memo.simulate(m, work, plan, s.hw, full=full, replay=s.replays(plan), fuse=s.fuses(plan))
        done[_key(plan)] = Scored(plan, pred, objective_value(pred, objective))
        spent += sim_cost(m, work, plan, full)
    return pruned, spent, unexplored


def _twin_ttft(done: dict):
    """plan -> the simulated first token of its replayed twin (the same prefill), or None."""
    def ttft(plan: Plan) -> float | None:
        twin = done.get(_key(plan.with_(replay=Replay.ON)))
        return None if twin is None else twin.prediction.report.timing.ttft_s
    return ttft


def _eager_skipped(s: _Search, objective: str) -> str | None:
    """Why the eager-decode pass does not run, or None when it does."""
    if s.replay is not Replay.AUTO:
        return "pinned by --replay"
    if s.fuse == "on":
        return "--fuse on fuses replayed decode only"
    if objective == "ttft":
        return "decode issue does not move the first token"
    return None


def _replay_note(s: _Search, best: Scored, done: dict, objective: str, skipped: str | None) -> str | None:
    """The replay choice of the winner and why, for the reason (None where its decode cannot replay)."""
    plan = best.plan
    if plan.replay is Replay.AUTO or plan.replay_blocker:   # e.g. the h2d codec's plan: its decode runs eagerly
        return None
    replayed = plan.replay is Replay.ON
    mode = "decode replayed" if replayed else "decode eager (replay off)"
    twin = done.get(_key(plan.with_(replay=Replay.OFF if replayed else Replay.ON)))
    if skipped is not None:
        return f"{mode}: {skipped}"
    if twin is not None:
        gap = twin.value / best.value - 1 if best.value else 0.0
        return f"{mode}: {gap:.1%} better on {objective} than {'eager' if replayed else 'replayed'} decode"
    if not replayed:
        return f"{mode}: its replayed twin was not simulated"
    bound = s.estimate(plan.with_(replay=Replay.OFF)).lower_bound(objective)
    return (f"{mode}: eager decode cannot beat it (its lower bound)" if bound >= best.value
            else f"{mode}: eager decode not simulated (simulation budget)")


def _h2d_codec(s: _Search, best: Scored, objective: str, full: bool, rest=()) -> Scored:
    """The codec dimension, on the winner and its runners-up `rest`: each is simulated again with
    each lossless codec the profile rates for h2d (sim/codec_choice.candidates); one the simulator
    predicts better on the objective than the winner, that still fits, replaces it. The runners-up
    too: the codec's GPU buffers may not fit beside the winner's deeper transfer ring where they
    fit beside a runner-up's (an eager winner of depth 4, its runner-up of depth 2). Plans with
    disk units, or nothing offloaded, keep none (the GPU codec serves host units only); the
    codec's decode runs eagerly (`Plan.replay_blocker`)."""
    from .codec_choice import candidates, with_codec
    m, chosen, tried = s.model, best, set()
    for base in (best,) + tuple(rest):
        plan = base.plan
        if plan.disk or plan.resident >= m.units or plan.decode.codec("h2d") != "none":
            continue
        for name in candidates("h2d", s.hw)[1:]:
            coded = with_codec(plan, "h2d", name)
            # The codec's GPU buffers (pipeline/memory.h2d_codec_bytes) may cost resident units.
            extra = breakdown(m, s.work, coded).gpu - breakdown(m, s.work, plan).gpu
            resident = max(0, plan.resident - math.ceil(extra / s.unit_bytes)) if plan.resident else 0
            coded = s.place(coded, resident)
            while coded is None and resident > 0:
                resident = max(0, resident - m.layers)
                coded = s.place(with_codec(plan, "h2d", name), resident)
            if coded is None or coded.disk or _key(coded) in tried:
                continue
            tried.add(_key(coded))
            pred = simulate(m, s.work, coded, s.hw, full=full, replay=s.replays(coded), fuse=s.fuses(coded))
            value = objective_value(pred, objective)
            if value < chosen.value:
                note = f"{SOURCE}; h2d codec {name}: {value:.4g} vs {best.value:.4g} without it ({objective})"
                chosen = Scored(coded.with_(source=note), pred, value)
    return chosen


def _reason(s: _Search, best: Scored, rest, objective: str, replay_note: str | None = None) -> str:
    m, plan, rep = s.model, best.plan, best.prediction.report
    parts = []
    if rest:
        gap = rest[0].value / best.value - 1 if best.value else 0.0
        parts.append(f"{gap:.1%} better on {objective} than the runner-up")
    if plan.resident == m.units:
        parts.append("the whole KV cache fits on the GPU")
    else:
        parts.append(f"GPU memory binds: {plan.resident} of {m.units} units resident "
                     f"({fmt_bytes(rep.peak_bytes['gpu'])} of {fmt_bytes(s.budgets['gpu'])})")
    if plan.disk:
        parts.append(f"host memory binds: {plan.disk} units on disk")
    lanes = ", ".join(f"{ph} {rep.critical_lane_of(ph)}" for ph in rep.phase_busy_s if rep.critical_lane_of(ph))
    parts.append(f"critical lane: {lanes}")
    if replay_note:
        parts.append(replay_note)
    if best.prediction.fused:
        c = best.prediction.compile_s
        parts.append("decode fused (one-time compile " + ("time unknown" if c is None else f"{c:.1f} s")
                     + ", not in the total)")
    return "; ".join(parts)
