"""The trained-model figures of the --max-error table (pipeline/lossy_measured.py MODEL, SmolLM2-135M
on a needle in a haystack of prose, benchmarks/lossy_needle.py): equal to the benchmark JSON they
name (tests/fixtures/lossy-needle.json, a copy of MODEL_SOURCE), that JSON's summary equal to its own
prompts (recomputed here), every measured planner option carrying its figure, and --max-error
budgeting the worst of an option's three figures."""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from kvpipe.pipeline.lossy_measured import MEASURED, MODEL, MODEL_EXACT_ACCURACY, MODEL_SOURCE, MeasuredError
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.sim import lossy_choice

ROOT = Path(__file__).parent
FIXTURE = ROOT / "fixtures" / "lossy-needle.json"   # a copy of MODEL_SOURCE
DOC = json.loads(FIXTURE.read_text())


def test_the_fixture_is_the_benchmark_file_the_table_names():
    """Fault caught: the table naming a file the fixture is not a copy of (a re-run left behind)."""
    assert json.loads((ROOT.parent / MODEL_SOURCE).read_text()) == DOC


def test_the_summary_is_its_prompts():
    """Faults caught: needle accuracy counted over another set of prompts than the runs, token
    agreement not position by position against the exact run, or a hit that is not the needle's
    code in the answer."""
    prompts = DOC["prompts"]
    assert 0 < len(prompts) <= DOC["config"]["count"]
    for name, s in DOC["summary"].items():
        rows = [p["options"][name] for p in prompts]
        assert s["prompts"] == len(prompts)
        assert all(r["hit"] == (p["code"] in r["text"]) for r, p in zip(rows, prompts))
        assert s["needle_accuracy"] == pytest.approx(sum(r["hit"] for r in rows) / len(rows))
        if name != "exact":
            agree = [sum(a == b for a, b in zip(p["options"]["exact"]["tokens"], r["tokens"]))
                     / len(p["options"]["exact"]["tokens"]) for r, p in zip(rows, prompts)]
            assert s["token_agreement"] == pytest.approx(statistics.fmean(agree))


def test_every_table_row_carries_the_figure_measured_for_it():
    """Faults caught: a trained-model figure typed in by hand or left behind, taken from another
    option's row, or a measured option's figure left out of the table (the planner would budget it
    by the synthetic figures alone)."""
    summary = DOC["summary"]
    assert MODEL_EXACT_ACCURACY == pytest.approx(summary["exact"]["needle_accuracy"])
    for row, (err, acc) in MODEL.items():
        assert err == pytest.approx(summary[row]["attn_rel_err"], rel=1e-3)
        assert acc == pytest.approx(summary[row]["needle_accuracy"])
    for opt in lossy_choice.options():   # the planner's option names are the benchmark's
        expect = opt.name if opt.name in summary else None
        m = opt.measured
        assert (m.model_row, m.model is not None) == (expect, expect is not None), opt.name
        if expect:
            assert (m.model, m.accuracy, m.model_source) == (*MODEL[expect], MODEL_SOURCE)


def test_worst_is_the_largest_of_the_three_figures():
    """Fault caught: the trained-model figure left out of `worst` (an option admitted by its
    synthetic figures while the trained model measured it above the budget)."""
    m = MeasuredError("x", needle=0.01, probe=0.02, model=0.3, accuracy=0.5)
    assert m.worst == 0.3 and MODEL_SOURCE in m.describe() and "needle accuracy 50%" in m.describe()
    assert replace(m, model=None, accuracy=None).worst == 0.02


class _Pred:
    def __init__(self, plan):
        self.plan, self.problems = plan, ()
        t = 0.5 if plan.lossy is not None else 1.0          # every lossy option faster than exact
        self.report = type("R", (), {"timing": type("T", (), {"total_s": t})()})()


def test_max_error_keeps_out_an_option_the_trained_model_puts_above_the_budget(monkeypatch):
    """Fault caught: --max-error admitting int8 by its synthetic figures (0.0093) where its
    trained-model figure (set here to 0.05) is above a 0.02 budget."""
    plan = Plan(Method.HEADWISE, PhasePlan(8, 2048), PhasePlan(8, 1), 0)
    int8 = MEASURED[("int8", 64)]
    monkeypatch.setitem(lossy_choice.MEASURED, ("int8", 64), replace(int8, model=0.05, accuracy=1.0))
    _, choice = lossy_choice.choose_lossy(plan, 0.02, "total", _Pred, context=131072)
    assert choice.chosen is None and "above the budget" in dict((n, v) for n, _, v in choice.rows)["int8"]
    monkeypatch.setitem(lossy_choice.MEASURED, ("int8", 64), replace(int8, model=0.01, accuracy=1.0))
    _, choice = lossy_choice.choose_lossy(plan, 0.02, "total", _Pred, context=131072)
    assert choice.chosen == "int8"
