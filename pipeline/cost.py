"""Seconds of one stage on one machine: a pure function of the stage's cost inputs and the
hardware profile (roofline for compute, alpha + bytes/beta for transfers)."""
from __future__ import annotations

from .codecs import H2D_BLOCK_TOKENS
from .hardware import HardwareProfile
from .lossy import PIPE_UNITS, QUANT_ENCODE_OPS, QUANT_TAIL_OPS
from .stage import Kind, Phase, Stage


def compute_seconds(flops: float, mem_bytes: float, ops: int, hw: HardwareProfile, dtype: str,
                    tag: str = "", replayed: bool = False, small_shape: bool = True) -> float:
    """Roofline with an efficiency that falls for small shapes: a kernel of `f` FLOPs runs at
    eff * f / (f + half), i.e. takes (f + half) / eff; memory traffic at the effective HBM rate;
    plus a launch overhead per kernel (the graph node time when replayed). `small_shape=False`:
    a kernel that is not GEMM-shaped in its rows (`split_kv_attention`) pays no `half`. A qkv or
    mlp stage takes its own rate and half where the profile has [gpu.stage_gemm] for `dtype`."""
    launch = hw.graph_node_s if replayed else hw.launch_overhead_s
    if few_row_gemm(flops, mem_bytes, tag, hw):
        return max(flops / hw.flops_eff(dtype), mem_bytes / hw.decode_gemm_bytes_per_s) + ops * launch
    rate = hw.flops_eff(dtype) * (hw.attention_efficiency if tag == "attn" else 1.0)
    half = hw.small_shape_half_flops if small_shape else 0.0
    own = hw.stage_gemm.of(tag) if hw.stage_gemm is not None and hw.stage_gemm.dtype == dtype else None
    if own is not None:
        rate, half = own
    arith = (flops + half) / rate if flops else 0.0
    return max(arith, mem_bytes / hw.hbm_eff_bytes_per_s) + ops * launch


GEMV_FLOPS_PER_BYTE = 16   # under this, a GEMM has a handful of rows (a decode step's): it streams its weights


def few_row_gemm(flops: float, mem_bytes: float, tag: str, hw: HardwareProfile) -> bool:
    """Whether a GEMM stage is a few-row one costed at the profile's measured weight-read rate
    (`decode_gemm_bytes_per_s`): such a kernel is bound by its weights' bytes, not by the rate
    curve `small_shape_half_flops` was fitted on (thousands of rows); charged that half, a decode
    step's qkv cost 51 us against 12 us of weights on h200-testbox."""
    return (hw.decode_gemm_bytes_per_s is not None and tag not in ("attn", "score") and flops > 0
            and flops < GEMV_FLOPS_PER_BYTE * mem_bytes)


def measured_compute_seconds(s: Stage, hw: HardwareProfile, dtype: str, replayed: bool) -> float | None:
    """GPU seconds of a compute stage from the profile's rates measured at the run's shapes, or
    None where the profile has none for it: a prefill attention from [gpu.attention_rates] (its
    causal call and its prefix call each at the rate of their shape, pipeline/run_rates.py); a
    quantise that fills blocks (LOSSY) as `quant_call_s + bytes / quant_bytes_per_s`, beside its
    tail copies. The roofline's memory term and the launches stay."""
    launch = hw.graph_node_s if replayed else hw.launch_overhead_s
    rates = hw.attention_rates
    if s.tag == "attn" and s.phase is Phase.PREFILL and rates is not None and rates.dtype == dtype and s.flops:
        start, end = s.tokens
        arith = rates.seconds(s.flops, max(1, len(s.heads)), start, end - start)
        return max(arith, s.mem_bytes / hw.hbm_eff_bytes_per_s) + s.ops * launch
    if s.tag == "quant" and hw.quant_call_s is not None and s.ops > QUANT_TAIL_OPS:
        fills = (s.ops - QUANT_TAIL_OPS) // QUANT_ENCODE_OPS
        return fills * (hw.quant_call_s + s.mem_bytes / hw.quant_bytes_per_s) + QUANT_TAIL_OPS * launch
    return None


def small_seconds(kernels: int, nbytes: float, hw: HardwareProfile, replayed: bool = False) -> float:
    """GPU seconds of a stage's small kernels (pipeline/layer_ops.py): their bytes at the
    elementwise rate, and never less than the per-kernel floor for each (one token's kernel;
    outside a graph a kernel also costs at least a launch)."""
    if not kernels:
        return 0.0
    floor = hw.small_kernel_s if replayed else max(hw.small_kernel_s, hw.launch_overhead_s)
    return max(kernels * floor, nbytes / (hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency))


