"""The fused decode step as the simulator sees it (pipeline/fusion.py's setting through the graph
builder, the simulator, the planner's estimate): fused forms in decode steps only, the prediction
faster by exactly the small-kernel time they save, the one-time compile reported beside the total,
and the closed-form estimate still equal to the simulated lane busy. No torch needed."""
import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline import layer_ops
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.cost import stage_small_seconds
from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.estimate import LANES, layer_classes, phase_layout, step_busy
from kvpipe.sim.planner import _Search, search
from kvpipe.sim.simulate import simulate
from test_planner import FLOAT_TOL, tiny

SPEC = load_model("llama-3-8b")
RESIDENT = Plan(Method.HEADWISE, PhasePlan(8, 2048, 2), PhasePlan(8, 1, 2), SPEC.units, 0)


def test_builder_counts_the_fused_forms_in_decode_steps_only():
    """Faults caught: the fused forms leaking into the prefill (it is never fused), not reaching
    a decode stage (qkv, mlp, head), or fusion changing anything but the small kernels."""
    work = Workload(4096, 2)
    plain, fused = build(SPEC, work, RESIDENT), build(SPEC, work, RESIDENT, fused=True)
    assert len(plain.stages) == len(fused.stages)
    forms = {"qkv": layer_ops.fused_qkv(SPEC, 1, SPEC.kv_heads), "mlp": layer_ops.fused_mlp(SPEC, 1),
             "head": layer_ops.fused_head(SPEC, 1)}
    seen = set()
    for a, b in zip(plain.stages, fused.stages):
        assert (a.kind, a.tag, a.phase, a.flops, a.mem_bytes, a.ops, a.deps) == \
            (b.kind, b.tag, b.phase, b.flops, b.mem_bytes, b.ops, b.deps)
        if a.phase is Phase.PREFILL or a.tag not in forms:
            assert (a.small_ops, a.small_bytes) == (b.small_ops, b.small_bytes), a.name
        else:
            assert (b.small_ops, b.small_bytes) == (forms[a.tag].kernels, forms[a.tag].bytes), b.name
            assert b.small_ops < a.small_ops
            seen.add(a.tag)
    assert seen == set(forms)


def test_fused_prediction_saves_exactly_the_small_kernel_time_and_reports_the_compile():
    """Faults caught: the simulator ignoring the builder's fused counts (or the cost model
    overriding them), fusion moving the prefill, the compile time missing from the prediction or
    charged without fusion, and eager decode (no replay) predicted fused."""
    hw, work = load_profile("h200-testbox"), Workload(8192, 6)
    off = simulate(SPEC, work, RESIDENT, hw, full=True, replay=True)
    on = simulate(SPEC, work, RESIDENT, hw, full=True, replay=True, fuse=True)
    eager = simulate(SPEC, work, RESIDENT, hw, full=True, replay=False, fuse=True)
    assert (on.fused, on.compile_s) == (True, 5.4) and (off.fused, off.compile_s) == (False, 0.0)
    assert eager.fused is False and eager.compile_s == 0.0
    assert on.report.timing.prefill_s == off.report.timing.prefill_s
    saved = sum(stage_small_seconds(a, hw, True) - stage_small_seconds(b, hw, True)
                for a, b in zip(off.trace.graph.stages, on.trace.graph.stages)
                if a.phase is Phase.DECODE and a.kind is Kind.COMPUTE)
    busy = off.report.phase_busy_s["decode"]["gpu"] - on.report.phase_busy_s["decode"]["gpu"]
    assert saved > 0 and busy == pytest.approx(saved, rel=1e-9)
    # the resident step is GPU-bound: the step itself is faster by that time per step
    per_step = saved / work.decode_tokens
    gain = off.report.timing.decode_s_per_token - on.report.timing.decode_s_per_token
    assert gain == pytest.approx(per_step, rel=1e-6)


@pytest.mark.parametrize("resident,disk", [(4, 0), (0, 0), (3, 1)])
def test_estimate_of_a_fused_replayed_decode_equals_the_simulated_busy(resident, disk):
    """Fault caught: the planner's closed form (sim/estimate.py) not counting the fused forms the
    builder counts, so its ranking and lower bounds (pruning) would be those of another step."""
    model, work, hw = tiny(2, 2), Workload(3000, 3), load_profile("h200-testbox")
    plan = Plan(Method.HEADWISE, PhasePlan(1, 1024, 2), PhasePlan(2, 1, 2), resident, disk)
    layout = phase_layout(model, layer_classes(model, resident, disk), 2)
    dec = dict.fromkeys(LANES, 0.0)
    for k in range(work.decode_tokens):
        b = step_busy(model, work, hw, layout, 2, False, work.context + k, 1, True, True, True)
        dec = {lane: dec[lane] + b[lane] for lane in LANES}
    sim = simulate(model, work, plan, hw, full=True, replay=True, fuse=True).report.phase_busy_s["decode"]
    for lane in LANES:
        assert dec[lane] == pytest.approx(sim[lane], rel=FLOAT_TOL, abs=1e-12), lane


def test_planner_fuses_replayed_plans_as_run_would_and_says_so():
    """Faults caught: the planner predicting unfused decode where `run --fuse auto` fuses (its
    pick would then be scored on another step), fusing plans whose decode is not replayed (disk
    units), and not reporting the setting."""
    model, work, hw = tiny(2, 2), Workload(3000, 4), load_profile("h200-testbox")
    budgets = {"gpu": 2**34, "host": 2**34, "disk": 2**34}
    s = _Search(model, work, hw, budgets)
    base = Plan(Method.HEADWISE, PhasePlan(1, 1024, 2), PhasePlan(1, 1, 2), 0, 0)
    assert s.fuses(base) and not s.fuses(base.with_(disk=1))
    assert not _Search(model, work, hw, budgets, fuse="off").fuses(base)
    fused, plain = search(model, work, hw, budgets, fuse="auto"), search(model, work, hw, budgets, fuse="off")
    assert fused.best.prediction.fused and "decode fused (one-time compile 5.4 s" in fused.reason
    assert not plain.best.prediction.fused and "fused" not in plain.reason
    assert fused.best.value < plain.best.value


def test_compile_s_is_an_optional_validated_profile_field(tmp_path):
    """Faults caught: a profile without `host.compile_s` (as `kvpipe calibrate` writes them today)
    refused or read as a zero compile, and a negative value accepted."""
    from kvpipe.hw_profiles import ProfileError, _HERE
    text = (_HERE / "h200-testbox.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("compile_s ="))
    (tmp_path / "none.toml").write_text(text.replace(line + "\n", ""))
    (tmp_path / "neg.toml").write_text(text.replace(line, "compile_s = -1.0"))
    hw = load_profile(str(tmp_path / "none.toml"))
    assert hw.compile_s is None
    pred = simulate(SPEC, Workload(4096, 2), RESIDENT, hw, replay=True, fuse=True)
    assert pred.fused and pred.compile_s is None
    with pytest.raises(ProfileError, match="host.compile_s"):
        load_profile(str(tmp_path / "neg.toml"))
