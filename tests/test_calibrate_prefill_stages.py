"""`kvpipe calibrate`'s prefill stages timed in a run's sequence (executor/calibrate/prefill_stages.py)
and the figures fitted on them (pipeline/stage_fit.py): the sequence timed is the executor's own
graph of the planner's shapes, run by the executor; fields derived from synthetic timings equal a
hand computation (float64 here); and the derived figures give back, through the simulator's cost
(pipeline/cost.stage_seconds), the seconds they were fitted on."""
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline import run_rates
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.cost import stage_seconds
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.run_rates import AttentionRates, RateGrid, StageGemmRates
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.stage_fit import Timed, fit, label
from kvpipe.pipeline.workload import Workload

SPEC = ModelSpec("p", layers=3, hidden=4096, q_heads=32, kv_heads=8, intermediate=14336, family="llama",
                 vocab=1024, head_dim=128)
# (group, chunk, prefix): the own grid 2 x 2, and a prefix row of each own group's 4096-token chunk
PTS = [(1, 1024, 0), (1, 4096, 0), (8, 1024, 0), (8, 4096, 0), (1, 4096, 8192), (1, 4096, 32768),
       (8, 4096, 8192), (8, 4096, 32768)]


def _plan(g: int, n: int) -> Plan:
    return Plan(Method.HEADWISE, PhasePlan(g, n, 2), PhasePlan(g, 1, 2), SPEC.units, 0)


def _stages(pts=PTS):
    """The prefill qkv, attn and mlp stages of layers 1.. of each point's graph, as calibrate times them."""
    out = []
    for g, n, p in pts:
        graph = build(SPEC, Workload(p + n, 0, 1), _plan(g, n), starts=(p,))
        out += [s for s in graph.stages if s.tag in ("qkv", "attn", "mlp") and s.layer >= 1]
    return out


def _hw():
    """h200-testbox with round small-kernel and launch figures, so the hand sums below are plain."""
    return replace(load_profile("h200-testbox"), launch_overhead_s=2e-6, small_kernel_s=1e-6,
                   elementwise_efficiency=0.5, hbm_eff_bytes_per_s=4e12, hbm_peak_bytes_per_s=4.8e12)


def _fixed(s) -> float:
    """By hand: the stage's small kernels (each at least the launch, their bytes at half the HBM
    rate) and its launches."""
    return max(s.small_ops * 2e-6, s.small_bytes / 2e12) + s.ops * 2e-6


def test_points_are_the_planners_shapes():
    # Fault caught: prefill stages timed at shapes no plan runs: chunks or groups other than the
    # planner's, a prefix row whose (group, chunk) has no first chunk timed (its own call unknown),
    # or prefixes short of a 128K run's last chunk.
    from kvpipe.executor.calibrate.prefill_stages import points
    pts = points(run_rates.OWN_GROUPS, run_rates.CALIBRATE_CHUNKS, run_rates.PREFIX_ROWS, run_rates.PREFIX_KEYS)
    own = {(g, n) for g, n, p in pts if p == 0}
    assert own == {(g, n) for g in run_rates.CALIBRATE_GROUPS for n in run_rates.CALIBRATE_CHUNKS}
    pre = [(g, n, p) for g, n, p in pts if p]
    assert {(g * n, p) for g, n, p in pre} == {(r, p) for r in run_rates.PREFIX_ROWS for p in run_rates.PREFIX_KEYS}
    assert all((g, n) in own for g, n, _ in pre)
    assert (4, 4096) in {(g, n) for g, n, _ in pre} and (8, 8192) in {(g, n) for g, n, _ in pre}   # 128K and 32K plans
    assert max(p for _, _, p in pre) >= 131072 - max(run_rates.CALIBRATE_CHUNKS)


