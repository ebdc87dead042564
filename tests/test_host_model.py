"""The per-phase host issue model: the fits of pipeline/calibration.py on hand-made
`host_stage_costs` records, the profile fields and their TOML keys, pipeline/cost.host_issue_seconds
with and without them, and the probe that records them. Each test names the fault it catches;
every expected figure is worked out by hand here, never by the code under test."""
from dataclasses import replace
from pathlib import Path

import pytest

from kvpipe.pipeline.builder import build
from kvpipe.pipeline.calibration import (compute_issue_fit, host_issue_fields, issue_gap, run_gap_fit)
from kvpipe.pipeline.cost import attention_plans, host_issue_seconds
from kvpipe.pipeline.hardware import HardwareFieldError
from kvpipe.pipeline.stage import Kind, Phase
from test_cost import HW
from test_memory import MHA, MHA_PLAN, MHA_WORK

REL = 1e-9


def group(phase, tag, kind, ops, small, n, seconds):
    return {"phase": phase, "tag": tag, "kind": kind, "ops": ops, "small_ops": small, "n": n, "median_s": seconds}


# Prefill compute groups exactly on host_s = 200 us + 30 us * (ops + small_ops); their ops alone do
# not order them as their launches do (the 2-op group has 9 launches, the 5-op group 6).
A, B = 200e-6, 30e-6
LINE = [group("prefill", "attn", "compute", 2, 7, 40, A + 9 * B), group("prefill", "attn", "compute", 5, 1, 10, A + 6 * B),
        group("prefill", "mlp", "compute", 8, 12, 20, A + 20 * B)]
NOISE = [group("prefill", "kv_store", "d2h", 8, 0, 30, 5e-3),        # a copy group far off the line
         group("decode", "qkv", "compute", 6, 20, 50, 9e-3)]          # the other phase, far off too


def test_compute_issue_fit_recovers_the_line_by_launches():
    """Faults caught: fitting against ops instead of ops + small_ops (the 2-op / 9-launch group
    then sits off the line and a, b come out wrong); copy groups or the other phase's groups
    taken into the fit."""
    a, b = compute_issue_fit(LINE + NOISE, "prefill")
    assert a == pytest.approx(A, rel=REL) and b == pytest.approx(B, rel=REL)


def test_compute_issue_fit_weights_groups_by_stage_count():
    """Fault caught: one point per group regardless of its stage count, so that a group of 2 head
    stages pulls the fit as hard as 400 attention stages. By hand: two groups on the line (5 and
    10 launches, 400 stages each) and one head group of 2 stages 100 us above it at 20 launches;
    weighted least squares over x = (5, 10, 20), w = (400, 400, 2), y = line + (0, 0, 100 us)."""
    pts = [(5, 400, A + 5 * B), (10, 400, A + 10 * B), (20, 2, A + 20 * B + 100e-6)]
    w = sum(n for _, n, _ in pts)
    mx = sum(n * x for x, n, _ in pts) / w
    my = sum(n * y for x, n, y in pts) / w
    slope = sum(n * (x - mx) * (y - my) for x, n, y in pts) / sum(n * (x - mx) ** 2 for x, n, _ in pts)
    kinds = [group("prefill", "t%d" % x, "compute", x, 0, n, y) for x, n, y in pts]
    a, b = compute_issue_fit(kinds, "prefill")
    assert b == pytest.approx(slope, rel=REL) and a == pytest.approx(my - slope * mx, rel=REL)
    # unweighted, the head group would move the slope by about a third of its excess per launch
    assert abs(b - B) < 0.1 * abs((A + 20 * B + 100e-6 - (A + 20 * B)) / 20)