def stage_small_seconds(s: Stage, hw: HardwareProfile, replayed: bool = False) -> float:
    """Small kernels of compute stage `s`. A replayed decode attention attends prefix and token in
    one call (executor/replay/device_step.py): no repeat, no LSE merge; its output copy remains, and with a
    transfer slot the new token's write into the slot."""
    if replayed and s.tag == "attn":
        return small_seconds(1 + (s.slot is not None), 0.0, hw, True)
    return small_seconds(s.small_ops, s.small_bytes, hw, replayed)


def split_kv_attention(s: Stage) -> bool:
    """A decode step's attention: one query token per head, the keys split across the SMs (FA2's
    split-KV, executor/layers/attention.py). `small_shape_half_flops` is the rate curve of a GEMM with few
    rows (fitted on [T, 4096] x [4096, 14336]: idle tiles); this kernel has no such rows, its time is
    its KV read at the HBM rate and its launches, so it pays no `half` (it was charged ~46 us a
    group on h200-testbox: group-1 decode predicted 1.85x the measurement)."""
    return s.tag == "attn" and s.phase is Phase.DECODE


# executor/session.WARMUP_MAX_TOKENS (tests/test_cost.py holds them equal): `kvpipe run` warms up
# on its first prefill chunk cut to this length, so that chunk's own attention plan is cached.
WARMUP_TOKENS = 8192
CUDNN_MIN_ROWS = 256   # executor/attention.CUDNN_MIN_ROWS: shorter chunks attend on FA2 (no plan)


def attention_plans(s: Stage) -> int:
    """cuDNN execution plans the first attention call of a prefill chunk builds (its layer 0,
    group 0; every later call of the chunk has the same shapes). One for its prefix: every chunk's
    prefix length is new. One for its own causal attention when the chunk's length is new: the
    warm-up ran the first chunk cut to WARMUP_TOKENS, and every chunk but the last has the first's
    length (`start // step`). (The warm-up's second chunk, CUDNN_MIN_ROWS tokens over the first,
    pays the process's one-time first prefix attention; its plan serves no chunk of the run unless
    the chunk is CUDNN_MIN_ROWS tokens, which this count ignores.) Decode, and chunks under
    CUDNN_MIN_ROWS, run on FA2: no plans."""
    if not (s.tag == "attn" and s.phase is Phase.PREFILL and s.layer == 0 and s.group == 0):
        return 0
    start, end = s.tokens
    n = end - start
    own = n >= CUDNN_MIN_ROWS
    if start == 0:
        return int(own and n > WARMUP_TOKENS)
    chunk = start // s.step
    return 1 + int(own and n != chunk and n != min(chunk, WARMUP_TOKENS))


def host_issue_seconds(s: Stage, hw: HardwareProfile) -> float:
    """Host seconds to issue `s` eagerly: a fixed cost per stage plus one per launch or copy call,
    plus the cuDNN execution plan of a new attention shape. The plan is built on the host inside
    the attention call (`attention_plans`; `kvpipe calibrate` times one as first call minus steady
    call); the GPU
    stalls only once it has run out of the work queued before it (the simulator's host lane and
    launch queue), so it no longer counts as GPU time: charged to the GPU it over-predicted the
    prefill of rows whose host runs ahead (8k-g1-none-c4k +16%, one plan; 16k-g8-none-c4k +20%,
    three). A copy stage costs `host_copy_s_per_stage + ops * host_copy_s_per_op` where the profile
    has them (calibrate: the executor's copy stages timed one by one): issued with the compute
    figures, a replayed step's 32 eager write-backs of 8 copies cost 22 ms of host on h200-testbox
    (4k-g8-none-c4k decode predicted +90%) where the executor spends ~6 ms.
    A prefill compute stage costs `host_prefill_issue_s_per_stage + (ops + small_ops) *
    host_prefill_issue_s_per_launch` where the profile has that pair (calibrate: prefill stages
    alone, each small kernel a launch too; the old pair is fitted on decode step times against ops),
    and every prefill stage adds `host_prefill_issue_gap_s` where the profile has it: the host time
    between issues that no stage's own issue time holds (actor turns, stream-event waits), measured
    by the same probe (benchmarks/SIMMODEL.md, "Host issue per phase")."""
    gap = (hw.host_prefill_issue_gap_s or 0.0) if s.phase is Phase.PREFILL else 0.0
    plans = attention_plans(s) * hw.attention_plan_s
    if s.kind in (Kind.H2D, Kind.D2H) and hw.host_copy_s_per_op is not None:
        return gap + (hw.host_copy_s_per_stage or 0.0) + s.ops * hw.host_copy_s_per_op
    if s.phase is Phase.PREFILL and s.kind is Kind.COMPUTE and hw.host_prefill_issue_s_per_launch is not None:
        launches = s.ops + s.small_ops
        return gap + hw.host_prefill_issue_s_per_stage + launches * hw.host_prefill_issue_s_per_launch + plans
    return gap + hw.host_issue_s_per_stage + s.ops * hw.host_issue_s_per_op + plans


