"""Tests of sim/planner.py and sim/estimate.py: the closed-form lane busy equals the simulator's,
its lower bounds hold, the search never returns a plan that does not fit, finds the brute-force
optimum (decode replayed or eager) on small synthetic machines, fills an A100 with resident heads, and the CLI refuses plan
files made for another model or schema and names the budget to raise when nothing fits."""
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import (ALLOCATOR_FLOOR_BYTES, ALLOCATOR_PERCENT, breakdown, chunk_sizes,
                                    gpu_budget_for)
from kvpipe.pipeline.model import PRESETS, ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.rules import GPU_FILL_FRACTION, HOST_KV_FRACTION, default_plan
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.estimate import LANES, step_busy
from kvpipe.sim.planner import (DEPTHS, OBJECTIVES, NoPlanFits, Pins, Space, _Search,
                                max_context, objective_value, search)
from kvpipe.sim.simulate import simulate

GiB = 2**30
FLOAT_TOL = 1e-9
TIE_TOL = 1e-4   # far below the simulator's own accuracy (its shortcuts hold 1%)


def tiny(layers=2, kv_heads=2, gqa=2, head_dim=32) -> ModelSpec:
    q = kv_heads * gqa
    return ModelSpec("tiny", "llama", layers, q * head_dim, q, kv_heads, head_dim, 2 * q * head_dim, 256)


@st.composite
def machines(draw) -> HardwareProfile:
    """A synthetic GPU machine with rates spread over orders of magnitude (which lane binds varies)."""
    f = lambda lo, hi: draw(st.floats(lo, hi))
    flops = f(1e11, 1e14)
    hbm = f(1e10, 3e12)
    return HardwareProfile(
        name="synthetic", description="drawn by hypothesis", gpu_mem_bytes=2**40,
        hbm_peak_bytes_per_s=hbm, hbm_eff_bytes_per_s=hbm, flops_peak_per_s={"bf16": flops},
        flops_eff_per_s={"bf16": flops}, small_shape_half_flops=f(0, 1e8),
        attention_efficiency=f(0.2, 1.0), launch_overhead_s=f(0, 1e-5), attention_plan_s=f(0, 1e-3),
        h2d_alpha_s=f(0, 1e-4), h2d_bytes_per_s=f(1e8, 1e11), d2h_alpha_s=f(0, 1e-4),
        d2h_bytes_per_s=f(1e8, 1e11), pcie_duplex=draw(st.booleans()), host_mem_bytes=2**40,
        disk_read_bytes_per_s=f(1e7, 1e10), disk_write_bytes_per_s=f(1e7, 1e10),
        disk_alpha_s=f(0, 1e-3), disk_bytes=2**40, cpu_codec_bytes_per_s=1e9,
        host_issue_s_per_stage=f(0, 2e-5), host_issue_s_per_op=f(0, 2e-6), graph_replay_s=f(0, 1e-4),
        graph_node_s=f(0, 1e-5), launch_queue_ops=f(1, 1024))


