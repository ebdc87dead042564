"""Several GPUs in the simulator and planner (sim/multi.py, sim/multi_choice.py, `kvpipe plan
--gpus N`): one rank's shard, its link under the shared host bandwidth, the collectives, the
layout search under per-GPU budgets; expected figures worked by hand from the shapes."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.hardware import HardwareFieldError
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.multi import Layout, collectives, layouts, link_rates, rank_budgets, rank_hardware, shard
from kvpipe.sim.multi_choice import consider, decide_multi
from kvpipe.sim.simulate import simulate

L8, L70 = PRESETS["llama-3-8b"], PRESETS["llama-3-70b"]
GIB = 2 ** 30


def test_rank_kv_and_weights_are_the_shard():
    """Fault: the shard keeps every KV head (or every layer under pp), so a rank is charged the
    whole KV cache; or the MLP is not split, so a rank's weights are not about 1/N."""
    for lay in (Layout(2), Layout(4), Layout(8), Layout(2, 2), Layout(1, 4)):
        rank = shard(L8, lay)
        assert rank.kv_bytes_per_token * lay.gpus == L8.kv_bytes_per_token   # 131072 / N
        assert rank.units * lay.gpus == L8.units
    r4 = shard(L70, Layout(4))
    # by hand, one layer of 70B over 4 ranks: q 8192x2048 + k,v 2x 8192x256 + o 2048x8192 + MLP 3x 8192x7168
    # + 2 norms of 8192; the embedding and head 2x (128256/4) x 8192
    layer = 8192 * 2048 * 2 + 2 * 8192 * 256 + 3 * 8192 * 7168 + 2 * 8192
    assert r4.params == 80 * layer + 2 * 32064 * 8192 + 8192


def test_70b_weights_need_tensor_parallel():
    """Fault: the layout search checks the whole model's weights against one GPU (70B never fits)
    or checks none (70B 'fits' one 24 GB card)."""
    hw = load_profile("h100-sxm")
    work = Workload(8192, 2, 1)
    budgets = {"gpu": 24 * 10**9, "host": 512 * GIB, "disk": 10**12}
    one = consider(L70, work, hw, budgets, Layout(1), lambda m: _request())
    assert one.why and one.why.startswith("gpu-mem:") and "cannot hold" in one.why
    four = consider(L70, work, hw, dict(budgets, gpu=48 * 10**9), Layout(4), lambda m: _request())
    assert four.why is None and four.fits, four.predicted.problems
    assert four.rank_model.weight_bytes < 48 * 10**9 < L70.weight_bytes


def _request():
    from kvpipe.sim.decide import Request
    return Request()


def _offloaded(model, work) -> Plan:
    """Every unit in pinned host RAM, one KV head per streamed group: decode is the link's."""
    return Plan(Method.HEADWISE, PhasePlan(1, 8192), PhasePlan(1, 1), resident=0)


def _decode_s(model, work, hw, lay: Layout) -> float:
    rank = shard(model, lay)
    rep = simulate(rank, work, _offloaded(rank, work), rank_hardware(hw, lay)).report
    return rep.timing.decode_s_per_token


def test_decode_link_time_halves_until_host_bandwidth_binds():
    """Fault: the rank streams the whole KV over its link (no speed-up), or the host bandwidth
    bound is ignored (2x where the host caps it), or applied though absent."""
    work = Workload(32768, 4, 1)
    free = replace(load_profile("rtx4090"), host_mem_bytes_per_s=1e12,   # 2 x 25 GB/s << 1 TB/s
                   h2d_bytes_per_s=25e9, d2h_bytes_per_s=26.5e9)
    one, two = _decode_s(L8, work, free, Layout(1)), _decode_s(L8, work, free, Layout(2))
    kv = 32768 * L8.kv_bytes_per_token   # 4 GiB a step over the link, by hand 0.172 s at 25 GB/s
    assert one == pytest.approx(kv / 25e9, rel=0.05) and two == pytest.approx(kv / 2 / 25e9, rel=0.05)
    assert one / two == pytest.approx(2.0, rel=0.05)
    capped = replace(free, host_mem_bytes_per_s=30e9)   # two links share 30 GB/s: 15 each
    assert link_rates(capped, Layout(2)) == (15e9, 15e9)
    assert link_rates(capped, Layout(1, 2)) == (25e9, 26.5e9)   # stages take turns: one link at a time
    two_capped = _decode_s(L8, work, capped, Layout(2))
    assert two_capped == pytest.approx(kv / 2 / 15e9, rel=0.05)
    assert link_rates(replace(free, host_mem_bytes_per_s=None), Layout(8)) == (25e9, 26.5e9)


def test_allreduce_cost_appears_per_layer():
    """Fault: the collectives are left out of the prediction, or counted once per step rather
    than twice per layer, or charged to one GPU."""
    hw = load_profile("rtx4090")   # peer: 25 us + bytes / 10 GB/s
    work = Workload(4096, 8, 1)
    plan = Plan(Method.HEADWISE, PhasePlan(1, 1024), PhasePlan(1, 1), resident=0)
    c = collectives(L8, work, plan, hw, Layout(2))
    # by hand: 64 all-reduces per forward; decode rows 1 x 4096 x 2 B, ring factor 2(2-1)/2 = 1
    step = 64 * (2.5e-5 + 8192 / 10e9)
    assert c.allreduces_per_token == 64 and c.decode_s_per_token == pytest.approx(step, rel=1e-12)
    assert c.prefill_s == pytest.approx(4 * 64 * (2.5e-5 + 1024 * 8192 / 10e9), rel=1e-12)
    assert c.total_s == pytest.approx(c.prefill_s + 8 * step, rel=1e-12)
    assert collectives(L8, work, plan, hw, Layout(1)).total_s == 0.0
    hw8 = load_profile("h100-sxm")   # pp 2 over tp 4: 2 x 32 layers' all-reduces, one stage send
    c8 = collectives(L8, work, plan, hw8, Layout(4, 2))
    ar = 1e-5 + 1.5 * 8192 / 360e9
    assert c8.decode_s_per_token == pytest.approx(64 * ar + 1e-5 + 8192 / 360e9, rel=1e-12)


