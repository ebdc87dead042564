"""benchmarks/kernel_split.py and benchmarks/diag_stages.py: the per-stage kernel split the GPU
diagnosis of the simulator's misses relies on (issue 8 §3 / issue 10 §4)."""
import json

import pytest

from benchmarks.kernel_split import ANNOTATION_PREFIX, category, split


def _ev(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_kernel_names_fall_in_their_category():
    # Fault caught: FA2's kernel (its name carries cutlass types) counted as a GEMM, a cuBLAS /
    # nvjet GEMM or cuDNN's SDPA kernel counted as a small kernel, a memcpy as compute.
    assert category("kernel", "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, "
                              "false, cutlass::bfloat16_t>>") == "attention"
    assert category("kernel", "flash_fwd_splitkv_combine_kernel") == "attention"
    assert category("kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert category("kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert category("kernel", "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16>") == "gemm"
    assert category("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert category("kernel", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "small"
    assert category("kernel", "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "small"
    assert category("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)") == "copy"
    assert category("gpu_memset", "Memset (Device)") == "copy"


def test_split_ties_kernels_to_the_range_that_launched_them():
    # Fault caught: kernels attributed by their GPU time (they run long after the host moved on to
    # later stages) instead of by their launch; a launch outside every range silently dropped.
    ev = [_ev("user_annotation", f"{ANNOTATION_PREFIX}3", 100, 50),
          _ev("user_annotation", f"{ANNOTATION_PREFIX}4", 150, 50),
          _ev("cuda_runtime", "cudaLaunchKernel", 110, 2, corr=1),
          _ev("cuda_runtime", "cudaMemcpyAsync", 160, 2, corr=2),
          _ev("cuda_runtime", "cudaLaunchKernel", 170, 2, corr=3),
          _ev("cuda_runtime", "cudaLaunchKernel", 300, 2, corr=4),
          # GPU events run later, in the order launched; stage 3's GEMM ends during stage 4's range
          _ev("kernel", "nvjet_tst_gemm", 180, 40, tid=20, corr=1),
          _ev("gpu_memcpy", "Memcpy HtoD", 221, 10, tid=21, corr=2),
          _ev("kernel", "flash_fwd_kernel", 232, 30, tid=20, corr=3),
          _ev("kernel", "elementwise_kernel", 400, 5, tid=20, corr=4)]
    out = split(ev)
    assert out[3]["gemm"] == [pytest.approx(40e-6), 1] and out[3]["attention"] == [0.0, 0]
    assert out[4]["copy"] == [pytest.approx(10e-6), 1] and out[4]["attention"] == [pytest.approx(30e-6), 1]
    assert out[-1]["small"] == [pytest.approx(5e-6), 1]


@pytest.mark.gpu
def test_stage_ranges_tie_every_kernel_of_a_run_to_its_stage(tiny_model):
    # Fault caught: the diag hook opening ranges that nest or leak (one range left open swallows
    # the next stages' launches), stages without a range, or kernels not tied to a stage (the
    # correlation between a kernel and its launch lost): on a CUDA run of a tiny bf16 model under
    # the profiler, exactly one `kvpipe#<id>` range per stage, none overlapping on its thread, and
    # every GPU event of the run attributed to a stage, each attention stage holding attention
    # kernels and each qkv / mlp stage GEMMs. (GPU only: the profiler takes ~16 s to start on the
    # CPU box, and there are no kernels to tie there.)
    torch = pytest.importorskip("torch")
    import copy
    import tempfile

    from benchmarks.diag_stages import StageRanges
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    model = copy.deepcopy(tiny_model("llama", kv_heads=2, q_heads=4, head_dim=64, layers=2)).to("cuda", torch.bfloat16)
    spec = HFAdapter(model).spec()
    g = build(spec, Workload(512, 1, 1), Plan(Method.HEADWISE, PhasePlan(1, 256, 2), PhasePlan(1, 1, 2), 1, 0))
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(0)).cuda()
    execute(g, model, ids, "cuda")      # warm-up: kernels loaded, plans built
    hook = StageRanges()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as p:
        execute(g, model, ids, "cuda", stage_hook=hook)
        hook.close()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        p.export_chrome_trace(f"{d}/t.json")
        events = json.load(open(f"{d}/t.json"))["traceEvents"]
    ev = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith(ANNOTATION_PREFIX)]
    assert sorted(int(e["name"][len(ANNOTATION_PREFIX):]) for e in ev) == list(range(len(g.stages)))
    by_tid = {}
    for e in ev:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_tid.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    out = split(events)
    assert -1 not in out or sum(n for _, n in out[-1].values()) == 0, out.get(-1)
    for s in g.stages:
        if s.tag == "attn":
            assert out[s.id]["attention"][1] >= 1, s.name
        if s.tag in ("qkv", "mlp"):
            assert out[s.id]["gemm"][1] >= 1, s.name
