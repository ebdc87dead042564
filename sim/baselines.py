"""Other systems as the simulator predicts them: each way a system works differently from kvpipe's
executor is one named transformation here, with the source that says the system does it; the
table of published figures (benchmarks/published.py) predicts each system through these only.

llama.cpp (CUDA backend, `llama-bench`, the builds the validation figures name):
- `native_issue`: its ggml graph's kernels are launched from C++ on one stream, queued ahead of
  the GPU (ggml-cuda.cu, `ggml_backend_cuda_graph_compute`: a loop of launches, no sync per node),
  so the host pays the CUDA launch call per kernel and the GPU pays only each kernel's own start
  (the profile's `graph_node_s`), not kvpipe's eager Python issue.
- `scores_seconds`: llama-bench ran with `flash_attn = 0` (its default; printed in the sources'
  notebooks). Without flash attention, llm_build_kqv computes KQ = K Q^T over all KV cells of the
  micro-batch's view through cuBLAS (ggml_cuda_mul_mat_batched_cublas: CUBLAS_COMPUTE_16F, an F16
  result at GGML_PREC_DEFAULT, then converted to F32), softmaxes it (ggml_soft_max_ext: read and
  write F32), and multiplies V by it after converting it back to F16: SCORE_BYTES bytes of HBM
  traffic per score element, beside the FLOPs the simulator costs.
- `fp16_accumulate`: its F16 weight GEMMs go through ggml_cuda_op_mul_mat_cublas, which on NVIDIA
  parts calls cublasGemmEx with CUBLAS_COMPUTE_16F (fp16 accumulation, an F16 result); a GeForce
  card runs that at twice its fp32-accumulate rate (the profile's `fp16_acc16_*` fields).
- `elementwise_seconds`: its activations are F32 between kernels, and every cuBLAS GEMM converts
  its F32 input to F16 and its F16 result back to F32 (ggml_cuda_op_mul_mat_cublas); norms, RoPE,
  the K/V cache copies, SiLU, multiplies and residual adds are separate F32 kernels
  (llm_build_llama, llm_build_norm, llm_build_ffn). Those bytes replace kvpipe's own small-kernel
  list (HF's bf16 ops) in a prompt's prediction.
Source read: ggml-cuda.cu of the 2024 builds (ggml_cuda_op_mul_mat_cublas, ggml_cuda_mul_mat_batched_cublas)."""
from __future__ import annotations

from dataclasses import replace

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec

# KQ written F16 by cuBLAS (2) + its F16->F32 conversion read and write (2 + 4) + softmax read and
# write (4 + 4) + the F32->F16 conversion for KQV read and write (4 + 2) + the KQV GEMM's read (2)
SCORE_BYTES = 24
UBATCH = 512        # llama-bench's default n_ubatch (llama.cpp common/common.h, n_ubatch = 512)
KV_PAD = 32         # llama.cpp pads the KV view to 32 cells when flash attention is off (llama_kv_cache_get_padding)


def native_issue(hw: HardwareProfile) -> HardwareProfile:
    """The profile as a C++ engine that queues its kernels ahead of the GPU issues work: the host
    pays the profile's launch cost per kernel or copy and nothing per stage; the GPU pays
    `graph_node_s` per kernel (back-to-back kernels from a full queue), not a launch each."""
    return replace(hw, host_issue_s_per_stage=0.0, host_issue_s_per_op=hw.launch_overhead_s,
                   host_copy_s_per_stage=0.0, host_copy_s_per_op=hw.launch_overhead_s,
                   host_prefill_issue_s_per_stage=None, host_prefill_issue_s_per_launch=None,
                   host_prefill_issue_gap_s=None, launch_overhead_s=hw.graph_node_s)


def fp16_accumulate(hw: HardwareProfile) -> HardwareProfile:
    """The profile as llama.cpp's F16 GEMMs see it: fp16-accumulate rates in place of the `fp16`
    ones where the profile has them (a GeForce card); unchanged elsewhere (full-rate fp32 accumulate)."""
    if hw.fp16_acc16_flops_per_s is None:
        return hw
    eff, peak = dict(hw.flops_eff_per_s), dict(hw.flops_peak_per_s)
    eff["fp16"], peak["fp16"] = hw.fp16_acc16_flops_per_s, hw.fp16_acc16_peak_flops_per_s
    return replace(hw, flops_eff_per_s=eff, flops_peak_per_s=peak)