def test_machine_report_adds_stages_and_collectives():
    """Fault: the machine's decode is the rank's alone (collectives or stages dropped)."""
    hw = load_profile("rtx4090")
    work = Workload(8192, 4, 1)
    opt = consider(L8, work, hw, {"gpu": 24 * 10**9, "host": 64 * GIB, "disk": 10**12}, Layout(1, 2),
                   lambda m: _request())
    rank = opt.decision.predicted.report.timing
    whole = opt.predicted.report.timing
    assert whole.decode_s_per_token == pytest.approx(2 * rank.decode_s_per_token + opt.collectives.decode_s_per_token)
    assert whole.prefill_s == pytest.approx(2 * rank.prefill_s + opt.collectives.prefill_s)
    assert opt.collectives.decode_s_per_token == pytest.approx(2.5e-5 + 8192 / 10e9)   # one send, no all-reduce


def test_budgets_per_gpu_and_shared_host():
    """Fault: host RAM is counted per GPU (N times the machine's) or the GPU budget is split."""
    b = rank_budgets({"gpu": 24, "host": 64, "disk": 80}, Layout(2, 2))
    assert b == {"gpu": 24, "host": 16, "disk": 20}


def test_layouts_and_pins():
    """Fault: a TP degree that does not divide the KV heads is searched, or a bad pin passes."""
    assert [(x.tp, x.pp) for x in layouts(L70, 8)] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert [(x.tp, x.pp) for x in layouts(L8, 16)] == [(1, 16), (2, 8), (4, 4), (8, 2)]   # tp 16 > 8 KV heads
    assert layouts(L8, 4, pp=2) == [Layout(2, 2)]
    for kwargs, flag in (({"tp": 3}, "tp:"), ({"tp": 2, "pp": 1}, "tp:"), ({"pp": 5}, "pp:")):
        with pytest.raises(ValueError, match=flag):
            layouts(L8, 4, **kwargs)
    with pytest.raises(ValueError, match="^tp: 16 does not divide"):
        layouts(L8, 16, tp=16)


def test_profile_multi_gpu_fields():
    """Fault: the loader drops [multi_gpu], or one peer figure comes without the other, or a
    layout over GPUs with no peer figures is predicted anyway."""
    hw = load_profile("rtx4090")
    assert (hw.host_mem_bytes_per_s, hw.peer_alpha_s, hw.peer_bytes_per_s) == (60e9, 2.5e-5, 10e9)
    with pytest.raises(HardwareFieldError, match="peer_bytes_per_s"):
        replace(hw, peer_bytes_per_s=None)
    bare = replace(hw, peer_alpha_s=None, peer_bytes_per_s=None)
    with pytest.raises(ValueError, match="^gpus: hardware 'rtx4090' has no GPU-to-GPU link"):
        decide_multi(L8, Workload(4096, 2, 1), bare, {"gpu": 24 * 10**9, "host": 64 * GIB, "disk": 10**12}, 2,
                     lambda m: _request(), tp=2)


def _plan_json(*argv):
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", *argv, "--json"], capture_output=True, text=True,
                       timeout=300)
    return r.returncode, (json.loads(r.stdout) if r.returncode in (0, 3) else None), r.stderr


def test_cli_answers_for_machines_the_user_does_not_own():
    """Fault: `--gpus` is ignored (one GPU's plan printed) or its JSON lacks the layout."""
    rc, out, err = _plan_json("--gpus", "2", "--hw", "rtx4090", "--model", "llama-3-8b", "--context", "128K")
    assert rc == 0, err
    m = out["multi_gpu"]
    assert m["gpus"] == 2 and m["tp"] * m["pp"] == 2 and m["rank_model"]["kv_heads"] * m["tp"] == 8
    assert m["collectives"]["decode_s_per_token"] > 0 and len(m["layouts"]) == 2
    rc, out, err = _plan_json("--gpus", "8", "--hw", "h100-sxm", "--model", "llama-3-70b", "--context", "1M")
    assert rc in (0, 3), err
    assert out["multi_gpu"]["gpus"] == 8 and {(x["tp"], x["pp"]) for x in out["multi_gpu"]["layouts"]} == \
        {(1, 8), (2, 4), (4, 2), (8, 1)}


@pytest.mark.parametrize("argv, flag", [(["--gpus", "2", "--tp", "3"], "--tp"), (["--tp", "2"], "--tp"),
                                        (["--gpus", "0"], "gpus")])
def test_cli_bad_layout_is_one_line(argv, flag):
    """Fault: a bad --gpus/--tp/--pp ends in a traceback or a plan instead of exit 2 naming it."""
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--context", "8K", *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and flag.lstrip("-") in r.stderr, r.stderr


def test_plan_gpus_never_imports_torch():
    """Fault: sim/multi.py or the --gpus path imports torch (kvpipe plan must start on a laptop)."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from kvpipe.cli import main\n"
            "assert main(['plan', '--gpus', '2', '--context', '8K', '--decode-tokens', '2', '--json']) == 0\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
