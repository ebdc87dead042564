"""pipeline/cost.py and the builder's cost inputs (bytes, FLOPs, memory traffic per stage) against
numbers worked out by hand, on a fictional machine whose four link rates (h2d, d2h, disk read,
disk write) and three fixed costs all differ, so a formula that uses the wrong one shows.
Models and plans: the MHA (bf16, with disk units) and GQA (fp32) cases of test_memory.py."""
import pytest

from kvpipe.pipeline.builder import build
from dataclasses import replace

from kvpipe.pipeline.cost import (compute_seconds, host_issue_seconds, small_seconds, stage_seconds,
                                  stage_small_seconds)
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.stage import Kind, Phase, Stage
from test_memory import GQA, GQA_PLAN, GQA_WORK, MHA, MHA_PLAN, MHA_WORK

# A test machine with round numbers (not a real GPU: real ones live in hw_profiles/ with sources).
HW = HardwareProfile(
    name="test-machine", description="fictional: round numbers, every link rate different",
    gpu_mem_bytes=10**10, hbm_peak_bytes_per_s=2e9, hbm_eff_bytes_per_s=1e9,
    flops_peak_per_s={"bf16": 2e12, "fp16": 2e12, "fp32": 1e12},
    flops_eff_per_s={"bf16": 1e12, "fp16": 1e12, "fp32": 5e11},
    small_shape_half_flops=1e6, attention_efficiency=0.5, launch_overhead_s=1e-6, attention_plan_s=0.01,
    h2d_alpha_s=1e-6, h2d_bytes_per_s=10e9, d2h_alpha_s=2e-6, d2h_bytes_per_s=4e9, pcie_duplex=True,
    host_mem_bytes=10**10, disk_read_bytes_per_s=2e9, disk_write_bytes_per_s=1e9, disk_alpha_s=5e-5,
    disk_bytes=10**11, cpu_codec_bytes_per_s=3e9, host_issue_s_per_stage=1e-4, host_issue_s_per_op=1e-5,
    graph_replay_s=2e-4, graph_node_s=2e-6, launch_queue_ops=1000)

REL = 1e-12


def test_the_machine_separates_every_link():
    """Guards the test machine itself: equal rates would let a swapped rate pass."""
    rates = (HW.h2d_bytes_per_s, HW.d2h_bytes_per_s, HW.disk_read_bytes_per_s, HW.disk_write_bytes_per_s)
    alphas = (HW.h2d_alpha_s, HW.d2h_alpha_s, HW.disk_alpha_s)
    assert len(set(rates)) == 4 and len(set(alphas)) == 3


@pytest.fixture(scope="module")
def mha():
    return {s.name: s for s in build(MHA, MHA_WORK, MHA_PLAN).stages}


@pytest.fixture(scope="module")
def gqa():
    return {s.name: s for s in build(GQA, GQA_WORK, GQA_PLAN).stages}


def check(stage: Stage, dtype: str, *, bytes=None, ops=None, flops=None, mem=None, seconds=None):
    if bytes is not None:
        assert stage.bytes == bytes, stage.name
    if ops is not None:
        assert stage.ops == ops, stage.name
    if flops is not None:
        assert stage.flops == flops, stage.name
    if mem is not None:
        assert stage.mem_bytes == mem, stage.name
    # plus the stage's small kernels (counted by layer_ops, tested in test_layer_ops.py): this
    # machine has no per-kernel floor beyond a launch (1e-6) and streams them at hbm_eff (1e9)
    small = max(stage.small_ops * 1e-6, stage.small_bytes / 1e9) if stage.kind is Kind.COMPUTE else 0.0
    assert stage_seconds(stage, HW, dtype) == pytest.approx(seconds + small, rel=REL), stage.name


