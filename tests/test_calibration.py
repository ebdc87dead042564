"""pipeline/calibration.py: the fits `kvpipe calibrate` applies and the profile TOML it writes.
Expected values are computed by hand in each test, not by the module's helpers."""
import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.calibration import Calibration, fit_alpha_beta, half_rate_flops, to_toml


def test_alpha_beta_recovers_a_known_link():
    # Fault caught: slope and intercept swapped, or beta returned as seconds per byte.
    sizes = [65536, 1 << 20, 16 << 20, 256 << 20]
    secs = [10e-6 + n / 50e9 for n in sizes]         # alpha 10 us, beta 50 GB/s, by hand
    alpha, beta = fit_alpha_beta(sizes, secs)
    assert alpha == pytest.approx(10e-6, rel=1e-6) and beta == pytest.approx(50e9, rel=1e-9)


def test_alpha_beta_refuses_broken_timings():
    # Fault caught: a fit that returns a negative or infinite rate from timings that shrink with size.
    with pytest.raises(ValueError, match="seconds"):
        fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="sizes"):
        fit_alpha_beta([4, 4], [1.0, 1.0])


def test_half_rate_flops_recovers_h():
    # rate(f) = eff * f / (f + h) with eff = 800e12, h = 4e9: seconds = (f + h) / eff.
    # Fault caught: h computed from the inverse ratio (rate/eff - 1 is negative).
    eff, h = 800e12, 4e9
    pts = [(f, (f + h) / eff) for f in (1e8, 1e9, 4e9, 1e10, 1e13)]
    assert half_rate_flops(pts, eff) == pytest.approx(h, rel=1e-9)


def test_half_rate_flops_leaves_memory_bound_points_out():
    # Fault caught: a GEMV that is slow because it reads its weights (memory-bound) taken for a
    # small-shape FLOP penalty: h then charges every small kernel (decode attention included) the
    # weight-reading time of a GEMV. Points: (FLOPs, seconds, bytes / HBM rate).
    eff, h, hbm = 800e12, 1e11, 4e12
    weights = 1e9
    pts = [(f, max((f + h) / eff, weights / hbm), weights / hbm) for f in (1.2e8, 1.9e9, 1.5e10, 1.2e11, 5e11, 2e12)]
    assert half_rate_flops(pts, eff) == pytest.approx(h, rel=1e-9)
    assert half_rate_flops([p[:2] for p in pts], eff) > 1.5 * h     # without the memory times: inflated


def test_written_profile_loads_and_keeps_every_value(tmp_path):
    # Fault caught: a TOML key or section the loader does not know, or a float written as an int.
    base = load_profile("h200")
    cal = Calibration("lab", "a calibrated test box", "unit test, 2026-11-29")
    vals = {"gpu.mem_bytes": 25_000_000_000, "gpu.hbm_peak_bytes_per_s": 1.0e12, "gpu.hbm_eff_bytes_per_s": 9.0e11,
            "gpu.small_shape_half_flops": 2.5e9, "gpu.launch_overhead_s": 6e-6, "gpu.attention_efficiency": 0.5,
            "gpu.attention_plan_s": 0.0, "link.h2d_alpha_s": 1e-5, "link.h2d_bytes_per_s": 2.5e10,
            "link.d2h_alpha_s": 2e-5, "link.d2h_bytes_per_s": 2.4e10, "link.pcie_duplex": False,
            "host.mem_bytes": 64_000_000_000, "host.cpu_codec_bytes_per_s": 2e9, "disk.read_bytes_per_s": 3e9,
            "disk.write_bytes_per_s": 2e9, "disk.alpha_s": 8e-5, "disk.bytes": 10**12,
            "host.issue_s_per_stage": 1.5e-4, "host.issue_s_per_op": 4e-5, "host.graph_replay_s": 2.5e-4,
            "gpu.graph_node_s": 1e-6, "gpu.launch_queue_ops": 1024.0, "gpu.small_kernel_s": 2e-6,
            "gpu.elementwise_efficiency": 0.7}
    for dtype in base.dtypes:
        vals[f"gpu.compute.{dtype}.peak_flops_per_s"] = 1000e12
        vals[f"gpu.compute.{dtype}.effective_flops_per_s"] = 700e12
    for k, v in vals.items():
        cal.set(k, v, "by hand")
    path = tmp_path / "lab.toml"
    path.write_text(to_toml(cal))
    hw = load_profile(str(path))
    assert (hw.name, hw.h2d_bytes_per_s, hw.d2h_alpha_s, hw.pcie_duplex) == ("lab", 2.5e10, 2e-5, False)
    assert hw.flops_eff("bf16") == 700e12 and hw.attention_plan_s == 0.0 and hw.disk_bytes == 10**12
    text = path.read_text()
    assert "source: measured, by hand" in text and "unit test, 2026-11-29" in text


def test_calibrate_needs_cuda():
    # Fault caught: calibrate silently writing a profile from a CPU-only machine.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvpipe.executor.calibrate import calibrate
    with pytest.raises(ValueError, match="calibrate: needs a CUDA GPU"):
        calibrate(load_profile("h200"), "x")


def test_calibrate_cli_without_cuda_is_one_line_exit_2(capsys):
    # Fault caught: a traceback (or exit 0 with no profile) when calibrate runs on a CPU-only machine.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvpipe.cli import main
    assert main(["calibrate", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]