def elementwise_bytes(model: ModelSpec) -> int:
    """HBM bytes of one layer's non-GEMM, non-score kernels per prompt token in llama.cpp's graph,
    F32 activations (4 B) and F16 GEMM operands (2 B): h = hidden, q / kv = query / K-or-V width,
    i = intermediate."""
    h, i = model.hidden, model.intermediate
    q, kv = model.q_heads * model.head_dim, model.kv_heads * model.head_dim
    norms = 2 * (8 + 8) * h                    # rms_norm and the weight multiply, attention and FFN
    to_f16 = 6 * (3 * h + q + 2 * h + i)       # each GEMM's F32 input read, F16 copy written: q, k, v, o, gate, up, down
    to_f32 = 6 * (q + 2 * kv + h + 2 * i + h)  # each GEMM's F16 result read, F32 written
    rope = 8 * (q + kv)                        # RoPE on Q and K, F32 in and out
    cache = 2 * 6 * kv                         # K and V copied into the F16 cache
    attn = 6 * q + 6 * q + 8 * q               # Q to F16 for KQ, KQV's F16 result to F32, its permute made contiguous
    ffn = 8 * i + 12 * i                       # SiLU, then its multiply with up
    residual = 2 * 12 * h                      # two residual adds
    return norms + to_f16 + to_f32 + rope + cache + attn + ffn + residual


def elementwise_seconds(model: ModelSpec, tokens: int, hw: HardwareProfile) -> float:
    """GPU seconds of `elementwise_bytes` over `tokens` prompt tokens, every layer, at the profile's
    elementwise HBM rate."""
    return tokens * model.layers * elementwise_bytes(model) / (hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency)


def padded(cells: int) -> int:
    return -(-cells // KV_PAD) * KV_PAD


def scores_seconds(model: ModelSpec, start: int, tokens: int, hw: HardwareProfile) -> float:
    """GPU seconds of the materialised attention scores of `tokens` queries after `start` cached
    ones (one micro-batch), every layer: each query head scores every KV cell of the padded view."""
    elements = model.layers * model.q_heads * tokens * padded(start + tokens)
    return elements * SCORE_BYTES / hw.hbm_eff_bytes_per_s


def prompt_scores_seconds(model: ModelSpec, n: int, hw: HardwareProfile, ubatch: int = UBATCH) -> float:
    """`scores_seconds` over a prompt of `n` tokens in micro-batches of `ubatch`."""
    return sum(scores_seconds(model, s, min(ubatch, n - s), hw) for s in range(0, n, ubatch))


# HeadInfer (github.com/wdlctc/headinfer, headinfer/cache.py `OffloadedCache`, one cache entry per
# KV head): `update` concatenates the prefetched prefix and the new tokens with torch.cat (both
# live), `__getitem__` prefetches the next head while this one is in use, and the previous head's
# eviction runs on a side stream (its memory is not reusable until that copy ends): four copies of
# one group's KV on the GPU where kvpipe's depth-2 slots hold two.
HEADINFER_LIVE_COPIES = 4


def live_copies(plan, copies: int):
    """`plan` as its memory is when `copies` copies of a group's KV are live (its depth, in the
    memory model: pipeline/memory.py counts one group buffer per transfer slot)."""
    return plan.with_(prefill=replace(plan.prefill, depth=copies), decode=replace(plan.decode, depth=copies))


def one_pass(plan, context: int):
    """`plan` with the whole prompt in one forward: Hugging Face generate() prefills the prompt in
    one call whatever the cache (transformers GenerationMixin._sample: the first step's input is
    the whole prompt), so its activations are the full prompt's."""
    return plan.with_(prefill=replace(plan.prefill, chunk=context))


# LMDeploy TurboMind v0.1.0a1 (src/turbomind/models/llama/LlamaBatch.cc): `ContextDecode` runs the
# prompt less its last token ("subtract input/context len by 1 to skip last input token (will
# process with decoder later)"), then the loop's first `Generate` step (step_length 1,
# lmdeploy/turbomind/deploy/target_model/base.py) feeds that token to the decoder and samples the
# first output; benchmark/profile_generation.py times the first token at that step's stream output.
def turbomind_first_token(prompt: int) -> tuple[int, int]:
    """(tokens of TurboMind's context pass, decode steps before its first token) for a prompt of
    `prompt` tokens: the context pass skips the last prompt token, one decoder step takes it."""
    if prompt < 2:
        raise ValueError(f"turbomind_first_token: a context pass needs a prompt of 2 or more tokens, got {prompt}")
    return prompt - 1, 1