def test_mha_copies_by_hand(mha):
    """Faults caught: d2h timed with the h2d rate or alpha; disk reads timed with the write rate
    (or writes with the read rate); a copy's bytes or per-(sequence, head) ops miscounted.
    Layer 1 of the MHA plan: head 0 on the GPU, heads 1, 2 in host RAM, head 3 on disk; batch 2;
    64 bytes of K/V per head and token."""
    # Prefill chunk 1 (tokens 4..8), head group 1 = heads 2, 3: head 3's 4-token prefix is read
    # from disk (2 x 4 x 64 = 512 bytes, one request per sequence), then both heads go h2d.
    check(mha["prefill.1.L1.kv_read.g1"], "bf16", bytes=512, ops=2, seconds=2 * 5e-5 + 512 / 2e9)
    check(mha["prefill.1.L1.kv_fetch.g1"], "bf16", bytes=1024, ops=4, seconds=4 * 1e-6 + 1024 / 10e9)
    # The chunk's new K/V (4 tokens) of the 3 offloaded heads go d2h, head 3's then to disk.
    check(mha["prefill.1.L1.kv_store"], "bf16", bytes=1536, ops=6, seconds=6 * 2e-6 + 1536 / 4e9)
    check(mha["prefill.1.L1.kv_write"], "bf16", bytes=512, ops=2, seconds=2 * 5e-5 + 512 / 1e9)
    # Decode step 0 (position 10): decode groups are single heads; head 1's 10-token prefix.
    check(mha["decode.0.L1.kv_fetch.g1"], "bf16", bytes=1280, ops=2, seconds=2 * 1e-6 + 1280 / 10e9)
    check(mha["decode.0.L1.kv_read.g3"], "bf16", bytes=1280, ops=2, seconds=2 * 5e-5 + 1280 / 2e9)
    check(mha["decode.0.L1.kv_write"], "bf16", bytes=128, ops=2, seconds=2 * 5e-5 + 128 / 1e9)


def test_mha_compute_by_hand(mha):
    """Faults caught: qkv's memory traffic counting offloaded heads as resident (it reads only the
    resident heads' K/V homes); attention FLOPs, traffic, efficiency or the plan-build stall wrong."""
    # qkv of layer 1, chunk 1 (4 tokens): FLOPs 2 seq x 4 tok x 2*64*(4+2*4)*16 = 196608.
    # Traffic: weights 64 x 12 x 16 x 2 = 24576; activations 2 x 4 x 320 x 2 = 5120; the ONE
    # resident head's new K/V 2 x 4 x 64 = 512 -> 30208. Memory bound: 30208 / 1e9 + 6 launches.
    check(mha["prefill.1.L1.qkv"], "bf16", flops=196608, mem=30208, seconds=30208 / 1e9 + 6e-6)
    # Layer 0 has two resident heads: 1024 bytes of new K/V instead of 512.
    check(mha["prefill.1.L0.qkv"], "bf16", flops=196608, mem=30720, seconds=30720 / 1e9 + 6e-6)
    # attn layer 0, group 0 (heads 0, 1 both resident; 2 query heads), queries 4..7 over keys 0..7:
    # 5+6+7+8 = 26 pairs x 4 x 16 x 2 heads x 2 seq = 6656 FLOPs. Traffic: keys 2 x 8 x 2 x 64 =
    # 2048, q and out 2 x 2 x 4 x 2 x 16 x 2 = 1024, workspace written and read 2 x 2176 -> 7424.
    # The first attention of a chunk with a prefix builds a plan: 0.01 s of HOST time, not device time.
    check(mha["prefill.1.L0.attn.g0"], "bf16", flops=6656, mem=7424, seconds=7424 / 1e9 + 5e-6)
    assert host_issue_seconds(mha["prefill.1.L0.attn.g0"], HW) == pytest.approx(1e-4 + 5 * 1e-5 + 0.01, rel=REL)
    assert host_issue_seconds(mha["prefill.1.L1.attn.g0"], HW) == pytest.approx(1e-4 + 5 * 1e-5, rel=REL)
    # Layer 1, group 0: head 0 resident, head 1 fetched: the resident head's prefix is copied into
    # the slot too, 2 (K, V reads and writes) x 2 seq x 4 tok x 1 head x 64 = 1024 more; no plan build.
    check(mha["prefill.1.L1.attn.g0"], "bf16", flops=6656, mem=8448, seconds=8448 / 1e9 + 5e-6)
    # The first chunk has no prefix: no plan build, 2 launches. 4 queries: 1+2+3+4 = 10 pairs ->
    # 2560 FLOPs; traffic 2 x 4 x 2 x 64 + 1024 + 4352 = 6400 bytes (memory bound).
    check(mha["prefill.0.L0.attn.g0"], "bf16", flops=2560, mem=6400, seconds=6400 / 1e9 + 2e-6)


