"""benchmarks/regret_plans.py: the rows the planner-regret benchmark measures (issue 10 §4)."""
from dataclasses import replace

import pytest

import kvpipe
from benchmarks.regret_plans import WORKLOADS, candidates, fits
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.workload import Workload

BUDGETS = {"gpu": 24_000_000_000, "host": 125 * 2**30, "disk": 0}


@pytest.fixture(scope="module")
def rows_8k():
    ctx, d = WORKLOADS["8K"]
    return candidates(load_model("llama-3-8b"), Workload(ctx, d, 1), load_profile("h200"), BUDGETS)


def test_the_pick_is_the_plan_kvpipe_chooses_for_the_same_workload(rows_8k):
    """Fault caught: the benchmark measuring a pick the user's command would not choose (another
    objective, decode count or budget than `kvpipe plan/run --objective total` uses). run never
    tries an h2d codec by itself; plan does, but the h200 profile rates none, so both choose alike."""
    ctx, d = WORKLOADS["8K"]
    res = kvpipe.plan(model="llama-3-8b", hw="h200", context=ctx, decode_tokens=d, gpu_mem=BUDGETS["gpu"],
                      host_mem=BUDGETS["host"], objective="total")
    pick = rows_8k[0]
    assert pick.label == "planner pick" and pick.rank == 0
    assert replace(pick.plan, source="") == replace(res.plan, source="")


def test_at_least_eight_distinct_fitting_others_spanning_the_knobs(rows_8k):
    """Fault caught: a regret set too small for the issue (the pick and >= 8 other plans), with
    repeats (one plan measured twice counts once), with plans over the budget (they would be
    refused, not measured), or missing a dimension (group, chunk, resident, replay)."""
    spec, work = load_model("llama-3-8b"), Workload(*WORKLOADS["8K"], 1)
    others = rows_8k[1:]
    assert len(others) >= 8
    assert len({c.key() for c in rows_8k}) == len(rows_8k)
    assert all(fits(spec, work, c.plan, BUDGETS) for c in rows_8k)
    pick = rows_8k[0].plan
    assert {c.plan.decode.group for c in others} - {pick.decode.group}
    assert {c.plan.prefill.chunk for c in others} - {pick.prefill.chunk}
    assert {c.plan.resident for c in others} - {pick.resident}
    assert any(c.replay == "off" for c in others)
    ranks = [c.rank for c in rows_8k]
    assert ranks == list(range(len(rows_8k)))
    hand = [c.predicted["total_s"] for c in rows_8k if c.how != "the planner"]
    assert hand == sorted(hand)   # the strongest hand-chosen contenders are measured first