@st.composite
def problems(draw, tight: bool = True, shapes=((1, 2), (2, 2), (1, 4))):
    """(model, workload, machine, budgets): budgets from 'the leanest plan barely fits' to roomy;
    `tight` also draws budgets a little under that (nothing fits)."""
    layers, kv = draw(st.sampled_from(shapes))
    model = tiny(layers, kv, draw(st.sampled_from([1, 2])), draw(st.sampled_from([16, 64])))
    work = Workload(draw(st.integers(1100, 3500)), draw(st.integers(0, 4)))
    hw = draw(machines())
    lean = breakdown(model, work, Plan(Method.HEADWISE, PhasePlan(1, 1024, 2), PhasePlan(1, 1, 2), 0))
    kv_all = model.units * work.kv_capacity * model.kv_unit_bytes_per_token
    host = draw(st.floats(0.05, 1.5))     # share of the KV cache the host holds; disk about the rest
    slack = -0.05 if tight else 0.02
    staging = max(DEPTHS) * model.kv_heads * work.kv_capacity * model.kv_unit_bytes_per_token  # disk reads land here
    blocks = 3 * work.batch * 1024 * model.intermediate * model.dtype_bytes   # allocator room, 1K chunk
    # What the GPU budget lets resident units and the chunk's blocks fill (rules.gpu_fill): the
    # budget drawn is the smallest that fills this much (a fraction of it, or the allocator's allowance off it).
    fill = (lean.gpu + blocks) * draw(st.floats(1 + slack, 1.1)) + kv_all * draw(st.floats(0, 1.3))
    budgets = {"gpu": max(gpu_budget_for(fill), int(fill / GPU_FILL_FRACTION)),
               "host": int((kv_all * host + (0 if tight else staging)) / HOST_KV_FRACTION) + 1,
               "disk": int(kv_all * (max(0.0, 1.0 - host) + draw(st.floats(slack, 0.3)))) + 1}
    return model, work, hw, budgets


def divisors(n):
    return [g for g in range(1, n + 1) if n % g == 0]


def fits_planner_rules(model, work, plan, budgets) -> bool:
    """The planner's notion of fitting, written out: every pool within its budget (the GPU's less
    the allocator's allowance), KV and staging within HOST_KV_FRACTION of the host budget, and no
    more resident units than GPU_FILL_FRACTION of the GPU budget holds, nor than the allowance
    leaves (a plan with none resident may use the whole budget less the allowance)."""
    mem = breakdown(model, work, plan)
    gpu = budgets["gpu"]
    usable = gpu - max(ALLOCATOR_FLOOR_BYTES, math.ceil(gpu * ALLOCATOR_PERCENT / 100))   # by hand
    fill = min(gpu * GPU_FILL_FRACTION, usable)
    if mem.gpu > usable or mem.disk > budgets["disk"] or mem.host > budgets["host"] * HOST_KV_FRACTION:
        return False
    # allocator room for a searched chunk: three MLP intermediates of the chunk, bytes by hand
    blocks = 3 * work.batch * min(plan.prefill.chunk, work.context) * model.intermediate * model.dtype_bytes
    if mem.gpu + blocks > fill:
        return False
    if plan.resident == 0:
        return True
    streamed = breakdown(model, work, plan.with_(disk=0))
    return streamed.gpu <= fill


def every_plan(model, work):
    """Every head-wise plan of the space: groups per phase, chunks, depths, resident and disk units."""
    U = model.units
    for gp in divisors(model.kv_heads):
        for gd in divisors(model.kv_heads):
            for chunk in Space.of(model, work, Pins()).chunks:
                for depth in DEPTHS:
                    for r in range(U + 1):
                        for d in range(U - r + 1):
                            yield Plan(Method.HEADWISE, PhasePlan(gp, chunk, depth), PhasePlan(gd, 1, depth), r, d)


# ---- the closed-form lane estimate ----------------------------------------------------------

EST_CASES = [  # (layers, kv heads, context, decode, prefill group, decode group, chunk, resident, disk)
    (2, 4, 5000, 3, 1, 2, 1024, 3, 2),
    (3, 4, 4096, 2, 2, 4, 2048, 5, 4),
    (2, 2, 3000, 0, 1, 1, 1024, 0, 4),
    (2, 4, 2500, 4, 4, 1, 1000, 8, 0),
]


