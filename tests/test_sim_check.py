"""benchmarks/sim_check.py, the simulator-vs-measured check of issue 10 §4, on CPU. Faults caught:
a row set that no longer spans what the issue asks (contexts 4K-128K, groups 1/2/4/8, resident
none/some/all, chunks 2K-32K) or has fewer than 16 rows; a row that does not fit the 24 GB the
GPU run is capped at (it would fail on the device and waste its time); error statistics that mix
prefill and decode, take signed instead of absolute errors, or count rows without a prediction."""
import pytest

from benchmarks.sim_check import GPU_BUDGET, ROWS, errors, plan_of, summary, table
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.report import budget_problems
from kvpipe.pipeline.workload import Workload


def test_rows_span_issue_10():
    units = load_model("llama-3-8b").units
    ctx = [c for c, _, _, _ in ROWS.values()]
    assert len(ROWS) >= 16
    assert min(ctx) == 4096 and max(ctx) >= 131072
    assert {g for _, g, _, _ in ROWS.values()} == {1, 2, 4, 8}
    res = {r for _, _, _, r in ROWS.values()}
    assert 0 in res and units in res and any(0 < r < units for r in res)
    chunks = {c for _, _, c, _ in ROWS.values()}
    assert min(chunks) == 2048 and max(chunks) == 32768


@pytest.mark.parametrize("name", list(ROWS))
def test_every_row_fits_the_gpu_cap(name):
    spec = load_model("llama-3-8b")
    work = Workload(ROWS[name][0], 6, 1)
    plan = plan_of(name)
    plan.check(spec, work)
    assert not budget_problems(breakdown(spec, work, plan), {"gpu": GPU_BUDGET, "host": 10**12, "disk": 0})


def test_error_summary_per_metric():
    res = {"rows": {
        "a": {"measured": {"prefill_s": 1.0, "decode_s_per_token": 0.010},
              "predicted": {"prefill_s": 1.1, "decode_s_per_token": 0.009}},
        "b": {"measured": {"prefill_s": 2.0, "decode_s_per_token": 0.020},
              "predicted": {"prefill_s": 1.5, "decode_s_per_token": 0.020}},
        "c": {"measured": {"prefill_s": 4.0, "decode_s_per_token": 0.040},
              "predicted": {"prefill_s": 4.0, "decode_s_per_token": 0.050}},
        "failed": {"error": "OutOfMemoryError"},
        "unpredicted": {"measured": {"prefill_s": 1.0, "decode_s_per_token": 0.01}, "predicted": {"error": "x"}},
    }}
    e = errors(res)
    assert e["prefill_s"] == pytest.approx([0.1, -0.25, 0.0])
    assert e["decode_s_per_token"] == pytest.approx([-0.1, 0.0, 0.25])
    s = summary(e)
    assert s["prefill_s"] == pytest.approx({"rows": 3, "median_abs": 0.1, "max_abs": 0.25})
    assert s["decode_s_per_token"] == pytest.approx({"rows": 3, "median_abs": 0.1, "max_abs": 0.25})
    lines = table(res)
    assert lines[-2].startswith("prefill_s") and "median |error| 10.0%, max 25.0%" in lines[-2]
    assert any("failed: OutOfMemoryError" in line for line in lines)


def test_first_run_errors_and_spread_beside_the_median():
    """Fault caught: the report judging a repeated row by one of its runs, or dropping the
    first-run comparison with the sessions measured before repeats."""
    res = {"rows": {"a": {"measured": {"prefill_s": 1.0, "decode_s_per_token": 0.010},
                          "repeats": 3, "samples": [{"prefill_s": 2.0, "decode_s_per_token": 0.010},
                                                    {"prefill_s": 1.0, "decode_s_per_token": 0.010},
                                                    {"prefill_s": 0.9, "decode_s_per_token": 0.010}],
                          "predicted": {"prefill_s": 1.1, "decode_s_per_token": 0.010}}}}
    assert errors(res)["prefill_s"] == pytest.approx([0.1])
    assert errors(res, first=True)["prefill_s"] == pytest.approx([-0.45])
    lines = table(res)
    assert "n=3 0.900-2.000" in lines[1]
    assert any("(1st run)" in line and "max 45.0%" in line for line in lines)


def test_repeats_rule():
    """Fault caught: the fixed rule (5 runs to 16K, 3 at 32K, 1 beyond) drifting."""
    from benchmarks.sim_check import repeats_of
    assert [repeats_of(c) for c in (4096, 16384, 32768, 65536, 524288)] == [5, 5, 3, 1, 1]
