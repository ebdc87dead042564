"""--max-error (sim/lossy_choice.py): lossy KV only from an explicit error budget, by the MEASURED
error table (pipeline/lossy_measured.py), which must equal the benchmark JSON it names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe import api
from kvpipe.cli import main
from kvpipe.pipeline.lossy_measured import MEASURED, SOURCE

FIXTURE = Path(__file__).parent / "fixtures" / "lossy-error.json"   # a copy of the SOURCE benchmark file
# 128K on the H200 at 24 GB, everything streamed: PCIe-bound, where quantised KV is predicted faster
KW = dict(model="llama-3-8b", hw="h200", context="128K", gpu_mem="24GB", group=8, resident="none",
          chunk=16384, decode_tokens=4)


@pytest.fixture(scope="module")
def exact_vs_lossy():
    """The same plan predicted exact and with each quantisation forced (--lossy)."""
    return {q: api.plan(**KW, lossy=q).predicted.report.timing.total_s for q in ("int8", "int4")} | \
        {"exact": api.plan(**KW).predicted.report.timing.total_s}


def test_without_a_budget_the_plan_is_exact_even_where_lossy_is_faster(exact_vs_lossy):
    # Fault caught: the planner choosing quantisation on its own (lossy is opt-in: issue 11).
    assert exact_vs_lossy["int4"] < exact_vs_lossy["int8"] < exact_vs_lossy["exact"]   # lossy would win
    res = api.plan(**KW)
    assert res.plan.lossy is None and res.lossy_choice is None
    assert res.to_json()["lossy"] is None


def test_budget_below_int4s_measured_error_never_picks_int4():
    # Fault caught: an option admitted whose measured error exceeds the budget (int4's worse
    # figure is above 0.05), or a choice that does not name the figure and its source.
    assert MEASURED[("int4", 32)].worst > 0.05 >= MEASURED[("int8", 64)].worst
    res = api.plan(**KW, max_error=0.05)
    assert res.plan.lossy is not None and res.plan.lossy.quant == "int8"
    assert "above the budget" in res.lossy_choice and SOURCE in res.lossy_choice
    assert f"{MEASURED[('int4', 32)].worst:.2g}" in res.lossy_choice
    j = res.to_json()
    assert j["lossy"]["quant"] == "int8" and SOURCE in j["lossy"]["basis"]
    assert j["lossy"]["measured_error"]["attn_rel_err"] == MEASURED[("int8", 64)].worst


def test_a_budget_that_admits_both_picks_the_fastest_labelled_lossy(exact_vs_lossy, capsys):
    # Faults caught: a pick that is not the predicted best, or not labelled LOSSY as --lossy is; the
    # exact search's "why" (e.g. "decode fused", which lossy decode never is) shown as the lossy plan's.
    res = api.plan(**KW, max_error=0.5)
    assert res.plan.lossy.quant == "int4"
    assert res.predicted.report.timing.total_s == pytest.approx(exact_vs_lossy["int4"], rel=1e-9)
    assert main(["plan", "--context", "128K", "--hw", "h200", "--gpu-mem", "24GB", "--group", "8", "--resident",
                 "none", "--chunk", "16384", "--decode-tokens", "4", "--max-error", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvpipe plan: LOSSY (int4") and "lossy choice: --max-error 0.5: int4 chosen" in out
    assert "why (the exact plan, before the lossy option): " in out


def test_a_budget_below_every_measured_error_stays_exact():
    # Fault caught: falling back to the least-bad lossy option when none is within the budget.
    res = api.plan(**KW, max_error=1e-4)
    assert res.plan.lossy is None and "exact chosen" in res.lossy_choice


def test_the_measured_table_equals_the_benchmark_json_it_names():
    # Fault caught: figures typed in by hand (a guess) or left behind when the benchmark re-ran.
    doc = json.loads((FIXTURE).read_text())
    for (quant, group), m in MEASURED.items():
        name = f"{quant} (group {group})"
        assert doc["rows"][name]["kind"] == "kvpipe"
        assert m.needle == pytest.approx(doc["rows"][name]["rel_err_mean"], rel=1e-3)
        assert m.probe == pytest.approx(doc["probe"]["rows"][name]["rel_err_mean"], rel=1e-3)


@pytest.mark.parametrize("extra", [["--max-error", "0"], ["--max-error", "-1"], ["--max-error", "1.5"],
                                   ["--max-error", "nan"], ["--max-error", "0.1", "--lossy", "int4"]])
def test_bad_max_error_is_one_line_exit_2(extra, capsys):
    # Fault caught: a budget of 0 / negative / >= 1 / NaN accepted, or --max-error combined with an
    # explicit --lossy (ambiguous), or a traceback instead of one line naming the flag.
    assert main(["plan", "--context", "8K", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max-error" in err[0]


def test_run_takes_the_budget_too_and_without_it_stays_exact(tmp_path_factory, capsys):
    # Fault caught: `kvpipe run` ignoring --max-error (no choice made or reported), or picking a
    # lossy option without it. Tiny model on the CPU: which option wins is the simulator's call;
    # the pick, whatever it is, must be within the budget and say so.
    from conftest import write_config
    cfg = write_config(tmp_path_factory, head_dim=32)
    common = ["run", "--device", "cpu", "--no-progress", "--json", "--model", cfg, "--random-weights",
              "--context", "96", "--decode-tokens", "2", "--chunk", "32", "--resident", "none", "--group", "1"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["lossy"] is None and plain["lossy_choice"] is None
    assert main(common + ["--max-error", "0.05"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["lossy_choice"].startswith("--max-error 0.05: ")
    assert j["lossy"] is None or (j["lossy"]["quant"] == "int8" and SOURCE in j["lossy"]["basis"])


def test_no_lossy_pick_over_a_codec_or_when_the_caller_refuses():
    # Fault caught: int8 picked over a plan with a lossless codec on a link (the run then refuses
    # the combination), or over a caller's refusal (--replay on); the reason must be shown.
    from dataclasses import replace

    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.sim.lossy_choice import choose_lossy, excluded

    class Pred:      # the two things choose_lossy reads of a prediction; lossy predicted faster
        def __init__(self, plan):
            self.plan, self.problems = plan, ()
            t = 1.0 if plan.lossy is None else 0.5
            self.report = type("R", (), {"timing": type("T", (), {"total_s": t, "ttft_s": t,
                                                                   "decode_s_per_token": t})()})()
    base = Plan(Method.HEADWISE, PhasePlan(8, 2048), PhasePlan(8, 1), 0)
    assert excluded(base) is None and choose_lossy(base, 0.05, "total", Pred)[1].chosen == "int8"
    coded = replace(base, decode=replace(base.decode, codecs=(("h2d", "nvcomp-ans-planes"), ("d2h", "none"),
                                                               ("disk", "none"))))
    best, choice = choose_lossy(coded, 0.05, "total", Pred)
    assert best.plan.lossy is None and "not with a codec on a link" in choice.describe()
    best, choice = choose_lossy(base, 0.05, "total", Pred, refuse="not with --replay on")
    assert best.plan.lossy is None and "not with --replay on" in choice.describe()
