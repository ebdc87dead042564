"""Rates measured at the run's shapes (pipeline/run_rates.py, pipeline/cost.py, the loader): the
attention grid's interpolation, the profile fields written by calibrate and read back, the
simulator costing prefill attention, few-row GEMMs and the LOSSY quantise from them, and
calibrate measuring at the shapes the planner's plans use. Expected values are computed in the
tests (float64 by hand), not by the module's helpers."""
import math
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline import run_rates
from kvpipe.pipeline.calibration import Calibration, to_toml
from kvpipe.pipeline.cost import stage_seconds
from kvpipe.pipeline.lossy import QUANT_ENCODE_OPS, QUANT_TAIL_OPS
from kvpipe.pipeline.run_rates import AttentionRates, RateGrid, StageGemmRates
from kvpipe.pipeline.stage import Kind, Phase, Stage

GRID = RateGrid((1024, 4096), (2048, 8192), ((100e12, 400e12), (200e12, 800e12)))
OWN = RateGrid((1, 8), (1024, 4096), ((50e12, 100e12), (150e12, 300e12)))


def test_grid_interpolates_log_log_and_holds_its_edges():
    # Fault caught: linear (not log-log) interpolation, the axes swapped, or extrapolation past the grid.
    assert GRID.at(1024, 2048) == pytest.approx(100e12, rel=1e-12)
    assert GRID.at(4096, 2048) == pytest.approx(200e12, rel=1e-12)     # xs index the rows of `rates`
    assert GRID.at(2048, 2048) == pytest.approx(math.sqrt(100e12 * 200e12), rel=1e-12)   # halfway in log x
    mid = math.exp((math.log(100e12) + math.log(400e12) + math.log(200e12) + math.log(800e12)) / 4)
    assert GRID.at(2048, 4096) == pytest.approx(mid, rel=1e-12)
    assert GRID.at(10, 10) == pytest.approx(100e12, rel=1e-12) and GRID.at(1e9, 1e9) == pytest.approx(800e12, rel=1e-12)


