"""Lossy KV chosen only from an explicit error budget (`--max-error REL`): the exact plan, the same
plan with each quantisation, and the same plan with each sparse-decode fraction whose MEASURED error
(pipeline/lossy_measured.py) is within the budget are predicted,
and the best on the objective that fits wins; ties go to exact, then to the smaller error. Sparse
with quantisation at once (whole quantised blocks selected) is a candidate too, by its own measured
error; sparse is not a candidate where the run could not execute it: disk units or a codec on a
link (executor/sparse/homes.py).
Without a budget nothing here runs and no plan is ever lossy unless the user opts in with --lossy
or --sparse. A pick carries its basis (budget, figures, sources), so it is labelled LOSSY wherever
--lossy would be. `lossy_opt_in` puts the explicit opt-in over the exact plan, searching again where
its GPU bytes do not fit."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpipe.pipeline.lossy import DEFAULT_GROUP, QUANT_BITS, LossySpec
from kvpipe.pipeline.lossy_measured import (MEASURED, SPARSE_MEASURED, SPARSE_QUANT_MEASURED, SPARSE_SKETCH,
                                            MeasuredError)
from kvpipe.pipeline.memory import breakdown, gpu_usable
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.units import fmt_bytes
from kvpipe.pipeline.workload import Workload

from .planner import NoPlanFits, objective_value

RESEARCHES = 3   # searches again with the lossy option's bytes off the GPU budget, at most


def check_budget(max_error) -> float:
    """The budget as a float in (0, 1), or ValueError naming --max-error."""
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not 0 < max_error < 1 \
            or not math.isfinite(max_error):
        raise ValueError(f"max-error: an attention-output relative error in (0, 1), got {max_error!r}")
    return float(max_error)


@dataclass(frozen=True)
class LossyChoice:
    """The budget, each option with its measured error and verdict, and the pick (None: exact)."""

    max_error: float
    rows: tuple[tuple[str, float | None, str], ...]    # (option, measured error or None, verdict)
    chosen: str | None

    def describe(self) -> str:
        rows = "; ".join(f"{name}{'' if err is None else f' (error {err:.2g})'}: {verdict}"
                         for name, err, verdict in self.rows)
        pick = self.chosen or "exact"
        return f"--max-error {self.max_error:g}: {pick} chosen ({rows})"


@dataclass(frozen=True)
class Option:
    """One lossy candidate: its name in the choice, what it measured, and the spec it runs as."""

    name: str
    measured: MeasuredError
    quant: str | None = None
    sparse: float | None = None

    def spec(self, max_error: float) -> LossySpec:
        basis = f"chosen under --max-error {max_error:g}: {self.measured.describe()}"
        err = (("attn_rel_err", self.measured.worst), ("needle_rel_err", self.measured.needle),
               ("probe_rel_err", self.measured.probe))
        if self.sparse is None:
            return LossySpec(self.quant, error=err, basis=basis)
        return LossySpec(self.quant, sparse=self.sparse, sketch=SPARSE_SKETCH, error=err, basis=basis)


def sparse_name(fraction: float) -> str:
    return f"sparse {fraction:.0%}"


def options() -> list[Option]:
    """Every lossy option with a measured error: each quantisation, each sparse fraction, then each
    sparse fraction with a quantisation."""
    out = [Option(q, MEASURED[(q, DEFAULT_GROUP[q])], quant=q) for q in QUANT_BITS if (q, DEFAULT_GROUP[q]) in MEASURED]
    out += [Option(sparse_name(f), m, sparse=f) for f, m in sorted(SPARSE_MEASURED.items())]
    return out + [Option(f"{sparse_name(f)} + {q}", m, quant=q, sparse=f)
                  for (f, q), m in sorted(SPARSE_QUANT_MEASURED.items())]


def excluded(plan: Plan, option: Option | None = None) -> str | None:
    """Why `option` (any lossy option if None) cannot run over `plan`, or None: quantised records
    and sparse gathers cross the links as they are (no codec on a link), and sparse decode reads
    every offloaded unit from host RAM (no disk units; executor/sparse/homes.py)."""
    if any(name != "none" for pp in (plan.prefill, plan.decode) for _, name in pp.codecs):
        return "not with a codec on a link"
    if option is not None and option.sparse is not None and plan.disk:
        return "not with disk units (sparse decode reads every offloaded unit from host RAM)"
    return None


def choose_lossy(plan: Plan, max_error: float, objective: str, predict: Callable,
                 refuse: str | None = None, replay: Replay = Replay.AUTO,
                 quantile: str = "p50") -> tuple[object, LossyChoice]:
    """The best of `plan` (exact) and its admitted lossy variants. `predict(plan)` returns an
    object with `problems` (budget misses) and the simulator's `report` (sim/decide.predict).
    `refuse`: why the caller cannot run a lossy plan at all (e.g. --replay on), or None.
    `replay`: the --replay pin; each candidate's replay choice is made again (Plan.with_lossy).
    Candidates are tried exact first, then by measured error (smallest first), and one replaces
    the best so far only when strictly faster: ties go to exact, then to the smaller error.
    `quantile`: the run the objective is ranked on (Predicted.timing_at)."""
    max_error = check_budget(max_error)
    rows: dict[str, tuple[str, float | None, str]] = {}
    tried: list[tuple[str, Plan, float | None]] = [("exact", plan, None)]
    for opt in options():
        why = refuse or excluded(plan, opt)
        if opt.measured.worst > max_error:
            rows[opt.name] = (opt.name, opt.measured.worst, f"above the budget ({opt.measured.describe()})")
        elif why:
            rows[opt.name] = (opt.name, opt.measured.worst, why)
        else:
            tried.append((opt.name, plan.with_lossy(opt.spec(max_error), replay), opt.measured.worst))
    best, best_v, pick = None, math.inf, None
    for name, p, err in sorted(tried, key=lambda t: -1.0 if t[2] is None else t[2]):
        pred = predict(p)
        v = objective_value(pred, objective, quantile)
        fits = not pred.problems
        rows[name] = (name, err, f"predicted {objective} {v:.3g} s" + ("" if fits else ", does not fit"))
        if fits and v < best_v * (1 - 1e-9):     # strictly better than all before it
            best, best_v, pick = pred, v, (None if name == "exact" else name)
    if best is None:   # nothing fits: keep the exact prediction (its problems are reported as usual)
        best, pick = predict(plan), None
    order = ["exact"] + [o.name for o in options()]
    return best, LossyChoice(max_error, tuple(rows[n] for n in order if n in rows), pick)


def lossy_opt_in(model: ModelSpec, work: Workload, budgets: dict[str, int], exact: Plan, spec: LossySpec,
                 rechoose: Callable | None, pin: Replay = Replay.AUTO) -> tuple[Plan, object]:
    """The exact plan `exact` with the LOSSY opt-in `spec` on, and the planner's result where it
    searched again (else None). The search ranks exact plans; the lossy GPU bytes (the sparse
    sketch and chunk summaries, quantised byte slots) come on top, so a plan that fit exact may not
    fit lossy. Where the planner chose the plan (`rechoose`: budgets -> (prediction, planner
    result); None where the user gave the plan) and the lossy plan does not fit, it searches again
    with the GPU budget less those bytes, up to RESEARCHES times, and keeps the first plan that
    fits with them; if none does, the original, which then reports "fits: NO" (plan) or is
    refused (run). Where the planner chose, the replay choice is made again (`Plan.with_lossy`,
    `pin` the --replay pin): an exact decode at the PCIe floor hides the host's issue cost, a
    sparse one moves a fraction of the bytes and is host-bound unless replayed. A user's plan
    keeps its own."""
    if rechoose is None:
        return exact.with_(lossy=spec), None
    plan, extra, found = exact.with_lossy(spec, pin), 0, None
    for _ in range(RESEARCHES):
        lossy_gpu = breakdown(model, work, exact.with_(lossy=spec)).gpu
        if lossy_gpu <= gpu_usable(budgets["gpu"]):   # fits with the allocator's allowance
            return exact.with_lossy(spec, pin), found
        extra = max(extra, lossy_gpu - breakdown(model, work, exact).gpu)   # what the lossy option adds
        try:
            again, found = rechoose(dict(budgets, gpu=budgets["gpu"] - extra))
        except NoPlanFits:
            break
        exact = again.plan
        if found is not None:
            found = replace(found, reason=f"{found.reason}; searched with the GPU budget less the lossy "
                                          f"option's {fmt_bytes(extra)} (summaries, sketch or byte slots)")
    return plan, None