@pytest.mark.parametrize("case", EST_CASES)
@pytest.mark.parametrize("hw_name", ["rtx4090", "a100-80g"])
def test_step_busy_sums_to_the_simulated_lane_busy(case, hw_name):
    """Catches the closed form drifting from the builder's stages or the cost model: summed over
    every step it must equal the busy seconds per lane of the full simulation."""
    layers, kv, ctx, dec, gp, gd, chunk, r, d = case
    model, work, hw = tiny(layers, kv), Workload(ctx, dec), load_profile(hw_name)
    plan = Plan(Method.HEADWISE, PhasePlan(gp, chunk, 2), PhasePlan(gd, 1, 2), r, d)
    from kvpipe.sim.estimate import layer_classes, phase_layout
    cls = layer_classes(model, r, d)
    sizes = chunk_sizes(ctx, chunk)
    pre = {lane: 0.0 for lane in LANES}
    for i, n in enumerate(sizes):
        b = step_busy(model, work, hw, phase_layout(model, cls, gp), gp, True, i * chunk, n, i == len(sizes) - 1)
        pre = {lane: pre[lane] + b[lane] for lane in LANES}
    decb = {lane: 0.0 for lane in LANES}
    for k in range(dec):
        b = step_busy(model, work, hw, phase_layout(model, cls, gd), gd, False, ctx + k, 1, True)
        decb = {lane: decb[lane] + b[lane] for lane in LANES}
    sim = simulate(model, work, plan, hw, full=True).report.phase_busy_s
    for lane in LANES:
        assert pre[lane] == pytest.approx(sim["prefill"][lane], rel=FLOAT_TOL, abs=1e-12), lane
        assert decb[lane] == pytest.approx(sim["decode"][lane], rel=FLOAT_TOL, abs=1e-12), lane


@pytest.mark.parametrize("case", EST_CASES[:2] + EST_CASES[3:])
def test_replayed_decode_busy_matches_the_simulation_with_a_decode_attention_table(case):
    """Catches sim/estimate.py drifting from pipeline/cost.py on replayed decode steps when the
    profile has a measured [gpu.decode_attention] table (the planner would rank group sizes by a
    cost the simulator does not charge): the summed step busy equals the replayed simulation's."""
    from dataclasses import replace

    from kvpipe.pipeline.hardware import DecodeAttention
    from kvpipe.sim.estimate import layer_classes, phase_layout
    layers, kv, ctx, dec, gp, gd, chunk, r, d = case
    model, work = tiny(layers, kv), Workload(ctx, dec)
    hw = replace(load_profile("rtx4090"), decode_attention=(DecodeAttention(1, 9e-6, 3e11), DecodeAttention(4, 4e-6, 8e11)))
    plan = Plan(Method.HEADWISE, PhasePlan(gp, chunk, 2), PhasePlan(gd, 1, 2), r, 0)
    cls = layer_classes(model, r, 0)
    busy = 0.0
    for k in range(dec):
        busy += step_busy(model, work, hw, phase_layout(model, cls, gd), gd, False, ctx + k, 1, True, replayed=True)["gpu"]
    sim = simulate(model, work, plan, hw, full=True, replay=True).report.phase_busy_s
    assert busy == pytest.approx(sim["decode"]["gpu"], rel=FLOAT_TOL)
    plain = replace(hw, decode_attention=())
    assert sim["decode"]["gpu"] != pytest.approx(
        simulate(model, work, plan, plain, full=True, replay=True).report.phase_busy_s["decode"]["gpu"], rel=1e-3)


@settings(max_examples=20)
@given(problems(), st.data())
def test_lower_bounds_hold(problem, data):
    """Catches unsound pruning: the estimate's lower bound of each objective never exceeds the
    fully simulated value, for any plan of the space on any synthetic machine."""
    model, work, hw, _ = problem
    plan = data.draw(st.sampled_from(list(every_plan(model, work))[::7]))
    s = _Search(model, work, hw, {"gpu": 2**50, "host": 2**50, "disk": 2**50})
    plan = s.stamped(plan)
    if plan.replay is Replay.ON and data.draw(st.booleans()):   # the eager twin (its host issue in the bound)
        plan = plan.with_(replay=Replay.OFF)
    pred = simulate(model, work, plan, hw, full=True, replay=s.replays(plan), fuse=s.fuses(plan))
    for objective in OBJECTIVES:
        bound = s.estimate(plan).lower_bound(objective)
        assert bound <= objective_value(pred, objective) * (1 + FLOAT_TOL), (objective, plan.describe())