def test_compute_issue_fit_clamps_a_negative_intercept_through_the_origin():
    """Fault caught: a negative per-stage cost reaching the profile (HardwareProfile refuses it)
    or the intercept dropped without refitting the slope. Points y = 40 us * x - 50 us at x = 2
    and 10 (equal weights): through the origin, b = sum(x y) / sum(x^2) by hand."""
    kinds = [group("prefill", "a", "compute", 2, 0, 1, 30e-6), group("prefill", "b", "compute", 10, 0, 1, 350e-6)]
    a, b = compute_issue_fit(kinds, "prefill")
    assert a == 0.0 and b == pytest.approx((2 * 30e-6 + 10 * 350e-6) / (4 + 100), rel=REL)


def test_compute_issue_fit_refuses_what_it_cannot_fit():
    """Faults caught: a record before `small_ops` fitted against ops silently; one launch count
    (no slope) or a falling slope fitted into a profile."""
    old = [{k: v for k, v in g.items() if k != "small_ops"} for g in LINE]
    with pytest.raises(ValueError, match="small_ops"):
        compute_issue_fit(old, "prefill")
    with pytest.raises(ValueError, match="two or more launch counts"):
        compute_issue_fit(LINE[:1], "prefill")
    falling = [group("prefill", "a", "compute", 2, 0, 1, 5e-4), group("prefill", "b", "compute", 9, 0, 1, 1e-4)]
    with pytest.raises(ValueError, match="do not grow"):
        compute_issue_fit(falling, "prefill")


RUNS = [{"stages": 100, "wall_s": 0.060, "host_s_sum": 0.045, "prefill_wall_s": 0.030, "prefill_host_s": 0.026,
         "prefill_stages": 40},
        {"stages": 300, "wall_s": 0.150, "host_s_sum": 0.120, "prefill_wall_s": 0.080, "prefill_host_s": 0.074,
         "prefill_stages": 160}]


def test_issue_gap_pools_the_runs_by_hand():
    """Faults caught: a mean of per-run ratios instead of the pooled gap; the whole run's wall
    (set-up, the final sync) taken for the phase's. (0.030 - 0.026 + 0.080 - 0.074) / 200 = 50 us."""
    assert issue_gap(RUNS) == pytest.approx(0.010 / 200, rel=REL)
    with pytest.raises(ValueError, match="prefill_wall_s"):
        issue_gap([{k: v for k, v in r.items() if not k.startswith("prefill")} for r in RUNS])


def test_run_gap_fit_by_hand():
    """Fault caught: the whole-run excess divided by stages (set-up charged to every stage) instead
    of its slope over stage counts. Excess 15 ms at 100 stages, 30 ms at 300: 75 us a stage + 7.5 ms."""
    fixed, per_stage = run_gap_fit(RUNS)
    assert per_stage == pytest.approx(0.015 / 200, rel=REL) and fixed == pytest.approx(0.0075, rel=REL)


def test_host_issue_fields_take_the_phase_walls_when_recorded():
    """Faults caught: the run-level slope used where the record has per-phase walls, or the
    per-phase gap demanded of an older record that has none (it falls back to the run slope)."""
    copies = [group("prefill", "kv_fetch", "h2d", o, 0, 4, 20e-6 + o * 5e-6) for o in (1, 8)]
    rec = {"per_kind": LINE + copies, "runs": RUNS}
    f = host_issue_fields(rec)
    assert f["host_prefill_issue_s_per_stage"] == pytest.approx(A, rel=REL)
    assert f["host_prefill_issue_s_per_launch"] == pytest.approx(B, rel=REL)
    assert f["host_copy_s_per_stage"] == pytest.approx(20e-6, rel=REL)
    assert f["host_copy_s_per_op"] == pytest.approx(5e-6, rel=REL)
    assert f["host_prefill_issue_gap_s"] == pytest.approx(50e-6, rel=REL)
    old = {"per_kind": LINE + copies, "runs": [{k: v for k, v in r.items() if not k.startswith("prefill")} for r in RUNS]}
    assert host_issue_fields(old)["host_prefill_issue_gap_s"] == pytest.approx(75e-6, rel=REL)
    assert "host_prefill_issue_gap_s" not in host_issue_fields(rec, gap=False)