def test_gqa_by_hand(gqa):
    """The GQA model (4 query heads per KV head, fp32, batch 1): layer 0 has head 0 resident,
    the other five units live in host RAM."""
    # Decode step 0 at position 9: head 1's 9-token prefix (9 x 256 = 2304 bytes), one copy.
    check(gqa["decode.0.L1.kv_fetch.g1"], "fp32", bytes=2304, ops=1, seconds=1e-6 + 2304 / 10e9)
    # Its new K/V of both heads of layer 1 (2 x 256) go home in 2 copies.
    check(gqa["decode.0.L1.kv_store"], "fp32", bytes=512, ops=2, seconds=2 * 2e-6 + 512 / 4e9)
    # qkv, chunk 0 (5 tokens): weights 64 x 12 x 32 x 4 = 98304; activations 5 x 704 x 4 = 14080;
    # resident K/V 5 x 256 = 1280 in layer 0, none in layer 1.
    check(gqa["prefill.0.L0.qkv"], "fp32", flops=5 * 49152, mem=113664, seconds=113664 / 1e9 + 6e-6)
    check(gqa["prefill.0.L1.qkv"], "fp32", flops=5 * 49152, mem=112384, seconds=112384 / 1e9 + 6e-6)
    # attn layer 0 group 0 (heads 0, 1; 8 query heads), chunk 1 = queries 5..8 over keys 0..8:
    # 6+7+8+9 = 30 pairs x 4 x 32 x 8 = 30720 FLOPs. Traffic: keys 9 x 2 x 256 = 4608; q and out
    # 2 x 4 x 8 x 32 x 4 = 8192; workspace 2 x 8448; the resident head's prefix copy 2 x 5 x 256
    # = 2560 -> 32256. Plan build (first attention of a chunk with a prefix).
    check(gqa["prefill.1.L0.attn.g0"], "fp32", flops=30720, mem=32256, seconds=32256 / 1e9 + 5e-6)


def test_compute_seconds_roofline_by_hand():
    """Arithmetic bound: (FLOPs + the small-shape half point) / rate; attention at its efficiency."""
    assert compute_seconds(1e9, 0, 2, HW, "bf16") == pytest.approx((1e9 + 1e6) / 1e12 + 2e-6, rel=REL)
    assert compute_seconds(1e9, 0, 2, HW, "bf16", "attn") == pytest.approx((1e9 + 1e6) / 5e11 + 2e-6, rel=REL)
    assert compute_seconds(1e9, 0, 0, HW, "fp32") == pytest.approx((1e9 + 1e6) / 5e11, rel=REL)
    assert compute_seconds(1e9, 5e6, 1, HW, "bf16") == pytest.approx(5e6 / 1e9 + 1e-6, rel=REL)  # memory bound
    assert compute_seconds(0, 0, 3, HW, "bf16") == pytest.approx(3e-6, rel=REL)


def test_codec_stage_by_hand():
    """Fault caught: codec stages timed by another rate than the CPU codec pool's."""
    s = Stage(0, Kind.COMPRESS, "compress", Phase.PREFILL, 0, 0, None, (0, 1), bytes=6_000_000)
    assert stage_seconds(s, HW, "bf16") == pytest.approx(6e6 / 3e9, rel=REL)


def test_small_kernels_by_hand(mha):
    """Faults caught: small kernels' bytes not slowed by elementwise_efficiency, the per-kernel
    floor ignored (decode) or charged on top of the bytes (prefill), eager kernels under a launch,
    a replayed decode attention charged the eager path's LSE merge."""
    hw = replace(HW, small_kernel_s=3e-6, elementwise_efficiency=0.5)
    assert small_seconds(10, 1e6, hw, True) == pytest.approx(1e6 / 0.5e9, rel=REL)      # bytes bind
    assert small_seconds(10, 10.0, hw, True) == pytest.approx(10 * 3e-6, rel=REL)      # the floor binds
    assert small_seconds(10, 10.0, replace(hw, launch_overhead_s=7e-6)) == pytest.approx(7e-5, rel=REL)
    assert small_seconds(0, 1e9, hw) == 0.0
    # A decode attention with a prefix: eager it merges (11 + 1 kernels); replayed one copy is left,
    # and with a transfer slot the new token's write into the slot.
    resident, fetched = mha["decode.0.L0.attn.g0"], mha["decode.0.L1.attn.g1"]
    assert resident.small_ops == 12 and resident.slot is None and fetched.slot is not None
    base = {s: stage_seconds(s, replace(hw, small_kernel_s=0.0), "bf16", True) for s in (resident, fetched)}
    assert stage_seconds(resident, hw, "bf16", True) == pytest.approx(base[resident] + 3e-6, rel=REL)
    assert stage_seconds(fetched, hw, "bf16", True) == pytest.approx(base[fetched] + 6e-6, rel=REL)


