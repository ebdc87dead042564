"""The one place that decides: from what was asked (`Request`) and what will run it (`Target`),
the plan and its prediction (`Decision`). A head-wise plan without a plan file comes from the
planner's search (sim/planner.py), any other from its method's rule (pipeline/rules.py) or the
file; --disk and --codec apply over it (sim/codec_choice.py); the replay setting holds where the
search did not choose (`apply_replay`); a LOSSY opt-in or a --max-error choice comes last
(sim/lossy_choice.py). The executor runs `Decision.plan` and never chooses again."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvpipe.pipeline.fusion import decode_fused, refuse_unfusable
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import ALL_ON_GPU, Method, Plan, decode_replayed
from kvpipe.pipeline.replay import Replay, blocker
from kvpipe.pipeline.report import budget_problems
from kvpipe.pipeline.workload import Workload

from .codec_choice import with_tiers
from .lossy_choice import LossyChoice, choose_lossy, lossy_opt_in
from .planner import Pins, PlannerResult, search
from .predicted import Predicted
from .simulate import simulate


@dataclass(frozen=True)
class Request:
    """What the user asked, parsed (kvpipe/options.py builds it): None leaves a knob to the planner
    or the method's rule."""

    method: Method | None = None        # None: headwise, or the plan file's
    group: int | None = None            # KV heads per streamed group
    chunk: int | None = None            # prefill chunk (tokens)
    resident: int | str | None = None   # units kept on the GPU: a count, or "max" (as many as fit)
    plan: Plan | None = None            # a given plan: replaces the search and the rule
    disk: int | None = None             # offloaded units on disk; None: what host RAM cannot hold
    codecs: tuple[tuple[str, str], ...] = ()   # (link, codec); codec "auto": the simulator picks
    objective: str = "total"            # what the planner minimises (sim/planner.OBJECTIVES), on a `quantile` run
    full: bool = False                  # simulate every prefill chunk and decode step
    lossy: str | None = None            # LOSSY opt-in: "int8" or "int4"
    sparse: float | None = None         # LOSSY opt-in: the fraction of offloaded tokens per decode step
    max_error: float | None = None      # LOSSY only within this attention-output error budget
    fuse: str = "auto"                  # pipeline/fusion.MODES
    replay: Replay = Replay.AUTO        # the user's setting
    quantile: str = "p90"               # rank on a median (p50) or a slow run (p90; pipeline/hardware.QUANTILES)

    @property
    def searches(self) -> bool:
        """Head-wise plans without a plan file come from the planner; the others from their rule."""
        return self.plan is None and (self.method or Method.HEADWISE) is Method.HEADWISE

    @property
    def opted_lossy(self) -> bool:
        return self.lossy is not None or self.sparse is not None


@dataclass(frozen=True)
class Target:
    """What will run the plan: `kvpipe plan` predicts a CUDA GPU; `kvpipe run` says what this
    machine can do."""

    device: str = "cuda"       # "cuda" or "cpu" (pipeline/replay.shape_blocker)
    h2d_codecs: bool = True    # a GPU codec can run on the h2d link (CUDA and nvCOMP)


@dataclass(frozen=True)
class Decision:
    """The handoff to the executor: the plan to run with its prediction, and how it was chosen."""

    predicted: Predicted
    search: PlannerResult | None = None   # the planner's result where it chose the plan
    lossy_choice: LossyChoice | None = None   # --max-error: the options and the pick

    @property
    def plan(self) -> Plan:
        return self.predicted.plan


