"""An explicit lossy opt-in over the planner's plan must still fit the GPU budget where a plan can:
the search ranks exact plans, and the lossy option's GPU bytes (sparse: the token sketch and the
chunk summaries, 5.0 GiB at 512K for Llama-3-8B) come on top (sim/lossy_choice.lossy_opt_in). Torch-free
(`kvpipe plan` on the bundled profile); the fitting figures are the memory model's own bytes,
checked here against the budget, not against a helper."""
from kvpipe import api

GiB = 1 << 30
BUDGET = "24GB"          # the 24 GB card of the issue: 22.35 GiB


def sparse_plan(**pins):
    return api.plan(model="llama-3-8b", context="512K", hw="h200-testbox", gpu_mem=BUDGET, resident="none",
                    decode_tokens=2, sparse=0.2, **pins)


def test_sparse_at_512k_is_searched_again_until_it_fits():
    """Fault caught: the sparse option laid over the exact winner (prefill group 4, chunk 16384:
    19.1 GiB exact, 24.1 GiB with the summaries) and reported "fits: NO" although smaller
    prefill groups and chunks fit with the summaries on."""
    res = sparse_plan()
    p = res.predicted
    assert p.plan.lossy is not None and p.plan.lossy.sparse == 0.2
    assert p.problems == ()
    assert p.report.peak_bytes["gpu"] <= 24e9
    assert "less the lossy option's" in res.search.reason
    # the summaries really are counted: the same plan without the lossy option is >= 5 GiB smaller
    from kvpipe.pipeline.memory import breakdown
    exact = breakdown(res.model, res.workload, p.plan.with_(lossy=None)).gpu
    assert breakdown(res.model, res.workload, p.plan).gpu - exact >= 5 * GiB


def test_a_plan_the_user_pinned_is_not_changed_to_fit():
    """Fault caught: the re-search overriding the user's --group/--chunk; a pinned plan that does
    not fit with the lossy option stays as given and says it does not fit."""
    res = sparse_plan(group=8, chunk=16384)
    p = res.predicted
    assert (p.plan.prefill.group, p.plan.prefill.chunk, p.plan.decode.group) == (8, 16384, 8)
    assert any(line.startswith("gpu needs") for line in p.problems)