# ---- the search -------------------------------------------------------------------------------

@settings(max_examples=25)
@given(problems(), st.sampled_from(OBJECTIVES))
def test_search_never_returns_a_plan_that_does_not_fit(problem, objective):
    """Catches a returned plan (or runner-up) over a budget, and a 'no plan fits' error when some
    plan of the space does fit (checked by enumerating them all)."""
    model, work, hw, budgets = problem
    try:
        res = search(model, work, hw, budgets, objective=objective, full=True)
    except NoPlanFits as e:
        assert not any(fits_planner_rules(model, work, p, budgets) for p in every_plan(model, work)), str(e)
        return
    for cand in (res.best,) + res.alternatives:
        cand.plan.check(model, work)
        assert fits_planner_rules(model, work, cand.plan, budgets), cand.plan.describe()
        assert all(cand.prediction.report.peak_bytes[p] <= budgets[p] for p in budgets)


@settings(max_examples=6)
@given(problems(tight=False, shapes=((1, 2), (2, 2))), st.sampled_from(OBJECTIVES))   # <= 540 plans to simulate
def test_search_finds_the_brute_force_optimum(problem, objective):
    """Catches a search that prunes or ranks the best plan away: on machines small enough to
    simulate every fitting plan of the space, its choice is as good as the best of them (to
    TIE_TOL: e.g. one more unit on disk than needed can move a d2h-bound prefill by 1e-6)."""
    model, work, hw, budgets = problem
    fitting = [p for p in every_plan(model, work) if fits_planner_rules(model, work, p, budgets)]
    assert fitting, "the drawn budgets fit the leanest plan"
    # The planner puts on disk only what host RAM cannot hold (the disk count is not searched):
    # of plans that differ only in it, the one with the fewest disk units is the space.
    fewest = {}
    for p in fitting:
        key = (p.prefill, p.decode, p.resident)
        fewest[key] = min(fewest.get(key, p.disk), p.disk)
    fitting = [p for p in fitting if p.disk == fewest[(p.prefill, p.decode, p.resident)]]
    s = _Search(model, work, hw, budgets)     # as `run --fuse auto` would decode
    # Decode replayed where it can be, and (not for ttft, where decode issue does not count) eager too.
    fitting = [q for p in fitting for q in ([p.with_(replay=Replay.ON), p.with_(replay=Replay.OFF)] if s.can_replay(p)
                                            and objective != "ttft" else [s.stamped(p)])]
    best = min(objective_value(simulate(model, work, p, hw, full=True, replay=s.replays(p), fuse=s.fuses(p)),
                               objective) for p in fitting)
    res = search(model, work, hw, budgets, objective=objective, full=True)
    assert res.best.value <= best * (1 + TIE_TOL), (res.best.plan.describe(), res.best.value, best)