def decide(model: ModelSpec, work: Workload, hw: HardwareProfile, budgets: dict[str, int], req: Request,
           target: Target = Target(), memo=None) -> Decision:
    """The plan `req` asks for on `target`, predicted. The search ranks exact plans; a LOSSY
    opt-in goes over the exact choice (searched again where its bytes do not fit); --max-error
    picks among exact and the lossy options by measured error. ValueError names a refused input.
    `memo`: a sim/memo.SimMemo kept across calls for one model and profile (other budgets)."""
    pin = replay_pin(model, work, req.replay, target)
    choose = lambda b: _choose(model, work, hw, b, req, target, pin, memo)   # noqa: E731
    pred, found = choose(budgets)
    if req.opted_lossy:   # explicit opt-in only, over the exact plan
        spec = LossySpec(req.lossy, sparse=req.sparse)
        plan, again = lossy_opt_in(model, work, budgets, pred.plan, spec, choose if req.searches else None, pin)
        found = again or found
        pred = predict(model, work, plan, hw, budgets, req, target)
    choice = None
    if req.max_error is not None:   # LOSSY only from the explicit budget, by measured error
        exact = pred
        unfused = "auto" if req.fuse == "on" else req.fuse   # a candidate that cannot fuse is predicted unfused

        def candidate(p: Plan) -> Predicted:
            return exact if p is exact.plan else predict(model, work, p, hw, budgets, req, target, fuse=unfused)
        refuse = "not with --replay on (the lossy choice runs under --replay auto)" if req.replay is Replay.ON else None
        pred, choice = choose_lossy(exact.plan, req.max_error, req.objective, candidate, refuse=refuse, replay=pin,
                                    quantile=req.quantile, context=work.context)
    if req.replay is Replay.ON and pred.plan.replay_blocker:
        raise ValueError(f"replay: {pred.plan.replay_blocker}; use --replay off or auto")
    return Decision(pred, found, choice)


def predict(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, budgets: dict[str, int],
            req: Request, target: Target = Target(), *, pred=None, fuse: str | None = None,
            replayed: bool | None = None, slow=None, memo=None) -> Predicted:
    """`plan` simulated as `target` runs it: decode replayed as its replay choice or the rule
    says (`replayed` overrides: what a run reported it did), fused under `fuse` (default the
    request's; `on` refused where decode is not replayed); on a median run and, where the profile
    knows the host's spread, on a slow one (`Predicted.p90`). `pred` / `slow`: the planner's
    simulation of it on a median / slow run."""
    fuse = req.fuse if fuse is None else fuse
    plan.check(model, work)
    problems = tuple(budget_problems(breakdown(model, work, plan), budgets))
    if replayed is None:
        replayed = decode_replayed(model, work, plan, target.device)
    refuse_unfusable(fuse, replayed)
    sim = simulate if memo is None else memo.simulate
    run = lambda h: sim(model, work, plan, h, full=req.full, replay=replayed, fuse=decode_fused(fuse, replayed, model.family))  # noqa: E731
    pred = pred or run(hw)
    p90 = (slow or run(hw.at_quantile("p90"))).report.timing if hw.host_issue_p90 > 1 else None
    return Predicted(plan, problems, pred.report, pred.trace, None, pred.fused, pred.compile_s, p90)


def _choose(model, work, hw, budgets, req: Request, target: Target, pin: Replay,
            memo=None) -> tuple[Predicted, object]:
    """(the exact plan's prediction, the planner's result or None). --disk/--codec are not
    dimensions of the search: given, they apply over the planner's plan, simulated again."""
    if req.searches:
        pins = replace(pins_of(req), replay=pin)
        h2d = target.h2d_codecs and not req.opted_lossy and not any(link == "h2d" for link, _ in req.codecs)
        found = search(model, work, hw, budgets, pins, req.objective, full=req.full, h2d_codecs=h2d, fuse=req.fuse,
                       quantile=req.quantile, memo=memo)
        ranked = hw.at_quantile(req.quantile)   # the run the search simulated its plans on
        if req.disk is None and not req.codecs:
            sim = found.best.prediction
            return predict(model, work, found.best.plan, hw, budgets, req, target, pred=sim if ranked is hw else None,
                           slow=sim if ranked is not hw else None, memo=memo), found
        plan = found.best.plan
    else:
        plan, found = rule_plan(model, work, budgets, req), None
    plan = with_tiers(model, work, plan, hw, req.disk, req.codecs)
    plan = apply_replay(model, work, plan, req.replay, target)
    return predict(model, work, plan, hw, budgets, req, target), found


def pins_of(req: Request) -> Pins:
    """The knobs the user gave as the planner's pins (`max` resident is what the search does anyway)."""
    return Pins(req.group, req.chunk, None if req.resident == "max" else req.resident)


