"""pipeline/builder.py's `build_lazily`: the whole-run graph built step by step (a prefill chunk,
then each decode step, per `next()`) equals `build`'s, whatever the plan: the slot round-robin,
the units' last writes and the disk staging carried from step to step as one build carries them."""
from __future__ import annotations

import pytest

from kvpipe.pipeline.builder import build, build_lazily
from kvpipe.pipeline.model import ModelSpec, preset
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload

SPEC = ModelSpec("tiny", "llama", layers=3, hidden=64, q_heads=8, kv_heads=4, head_dim=16,
                 intermediate=96, vocab=128, dtype="fp32")
DISK = (("h2d", "none"), ("d2h", "none"), ("disk", "zstd-planes"))


def plan(group, chunk, depth, resident, disk=0, decode_group=None, codecs=None):
    c = codecs or PhasePlan.codecs
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth, c), PhasePlan(decode_group or group, 1, depth, c),
                resident, disk)


CASES = [  # (model, workload, plan, prefill starts)
    (SPEC, Workload(40, 5), plan(1, 8, 3, 2, decode_group=2), None),           # a depth the steps' fetches do not divide
    (SPEC, Workload(40, 4), plan(2, 16, 2, 3, disk=5), (0, 16, 19, 35)),       # disk units, chunks broken at a turn
    (SPEC, Workload(30, 3), plan(1, 8, 2, 0, disk=12, codecs=DISK), (9,)),     # a disk codec, a kept prefix
    (SPEC, Workload(24, 0), plan(4, 8, 2, 12), None),                          # all resident, no decode step
]


@pytest.mark.parametrize("model,work,p,starts", CASES)
def test_built_step_by_step_the_graph_is_the_whole_build(model, work, p, starts):
    """Fault caught: a lazily built graph that differs from the whole build (a step built without
    the previous step's slot users or last writes: a fetch into a slot still being read, a store
    racing its disk write), or one whose first part holds more than the first prefill chunk."""
    whole = build(model, work, p, starts=starts)
    graph, more = build_lazily(model, work, p, starts=starts)
    assert {(s.phase, s.step) for s in graph.stages} == {(Phase.PREFILL, 0)}
    steps = 1
    for _ in more:
        steps += 1
        assert len({(s.phase, s.step) for s in graph.stages}) == steps
    assert graph == whole


def test_a_window_model_built_step_by_step_is_the_whole_build():
    """Fault caught: the rings of window layers (their stores after the step's fetches) lost
    between lazily built steps."""
    spec = preset("gemma-2-2b")
    work, p = Workload(8192, 3), plan(2, 4096, 2, 0)
    graph, more = build_lazily(spec, work, p)
    for _ in more:
        pass
    assert graph == build(spec, work, p)
