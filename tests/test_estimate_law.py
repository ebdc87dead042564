"""sim/estimate.py's lower bounds at long contexts: the planner prunes with them, so for any plan
and context the bound of each objective must never exceed the fully simulated value. Contexts up
to 1M tokens and chunks down to 1K make many chunks per run of the prefill estimate (runs of up to
~170 chunks costed at one start), which the 4-chunk contexts of test_planner.py never reach."""
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.planner import OBJECTIVES, _Search, objective_value
from kvpipe.sim.simulate import simulate

ROOMY = {"gpu": 2**50, "host": 2**50, "disk": 2**50}
TOL = 1e-9


def _model(layers: int, kv: int, head_dim: int) -> ModelSpec:
    q = 2 * kv
    return ModelSpec("tiny", "llama", layers, q * head_dim, q, kv, head_dim, 2 * q * head_dim, 256, "bf16")


@settings(max_examples=6, deadline=None)
@given(hw=st.sampled_from(["rtx4060", "rtx4090", "a100-80g", "h200"]), layers=st.integers(1, 2),
       kv=st.sampled_from([2, 4]), head_dim=st.sampled_from([64, 128]),
       context=st.integers(1100, 1 << 20), chunk=st.sampled_from([1024, 2048, 4096, 16384]),
       decode=st.integers(0, 2), group=st.sampled_from([1, 2]), resident=st.floats(0, 1), disk=st.floats(0, 1))
@example(hw="rtx4060", layers=1, kv=2, head_dim=64, context=1 << 20, chunk=1024, decode=2, group=1, resident=0, disk=0)
@example(hw="rtx4060", layers=1, kv=2, head_dim=64, context=131072, chunk=1024, decode=0, group=2, resident=0.5, disk=0)
def test_the_estimate_never_bounds_above_the_simulated_time(hw, layers, kv, head_dim, context, chunk, decode, group,
                                                            resident, disk):
    """Fault caught: each run of equal prefill chunks costed at its last start instead of its mean
    start. A chunk's cost grows with its start, so the run costed at its last start over-counts it:
    the "lower bound" the planner prunes by rises above the simulated time, and pruning can
    discard the best plan."""
    model, work, profile = _model(layers, kv, head_dim), Workload(context, decode), load_profile(hw)
    chunk = min(chunk, context)
    resident = round(resident * model.units)             # shares of the units: resident, then disk
    disk = round(disk * (model.units - resident))
    plan = Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, disk)
    s = _Search(model, work, profile, ROOMY)
    plan = s.stamped(plan)
    pred = simulate(model, work, plan, profile, full=True, replay=s.replays(plan), fuse=s.fuses(plan))
    est = s.estimate(plan)
    for objective in OBJECTIVES:
        assert est.lower_bound(objective) <= objective_value(pred, objective) * (1 + TOL), \
            (objective, est.lower_bound(objective), objective_value(pred, objective), plan.describe())