def replayed_decode_attention_seconds(group: int, kv_bytes: float, mem_bytes: float,
                                      hw: HardwareProfile) -> float | None:
    """The fused kernel of a replayed decode attention (executor/attention.attend_decode, one call
    per head group) from the profile's measured [gpu.decode_attention] table: per group size a
    per-call cost and the rate at which the call reads its `kv_bytes` of K/V; the stage's other
    device traffic (`mem_bytes - kv_bytes`: the query, its output, a mixed group's resident heads
    copied into the slot) at the HBM copy rate. None without a table (the roofline stands in).
    The roofline charged one KV head's keys at the copy rate: group-1 steps were predicted 23-34%
    short on the H200, where a call reads its few heads far below it."""
    call = hw.decode_attention_seconds(group, kv_bytes)
    if call is None:
        return None
    return call + max(0.0, mem_bytes - kv_bytes) / hw.hbm_eff_bytes_per_s


def unit_pipelined(s: Stage, replayed: bool) -> int:
    """Pieces (of PIPE_UNITS units, `Stage.pieces`: the builder's, where a step selects quantised
    blocks) a replayed sparse decode `score` stage ranks and selects one after another (LOSSY,
    executor/replay/device_step.py `_score`: an event per piece; each head's gather waits for its own
    piece's), else 0. Its consumers on other lanes may start once the first piece is selected
    (`pipelined_ready`), and a consumer cannot end before the last piece's heads are gathered
    after the stage ends (`pipelined_end`)."""
    if replayed and s.tag == "score" and s.phase is Phase.DECODE and s.kv_bytes and s.pieces > 1:
        return s.pieces
    return 0


def pipelined_ready(dep: Stage, start: float, end: float, seconds: float, replayed: bool) -> float:
    """When a consumer of `dep` (which ran [start, end], `seconds` long) may start: its end, or for a
    unit-pipelined score stage the end of its first piece's share (each piece an equal share)."""
    u = unit_pipelined(dep, replayed)
    return start + seconds / u if u else end


def pipelined_end(s: Stage, dep: Stage, dep_end: float, seconds: float, replayed: bool) -> float:
    """The earliest end of `s` (`seconds` long) imposed by a unit-pipelined score stage `dep` that
    ended at `dep_end`: its last piece's gathers, that many heads' share of `s`, come after it;
    0 otherwise."""
    if not unit_pipelined(dep, replayed):
        return 0.0
    last = len(dep.heads) - (dep.pieces - 1) * PIPE_UNITS   # units of the last piece
    return dep_end + seconds * min(1.0, last / max(1, len(s.heads)))


def stage_seconds(s: Stage, hw: HardwareProfile, dtype: str, replayed: bool = False) -> float:
    """Device seconds of `s` on its lane; `replayed`: issued inside a CUDA graph (decode replay)."""
    if s.kind is Kind.COMPUTE:
        if s.tag == "score" and s.kv_bytes and hw.sparse_score_call_s is not None:   # measured whole, selection included:
            calls = unit_pipelined(s, replayed) or 1   # replayed, one call per piece (each with its fixed cost)
            return calls * hw.sparse_score_call_s + s.kv_bytes / hw.sparse_score_bytes_per_s
        if s.tag == "score" and s.kv_bytes:   # LOSSY sparse ranking: codes streamed as decode attention streams K/V
            t = replayed_decode_attention_seconds(len(s.heads), s.kv_bytes, s.mem_bytes, hw)
            if t is not None:   # its float32 FLOPs (unpack, rebuild, dot) can bind instead
                arith = s.flops / hw.flops_eff("fp32") if "fp32" in hw.dtypes else 0.0
                return max(t, arith) + stage_small_seconds(s, hw, replayed)
        t = measured_compute_seconds(s, hw, dtype, replayed)
        if t is not None:
            return t + stage_small_seconds(s, hw, replayed)
        if replayed and split_kv_attention(s):
            t = replayed_decode_attention_seconds(len(s.heads), s.kv_bytes, s.mem_bytes, hw)
            if t is not None:
                return t + stage_small_seconds(s, hw, replayed)
        return (compute_seconds(s.flops, s.mem_bytes, s.ops, hw, dtype, s.tag, replayed,
                                not split_kv_attention(s))
                + stage_small_seconds(s, hw, replayed))
    if s.kind is Kind.H2D and s.gather and hw.gather_call_s is not None:   # LOSSY sparse: the rows gathered
        return s.ops * hw.gather_call_s + stored_bytes(s, hw) / hw.gather_bytes_per_s
    if s.kind is Kind.H2D:   # with a codec on h2d: its stored bytes
        return s.ops * hw.h2d_alpha_s + stored_bytes(s, hw) / hw.h2d_bytes_per_s
    if s.kind is Kind.D2H:
        return s.ops * hw.d2h_alpha_s + stored_bytes(s, hw) / hw.d2h_bytes_per_s
    if s.kind is Kind.DISK_READ:
        return s.ops * hw.disk_alpha_s + stored_bytes(s, hw) / hw.disk_read_bytes_per_s
    if s.kind is Kind.DISK_WRITE:
        return s.ops * hw.disk_alpha_s + stored_bytes(s, hw) / hw.disk_write_bytes_per_s
    rates = codec_rates(s, hw)    # compress / decompress on the codec's pool
    gpu = s.kind in (Kind.GPU_COMPRESS, Kind.GPU_DECOMPRESS)
    if rates is None and gpu:     # a GPU codec has no generic rate: the profile must rate it
        rates = hw.codec(s.codec)
    if rates is None:
        return s.bytes / hw.cpu_codec_bytes_per_s
    compress = s.kind in (Kind.COMPRESS, Kind.GPU_COMPRESS)
    if gpu:
        return gpu_codec_seconds(s, rates, hw)
    return s.bytes / (rates.compress_bytes_per_s if compress else rates.decompress_bytes_per_s)


