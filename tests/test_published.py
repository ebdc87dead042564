"""Other systems' models (sim/baselines.py) and the published-figures table (benchmarks/published.py):
the transformations by hand, llama.cpp decode bound by its weight stream, and the table's sources
kept apart from the profiles'."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from benchmarks import published, published_rows
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload
from kvpipe.sim import baselines

ROOT = Path(__file__).resolve().parents[1]


def test_scores_bytes_by_hand():
    """Fault caught: the materialised scores of a micro-batch without flash attention counted over
    the causal triangle, over an unpadded KV view, or at another byte count per score element (the
    F16 result cuBLAS writes at CUBLAS_COMPUTE_16F and its conversion to F32 left out: 20 B).
    Hand-worked: 2 layers x 4 query heads x 40 queries x 64 cells (40 padded to 32s) x 24 B
    (2 + 2 + 4 + 4 + 4 + 4 + 2 + 2)."""
    m = replace(PRESETS["llama-2-7b"], layers=2, q_heads=4, kv_heads=4)
    hw = load_profile("rtx4090")
    want = 2 * 4 * 40 * 64 * 24 / hw.hbm_eff_bytes_per_s
    assert baselines.scores_seconds(m, 0, 40, hw) == want
    # a prompt of 600 tokens: micro-batches [0, 512) over 512 cells and [512, 600) over 608
    whole = baselines.prompt_scores_seconds(m, 600, hw)
    assert whole == (2 * 4 * 512 * 512 + 2 * 4 * 88 * 608) * 24 / hw.hbm_eff_bytes_per_s


def test_llamacpp_elementwise_bytes_by_hand():
    """Fault caught: llama.cpp's prompt kernels besides its GEMMs and scores counted at kvpipe's
    bf16 widths, a GEMM's F32->F16 input or F16->F32 output conversion left out, or a kernel of
    its Llama graph missing. Hand-worked on a toy layer (h 8, q 8, kv 4, i 16), kernel by kernel:
    norms 2 x 16h, input conversions 6 x (5h + q + i), output conversions 6 x (q + 2kv + 2h + 2i),
    RoPE 8 x (q + kv), cache copies 12 kv, Q / KQV / permute 20 q, SiLU and multiply 20 i,
    residuals 24 h."""
    m = replace(PRESETS["llama-2-7b"], hidden=8, q_heads=2, kv_heads=1, head_dim=4, intermediate=16, layers=3)
    want = 256 + 6 * (40 + 8 + 16) + 6 * (8 + 8 + 16 + 32) + 8 * 12 + 12 * 4 + 20 * 8 + 20 * 16 + 24 * 8
    assert baselines.elementwise_bytes(m) == want
    hw = load_profile("rtx4090")
    assert baselines.elementwise_seconds(m, 100, hw) == 100 * 3 * want / (hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency)


def test_fp16_accumulate_takes_the_profiles_acc16_rate_where_it_has_one():
    """Fault caught: llama.cpp's F16 GEMMs (cuBLAS CUBLAS_COMPUTE_16F) costed at a GeForce card's
    fp32-accumulate rate, or a workstation part's rate changed though it has no acc16 figure, or
    another dtype's rate touched."""
    hw = load_profile("rtx4090")
    acc = baselines.fp16_accumulate(hw)
    assert acc.flops_eff("fp16") == hw.fp16_acc16_flops_per_s == 317.5e12
    assert acc.flops_peak("fp16") == hw.fp16_acc16_peak_flops_per_s == 330.3e12
    assert acc.flops_eff("bf16") == hw.flops_eff("bf16")
    a100 = load_profile("a100-80g")
    assert a100.fp16_acc16_flops_per_s is None and baselines.fp16_accumulate(a100) == a100


def test_llamacpp_prompt_swaps_kvpipes_small_kernels_for_its_own():
    """Fault caught: a llama.cpp prompt's prediction keeping kvpipe's own small kernels beside
    llama.cpp's elementwise ones (both charged), or dropping the scores. Reference: the stages
    the row reports, which add up to the prediction, with `small` equal to elementwise_seconds."""
    p = published.predict_llamacpp("rtx3090", "llama-3-8b", "pp", 1024)
    hw = baselines.fp16_accumulate(baselines.native_issue(load_profile("rtx3090")))
    m = replace(PRESETS["llama-3-8b"], dtype="fp16")
    assert p["split"]["small"] == baselines.elementwise_seconds(m, 1024, hw)
    assert p["split"]["scores"] == baselines.prompt_scores_seconds(m, 1024, hw)
    assert abs(sum(p["split"].values()) - p["predicted"]) <= 1e-9 * p["predicted"]


def test_native_issue_charges_the_gpu_its_kernel_start_not_a_launch():
    """Fault caught: a C++ engine's kernels charged the GPU the profile's (PyTorch) launch cost each,
    or its host still paying kvpipe's Python issue per stage."""
    hw = load_profile("rtx4090")
    n = baselines.native_issue(hw)
    assert n.launch_overhead_s == hw.graph_node_s
    assert n.host_issue_s_per_op == hw.launch_overhead_s and n.host_issue_s_per_stage == 0.0
    assert n.host_prefill_issue_s_per_launch is None


def test_llamacpp_decode_is_bound_by_the_weight_stream():
    """Fault caught: llama.cpp's short-context decode predicted far above the time to stream its F16
    weights once per token (the old model's +70%: a launch per kernel charged to the GPU). Reference:
    weight bytes / the profile's HBM rate, in float64, and at most 10% more."""
    hw = load_profile("rtx4090")
    floor = PRESETS["llama-3-8b"].params * 2 / hw.hbm_eff_bytes_per_s
    got = published.predict_llamacpp("rtx4090", "llama-3-8b", "tg", 512)["predicted"]
    assert floor <= got <= 1.10 * floor