def test_llama2_7b_on_a100_at_128k_fills_the_gpu_with_resident_heads():
    """The issue's case: the rule kept 13 of 74 GiB in use (no resident heads) and predicted
    2.76 s/token. The planner must keep heads resident up to the fill fraction of the GPU and
    decode faster than the rule's plan."""
    hw, model, work = load_profile("a100-80g"), PRESETS["llama-2-7b"], Workload(131072, 32)
    budgets = {"gpu": hw.gpu_mem_bytes, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    res = search(model, work, hw, budgets)
    assert res.best.plan.source == "planner" and len(res.alternatives) == 2
    assert 0 < res.best.plan.resident < model.units
    unit = work.kv_capacity * model.kv_unit_bytes_per_token
    peak = res.best.prediction.report.peak_bytes["gpu"]
    assert budgets["gpu"] * GPU_FILL_FRACTION - 2 * model.kv_heads * model.layers * unit <= peak <= budgets["gpu"]
    rule = default_plan(Method.HEADWISE, model, work, budgets)
    assert rule.resident == 0
    rule_dec = simulate(model, work, rule, hw).report.timing.decode_s_per_token
    assert res.best.prediction.report.timing.decode_s_per_token < rule_dec / 2


def test_pins_fix_their_dimension():
    """Catches knobs the search overrides: pinned group, chunk and resident units are kept."""
    hw, model, work = load_profile("rtx4090"), PRESETS["llama-3-8b"], Workload(65536, 4)
    budgets = {"gpu": 20 * GiB, "host": 64 * GiB, "disk": 2**40}
    res = search(model, work, hw, budgets, Pins(group=2, chunk=8192, resident=40))
    for cand in (res.best,) + res.alternatives:
        p = cand.plan
        assert (p.prefill.group, p.decode.group, p.prefill.chunk, p.resident) == (2, 2, 8192, 40)


def test_a_pinned_plan_20_mib_under_the_gpu_cap_is_refused_naming_a_budget_that_fits():
    """Fault caught: a user-pinned plan predicted just under the GPU budget passing as fitting. On
    the H200, 128k-g2-some-c16k (group 2, 16K chunks, 80 resident units) was predicted at 23.98 GB
    under a 24.0 GB cap and ran out of memory: the caching allocator held 110 MiB reserved but
    unallocated (docs/PERFORMANCE.md). With every knob pinned and the budget 20 MiB over the
    plan's peak, the search must find no plan, name --gpu-mem, and the budget named must fit; a
    plan file of the same plan must report "fits: NO"."""
    import kvpipe
    hw, model, work = load_profile("h200-testbox"), PRESETS["llama-3-8b"], Workload(131072, 6)
    plan = Plan(Method.HEADWISE, PhasePlan(2, 16384, min(DEPTHS)), PhasePlan(2, 1, min(DEPTHS)), 80, 0, "user")
    peak = breakdown(model, work, plan).gpu
    budgets = {"gpu": peak + 20 * 2**20, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    pins = Pins(group=2, chunk=16384, resident=80)
    with pytest.raises(NoPlanFits) as err:
        search(model, work, hw, budgets, pins)
    msg = str(err.value)
    assert msg.startswith("gpu-mem:") and "--gpu-mem " in msg, msg
    named = msg.split("--gpu-mem ")[1].rstrip(")")
    assert named.endswith("GiB")
    res = search(model, work, hw, dict(budgets, gpu=int(float(named[:-3]) * GiB)), pins)
    assert res.best.plan.resident == 80 and res.best.prediction.report.peak_bytes["gpu"] == peak
    pred = kvpipe.plan(model="llama-3-8b", hw="h200-testbox", context=131072, decode_tokens=6,
                       gpu_mem=budgets["gpu"], plan=plan.to_json(model))
    assert not pred.fits and any("allocator allowance" in p for p in pred.predicted.problems)


def test_max_context_is_the_last_that_fits():
    """Catches an off-by-one or a non-monotone answer: the planner fits at the answer, not one past."""
    model, hw = tiny(2, 2), load_profile("rtx4090")
    budgets = {"gpu": gpu_budget_for(40 * 2**20), "host": 30 * 2**20, "disk": 10 * 2**20}   # 40 MiB usable
    ctx = max_context(model, 4, 1, budgets)
    assert ctx > 0
    search(model, Workload(ctx, 4), hw, budgets)
    with pytest.raises(NoPlanFits):
        search(model, Workload(ctx + 1, 4), hw, budgets)


# ---- the command line -------------------------------------------------------------------------

def kvpipe(*args):
    return subprocess.run([sys.executable, "-m", "kvpipe", *args], capture_output=True, text=True, timeout=600)


def test_plan_out_round_trips_and_wrong_model_or_schema_is_refused(tmp_path):
    """Catches a plan file read for the wrong model or from an older layout (the mismatch must
    be named on one line, exit 2) and --out writing something `--plan` cannot read back."""
    path = tmp_path / "plan.json"
    common = ("--context", "16K", "--decode-tokens", "2", "--json")
    r = kvpipe("plan", "--model", "llama-3-8b", *common, "--out", str(path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["plan"]["source"] == "planner" and len(out["alternatives"]) == 2
    assert all({"plan", "predicted"} <= set(a) for a in out["alternatives"])
    saved = json.loads(path.read_text())
    assert saved["model"] == "llama-3-8b" and saved["schema"] == out["plan"]["schema"]
    again = json.loads(kvpipe("plan", "--model", "llama-3-8b", *common, "--plan", str(path)).stdout)
    assert again["plan"]["prefill"] == saved["prefill"] and again["plan"]["resident"] == saved["resident"]
    r = kvpipe("plan", "--model", "mistral-7b", *common, "--plan", str(path))
    assert r.returncode == 2 and "llama-3-8b" in r.stderr and "mistral-7b" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    old = {k: v for k, v in saved.items() if k not in ("schema", "model")}
    path.write_text(json.dumps(old))
    r = kvpipe("plan", "--model", "llama-3-8b", *common, "--plan", str(path))
    assert r.returncode == 2 and "schema" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_no_plan_fits_names_the_smallest_budget():
    """Catches an unhelpful refusal: the message names the pool and a budget that then fits."""
    r = kvpipe("plan", "--context", "4M", "--host-mem", "10GB", "--disk-mem", "20GB")
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1
    line = r.stderr.strip()
    assert "disk-mem" in line
    need = line.split("--disk-mem ")[1].split()[0]
    ok = kvpipe("plan", "--context", "4M", "--host-mem", "10GB", "--disk-mem", need, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["fits"], ok.stderr


def test_no_plan_fits_for_the_gpu_names_the_gpu_budget_with_the_allocators_room():
    """Catches a refusal that names the wrong pool: when the GPU fits the leanest plan's bytes but
    not the slack the search leaves the allocator (GPU_FILL_FRACTION, the chunk's blocks), the
    message named host-mem (llama-3-70b on h200 at 4M with 4 TiB of disk said "--disk-mem 1172GiB"
    with 4 TiB available). It must name --gpu-mem, and that budget must then fit."""
    model, hw, work = PRESETS["llama-3-8b"], load_profile("rtx4090"), Workload(2**20, 4, 1)
    budgets = {"gpu": model.weight_bytes + 2 * GiB, "host": 512 * GiB, "disk": 4096 * GiB}
    with pytest.raises(NoPlanFits) as err:
        search(model, work, hw, budgets)
    msg = str(err.value)
    assert msg.startswith("gpu-mem:") and "--gpu-mem " in msg, msg
    need = msg.split("--gpu-mem ")[1].rstrip(")")
    assert need.endswith("GiB")
    budgets["gpu"] = int(float(need[:-3]) * GiB)
    res = search(model, work, hw, budgets)
    mem = breakdown(model, work, res.best.plan)
    assert all(v <= budgets[p] for p, v in mem.pools().items())


def test_a_pinned_chunk_without_the_allocators_room_is_warned_and_the_searched_one_is_not():
    """Fault caught: a user-pinned prefill chunk that breaks the planner's room rule (three MLP
    blocks beside the predicted peak) passing silently. The H200 runs of 2026-11-30 with 32K-token
    chunks at 24 GB (32K group 2, 128K group 8, all streamed) died of fragmentation. Room computed
    here by hand: 3 x 32768 tokens x 14336 x 2 bytes = 2.625 GiB."""
    import kvpipe
    kw = dict(model="llama-3-8b", hw="rtx4090", context="128K", decode_tokens=4, gpu_mem="24GB",
              group="8", resident="none")
    warned = [w for w in kvpipe.plan(chunk="32K", **kw).warnings if w.startswith("chunk:")]
    assert len(warned) == 1 and "2.6 GiB" in warned[0] and "32K-token" in warned[0]
    assert not [w for w in kvpipe.plan(chunk="4K", **kw).warnings if w.startswith("chunk:")]
    assert not [w for w in kvpipe.plan(**kw).warnings if w.startswith("chunk:")]   # the search keeps the room
