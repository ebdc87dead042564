"""Published end-to-end figures of GPUs we do not own, each beside the simulator's prediction of the
same workload with the plan or method that matches what the measured system does, and the error.
Only figures read in a cited source; every plan detail a source does not state is named in
`ASSUMED`. The profiles' own sources (micro-benchmarks, docs/HARDWARE.md) are disjoint from these.

  python -m benchmarks.published     # prints the table and medians, writes benchmarks/results/cpu-<date>-published.json

Systems:
- HeadInfer (Luo et al., arXiv 2502.12574), Tables 6 (prefill s) and 7 (decode s/token), Llama-3-8B,
  one RTX 4090 with 1 TB RAM (Table 3 caption); read from the paper's HTML tables as reproduced in
  github.com/deep-diver/ai-paper-reviewer content/paper-reviews/2502.12574/index.md. Its "head=h" is h
  KV heads per group (`--group h`), nothing resident. Its Standard and Layer-offload rows are the
  Hugging Face transformers baselines it measured (system "hf", plans standard / layerwise).
- llama.cpp `llama-bench`, F16 weights, as published in XiongjieDai/GPU-Benchmarks-on-LLM-Inference
  README.md (RunPod machines): Llama-3-8B table (pp N: N prompt tokens; tg N: N tokens generated
  from an empty prompt) and the LLaMA-7B overview tables (llama-bench defaults pp512 / tg128; the 7B
  shapes are the llama-2-7b preset's). Modelled as what llama.cpp does: the prompt in 512-token
  micro-batches (chunked, chunk 512), decode all on the GPU (standard), and its F16 GEMMs with fp16
  accumulation (`fp16_accumulate` below) issued from C++ (`native_issue`), cited from its source."""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan
from kvpipe.pipeline.rules import default_plan
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.simulate import simulate

HEADINFER = "https://arxiv.org/html/2502.12574v1"
LLAMACPP = "https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference/blob/main/README.md"
# llama.cpp's CUDA backend multiplies F16 weights with cublasGemmEx(..., CUBLAS_COMPUTE_16F, ...): fp16
# accumulation (ggml-cuda.cu, ggml_cuda_op_mul_mat_cublas). GeForce cards run it at twice their
# fp32-accumulate tensor rate; data-centre and workstation cards at the same rate. Peaks (dense):
FP16_ACC = {  # profile -> (fp16-accumulate peak FLOP/s, source)
    "rtx4090": (330.3e12, "NVIDIA Ada whitepaper, RTX 4090 peak FP16 tensor with FP16 accumulate 330.3 TFLOP/s"),
    "rtx3090": (142e12, "NVIDIA GA102 whitepaper, RTX 3090 peak FP16 tensor with FP16 accumulate 142 TFLOP/s"),
    "rtx6000-ada": (364.2e12, "NVIDIA RTX 6000 Ada datasheet: fp16 accumulate at the fp32-accumulate rate"),
    "a100-80g": (312e12, "NVIDIA A100 datasheet: 312 TFLOP/s FP16 tensor, either accumulation"),
}
LLAMACPP_SOURCE = "https://github.com/ggerganov/llama.cpp/blob/master/ggml-cuda.cu (ggml_cuda_op_mul_mat_cublas)"
HOST_BYTES = 10**12       # HeadInfer's 1 TB RAM
ASSUMED = ("HeadInfer: prefill chunk 4096 tokens for its chunked and head-wise rows, depth 2, 16 decode steps, "
           "Tables 6 and 7 on the RTX 4090 of its setup. llama.cpp: llama-bench's n_ubatch 512 as the chunk; "
           "tg N as 16 decode steps at context N/2 (the mean context of N steps from an empty prompt); pp N "
           "seconds = N / published tokens per second; the RunPod 'A100 80GB' taken as the SXM part of "
           "profile a100-80g; llama.cpp ran without flash attention (llama-bench's default then), which "
           "the simulator does not model (it costs attention as FA2): an unmodelled difference")
