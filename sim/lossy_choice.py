"""Lossy KV chosen only from an explicit error budget (`--max-error REL`): the exact plan and the
same plan with each quantisation whose MEASURED error (pipeline/lossy_measured.py, from
benchmarks/lossy_error.py) is within the budget are predicted, and the best on the objective that
fits wins; ties go to exact. Without a budget nothing here runs and no plan is ever lossy
unless the user opts in with --lossy. A pick carries its basis (budget, figure, source), so it
is labelled LOSSY wherever --lossy would be."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvpipe.pipeline.lossy import DEFAULT_GROUP, QUANT_BITS, LossySpec
from kvpipe.pipeline.lossy_measured import MEASURED
from kvpipe.pipeline.plan import Plan

from .planner import objective_value


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


def admitted(max_error: float) -> list[tuple[str, LossySpec | None, str]]:
    """(option, spec or None for exact, verdict) for exact and every quantisation."""
    out = [("exact", None, "exact")]
    for quant in QUANT_BITS:
        m = MEASURED.get((quant, DEFAULT_GROUP[quant]))
        if m is None:
            out.append((quant, None, "no measured error: not a candidate"))
        elif m.worst > max_error:
            out.append((quant, None, f"above the budget ({m.describe()})"))
        else:
            basis = f"chosen under --max-error {max_error:g}: {m.describe()}"
            out.append((quant, LossySpec(quant, error=(("attn_rel_err", m.worst),), basis=basis), "within the budget"))
    return out


def excluded(plan: Plan) -> str | None:
    """Why no quantisation can run over `plan` (a codec on a link: quantised records cross the
    links as they are), or None."""
    if any(name != "none" for pp in (plan.prefill, plan.decode) for _, name in pp.codecs):
        return "not with a codec on a link"
    return None


def choose_lossy(plan: Plan, max_error: float, objective: str, predict: Callable,
                 refuse: str | None = None) -> tuple[object, LossyChoice]:
    """The best of `plan` (exact) and its admitted lossy variants. `predict(plan)` returns an
    object with `problems` (budget misses) and the simulator's `report` (api._predict).
    `refuse`: why the caller cannot run a lossy plan at all (e.g. --replay on), or None."""
    max_error = check_budget(max_error)
    refuse = refuse or excluded(plan)
    best, best_v, rows = None, math.inf, []
    for name, spec, verdict in admitted(max_error):
        if name != "exact" and spec is not None and refuse:
            spec, verdict = None, refuse
        if name != "exact" and spec is None:
            m = MEASURED.get((name, DEFAULT_GROUP[name]))
            rows.append((name, m.worst if m else None, verdict))
            continue
        pred = predict(plan if spec is None else plan.with_(lossy=spec))
        v = objective_value(pred, objective)
        m = MEASURED.get((name, DEFAULT_GROUP.get(name)))
        fits = not pred.problems
        rows.append((name, m.worst if m else None, f"predicted {objective} {v:.3g} s" + ("" if fits else ", does not fit")))
        if fits and v < best_v * (1 - 1e-9):     # strictly better than exact (first) to pick lossy
            best, best_v = pred, v
    if best is None:   # nothing fits: keep the exact prediction (its problems are reported as usual)
        best = predict(plan)
    chosen = best.plan.lossy.quant if best.plan.lossy else None
    return best, LossyChoice(max_error, tuple(rows), chosen)
