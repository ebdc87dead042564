"""The simulator's launch queue (sim/onepass.py, sim/engine.py): it holds exactly
`launch_queue_ops` launches. A stage whose launches bring the queue exactly to its capacity is
issued without waiting; one launch more and the host waits for the oldest stage to finish.
A hand-made graph where that wait is visible: a long compute stage, then a copy with no
dependency that the host issues right behind it (expected times worked out from the profile)."""
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.cost import host_issue_seconds
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Graph, Kind, Phase, Stage
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.engine import run_events
from kvpipe.sim.onepass import exact_for, schedule

SPEC = ModelSpec("small", "llama", 1, 512, 8, 4, 64, 1024, 1000)
HW = load_profile("h200")


def _graph(compute_ops: int, copy_ops: int) -> Graph:
    plan = Plan(Method.HEADWISE, PhasePlan(1, 64, 2), PhasePlan(1, 1, 2), 0)
    long = Stage(0, Kind.COMPUTE, "mlp", Phase.PREFILL, 0, 0, None, (0, 64), flops=1e15, ops=compute_ops)
    copy = Stage(1, Kind.H2D, "kv_fetch", Phase.PREFILL, 0, 0, 0, (0, 64), heads=(0,), slot=0, bytes=4096,
                 ops=copy_ops)
    return Graph(SPEC, Workload(64, 0), plan, [long, copy])


@pytest.mark.parametrize("compute_ops,copy_ops", [(3, 2), (1, 1), (7, 5)])
@pytest.mark.parametrize("backend", ["onepass", "events"])
def test_a_launch_that_fills_the_queue_exactly_does_not_wait(compute_ops, copy_ops, backend):
    """Fault caught: the launch queue treated as full one launch early (`>=` for `>`): every
    bundled profile's queue is 1024 launches and no test lands exactly on it. With a queue of
    compute_ops + copy_ops the copy is issued behind the compute stage at once and overlaps it;
    with one launch less it is issued only once the compute stage has ended."""
    g = _graph(compute_ops, copy_ops)
    issue = host_issue_seconds(g.stages[0], HW) + host_issue_seconds(g.stages[1], HW)

    def spans(queue):
        hw = replace(HW, launch_queue_ops=queue)
        if backend == "onepass":
            assert exact_for(g, hw)
            trace = schedule(g, hw)[0]
        else:
            trace = run_events(g, hw)[0]
        return [(s.start_s, s.end_s) for s in trace.spans]

    (c0, c1), (f0, _) = spans(compute_ops + copy_ops)
    assert c1 - c0 > 1e-3                                   # the compute stage is long
    assert f0 == pytest.approx(issue, rel=1e-12)            # issued at once, overlapping it
    assert f0 < c1
    (c0, c1), (f0, _) = spans(compute_ops + copy_ops - 1)
    assert f0 == pytest.approx(c1 + host_issue_seconds(g.stages[1], HW), rel=1e-12)   # waited for it