def test_cost_uses_the_prefill_pair_and_gap_where_the_profile_has_them():
    """Faults caught: the per-phase pair ignored, applied to decode stages, or charged per op
    instead of per launch; the gap missing from prefill copy stages or charged to decode; a
    profile without the fields priced differently than before (old pair for every compute stage,
    no gap). Expected seconds by hand from the stage's ops, small_ops and plan count."""
    hw = replace(HW, host_prefill_issue_s_per_stage=3e-4, host_prefill_issue_s_per_launch=2e-5,
                 host_prefill_issue_gap_s=7e-5, host_copy_s_per_stage=3e-5, host_copy_s_per_op=2e-6)
    stages = build(MHA, MHA_WORK, MHA_PLAN).stages
    kinds = {(s.phase, s.kind) for s in stages}
    assert {(Phase.PREFILL, Kind.COMPUTE), (Phase.DECODE, Kind.COMPUTE), (Phase.PREFILL, Kind.D2H)} <= kinds
    assert any(s.small_ops for s in stages if s.phase is Phase.PREFILL and s.kind is Kind.COMPUTE)
    for s in stages:
        plans = attention_plans(s) * HW.attention_plan_s
        old = HW.host_issue_s_per_stage + s.ops * HW.host_issue_s_per_op + plans
        if s.kind in (Kind.H2D, Kind.D2H):
            want = (7e-5 if s.phase is Phase.PREFILL else 0.0) + 3e-5 + s.ops * 2e-6
        elif s.kind is Kind.COMPUTE and s.phase is Phase.PREFILL:
            want = 7e-5 + 3e-4 + (s.ops + s.small_ops) * 2e-5 + plans
        elif s.kind is Kind.COMPUTE:
            want = old
        else:
            continue
        assert host_issue_seconds(s, hw) == pytest.approx(want, rel=1e-12), s.name
        if s.kind is Kind.COMPUTE:
            assert host_issue_seconds(s, HW) == pytest.approx(old, rel=1e-12), s.name


def test_profile_fields_come_as_a_pair_and_load_from_toml(tmp_path):
    """Faults caught: half a prefill pair accepted (the cost would mix fits); the TOML keys not
    loaded (a calibrated profile's figures silently dropped) or a negative value accepted."""
    with pytest.raises(HardwareFieldError, match="host_prefill_issue_s_per_launch"):
        replace(HW, host_prefill_issue_s_per_stage=1e-4)
    import kvpipe.hw_profiles as hp
    from kvpipe.hw_profiles import ProfileError, load_profile
    text = (Path(hp.__file__).parent / "h200.toml").read_text()
    assert "prefill_issue" not in text
    lines = "prefill_issue_s_per_stage = 1.5e-4\nprefill_issue_s_per_launch = 2.5e-5\nprefill_issue_gap_s = 4e-5\n"
    path = tmp_path / "p.toml"
    path.write_text(text.replace("[host]\n", "[host]\n" + lines, 1))
    hw = load_profile(str(path))
    assert (hw.host_prefill_issue_s_per_stage, hw.host_prefill_issue_s_per_launch, hw.host_prefill_issue_gap_s) == (1.5e-4, 2.5e-5, 4e-5)
    path.write_text(text.replace("[host]\n", "[host]\n" + lines.replace("4e-5", "-4e-5"), 1))
    with pytest.raises(ProfileError, match="host.prefill_issue_gap_s"):
        load_profile(str(path))


