"""`kvpipe calibrate`'s run-shape steps (executor/calibrate/machine.run_shape_steps: run_shapes.py,
prefill_stages.py, gemm_shapes.py, lossy.py) on the CPU at tiny shapes: every profile field they
feed is written, with a source, and loads; the attention grid is the shapes asked for; the
quantise is fitted over the bytes the builder's `quant` stage counts. The prefill stages' own
checks (timed in the executor's order at the plan's shapes): tests/test_calibrate_prefill_stages.py."""
import pytest

torch = pytest.importorskip("torch")

from kvpipe.hw_profiles import load_profile  # noqa: E402
from kvpipe.pipeline.calibration import Calibration, to_toml  # noqa: E402

DIMS = {"hidden": 64, "inner": 128, "q_dim": 64, "kv_dim": 32}
GRIDS = dict(d=16, rows=(256, 1024), keys=(256, 1024), groups=(1, 2))
NEW = ("gpu.attention_rates.prefix_flops_per_s", "gpu.attention_rates.own_flops_per_s", "gpu.decode_gemm_bytes_per_s",
       "gpu.quant_call_s", "gpu.quant_bytes_per_s", "gpu.compute.fp32.effective_flops_per_s",
       "gpu.small_shape_half_flops", "gpu.attention_efficiency", "gpu.stage_gemm.qkv_flops_per_s",
       "gpu.stage_gemm.qkv_half_flops", "gpu.stage_gemm.mlp_flops_per_s", "gpu.stage_gemm.mlp_half_flops")


@pytest.fixture(scope="module")
def measured():
    import tomllib

    from kvpipe.executor.calibrate.machine import run_shape_steps
    from kvpipe.hw_profiles import _HERE, _flatten
    cal = Calibration("cpu", "run-shape steps on a CPU", "unit test")
    for k, v in _flatten(tomllib.loads((_HERE / "h200-testbox.toml").read_text())).items():
        if k not in ("name", "description"):
            cal.set(k, v, "from h200-testbox", measured=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # restored: later tests' CPU digests depend on the thread count
    try:
        for _, step in run_shape_steps(cal, torch.device("cpu"), load_profile("h200-testbox"), DIMS, GRIDS,
                                       chunks=(256, 1024)):
            step()
    finally:
        torch.set_num_threads(before)
    return cal


def test_every_new_field_is_measured_and_loads(measured, tmp_path):
    # Fault caught: a step that runs but writes no field (or one the loader refuses), a field
    # without its measurement in the source line, or a grid of other shapes than asked.
    for key in NEW:
        assert key in measured.values and measured.notes[key].startswith("measured by kvpipe calibrate, "), key
    assert measured.notes["gpu.sparse_score_call_s"].startswith("not measured")   # Triton ranking: CUDA only, said so
    assert "not measured" in str(measured.extra["gpu.sparse_score"])
    path = tmp_path / "cpu.toml"
    path.write_text(to_toml(measured))
    hw = load_profile(str(path))
    r = hw.attention_rates
    assert (r.prefix.xs, r.prefix.ys, r.own.xs, r.own.ys, r.dtype) == ((256, 1024), (256, 1024), (1, 2), (256, 1024), "fp32")
    assert hw.stage_gemm is not None and hw.stage_gemm.dtype == "fp32"
    peak = max(v for g in (r.prefix, r.own) for row in g.rates for v in row)
    assert hw.attention_efficiency == pytest.approx(min(1.0, peak / hw.flops_eff("fp32")), rel=1e-3)


def test_quantise_fit_is_over_the_builders_bytes(measured):
    # Fault caught: the quantise timed over other bytes than the simulator's `quant` stage counts
    # (pipeline/builder.py: the exact K/V read plus the records written), so its rate misprices it.
    from kvpipe.pipeline.lossy import LossySpec
    for p in measured.extra["quant_points"]:
        spec = LossySpec(p["quant"])
        raw = p["units"] * p["tokens"] * 2 * 128 * 4   # fp32 on the CPU, D 128
        assert p["bytes"] == raw + p["units"] * spec.unit_bytes(p["tokens"], 128, 4)
    assert {p["quant"] for p in measured.extra["quant_points"]} == {"int4", "int8"}