@pytest.mark.parametrize("replayed", [False, True])
def test_decode_attention_pays_no_gemm_small_shape_term(replayed):
    """Fault caught: a decode step's attention (one query token, FA2 split-KV) charged the GEMM
    small-shape term `small_shape_half_flops`, a curve fitted on [T, 4096] x [4096, 14336] GEMMs
    with few rows; on h200-testbox that was ~46 us per head group, so group-1 decode was predicted
    1.85x the measured step. By hand: a decode attention is max(flops / (eff * attention_eff),
    bytes / hbm) + launches; a prefill attention and the decode GEMMs keep the term."""
    big = replace(HW, small_shape_half_flops=1e9)
    g = build(GQA, GQA_WORK, GQA_PLAN)
    dec = [s for s in g.stages if s.phase is Phase.DECODE and s.kind is Kind.COMPUTE]
    attn = [s for s in dec if s.tag == "attn"]
    assert attn
    for s in attn:
        smalls = stage_small_seconds(s, HW, replayed)
        launch = HW.graph_node_s if replayed else HW.launch_overhead_s
        rate = HW.flops_eff(GQA.dtype) * HW.attention_efficiency
        by_hand = max(s.flops / rate, s.mem_bytes / HW.hbm_eff_bytes_per_s) + s.ops * launch
        assert stage_seconds(s, big, GQA.dtype, replayed) == pytest.approx(by_hand + smalls, rel=REL)
        assert stage_seconds(s, HW, GQA.dtype, replayed) == pytest.approx(by_hand + smalls, rel=REL)
    for s in dec:   # the GEMM stages of the same step still follow the small-shape curve
        if s.tag in ("qkv", "mlp") and s.flops:
            assert stage_seconds(s, big, GQA.dtype, replayed) > stage_seconds(s, HW, GQA.dtype, replayed)
    pre = next(s for s in g.stages if s.phase is Phase.PREFILL and s.tag == "attn")
    assert stage_seconds(pre, big, GQA.dtype) > stage_seconds(pre, HW, GQA.dtype)


@pytest.mark.parametrize("group", [1, 2])
def test_replayed_decode_attention_uses_the_measured_call(group):
    """Fault caught (issue 10 §4, group-1 resident decode 23-34% short on the H200): a replayed
    decode attention costed as its K/V bytes at the HBM copy rate plus launches, where one
    attend_decode call of few KV heads reads far below that rate. With a [gpu.decode_attention]
    table the kernel is call_s + kv_bytes / rate of its group size (between two measured sizes,
    linear in the size), the rest of its traffic (query, output, a mixed group's copy-in) at the
    HBM rate, plus its small kernels. By hand from the stage's cost inputs; eager decode and
    prefill attention keep the roofline; without a table the roofline stands."""
    from kvpipe.pipeline.hardware import DecodeAttention
    tab = replace(HW, decode_attention=(DecodeAttention(1, 7e-6, 2e8), DecodeAttention(4, 3e-6, 6e8)))
    g = build(GQA, GQA_WORK, replace(GQA_PLAN, decode=replace(GQA_PLAN.decode, group=group)))
    attn = [s for s in g.stages if s.phase is Phase.DECODE and s.tag == "attn"]
    assert attn and all(len(s.heads) == group for s in attn)
    for s in attn:
        kv = GQA_WORK.batch * (s.tokens[1]) * group * GQA.kv_unit_bytes_per_token
        assert s.kv_bytes == kv
        w = (group - 1) / 3
        call = (1 - w) * (7e-6 + kv / 2e8) + w * (3e-6 + kv / 6e8)
        by_hand = call + (s.mem_bytes - kv) / HW.hbm_eff_bytes_per_s + stage_small_seconds(s, HW, True)
        assert stage_seconds(s, tab, GQA.dtype, True) == pytest.approx(by_hand, rel=REL)
        assert stage_seconds(s, tab, GQA.dtype, False) == stage_seconds(s, HW, GQA.dtype, False)
        assert stage_seconds(s, HW, GQA.dtype, True) != pytest.approx(by_hand, rel=1e-3)
    pre = next(s for s in g.stages if s.phase is Phase.PREFILL and s.tag == "attn")
    assert stage_seconds(pre, tab, GQA.dtype) == stage_seconds(pre, HW, GQA.dtype)