def test_sequence_timed_is_the_executors_graph():
    # Fault caught: kernels timed alone instead of the executor's stages in a run's order, a chunk
    # whose prefix is not home (its graph starting at token 0), the warm-up layer's spans used, or
    # a span's seconds taken from another stage than its own.
    torch = pytest.importorskip("torch")
    from kvpipe.executor.calibrate import prefill_stages as ps
    from kvpipe.executor.layers.adapter import HFAdapter
    dims = {"hidden": 64, "inner": 128, "q_dim": 64, "kv_dim": 32}
    pts = [(1, 128, 0), (2, 128, 0), (2, 128, 512)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        traces = ps.time_points(torch.device("cpu"), dims, 16, pts, 3, lambda s: 0.0, None)
    finally:
        torch.set_num_threads(before)
    spec = HFAdapter(ps.probe_model("cpu", 3, **ps.model_config(dims, 16))).spec()
    assert len(traces) == len(pts)
    for tr, (g, n, p) in zip(traces, pts):
        plan = Plan(Method.HEADWISE, PhasePlan(g, n, 2), PhasePlan(g, 1, 2), spec.units, 0)
        want = build(spec, Workload(p + n, 0, 1), plan, starts=(p,))
        assert tr.source == "real" and tr.graph.stages == want.stages
        assert [sp.stage for sp in tr.spans if tr.graph.stages[sp.stage].lane.value == "gpu"] == \
            [s.id for s in want.stages if s.lane.value == "gpu"]   # issued in the graph's order
        assert all(s.tokens == (p, p + n) for s in want.stages if s.tag in ("qkv", "attn", "mlp"))
        got = ps.timed([tr])
        span = {sp.stage: sp for sp in tr.spans}
        assert [t.stage for t in got] == [s for s in want.stages if s.tag in ("qkv", "attn", "mlp") and s.layer >= 1]
        assert all(t.seconds == span[t.stage.id].end_s - span[t.stage.id].start_s for t in got)
    rec = ps.record(traces)
    assert [(r["group"], r["chunk"], r["prefix"]) for r in rec] == pts


def test_fields_from_synthetic_timings_match_a_hand_computation():
    # Fault caught: a stage's small kernels or launches not taken off before the rate is read, one
    # rate fitted for qkv and mlp, the prefix call's rate read without taking off its own call, or
    # the stage's flops split by tokens (n against the prefix) instead of (query, key) pairs.
    rates = {"qkv": (5.0e14, 2.0e10), "mlp": (8.0e14, 4.0e10)}
    own = {(1, 1024): 1.0e14, (1, 4096): 3.0e14, (8, 1024): 2.0e14, (8, 4096): 5.0e14}
    pre = {(4096, 8192): 4.0e14, (4096, 32768): 4.5e14, (32768, 8192): 6.0e14, (32768, 32768): 6.5e14}
    timed = []
    for s in _stages():
        start, end = s.tokens
        n, g = end - start, len(s.heads)
        if s.tag in rates:
            rate, half = rates[s.tag]
            k = (s.flops + half) / rate
        elif start == 0:
            k = s.flops / own[(g, n)]
        else:
            own_f = s.flops * (n * (n + 1) / 2) / (n * (n + 1) / 2 + n * start)
            k = own_f / own[(g, n)] + (s.flops - own_f) / pre[(g * n, start)]
        timed.append(Timed(s, _fixed(s) + k))
    f = fit(timed, _hw(), "bf16")
    for tag, (rate, half) in rates.items():
        got = f.gemm.of(tag)
        assert got[0] == pytest.approx(rate, rel=1e-9) and got[1] == pytest.approx(half, rel=1e-6), tag
    assert (f.attention.own.xs, f.attention.own.ys) == ((1, 8), (1024, 4096))
    for (g, n), r in own.items():
        assert f.attention.own.at(g, n) == pytest.approx(r, rel=1e-9), (g, n)
    assert (f.attention.prefix.xs, f.attention.prefix.ys) == ((4096, 32768), (8192, 32768))
    for (rows, p), r in pre.items():
        assert f.attention.prefix.at(rows, p) == pytest.approx(r, rel=1e-9), (rows, p)
    assert f.clamped == () and f.gemm.dtype == "bf16"


def test_pooled_gemm_rate_is_the_relative_fit_over_both_stages():
    # Fault caught: the profile's one GEMM rate and half fitted on one stage's points only, or in
    # error relative to the kernel time instead of the stage's (the seconds a prediction is judged by).
    rates = {"qkv": (5.0e14, 2.0e10), "mlp": (8.0e14, 4.0e10)}
    timed = [Timed(s, _fixed(s) + (s.flops + rates[s.tag][1]) / rates[s.tag][0]) for s in _stages() if s.tag in rates]
    attn = [Timed(s, _fixed(s) + s.flops / 4.0e14) for s in _stages() if s.tag == "attn"]
    f = fit(timed + attn, _hw(), "bf16")
    # by hand: minimise sum(((a + b f - k) / t)^2), k the stage's seconds less its small kernels and launches
    pts = [(t.stage.flops, t.seconds - _fixed(t.stage), t.seconds) for t in timed]
    w = [1 / t ** 2 for _, _, t in pts]
    sw, sx = sum(w), sum(wi * x for wi, (x, _, _) in zip(w, pts))
    sy, sxx = sum(wi * k for wi, (_, k, _) in zip(w, pts)), sum(wi * x * x for wi, (x, _, _) in zip(w, pts))
    sxy = sum(wi * x * k for wi, (x, k, _) in zip(w, pts))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    assert a > 0 and f.flops_per_s == pytest.approx(1 / b, rel=1e-9) and f.half_flops == pytest.approx(a / b, rel=1e-6)


def test_derived_figures_give_back_the_timed_seconds_through_the_cost():
    # Fault caught: the fit and the simulator's cost disagree on a stage's formula (a term the fit
    # takes off that the cost does not add, a grid axis keyed otherwise than the cost looks it up),
    # so a calibrated profile predicts other seconds than the run it was measured on.
    own = RateGrid((1, 8), (1024, 4096), ((9e13, 2.5e14), (1.8e14, 5.2e14)))
    pre = RateGrid((4096, 32768), (8192, 32768), ((3.9e14, 4.4e14), (5.9e14, 6.4e14)))
    true = replace(_hw(), attention_rates=AttentionRates(pre, own), stage_gemm=StageGemmRates(4.6e14, 1.5e10, 7.9e14, 3e10))
    timed = [Timed(s, stage_seconds(s, true, "bf16")) for s in _stages()]
    f = fit(timed, _hw(), "bf16")
    back = replace(_hw(), attention_rates=f.attention, stage_gemm=f.gemm)
    for tag in ("qkv", "mlp"):
        assert f.gemm.of(tag) == pytest.approx(true.stage_gemm.of(tag), rel=1e-6), tag
    for t in timed:
        assert stage_seconds(t.stage, back, "bf16") == pytest.approx(t.seconds, rel=1e-9), t.stage.name
    assert all(t.stage.phase is Phase.PREFILL for t in timed)


def test_kernel_time_under_the_stages_small_kernels_is_clamped_and_named():
    # Fault caught: a stage measured faster than its small kernels are priced giving a negative or
    # infinite rate (a profile the loader refuses, or a grid point that costs nothing) unsaid.
    timed = [Timed(s, _fixed(s) + ((s.flops + 2e10) / 6e14 if s.tag != "attn" else s.flops / 4e14)) for s in _stages()]
    bad = next(i for i, t in enumerate(timed) if t.stage.tag == "attn" and t.stage.tokens[0] == 0)
    timed[bad] = Timed(timed[bad].stage, 0.5 * _fixed(timed[bad].stage))
    f = fit(timed, _hw(), "bf16")
    assert f.clamped == (label(timed[bad].stage),)
    assert all(v > 0 for row in f.attention.own.rates for v in row)