K, M = 1024, 1024 * 1024
# (system, profile, model, what, method, KV heads per group or None, context, published, where)
HEADINFER_ROWS = [
    ("hf", "standard", None, 10 * K, "prefill_s", 1.23, "Table 6, Standard"),
    ("hf", "standard", None, 20 * K, "prefill_s", 2.83, "Table 6, Standard"),
    ("hf", "layerwise", None, 40 * K, "prefill_s", 6.93, "Table 6, Layer-offload"),
    ("headinfer", "headwise", 8, 100 * K, "prefill_s", 30.2, "Table 6, HeadInfer head=8/group=1"),
    ("headinfer", "headwise", 8, 400 * K, "prefill_s", 357, "Table 6, HeadInfer head=8/group=1"),
    ("headinfer", "headwise", 2, 1 * M, "prefill_s", 2035, "Table 6, HeadInfer head=2/group=4"),
    ("headinfer", "headwise", 1, 1 * M, "prefill_s", 2054, "Table 6, HeadInfer head=1/group=8"),
    ("headinfer", "headwise", 1, 4 * M, "prefill_s", 27114, "Table 6, HeadInfer head=1/group=8"),
    ("hf", "standard", None, 10 * K, "decode_s_per_token", 0.03, "Table 7, Standard"),
    ("hf", "standard", None, 40 * K, "decode_s_per_token", 0.04, "Table 7, Standard"),
    ("hf", "layerwise", None, 100 * K, "decode_s_per_token", 0.66, "Table 7, Layer-offload"),
    ("hf", "layerwise", None, 400 * K, "decode_s_per_token", 2.58, "Table 7, Layer-offload"),
    ("headinfer", "headwise", 1, 100 * K, "decode_s_per_token", 0.71, "Table 7, HeadInfer head=1/group=8"),
    ("headinfer", "headwise", 4, 1 * M, "decode_s_per_token", 6.41, "Table 7, HeadInfer head=4/group=2"),
    ("headinfer", "headwise", 1, 1 * M, "decode_s_per_token", 6.51, "Table 7, HeadInfer head=1/group=8"),
    ("headinfer", "headwise", 1, 4 * M, "decode_s_per_token", 27.2, "Table 7, HeadInfer head=1/group=8"),
]
# (profile, model, 'pp' or 'tg', N tokens, published tokens per second, where)
LLAMACPP_ROWS = [
    ("rtx4090", "llama-3-8b", "pp", n, tps, "LLaMA 3 table, 4090 24GB, 8B F16, pp " + str(n))
    for n, tps in ((512, 9382.00), (1024, 9056.26), (4096, 6531.36), (8192, 4744.18))
] + [
    ("rtx4090", "llama-3-8b", "tg", n, tps, "LLaMA 3 table, 4090 24GB, 8B F16, tg " + str(n))
    for n, tps in ((512, 54.84), (1024, 54.34), (4096, 52.63), (8192, 50.88))
] + [
    ("rtx3090", "llama-3-8b", "pp", n, tps, "LLaMA 3 table, 3090 24GB, 8B F16, pp " + str(n))
    for n, tps in ((512, 4444.65), (1024, 4239.64), (4096, 3410.47), (8192, 2667.14))
] + [
    ("rtx3090", "llama-3-8b", "tg", n, tps, "LLaMA 3 table, 3090 24GB, 8B F16, tg " + str(n))
    for n, tps in ((512, 47.40), (1024, 46.51), (4096, 44.79), (8192, 42.62))
] + [
    (hw, "llama-2-7b", what, n, tps, f"overview tables, {label}, 7B_f16 ({'prompt eval' if what == 'pp' else 'eval'})")
    for hw, label, tg, pp in (("rtx4090", "4090 24GB", 60.78, 7348.69), ("rtx3090", "3090 24GB", 51.85, 3075.37),
                              ("rtx6000-ada", "RTX 6000 Ada 48GB", 50.56, 5403.6), ("a100-80g", "A100 80GB", 73.83, 5105.77))
    for what, n, tps in (("pp", 512, pp), ("tg", 128, tg))
]


def fp16_accumulate(hw, name: str):
    """The profile as llama.cpp's F16 GEMMs see it: the fp16 rate at the fp16-accumulate peak, scaled
    by the profile's own effective/peak ratio (the same GEMM, a different accumulator)."""
    peak, _ = FP16_ACC[name]
    ratio = hw.flops_eff("fp16") / hw.flops_peak("fp16")
    eff = dict(hw.flops_eff_per_s, fp16=peak * ratio)
    return replace(hw, flops_peak_per_s=dict(hw.flops_peak_per_s, fp16=peak), flops_eff_per_s=eff)


def native_issue(hw):
    """The profile as a C++ engine issues work: no Python per stage, each kernel launch or copy call
    costing the host what the CUDA launch itself costs (the profile's launch_overhead_s), and no
    separate prefill issue fit. llama.cpp launches its ggml graph's kernels from C++ (ggml-cuda.cu,
    ggml_backend_cuda_graph_compute), not from Python as kvpipe's executor does."""
    return replace(hw, host_issue_s_per_stage=0.0, host_issue_s_per_op=hw.launch_overhead_s,
                   host_copy_s_per_stage=0.0, host_copy_s_per_op=hw.launch_overhead_s,
                   host_prefill_issue_s_per_stage=None, host_prefill_issue_s_per_launch=None,
                   host_prefill_issue_gap_s=None)


def _simulate(model, work, plan, hw, budgets) -> tuple[object, bool]:
    fits = all(v <= budgets[p] for p, v in breakdown(model, work, plan).pools().items())
    return simulate(model, work, plan, hw).report.timing, fits


