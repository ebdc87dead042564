"""Other systems as the simulator predicts them: each way a system works differently from kvpipe's
executor is one named transformation here, with the source that says the system does it; the
table of published figures (benchmarks/published.py) predicts each system through these only.

llama.cpp (CUDA backend, `llama-bench`, the builds the validation figures name):
- `native_issue`: its ggml graph's kernels are launched from C++ on one stream, queued ahead of
  the GPU (ggml-cuda.cu, `ggml_backend_cuda_graph_compute`: a loop of launches, no sync per node),
  so the host pays the CUDA launch call per kernel and the GPU pays only each kernel's own start
  (the profile's `graph_node_s`), not kvpipe's eager Python issue.
- `scores_seconds`: llama-bench ran with `flash_attn = 0` (its default; printed in the sources'
  notebooks). Without flash attention, llm_build_kqv computes KQ = K Q^T as an F32 tensor over all
  KV cells of the micro-batch's view, softmaxes it (ggml_soft_max_ext: read and write F32), and
  multiplies V by it through cuBLAS after converting it to F16 (read F32, write F16, read F16):
  SCORE_BYTES bytes of HBM traffic per score element, beside the FLOPs the simulator costs.
- its F16 GEMMs are costed at the profile's measured GEMM rate (the profile's `fp16` effective
  rate); the fp16-accumulate peak its cuBLAS call could reach on GeForce cards has no published
  measurement we found (benchmarks/published.md says so and shows that variant's error)."""
from __future__ import annotations

from dataclasses import replace

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec

# F32 KQ written (4) + softmax read and write (4 + 4) + F32->F16 conversion read and write (4 + 2)
# + the KQV GEMM's read of the F16 copy (2)
SCORE_BYTES = 20
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