def test_stage_cost_probe_records_groups_and_phase_walls_on_cpu():
    """The probe itself (executor/issue_probe.stage_costs) on a tiny random Llama run by the
    executor on CPU. Faults caught: groups keyed without `small_ops` (the fit then cannot run),
    stages of a phase missing from the groups, a phase wall shorter than its stages' summed issue
    seconds (the stamps taken after the issue instead of before it), decode walls recorded for a
    replayed decode (its stages have no issue of their own)."""
    import torch
    from kvpipe.executor.calibrate.host_issue import probe_model, stage_costs
    torch.manual_seed(0)
    model = probe_model("cpu", layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, intermediate_size=64)
    rec = stage_costs(model, "cpu", context=64, chunk=32, decode=2, plans=((1, 0.0), (2, 0.5)))
    assert all("small_ops" in k for k in rec["per_kind"])
    for r in rec["runs"]:
        assert r["decode_issue"] == "eager"
        for phase in ("prefill", "decode"):
            assert r[f"{phase}_wall_s"] >= r[f"{phase}_host_s"] > 0
        assert r["prefill_stages"] + r["decode_stages"] == r["stages"]
    assert sum(k["n"] for k in rec["per_kind"]) == sum(r["stages"] for r in rec["runs"])
    # the fits' inputs are there: compute groups of two or more launch counts, copies of 1 and 2 calls
    assert len({k["ops"] + k["small_ops"] for k in rec["per_kind"] if k["kind"] == "compute" and k["phase"] == "prefill"}) >= 2
    assert {k["ops"] for k in rec["per_kind"] if k["kind"] in ("h2d", "d2h")} >= {1, 2}


def test_calibrate_host_keys_round_trip_through_the_toml(tmp_path):
    """Fault caught: `kvpipe calibrate` writing host.prefill_issue_* keys (Calibration.set, to_toml)
    that the loader rejects as unknown or reads into the wrong field."""
    from kvpipe.hw_profiles import _FIELDS, load_profile
    from kvpipe.pipeline.calibration import Calibration, to_toml
    base = load_profile("h200")
    cal = Calibration("lab", "a calibrated test box", "unit test")
    for key, (field, _) in _FIELDS.items():
        if key not in ("name", "description"):
            cal.set(key, getattr(base, field), "copied from h200 for the test")
    for dtype in base.dtypes:
        cal.set(f"gpu.compute.{dtype}.peak_flops_per_s", base.flops_peak(dtype), "h200")
        cal.set(f"gpu.compute.{dtype}.effective_flops_per_s", base.flops_eff(dtype), "h200")
    cal.set("host.prefill_issue_s_per_stage", 1.25e-4, "by hand")
    cal.set("host.prefill_issue_s_per_launch", 1.5e-5, "by hand")
    cal.set("host.prefill_issue_gap_s", 3.5e-5, "by hand")
    path = tmp_path / "lab.toml"
    path.write_text(to_toml(cal))
    hw = load_profile(str(path))
    assert (hw.host_prefill_issue_s_per_stage, hw.host_prefill_issue_s_per_launch, hw.host_prefill_issue_gap_s) == (1.25e-4, 1.5e-5, 3.5e-5)


@pytest.mark.gpu
def test_calibrate_sets_the_prefill_host_fields_on_the_gpu():
    """On the GPU, `kvpipe calibrate`'s host step as it runs there (bf16 probe model, cuDNN/FA2
    attention, pinned copies). Faults caught: the probe failing on CUDA (stream hook, replay off),
    a fit that cannot run on its record, the fields not set or a gap below zero, a phase wall
    shorter than its stages' issue seconds."""
    from kvpipe.executor.calibrate.host_issue import host_stage_costs
    from kvpipe.pipeline.calibration import Calibration
    cal = Calibration("t", "t", "t")
    host_stage_costs(cal)
    for key in ("host.prefill_issue_s_per_stage", "host.prefill_issue_s_per_launch", "host.prefill_issue_gap_s",
                "host.copy_s_per_stage", "host.copy_s_per_op"):
        assert key in cal.values and cal.values[key] >= 0, key
    assert cal.values["host.prefill_issue_s_per_launch"] > 0
    for r in cal.extra["host_stage_costs"]["runs"]:
        assert r["prefill_wall_s"] >= r["prefill_host_s"] > 0