def rule_plan(model: ModelSpec, work: Workload, budgets: dict[str, int], req: Request) -> Plan:
    """The given plan as is, or the method's rule plan with the user's knobs applied (`max`
    resident: as many as fit), then the fewest disk units its host budget allows."""
    from kvpipe.pipeline.rules import default_plan, max_resident, spill_to_disk
    if req.plan is not None:
        return req.plan
    method = req.method or Method.HEADWISE
    rule = default_plan(method, model, work, budgets)
    g, c, r = req.group, req.chunk, req.resident
    if g is None and c is None and r is None:
        return rule
    pre, dec = rule.prefill, rule.decode
    if g is not None:
        pre, dec = replace(pre, group=g), replace(dec, group=g)
    if c is not None:
        pre = replace(pre, chunk=c)
    out = rule.with_(prefill=pre, decode=dec, resident=rule.resident if r in (None, "max") else r,
                     source="user knobs over " + rule.source)
    if r == "max" and method not in ALL_ON_GPU:
        out = max_resident(model, work, out, budgets["gpu"])
    return spill_to_disk(model, work, out, budgets["host"]) if out.resident < model.units else out.with_(disk=0)


def replay_pin(model: ModelSpec, work: Workload, setting: Replay, target: Target) -> Replay:
    """The replay the search and a given plan are held to: the user's setting; under auto, off
    where the target's device cannot replay at all (kvpipe run on a CPU); on is refused there."""
    if target.device == "cuda" or setting is Replay.OFF:
        return setting
    if setting is Replay.ON:
        raise ValueError(f"replay: on, but {blocker(model, work, None, target.device)}; use --replay off or auto")
    return Replay.OFF


def apply_replay(model: ModelSpec, work: Workload, plan: Plan, setting: Replay, target: Target = Target()) -> Plan:
    """The replay setting over a plan the search did not choose (a rule's, a plan file's, or one
    the user's --disk/--codec changed): refused where the plan says otherwise (its own choice) or
    cannot replay (on); a plan (file) whose replay true cannot run on the target is refused,
    naming it. Plans that can replay on a CUDA GPU take the pin; the others keep AUTO."""
    why = blocker(model, work, plan) if work.decode_tokens else None   # on a CUDA GPU
    here = blocker(model, work, plan, target.device) if work.decode_tokens else None
    if setting is Replay.AUTO and plan.replay is Replay.ON and here:
        where = "" if target.device == "cuda" else f" ({target.device}); set it to false or null in the plan file, or give --replay off"
        raise ValueError(f"plan.replay: true, but {here}" + (where or "; set it to false or null"))
    pin = replay_pin(model, work, setting, target)
    if pin is Replay.AUTO:
        return plan
    if plan.replay is not Replay.AUTO and plan.replay is not pin:
        raise ValueError(f"replay: {pin.value} disagrees with the plan's replay "
                         f"{str(plan.replay.to_json()).lower()}; drop --replay or edit the plan file")
    if pin is Replay.ON and why:
        raise ValueError(f"replay: on, but {why}; use --replay off or auto")
    return plan.with_(replay=pin if why is None and work.decode_tokens else Replay.AUTO)


def max_context(model: ModelSpec, work: Workload, budgets: dict[str, int], req: Request) -> int:
    """Largest prompt that fits: over the planner's space for head-wise, the rule's plan otherwise."""
    if req.searches:
        from .planner import max_context as searched
        return searched(model, work.decode_tokens, work.batch, budgets, pins_of(req))
    from kvpipe.pipeline.rules import max_context as ruled
    method = req.plan.method if req.plan is not None else (req.method or Method.HEADWISE)
    return ruled(method, model, work.decode_tokens, work.batch, budgets)


def compare(model: ModelSpec, work: Workload, hw: HardwareProfile, budgets: dict[str, int], req: Request,
            chosen: Predicted) -> dict[str, Predicted]:
    """Every method side by side: the chosen plan for its own method, each other method's rule
    plan (replayed where it can be, unless --replay off), each with its largest context."""
    out = {}
    for m in Method:
        other = Request(m, objective=req.objective, quantile=req.quantile, full=req.full, fuse=req.fuse,
                        replay=Replay.OFF if req.replay is Replay.OFF else Replay.AUTO)
        pred = chosen if m is chosen.plan.method else _choose(model, work, hw, budgets, other, Target(), other.replay)[0]
        ctx = max_context(model, work, budgets, req if m is chosen.plan.method else other)
        out[m.value] = replace(pred, max_context=ctx)
    return out
