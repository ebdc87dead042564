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
    assert "source: measured by kvpipe calibrate, by hand" in text and "unit test, 2026-11-29" in text


def test_calibrate_needs_cuda():
    # Fault caught: calibrate silently writing a profile from a CPU-only machine.
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from kvpipe.executor.calibrate.machine import calibrate
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


def test_relative_fit_recovers_a_known_link():
    # Fault caught: the weighted normal equations written wrong (slope and intercept swapped, or a
    # weight of t instead of 1/t^2): exact points must give alpha and beta back.
    from kvpipe.pipeline.calibration import fit_alpha_beta_relative
    sizes = [65536, 262144, 1 << 20, 4 << 20, 64 << 20]
    secs = [5e-6 + n / 50e9 for n in sizes]          # alpha 5 us, beta 50 GB/s, by hand
    alpha, beta = fit_alpha_beta_relative(sizes, secs)
    assert alpha == pytest.approx(5e-6, rel=1e-6) and beta == pytest.approx(50e9, rel=1e-6)


def test_relative_fit_keeps_alpha_where_the_plain_fit_loses_it():
    # Fault caught (issue 10 §4, 4k-g8-none decode +35%): the link's per-copy cost taken from an
    # unweighted fit, whose intercept the largest copies set: a 1% timing wobble on a 512 MiB copy
    # (~100 us) swamps a 5 us per-copy cost. Each point has a +-1% error (alternating, by hand);
    # the relative fit keeps alpha within 2 us of 5 us, the plain one misses it by > 10 us.
    from kvpipe.pipeline.calibration import fit_alpha_beta_relative
    sizes = [65536, 1 << 20, 16 << 20, 128 << 20, 512 << 20]
    secs = [(5e-6 + n / 50e9) * (1.01 if i % 2 else 0.99) for i, n in enumerate(sizes)]
    alpha_rel, _ = fit_alpha_beta_relative(sizes, secs)
    alpha_plain, _ = fit_alpha_beta(sizes, secs)
    assert abs(alpha_rel - 5e-6) < 2e-6
    assert abs(alpha_plain - 5e-6) > 10e-6


def test_relative_fit_without_fixed_cost_goes_through_the_origin():
    # Fault caught: a negative intercept kept (a copy that costs less than nothing), or clamped to
    # zero while keeping the slope of the line that needed it.
    from kvpipe.pipeline.calibration import fit_alpha_beta_relative
    sizes = [1e6, 2e6, 4e6]
    secs = [n / 40e9 - 1e-6 for n in sizes]      # a negative intercept by construction
    alpha, beta = fit_alpha_beta_relative(sizes, secs)
    # through the origin, relative least squares: slope = sum(x/t) / sum(x^2/t^2) by hand
    xs_ts = [x / t for x, t in zip(sizes, secs)]
    assert alpha == 0.0 and beta == pytest.approx(sum(v * v for v in xs_ts) / sum(xs_ts), rel=1e-9)


def test_decode_attention_table_round_trips_through_the_toml(tmp_path):
    # Fault caught: calibrate writing [gpu.decode_attention.g<G>] tables (Calibration.set keys
    # gpu.decode_attention.g<G>.call_s / .bytes_per_s) that the loader rejects, or the loader
    # giving one group's numbers to another; a table not named g<int> is a one-line error naming it.
    from kvpipe.hw_profiles import ProfileError
    base = load_profile("h200")
    cal = Calibration("lab", "a calibrated test box", "unit test")
    for key, (field, _) in __import__("kvpipe.hw_profiles", fromlist=["_FIELDS"])._FIELDS.items():
        if key not in ("name", "description"):
            v = getattr(base, field)
            cal.set(key, v, "copied from h200 for the test")
    for dtype in base.dtypes:
        cal.set(f"gpu.compute.{dtype}.peak_flops_per_s", base.flops_peak(dtype), "h200")
        cal.set(f"gpu.compute.{dtype}.effective_flops_per_s", base.flops_eff(dtype), "h200")
    cal.set("gpu.decode_attention.g8.call_s", 6e-6, "by hand")
    cal.set("gpu.decode_attention.g8.bytes_per_s", 3e12, "by hand")
    cal.set("gpu.decode_attention.g1.call_s", 1.5e-5, "by hand")
    cal.set("gpu.decode_attention.g1.bytes_per_s", 5e11, "by hand")
    path = tmp_path / "lab.toml"
    path.write_text(to_toml(cal))
    hw = load_profile(str(path))
    assert [(e.group, e.call_s, e.bytes_per_s) for e in hw.decode_attention] == [(1, 1.5e-5, 5e11), (8, 6e-6, 3e12)]
    path.write_text(to_toml(cal) + "\n[gpu.decode_attention.x1]\ncall_s = 1.0\nbytes_per_s = 1.0\n")
    with pytest.raises(ProfileError, match="gpu.decode_attention.x1"):
        load_profile(str(path))