def test_headinfer_live_copies_hold_four_group_slots():
    """Fault caught: HeadInfer's memory modelled with kvpipe's two slots (its torch.cat copy, the
    prefetched next head and the evicting previous one left out), or the copies not counted in
    the GPU buffers. Hand-worked: group 1, 65536 + 16 tokens of capacity, one slot = 65552 x 512 B."""
    m, work = PRESETS["llama-3-8b"], Workload(65536, 16)
    plan = Plan(Method.HEADWISE, PhasePlan(1, 4096, 2), PhasePlan(1, 1, 2), 0, 0)
    four = baselines.live_copies(plan, baselines.HEADINFER_LIVE_COPIES)
    assert (breakdown(m, work, four).gpu_buffers - breakdown(m, work, plan).gpu_buffers
            == 2 * 65552 * 512)


def test_one_pass_prefills_the_whole_prompt():
    """Fault caught: HF's layer-offload baseline costed with kvpipe's chunked prefill activations."""
    plan = Plan(Method.LAYERWISE, PhasePlan(8, 4096, 2), PhasePlan(8, 1, 2), 0, 0)
    assert baselines.one_pass(plan, 50000).prefill.chunk == 50000


def test_validation_sources_are_not_profile_sources():
    """Fault caught: an end-to-end figure's source (a validation row's) used to build a bundled
    profile, so the table would validate a profile against its own input."""
    sources = {"2502.12574", "XiongjieDai/GPU-Benchmarks-on-LLM-Inference", "wdlctc/headinfer"}
    for toml in sorted((ROOT / "hw_profiles").glob("*.toml")):
        text = toml.read_text()
        assert not [s for s in sources if s in text], toml.name


def test_every_row_names_its_source_and_place():
    """Fault caught: a published figure without its URL and table/figure, or a llama-bench row whose
    tokens per second is not a positive figure."""
    rows = published_rows.HEADINFER_ROWS + published_rows.MAX_CONTEXT_ROWS
    assert all(r[-1].startswith("Table ") for r in rows)
    for *_, n, tps, source, where in published_rows.LLAMACPP_ROWS:
        assert source.startswith("https://github.com/XiongjieDai/") and where and tps > 0 and n > 0


def test_summary_by_hand():
    """Fault caught: medians over signed instead of absolute errors, or rows of one figure counted
    in another's summary."""
    rs = [{"what": "prefill_s", "error": e} for e in (-0.3, 0.1, 0.2)] + [{"what": "max_context", "error": 0.5}]
    s = published.summary(rs)
    assert s["prefill_s"] == {"rows": 3, "median_abs": 0.2, "max_abs": 0.3, "median_signed": 0.1, "over_25pct": 1}
    assert s["max_context"]["rows"] == 1 and "decode_s_per_token" not in s


def test_lmdeploy_decode_figure_by_hand():
    """Fault caught: TurboMind's decode per token read as 1 / throughput (its first token's latency
    left in) or divided by the wrong step count. Hand-worked: llama2-7b, prompt 1, out 128:
    (128 / 100.02 - 0.011) / 127."""
    row = next(r for r in published.lmdeploy_rows() if r["what"] == "decode_s_per_token")
    assert row["published"] == (128 / 100.02 - 0.011) / 127
    assert row["source"].startswith("https://github.com/InternLM/lmdeploy/") and "prompt 1, out 128" in row["where"]


def test_turbomind_first_token_is_the_prompt_less_one_then_a_decode_step():
    """Fault caught: LMDeploy's first-token latency predicted as a context pass over the whole
    prompt (TurboMind's ContextDecode skips the last prompt token, which its first decode step
    feeds), or without that decode step; a 1-token prompt given a context pass. Reference: the
    same simulator's TTFT of 127 tokens plus its decode step, simulated directly."""
    import pytest

    from kvpipe.pipeline.rules import default_plan
    from kvpipe.sim.simulate import simulate
    assert baselines.turbomind_first_token(128) == (127, 1)
    with pytest.raises(ValueError):
        baselines.turbomind_first_token(1)
    model = replace(PRESETS["llama-2-7b"], dtype="fp16")
    hw = baselines.native_issue(load_profile("a100-80g"))
    budgets = {"gpu": hw.gpu_mem_bytes, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    work = Workload(127, published.DECODE_STEPS)
    t = simulate(model, work, default_plan(Method.STANDARD, model, work, budgets), hw).report.timing
    got = published.predict_lmdeploy("llama-2-7b", 128, 128)["ttft_s"]
    assert got == t.ttft_s + t.decode_s_per_token


def test_prefill_split_adds_up_to_the_predicted_prefill():
    """Fault caught: the table's stage split of a prefill row leaving out a stage's seconds or
    counting one twice (GEMMs with their small kernels, a sampled prefill not scaled to the whole),
    or a stage's seconds left out (both rows are GPU-bound, so the GPU's parts fill the prefill),
    so the shares it prints do not describe the prediction. Reference: the row's own prediction."""
    for p in (published.predict_llamacpp("rtx4090", "llama-3-8b", "pp", 1024),
              published.predict_headinfer("headwise", 8, 100 * 1024, "prefill_s")):
        split = p["split"]
        assert abs(sum(split.values()) - p["predicted"]) <= 1e-9 * p["predicted"], split
        assert split["gemm"] > 0 and split["attn"] > 0 and split["small"] > 0
        assert split["waits"] <= 0.01 * p["predicted"]   # both run GPU-bound: a stage left out shows here