def predict_headinfer(method: str, group: int | None, context: int, what: str) -> dict:
    model, hw = PRESETS["llama-3-8b"], load_profile("rtx4090")
    work = Workload(context, 16 if what == "decode_s_per_token" else 0)
    budgets = {"gpu": hw.gpu_mem_bytes, "host": HOST_BYTES, "disk": hw.disk_bytes}
    plan = default_plan(Method(method), model, work, budgets)
    if group is not None:   # HeadInfer: every head offloaded, `group` heads per group in both phases
        plan = plan.with_(prefill=PhasePlan(group, plan.prefill.chunk, 2), decode=PhasePlan(group, 1, 2),
                          resident=0, disk=0)
    timing, fits = _simulate(model, work, plan, hw, budgets)
    return {"predicted": getattr(timing, what), "fits": fits, "plan": plan.describe()}


def predict_llamacpp(profile: str, model_name: str, kind: str, n: int) -> dict:
    model = replace(PRESETS[model_name], dtype="fp16")   # llama.cpp F16 weights and KV
    hw = native_issue(fp16_accumulate(load_profile(profile), profile))
    budgets = {"gpu": hw.gpu_mem_bytes, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    if kind == "pp":
        work = Workload(n, 0)
        plan = default_plan(Method.CHUNKED, model, work, budgets)
        plan = plan.with_(prefill=replace(plan.prefill, chunk=min(512, n)))
        timing, fits = _simulate(model, work, plan, hw, budgets)
        return {"predicted": timing.prefill_s, "fits": fits, "plan": plan.describe()}
    work = Workload(max(n // 2, 1), 16)
    plan = default_plan(Method.STANDARD, model, work, budgets)
    timing, fits = _simulate(model, work, plan, hw, budgets)
    return {"predicted": timing.decode_s_per_token, "fits": fits, "plan": plan.describe()}


def rows() -> list[dict]:
    out = []
    for system, method, group, ctx, what, value, where in HEADINFER_ROWS:
        p = predict_headinfer(method, group, ctx, what)
        out.append({"system": system, "hw": "rtx4090", "model": "llama-3-8b", "what": what, "context": ctx,
                    "method": method + (f" group {group}" if group else ""), "published": value,
                    "source": HEADINFER, "where": where, **p})
    for profile, model_name, kind, n, tps, where in LLAMACPP_ROWS:
        p = predict_llamacpp(profile, model_name, kind, n)
        what = "prefill_s" if kind == "pp" else "decode_s_per_token"
        value = n / tps if kind == "pp" else 1 / tps
        out.append({"system": "llama.cpp", "hw": profile, "model": model_name, "what": what, "context": n,
                    "method": "chunked 512, fp16 acc, C++ issue" if kind == "pp" else "standard, fp16 acc, C++ issue",
                    "published": value, "source": LLAMACPP, "where": where, **p})
    for r in out:
        r["error"] = r["predicted"] / r["published"] - 1
    return out


def summary(rs: list[dict]) -> dict:
    """Median and max |error| per figure kind, and the signed median."""
    out = {}
    for what in ("prefill_s", "decode_s_per_token"):
        errs = [r["error"] for r in rs if r["what"] == what]
        out[what] = {"rows": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                     "max_abs": max(abs(e) for e in errs), "median_signed": statistics.median(errs),
                     "over_25pct": sum(abs(e) > 0.25 for e in errs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        from benchmarks.result_file import result_file
        args.out = str(result_file("published"))
    rs = rows()
    summ = summary(rs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"assumed": ASSUMED, "fp16_accumulate": {k: v[1] for k, v in FP16_ACC.items()},
                                          "fp16_accumulate_source": LLAMACPP_SOURCE, "summary": summ,
                                          "rows": rs}, indent=2))
    print(f"published vs predicted (error = predicted / published - 1)\nassumed: {ASSUMED}")
    print(f"{'system':<10} {'hw':<12} {'model':<11} {'figure':<19} {'ctx':>6} {'plan':<30} "
          f"{'published':>10} {'predicted':>10} {'error':>7}  where")
    for r in rs:
        label = r["method"] + ("" if r["fits"] else " (NO FIT)")
        print(f"{r['system']:<10} {r['hw']:<12} {r['model']:<11} {r['what']:<19} {r['context']:>6} {label:<30} "
              f"{r['published']:>10.4g} {r['predicted']:>10.4g} {r['error']:>+7.0%}  {r['where']}")
    for what, s in summ.items():
        print(f"{what}: {s['rows']} rows, median |error| {s['median_abs']:.1%}, max {s['max_abs']:.1%}, "
              f"median signed {s['median_signed']:+.1%}, {s['over_25pct']} over 25%")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