@pytest.mark.gpu
def test_calibrate_decode_attention_and_copy_series_on_the_gpu():
    # Fault caught: the decode-attention probe timing something other than one attend_decode call
    # (its K/V bytes must be G * L * 2 * D * 2 by hand, and a call over 4x the keys must not be
    # faster), or the back-to-back copy series reporting more per copy than an isolated copy.
    torch = pytest.importorskip("torch")
    from kvpipe.executor.calibrate.attention import decode_attention_point
    from kvpipe.executor.calibrate.links import copy_series
    from kvpipe.executor.calibrate.timing import MiB, cuda_median_s
    b1, t1, calls = decode_attention_point(1, 8192)
    b4, t4, _ = decode_attention_point(1, 32768)
    assert b1 == 1 * 8192 * 2 * 128 * 2 and calls >= 32 and 0 < t1 <= t4 * 1.05
    host = torch.empty(32 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    one = cuda_median_s(lambda: dev[:MiB].copy_(host[:MiB], non_blocking=True), 5)
    queued, graphed = copy_series(lambda s, i: dev[i * s:(i + 1) * s].copy_(host[i * s:(i + 1) * s], non_blocking=True),
                                  16, MiB)
    assert 0 < queued <= one * 1.05 and graphed > 0


def test_copy_issue_fit_by_hand():
    # Fault caught: the copy issue fit taking compute stages in, or returning the rate (calls per
    # second) for the per-call seconds. Copy groups at a = 20 us, b = 5 us per call, a compute
    # group far off the line that must be ignored.
    from kvpipe.pipeline.calibration import copy_issue_fit
    kinds = [{"kind": k, "ops": o, "median_s": 20e-6 + o * 5e-6} for k, o in (("h2d", 1), ("h2d", 8), ("d2h", 4))]
    kinds.append({"kind": "compute", "ops": 5, "median_s": 1e-3})
    a, b = copy_issue_fit(kinds)
    assert a == pytest.approx(20e-6, rel=1e-9) and b == pytest.approx(5e-6, rel=1e-9)


def test_optional_copy_issue_fields_load_and_are_checked(tmp_path):
    # Fault caught: the loader requiring host.copy_s_per_* in every profile (they are optional),
    # dropping them when present, or accepting a negative one without naming it.
    from kvpipe.hw_profiles import ProfileError
    import kvpipe.hw_profiles as hp
    from pathlib import Path
    text = (Path(hp.__file__).parent / "h200.toml").read_text()
    base = text.replace("copy_s_per_stage", "x_copy_s_per_stage").replace("copy_s_per_op", "x_copy_s_per_op")
    base = "\n".join(line for line in base.splitlines() if "x_copy_s_per" not in line)
    path = tmp_path / "p.toml"
    path.write_text(base)
    assert load_profile(str(path)).host_copy_s_per_op is None
    path.write_text(base.replace("[host]\n", "[host]\ncopy_s_per_stage = 3e-05\ncopy_s_per_op = 2e-06\n"))
    hw = load_profile(str(path))
    assert (hw.host_copy_s_per_stage, hw.host_copy_s_per_op) == (3e-5, 2e-6)
    path.write_text(base.replace("[host]\n", "[host]\ncopy_s_per_op = -1e-06\n"))
    with pytest.raises(ProfileError, match="host.copy_s_per_op"):
        load_profile(str(path))


def test_a_failing_optional_step_leaves_its_table_out_and_says_so(capsys):
    """Fault caught: the codec step (nvCOMP, GPU only) failing aborts `kvpipe calibrate`, or leaves
    a half-written [codec.*] table the planner would then trust."""
    from kvpipe.executor.calibrate.machine import _optional
    from kvpipe.pipeline.calibration import Calibration, to_toml
    cal = Calibration("t", "d", "s")

    def half_then_fail(c):
        c.set("codec.x.compress_bytes_per_s", 1e9, "a first figure")
        c.set("codec.x.ratio", float("nan"), "then a non-finite one")   # set raises ValueError
    _optional(cal, "codec.x", half_then_fail)
    assert "codec.x" not in to_toml(cal) and cal.extra["codec.x"].startswith("not measured: ValueError")
    assert "codec.x not measured" in capsys.readouterr().err
