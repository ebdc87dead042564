"""The simulator's host (sim/engine.py): issuing a stage costs the host time, so where the GPU's
share of a step is small the host binds; graph replay replaces a step's issue by one replay; the
launch queue bounds how far the host runs ahead; a replayed step starts after the previous one's
write-backs. Also the least-squares fit behind the profile's host figures (executor/calibrate/host_issue.fit)."""
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.cost import host_issue_seconds, stage_small_seconds
from kvpipe.pipeline.hardware import HardwareFieldError
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.report import decode_head_ends
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.engine import run

SPEC = ModelSpec("small", "llama", layers=4, hidden=1024, q_heads=8, kv_heads=4, head_dim=128,
                 intermediate=2048, vocab=1024, dtype="bf16")
HW = load_profile("h200")


def plan(group=1, resident=SPEC.units):
    return Plan(Method.HEADWISE, PhasePlan(group, 256, 2), PhasePlan(group, 1, 2), resident, 0)


def steps(trace):
    e = decode_head_ends(trace)
    return [b - a for a, b in zip(e, e[1:])]


def decode_host_s(graph, step=1):
    return sum(host_issue_seconds(s, HW) for s in graph.stages if s.phase is Phase.DECODE and s.step == step)


def test_a_small_gpu_step_is_host_bound_when_issued_eagerly():
    """Fault caught: host issue cost ignored, i.e. resident decode predicted at GPU speed (the
    issue's 17 ms predicted against 88 ms measured). A tiny model's step costs the GPU microseconds,
    so once the launches queued during the prefill are used up each eager step takes at least the
    host's issue time for it, and replay is faster."""
    g = build(SPEC, Workload(512, 24, 1), plan())
    eager, _ = run(g, HW)
    replayed, _ = run(g, HW, replay=True)
    host = decode_host_s(g)
    # The first steps may run on launches queued during the prefill (at most launch_queue_ops).
    assert all(d >= host * (1 - 1e-9) for d in steps(eager)[12:]), (steps(eager), host)
    assert max(steps(replayed)) < 0.2 * min(steps(eager)[12:])


def test_free_host_issue_and_launch_give_the_gpu_bound_prediction():
    """Fault caught: host or replay terms leaking in when they are zero. With free issue, replays
    and graph nodes costing what launches cost, a replayed step is never faster than an eager one
    (it only adds the barrier between steps) and eager keeps its GPU-bound step time."""
    # (free copy issue too, and no measured decode-attention table: the replayed call would then
    # cost its measured time where the eager one costs the roofline)
    hw = replace(HW, host_issue_s_per_stage=0.0, host_issue_s_per_op=0.0, graph_replay_s=0.0,
                 graph_node_s=HW.launch_overhead_s, small_kernel_s=HW.launch_overhead_s,
                 host_copy_s_per_stage=None, host_copy_s_per_op=None, decode_attention=())
    g = build(SPEC, Workload(512, 6, 1), plan(group=2, resident=3))
    eager, _ = run(g, hw)
    replayed, _ = run(g, hw, replay=True)
    # The replayed attention attends prefix and token in one call: the eager LSE merge's small
    # kernels are all it saves (pipeline/cost.stage_small_seconds).
    saved = sum(stage_small_seconds(s, hw, False) - stage_small_seconds(s, hw, True) for s in g.stages
                if s.phase is Phase.DECODE and s.step == 1 and s.tag == "attn")
    assert saved > 0
    assert all(r >= e - saved - 1e-12 for r, e in zip(steps(replayed), steps(eager)))
    gpu = [s for s in g.stages if s.phase is Phase.DECODE and s.step == 3 and s.kind is Kind.COMPUTE]
    spans = {sp.stage: sp for sp in eager.spans}
    busy = sum(spans[s.id].end_s - spans[s.id].start_s for s in gpu)
    assert steps(eager)[2] >= busy * (1 - 1e-9)


def test_the_launch_queue_bounds_how_far_the_host_runs_ahead():
    """Fault caught: a host that issues the whole decode during a long prefill (its issue cost then
    never shows). With a queue of one launch the host issues no further than the GPU has run; with
    an unbounded queue it runs ahead, so decode can only be faster."""
    g = build(SPEC, Workload(4096, 4, 1), plan(group=1))
    bounded, _ = run(g, replace(HW, launch_queue_ops=1))
    free, _ = run(g, replace(HW, launch_queue_ops=1e12))
    assert sum(steps(free)) <= sum(steps(bounded)) + 1e-12
    host = decode_host_s(g)
    assert min(steps(bounded)) >= host * (1 - 1e-9)


def test_a_replayed_step_starts_after_the_previous_step_and_its_write_backs():
    """Fault caught: replayed steps overlapping in the model while the executor serialises them
    (the next replay waits for the write-backs of the step before, on the d2h lane)."""
    g = build(SPEC, Workload(300, 5, 1), plan(group=2, resident=5))
    tr, _ = run(g, HW, replay=True)
    end = {}
    for sp in tr.spans:
        s = g.stages[sp.stage]
        if s.phase is Phase.DECODE:
            end[s.step] = max(end.get(s.step, 0.0), sp.end_s)
    for sp in tr.spans:
        s = g.stages[sp.stage]
        if s.phase is Phase.DECODE and s.step > 0:
            assert sp.start_s >= end[s.step - 1] - 1e-12, s.name
    assert any(s.kind is Kind.D2H for s in g.stages if s.phase is Phase.DECODE)


@pytest.mark.parametrize("field", ["host_issue_s_per_stage", "host_issue_s_per_op", "graph_replay_s",
                                   "graph_node_s", "launch_queue_ops"])
def test_host_fields_reject_negative_values(field):
    """Fault caught: a profile with a negative issue cost (predictions faster than no work)."""
    with pytest.raises(HardwareFieldError, match=field):
        replace(HW, **{field: -1.0})


def test_issue_cost_fit_recovers_known_coefficients():
    """Fault caught: a wrong normal equation in executor/calibrate/host_issue.fit (kvpipe
    calibrate's decode-step fit), which sets the profile's per-stage and per-op host figures."""
    from kvpipe.executor.calibrate.host_issue import fit
    a, b = 1.5e-4, 4e-5
    rows = [{"stages_per_step": s, "ops_per_step": o, "decode_s_per_token": a * s + b * o}
            for s, o in ((22, 112), (8, 42), (40, 144), (12, 74))]
    fa, fb = fit(rows)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-9)