def test_grid_refuses_bad_tables():
    # Fault caught: a grid whose axes are not ascending, or whose rows do not match them, accepted.
    with pytest.raises(ValueError, match="xs"):
        RateGrid((4096, 1024), (1,), ((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="rates"):
        RateGrid((1, 2), (1, 2), ((1.0, 2.0),))
    with pytest.raises(ValueError, match="rates"):
        RateGrid((1,), (1,), ((0.0,),))


def test_attention_seconds_splits_the_flops_by_pairs():
    # Fault caught: the causal call and the prefix call costed at one rate, or the flops split by
    # tokens (n against start) instead of (query, key) pairs.
    rates = AttentionRates(GRID, OWN)
    n, start, heads, flops = 4096, 8192, 1, 7.0e12
    own_pairs, pre_pairs = n * (n + 1) / 2, n * start
    own = flops * own_pairs / (own_pairs + pre_pairs)
    want = own / 100e12 + (flops - own) / 800e12        # own at (1 head, 4096), prefix at (4096 rows, 8192 keys)
    assert rates.seconds(flops, heads, start, n) == pytest.approx(want, rel=1e-12)
    assert rates.seconds(flops, heads, 0, n) == pytest.approx(flops / 100e12, rel=1e-12)   # a first chunk: causal only


def _cal_with_rates() -> Calibration:
    """h200-testbox's values with the new fields set by hand, as a Calibration (calibrate's writer)."""
    import tomllib

    from kvpipe.hw_profiles import _HERE, _flatten
    cal = Calibration("lab", "a calibrated test box", "unit test")
    for k, v in _flatten(tomllib.loads((_HERE / "h200-testbox.toml").read_text())).items():
        if k not in ("name", "description"):
            cal.set(k, v, "from h200-testbox", measured=False)
    for k, v in {"gpu.attention_rates.prefix_rows": list(GRID.xs), "gpu.attention_rates.prefix_keys": list(GRID.ys),
                 "gpu.attention_rates.prefix_flops_per_s": [list(r) for r in GRID.rates],
                 "gpu.attention_rates.own_groups": list(OWN.xs), "gpu.attention_rates.own_chunks": list(OWN.ys),
                 "gpu.attention_rates.own_flops_per_s": [list(r) for r in OWN.rates],
                 "gpu.attention_rates.dtype": "bf16", "gpu.decode_gemm_bytes_per_s": 3.3e12,
                 "gpu.quant_call_s": 2.5e-4, "gpu.quant_bytes_per_s": 4.0e11,
                 "link.gather_call_s": 6e-6, "link.gather_bytes_per_s": 4.9e10,
                 "gpu.stage_gemm.dtype": "bf16", "gpu.stage_gemm.qkv_flops_per_s": 5.5e14,
                 "gpu.stage_gemm.qkv_half_flops": 1.2e10, "gpu.stage_gemm.mlp_flops_per_s": 8.1e14,
                 "gpu.stage_gemm.mlp_half_flops": 3.4e10}.items():
        cal.set(k, v, "by hand")
    return cal


def test_profile_fields_written_and_read_back(tmp_path):
    # Fault caught: the loader drops [gpu.attention_rates] or a new [gpu] field (the simulator would
    # silently fall back to the single figures), or the TOML writer cannot write a table's arrays.
    text = to_toml(_cal_with_rates())
    path = tmp_path / "lab.toml"
    path.write_text(text)
    hw = load_profile(str(path))
    assert hw.attention_rates == AttentionRates(GRID, OWN, "bf16")
    assert (hw.decode_gemm_bytes_per_s, hw.quant_call_s, hw.quant_bytes_per_s) == (3.3e12, 2.5e-4, 4.0e11)
    assert (hw.gather_call_s, hw.gather_bytes_per_s) == (6e-6, 4.9e10)
    assert "prefix_flops_per_s = [[1e+14, 4e+14], [2e+14, 8e+14]]" in text and "source: measured by kvpipe calibrate, by hand" in text
    assert hw.stage_gemm == StageGemmRates(5.5e14, 1.2e10, 8.1e14, 3.4e10, "bf16")
    path.write_text(text.replace("own_chunks = [1024, 4096]", "own_chunks = [4096, 1024]"))
    with pytest.raises(ValueError, match="attention_rates.own"):
        load_profile(str(path))
    path.write_text("\n".join(x for x in text.splitlines() if not x.startswith("mlp_half_flops")))
    with pytest.raises(ValueError, match="gpu.stage_gemm.mlp_half_flops' is missing"):
        load_profile(str(path))
    path.write_text(text.replace("qkv_flops_per_s = 5.5e+14", "qkv_flops_per_s = -1.0"))
    with pytest.raises(ValueError, match="gpu.stage_gemm.qkv_flops_per_s' must be"):
        load_profile(str(path))


def test_bundled_profiles_have_none_of_the_new_fields():
    # Fault caught: a default that turns a table on for profiles that never measured it (golden plans
    # move); a field is set only where the profile's file states it, with its source.
    from importlib.resources import files
    from kvpipe.hw_profiles import known_profiles
    for name in known_profiles():
        hw = load_profile(name)
        text = files("kvpipe.hw_profiles").joinpath(f"{name}.toml").read_text()
        assert hw.attention_rates is None and hw.quant_call_s is None and hw.stage_gemm is None, name
        stated = "\ndecode_gemm_bytes_per_s = " in text
        assert (hw.decode_gemm_bytes_per_s is not None) == stated, name
        assert not stated or "# source: measured" in text.split("\ndecode_gemm_bytes_per_s = ")[1].splitlines()[0], name


def _attn(start: int, n: int, heads: int, flops: float) -> Stage:
    return Stage(0, Kind.COMPUTE, "attn", Phase.PREFILL, 0, 0, 0, (start, start + n), heads=tuple(range(heads)),
                 flops=flops, mem_bytes=1e6, ops=5)


def test_simulator_costs_prefill_attention_from_the_grid():
    # Fault caught: stage_seconds ignoring [gpu.attention_rates] (one attention_efficiency for every shape).
    hw = replace(load_profile("h200-testbox"), attention_rates=AttentionRates(GRID, OWN))
    s = _attn(8192, 4096, 1, 7.0e12)
    own = 7.0e12 * (4096 * 4097 / 2) / (4096 * 4097 / 2 + 4096 * 8192)
    want = own / 100e12 + (7.0e12 - own) / 800e12 + 5 * hw.launch_overhead_s
    assert stage_seconds(replace(s, small_ops=0), hw, "bf16") == pytest.approx(want, rel=1e-9)
    old = load_profile("h200-testbox")
    assert stage_seconds(replace(s, small_ops=0), old, "bf16") != pytest.approx(want, rel=1e-3)
    assert stage_seconds(s, hw, "fp32") == stage_seconds(s, replace(old, attention_rates=None), "fp32")  # other dtype


def test_simulator_costs_qkv_and_mlp_from_their_own_gemm_rates():
    # Fault caught: stage_seconds ignoring [gpu.stage_gemm] (one GEMM rate and half for the narrow
    # qkv and the wide mlp GEMMs: qkv predicted fast, mlp slow), the pairs swapped, or the table
    # used for a dtype it was not measured in or for a stage it does not rate.
    table = StageGemmRates(4.0e14, 1.0e10, 9.0e14, 5.0e10)
    hw = replace(load_profile("h200-testbox"), stage_gemm=table)
    for tag, rate, half in (("qkv", 4.0e14, 1.0e10), ("mlp", 9.0e14, 5.0e10)):
        s = Stage(0, Kind.COMPUTE, tag, Phase.PREFILL, 0, 0, None, (0, 4096), flops=3.0e12, mem_bytes=1e6, ops=3)
        assert stage_seconds(s, hw, "bf16") == pytest.approx((3.0e12 + half) / rate + 3 * hw.launch_overhead_s,
                                                             rel=1e-12), tag
        assert stage_seconds(s, hw, "fp32") == stage_seconds(s, load_profile("h200-testbox"), "fp32"), tag
    head = Stage(0, Kind.COMPUTE, "head", Phase.PREFILL, 0, None, None, (4095, 4096), flops=3.0e12, mem_bytes=1e6, ops=3)
    assert stage_seconds(head, hw, "bf16") == stage_seconds(head, load_profile("h200-testbox"), "bf16")


def test_few_row_gemms_read_weights_at_the_measured_rate():
    # Fault caught: a decode step's one-row GEMM charged the small-shape half (51 us a qkv stage on
    # h200-testbox against its 12 us of weights), or a prefill GEMM costed as a few-row one.
    hw = replace(load_profile("h200-testbox"), decode_gemm_bytes_per_s=3.0e12)
    w = 4096 * 6144 * 2
    dec = Stage(0, Kind.COMPUTE, "qkv", Phase.DECODE, 0, 0, None, (8192, 8193), flops=2.0 * 4096 * 6144, mem_bytes=w, ops=6)
    assert stage_seconds(dec, hw, "bf16") == pytest.approx(w / 3.0e12 + 6 * hw.launch_overhead_s, rel=1e-12)
    pre = replace(dec, phase=Phase.PREFILL, tokens=(0, 4096), flops=4096 * 2.0 * 4096 * 6144)
    assert stage_seconds(pre, hw, "bf16") == stage_seconds(pre, load_profile("h200-testbox"), "bf16")


def test_quantise_stage_costed_from_its_measured_fit():
    # Fault caught: the LOSSY quantise costed as one pass of its bytes at the HBM rate (the 68
    # kernels' float32 work left out), or a step that fills no block charged the fit's call.
    hw = replace(load_profile("h200-testbox"), quant_call_s=2.5e-4, quant_bytes_per_s=4.0e11)
    fill = Stage(0, Kind.COMPUTE, "quant", Phase.PREFILL, 0, 0, None, (0, 4096), heads=tuple(range(8)),
                 mem_bytes=8 * 4096 * 512 * 1.28, ops=QUANT_TAIL_OPS + QUANT_ENCODE_OPS)
    want = 2.5e-4 + fill.mem_bytes / 4.0e11 + QUANT_TAIL_OPS * hw.launch_overhead_s
    assert stage_seconds(fill, hw, "bf16") == pytest.approx(want, rel=1e-12)
    tail = replace(fill, ops=QUANT_TAIL_OPS, mem_bytes=8 * 512 * 1.28)
    assert stage_seconds(tail, hw, "bf16") == stage_seconds(tail, load_profile("h200-testbox"), "bf16")


def test_calibrate_measures_at_the_planners_shapes():
    # Fault caught: calibrate's chunks or groups drifting from the planner's search (rates measured
    # at shapes no plan runs), or a prefix grid that stops short of the calls real plans make.
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.space import CHUNKS, Pins, Space
    assert run_rates.CALIBRATE_CHUNKS == CHUNKS
    m = load_model("llama-3-8b")
    space = Space.of(m, Workload(131072, 1, 1), Pins())
    assert run_rates.CALIBRATE_GROUPS == space.groups and run_rates.OWN_GROUPS == space.groups
    calls = {g * c for g in space.groups for c in space.chunks}
    assert run_rates.PREFIX_ROWS[0] <= min(calls) and run_rates.PREFIX_ROWS[-1] >= max(calls)
    assert run_rates.OWN_CHUNKS[0] <= min(space.chunks) and run_rates.OWN_CHUNKS[-1] >= max(space.chunks)
    assert run_rates.PREFIX_KEYS[-1] >= 131072 - max(space.chunks)   # a 128K run's last chunk's prefix


def test_eager_quantise_of_filled_blocks_makes_the_host_wait():
    # Fault caught: the LOSSY quantise's range check (a device-to-host read in
    # executor/quant/quantize.py) left out of the simulator: the host then ran ahead of every
    # prefill chunk's quantise and int4 prefill was predicted short. Both backends: the stage
    # issued after a filling quantise starts no earlier than its end plus its own issue.
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.cost import host_issue_seconds, host_waits_for
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.model import ModelSpec
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim import engine, onepass
    fill = Stage(0, Kind.COMPUTE, "quant", Phase.PREFILL, 0, 0, None, (0, 4096), heads=(0,),
                 mem_bytes=1e6, ops=QUANT_TAIL_OPS + QUANT_ENCODE_OPS)
    hw = replace(load_profile("h200-testbox"), quant_call_s=2.5e-4, quant_bytes_per_s=4.0e11)
    assert host_waits_for(fill, hw) and not host_waits_for(replace(fill, ops=QUANT_TAIL_OPS), hw)
    assert not host_waits_for(fill, load_profile("h200-testbox"))   # bundled profiles predict as validated
    m = ModelSpec("two", layers=2, hidden=4096, q_heads=32, kv_heads=8, intermediate=14336, family="llama",
                  vocab=128256, head_dim=128)
    plan = Plan(Method.HEADWISE, PhasePlan(8, 2048, 2), PhasePlan(8, 1, 2), 0, 0, lossy=LossySpec("int4"))
    graph = build(m, Workload(8192, 1, 1), plan)
    quants = [s for s in graph.stages if s.tag == "quant" and s.phase is Phase.PREFILL]
    assert len(quants) == 8 and all(host_waits_for(s, hw) for s in quants)
    for trace in (engine.run(graph, hw)[0], onepass.schedule(graph, hw)[0]):
        span = {sp.stage: sp for sp in trace.spans}
        for q in quants:
            nxt = graph.stages[q.id + 1]
            assert span[nxt.id].start_s >= span[q.id].end_s + host_issue_seconds(nxt, hw) - 1e-12, (q.name, nxt.name)


def test_the_estimate_stays_a_lower_bound_on_a_calibrated_profile():
    # Fault caught: a calibrated profile whose single attention_efficiency is slower than its grid
    # (e.g. the grid's median): the planner's estimate then bounds above the simulated time and
    # pruning can discard the best plan (as tests/test_estimate_law.py holds for bundled profiles).
    import itertools

    from kvpipe.pipeline.model import ModelSpec
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.planner import OBJECTIVES, _Search, objective_value
    from kvpipe.sim.simulate import simulate
    base = load_profile("h200-testbox")
    eff = base.flops_eff("bf16")
    grids = AttentionRates(
        RateGrid(run_rates.PREFIX_ROWS, run_rates.PREFIX_KEYS,
                 tuple(tuple(0.76 * eff * min(1, (r / 4096) ** 0.1) * min(1, (p / 32768) ** 0.05)
                             for p in run_rates.PREFIX_KEYS) for r in run_rates.PREFIX_ROWS)),
        RateGrid(run_rates.OWN_GROUPS, run_rates.OWN_CHUNKS,
                 tuple(tuple(0.6 * eff * min(1, (g * n / 8192) ** 0.1) for n in run_rates.OWN_CHUNKS)
                       for g in run_rates.OWN_GROUPS)))
    hw = replace(base, attention_rates=grids, attention_efficiency=grids.estimate_efficiency(eff),
                 decode_gemm_bytes_per_s=3.4e12, quant_call_s=3e-4, quant_bytes_per_s=3e11,
                 stage_gemm=StageGemmRates(0.6 * eff, 2e10, 1.05 * eff, 1e10))
    m = ModelSpec("two", layers=2, hidden=4096, q_heads=32, kv_heads=8, intermediate=14336, family="llama",
                  vocab=128256, head_dim=128)
    roomy = {"gpu": 2**50, "host": 2**50, "disk": 2**50}
    for context, chunk, group, resident, decode in itertools.product((32768, 131072), (1024, 32768), (1, 8),
                                                                     (0, 16), (0, 2)):
        work = Workload(context, decode)
        s = _Search(m, work, hw, roomy)
        plan = s.stamped(Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0))
        pred = simulate(m, work, plan, hw, full=True, replay=s.replays(plan), fuse=s.fuses(plan))
        est = s.estimate(plan)
        for objective in OBJECTIVES:
            assert est.lower_bound(objective) <= objective_value(pred, objective) * (1 + 1e-9), (objective, plan.describe())


def test_sparse_fetches_are_gathers_costed_at_the_gather_fit():
    # Fault caught: sparse decode's selected rows costed as bulk H2D copies (the UVA gather measured
    # ~0.9x a copy's rate on the H200: sparse + int4 decode predicted ~10% short), or exact and
    # prefill fetches taken for gathers.
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    m, work = load_model("llama-3-8b"), Workload(32768, 2, 1)
    plan = lambda spec: Plan(Method.HEADWISE, PhasePlan(8, 8192, 2), PhasePlan(8, 1, 2), 0, 0, lossy=spec)  # noqa: E731
    sparse = [s for s in build(m, work, plan(LossySpec("int4", sparse=0.2))).stages if s.tag == "kv_fetch"]
    assert all(s.gather == (s.phase is Phase.DECODE) for s in sparse) and any(s.gather for s in sparse)
    assert not any(s.gather for s in build(m, work, plan(LossySpec("int4"))).stages)
    hw0 = load_profile("h200-testbox")
    hw = replace(hw0, gather_call_s=6e-6, gather_bytes_per_s=4.9e10)
    s = next(s for s in sparse if s.gather)
    assert stage_seconds(s, hw, "bf16") == pytest.approx(s.ops * 6e-6 + s.bytes / 4.9e10, rel=1e-12)
    bulk = next(x for x in sparse if not x.gather)
    assert stage_seconds(bulk, hw, "bf16") == stage_seconds(bulk, hw0, "bf16")