def host_waits_for(s: Stage, hw: HardwareProfile | None = None) -> bool:
    """Whether the executor's host waits for `s` to end before it issues anything more (eagerly
    issued; a replayed step's quantise sets a device flag instead): a LOSSY quantise that fills
    blocks reads its range check back (the GPU's queue drains at every prefill chunk and layer,
    and the next stages wait for the host to issue them), charged with a profile that measured the
    quantise's device time (`hw.quant_call_s`; profiles without it costed the quantise as a
    whole and stay as they were validated); a GPU
    codec's encode reads the compressed sizes back (executor/nvcomp_codec.AnsBlocks.encode, one
    stream sync per batch of filled blocks). A prefill chunk's compress fills blocks; a decode
    step's only when its token completes a block of H2D_BLOCK_TOKENS (executor/codecs/h2d_store.py)."""
    if s.kind is Kind.COMPUTE and s.tag == "quant":   # LOSSY: an eager quantise of filled blocks checks its
        # range on the host (executor/quant/quantize.py, `y.abs().max()`): a sync, charged where the
        # profile times the quantise's kernels apart from it (calibrate's quant_*: device time only)
        return s.ops > QUANT_TAIL_OPS and hw is not None and hw.quant_call_s is not None
    if s.kind is not Kind.GPU_COMPRESS:
        return False
    return s.phase is Phase.PREFILL or s.tokens[1] % H2D_BLOCK_TOKENS == 0


def gpu_codec_calls(s: Stage) -> float:
    """Codec calls (batches) a GPU codec stage makes (executor/codecs/h2d_store.py): a decompress decodes
    its fetch's blocks in one call; a compress encodes the blocks a step fills in one call, i.e.
    once per prefill chunk, and in decode once per H2D_BLOCK_TOKENS steps (charged spread over them)."""
    if s.kind is Kind.GPU_DECOMPRESS or s.phase is Phase.PREFILL:
        return 1.0
    return (s.tokens[1] - s.tokens[0]) / H2D_BLOCK_TOKENS


def gpu_codec_seconds(s: Stage, rates, hw: HardwareProfile) -> float:
    """A GPU codec stage (gpu_compress / gpu_decompress): its codec calls at `call_s + raw bytes /
    rate` each (the profile's [codec.<name>] fit on batches of the executor's blocks), plus the
    byte-plane kernels around them (the split before an encode, the set-aside and interleave after
    a decode) at their measured rate per raw byte, or, where the profile has none, their bytes
    (`mem_bytes`) at the HBM copy rate; and a launch per kernel."""
    compress = s.kind is Kind.GPU_COMPRESS
    call_s, rate, planes = ((rates.compress_call_s, rates.compress_bytes_per_s, rates.split_bytes_per_s) if compress
                            else (rates.decompress_call_s, rates.decompress_bytes_per_s, rates.interleave_bytes_per_s))
    plane_s = s.bytes / planes if planes is not None else s.mem_bytes / hw.hbm_eff_bytes_per_s
    return gpu_codec_calls(s) * call_s + s.bytes / rate + plane_s + s.ops * hw.launch_overhead_s


def codec_rates(s: Stage, hw: HardwareProfile):
    """The profile's [codec.<name>] rates of the stage's codec, or None (no codec, or a codec the
    profile has no table for: timed at the generic cpu_codec_bytes_per_s, ratio 1)."""
    return next((c for c in hw.codecs if c.name == s.codec), None)


def stored_bytes(s: Stage, hw: HardwareProfile) -> float:
    """Bytes a transfer moves after its codec: raw bytes / the codec's ratio on this machine."""
    rates = codec_rates(s, hw)
    return s.bytes if rates is None else s.bytes / rates.ratio