def test_attention_plans_per_chunk_by_hand():
    """Fault caught: a cuDNN plan charged per chunk with a prefix only, missing the chunk's own
    causal attention when its length is new: the warm-up runs the first chunk cut to 8192 tokens,
    so a 16K chunk builds its own plan in the measured run (H200 sim_check 16k-g1-all-c16k, one
    16K chunk, was predicted 12% short with none). By hand per chunk (layer 0, group 0 only):
    16K context in 16K chunks: [1]; 40K in 16K chunks: [1, 1, 1] (the last chunk's 8K is the
    warm-up's length, seen); 20K in 8K chunks: [0, 1, 2] (the last 4K chunk is new); 10K in 4K
    chunks: [0, 1, 2]; 128-token chunks attend on FA2: prefix plans only (as charged before)."""
    from kvpipe.pipeline.cost import attention_plans
    from kvpipe.pipeline.model import PRESETS
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    m = PRESETS["llama-3-8b"]
    cases = [(16384, 16384, [1]), (40960, 16384, [1, 1, 1]), (20480, 8192, [0, 1, 2]), (10240, 4096, [0, 1, 2]),
             (8192, 8192, [0]), (1000, 128, [0, 1, 1, 1, 1, 1, 1, 1])]
    for ctx, chunk, want in cases:
        g = build(m, Workload(ctx, 1), Plan(Method.HEADWISE, PhasePlan(8, chunk, 2), PhasePlan(8, 1, 2), m.units, 0))
        got = {}
        for s in g.stages:
            if s.phase is Phase.PREFILL:
                got[s.step] = got.get(s.step, 0) + attention_plans(s)
            else:
                assert attention_plans(s) == 0
        assert [got[k] for k in sorted(got)] == want, (ctx, chunk)


def test_cost_mirrors_the_executor_constants():
    """Fault caught: the cost model's copies of the executor's warm-up length and cuDNN row
    threshold drifting from the executor (pipeline/ cannot import torch-side modules)."""
    pytest.importorskip("torch")
    from kvpipe.executor.layers.attention import CUDNN_MIN_ROWS
    from kvpipe.executor.engine.session import WARMUP_MAX_TOKENS
    from kvpipe.pipeline import cost
    assert (cost.WARMUP_TOKENS, cost.CUDNN_MIN_ROWS) == (WARMUP_MAX_TOKENS, CUDNN_MIN_ROWS)


def test_copy_stages_issue_at_the_copy_rate_when_the_profile_has_one():
    """Fault caught (issue 10 §4, 4k-g8-none-c4k decode predicted +90% on the calibrated H200
    profile): a copy stage's host issue charged the compute stages' per-launch figure (86.7 us a
    call, a fit over decode steps whose launches bring their small kernels), so a replayed step's
    32 eager write-backs of 8 copies cost 22 ms of host where the executor spends ~6 ms. With
    host_copy_s_per_stage / host_copy_s_per_op an h2d or d2h stage costs a + ops * b by hand;
    compute stages keep the old figures; without them copies keep the old figures too."""
    g = build(MHA, MHA_WORK, MHA_PLAN)
    hw = replace(HW, host_copy_s_per_stage=3e-5, host_copy_s_per_op=2e-6)
    copies = [s for s in g.stages if s.kind in (Kind.H2D, Kind.D2H)]
    assert copies and any(s.ops > 1 for s in copies)
    for s in copies:
        assert host_issue_seconds(s, hw) == pytest.approx(3e-5 + s.ops * 2e-6, rel=REL)
        assert host_issue_seconds(s, HW) == pytest.approx(1e-4 + s.ops * 1e-5, rel=REL)
    for s in g.stages:
        if s.kind is Kind.COMPUTE:
            assert host_issue_seconds(s, hw) == host_issue_seconds(s, HW)
