"""pipeline/memory.py against numbers worked out by hand (in the comments) for two small models,
one MHA in bf16 and one GQA in fp32. The simulator's peak-memory law compares `breakdown()` with
the builder, which copies its static buffers from `breakdown()`; only values fixed here, outside
the code, catch a term that is wrong in both."""

import math

from hypothesis import given
from hypothesis import strategies as st

from kvpipe.pipeline.memory import (ALLOCATOR_FLOOR_BYTES, ALLOCATOR_PERCENT, allocator_allowance, attn_ws_bytes,
                                    breakdown, gpu_budget_for, gpu_usable, slot_bytes, step_act_bytes)
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, Tier, placement
from kvpipe.pipeline.report import budget_problems
from kvpipe.pipeline.rules import fits
from kvpipe.pipeline.workload import Workload

MiB = 2**20

# MHA: 4 query heads = 4 KV heads, head_dim 16, bf16 (2 bytes).
MHA = ModelSpec("mha", "llama", layers=2, hidden=64, q_heads=4, kv_heads=4, head_dim=16,
                intermediate=32, vocab=100, dtype="bf16")
MHA_WORK = Workload(context=10, decode_tokens=3, batch=2)
MHA_PLAN = Plan(Method.HEADWISE, PhasePlan(2, 4, 3), PhasePlan(1, 1, 2), resident=3, disk=2)

# GQA: 8 query heads on 2 KV heads (ratio 4), head_dim 32, fp32 (4 bytes).
GQA = ModelSpec("gqa", "llama", layers=3, hidden=64, q_heads=8, kv_heads=2, head_dim=32,
                intermediate=16, vocab=50, dtype="fp32")
GQA_WORK = Workload(context=9, decode_tokens=2, batch=1)
GQA_PLAN = Plan(Method.HEADWISE, PhasePlan(2, 5, 2), PhasePlan(1, 1, 4), resident=1, disk=0)


def test_mha_sizes():
    # K and V of one head for one token: 2 x 16 dims x 2 bytes.
    assert MHA.kv_unit_bytes_per_token == 64
    # Per layer: q, k, v, o 64x64 each (4 x 4096), MLP 3 x 64x32 = 6144, two norms 128 -> 22656.
    # Embedding and lm_head 100x64 each, 2 layers, final norm 64 -> 58176 params, 2 bytes each.
    assert MHA.weight_bytes == 2 * (2 * 6400 + 2 * 22656 + 64) == 116352


def test_gqa_sizes():
    assert GQA.kv_unit_bytes_per_token == 2 * 32 * 4 == 256
    # Per layer: q 64x256, k and v 64x64 each, o 256x64 -> 40960; MLP 3 x 64x16 = 3072; norms 128.
    # Embedding and lm_head 50x64 each, 3 layers of 44160, final norm 64 -> 138944 params x 4 bytes.
    assert GQA.weight_bytes == 4 * (2 * 3200 + 3 * 44160 + 64) == 555776


def test_mha_placement():
    # 3 resident units over 2 layers: layer 0 gets 2 (heads 0, 1), layer 1 gets 1 (head 0).
    # 2 disk units: the highest head of each layer (head 3); heads 2 (L0), 1 and 2 (L1) on the host.
    t = placement(MHA, MHA_PLAN)
    assert [t[(0, h)] for h in range(4)] == [Tier.GPU, Tier.GPU, Tier.HOST, Tier.DISK]
    assert [t[(1, h)] for h in range(4)] == [Tier.GPU, Tier.HOST, Tier.HOST, Tier.DISK]


def test_attention_workspace_counts_the_lse():
    """Fault caught: the workspace without the log-sum-exp (fp32, one per query row), i.e.
    (head_dim) instead of (head_dim + 1) fp32 values per query head and token."""
    # Two halves (prefix, chunk) x batch 1 x 5 tokens x (2 KV heads x 4 query heads each) x (32 + 1) x 4 bytes.
    assert attn_ws_bytes(GQA, 1, 5, 2) == 2 * 1 * 5 * 8 * 33 * 4 == 10560
    # MHA, batch 2, 4 tokens, group of 2 KV heads = 2 query heads: 2 x 2 x 4 x 2 x 17 x 4.
    assert attn_ws_bytes(MHA, 2, 4, 2) == 2176


def test_mha_breakdown_by_hand():
    """Faults caught: KV homes sized by the context alone (decode tokens have nowhere to go); the
    host staging ring for disk units dropped; the transfer ring sized by the wrong phase."""
    mem = breakdown(MHA, MHA_WORK, MHA_PLAN)
    # One unit's home: batch 2 x (10 + 3 tokens) x 64 bytes = 1664.
    unit = 2 * 13 * 64
    assert (mem.gpu_kv, mem.host_kv, mem.disk_kv) == (3 * unit, 3 * unit, 2 * unit) == (4992, 4992, 3328)
    # Transfer slots: depth 3 (prefill's, the deeper phase) x the larger group (2 heads):
    # 3 x (batch 2 x 2 heads x 13 tokens x 64 bytes) = 9984 on the GPU; disk units need the same
    # ring of staging slots in pinned host RAM.
    assert slot_bytes(MHA, MHA_WORK, 2) == 3328
    assert mem.gpu_buffers == 9984 and mem.host_buffers == 9984
    # Activations: the first prefill chunk (4 tokens, no logits) is the largest step:
    #   residual 2 x 4 x 64 x 2 = 1024
    #   layer acts: per token 64 + 2*4*16 + 2*4*16 = 320 values x 2 bytes x 8 rows = 5120
    #   max(attention workspace 2*2*4*2*17*4 = 2176, MLP 2*4*(2*64 + 3*32)*2 = 3584) = 3584
    #   -> 1024 + 5120 + 3584 = 9728
    # (last chunk of 2 tokens with logits: 512 + 2560 + 1792 = 4864; decode: 2432).
    assert mem.activations == 9728
    assert step_act_bytes(MHA, 2, 2, 2, True) == 4864
    assert step_act_bytes(MHA, 2, 1, 1, True) == 2432
    assert mem.weights == 116352
    assert mem.pools() == {"gpu": 116352 + 4992 + 9984 + 9728, "host": 4992 + 9984, "disk": 3328}


def test_gqa_breakdown_by_hand():
    """Faults caught: as above, plus an attention workspace without its LSE term (here the
    workspace, not the MLP, sets the activation peak)."""
    mem = breakdown(GQA, GQA_WORK, GQA_PLAN)
    # 1 resident unit (layer 0, head 0), 5 in host RAM; one home: 1 x (9 + 2) x 256 = 2816.
    assert (mem.gpu_kv, mem.host_kv, mem.disk_kv) == (2816, 5 * 2816, 0)
    # Ring: depth 4 (decode's) x group 2 (prefill's): 4 x (1 x 2 x 11 x 256) = 22528; no disk, no staging.
    assert (mem.gpu_buffers, mem.host_buffers) == (22528, 0)
    # First chunk, 5 tokens: residual 5 x 64 x 4 = 1280; layer acts 5 x (64 + 2*8*32 + 2*2*32) x 4
    # = 14080; workspace 2 x 5 x 8 x 33 x 4 = 10560 > MLP 5 x (128 + 48) x 4 = 3520
    # -> 1280 + 14080 + 10560 = 25920.
    assert mem.activations == 25920
    assert mem.pools() == {"gpu": 555776 + 2816 + 22528 + 25920, "host": 14080, "disk": 0}


def test_no_decode_no_decode_sizes():
    """Without decode steps the homes hold the context only and the decode phase sizes nothing."""
    work = Workload(9, 0, 1)
    mem = breakdown(GQA, work, GQA_PLAN)
    assert mem.host_kv == 5 * 9 * 256
    assert mem.gpu_buffers == 2 * (2 * 9 * 256)    # prefill's depth 2, not decode's 4


# ---- the caching allocator's allowance --------------------------------------------------------

def test_a_plan_20_mib_under_the_gpu_cap_does_not_fit():
    """Fault caught: a plan whose predicted GPU peak is just under the budget reported as fitting.
    On the H200 (docs/PERFORMANCE.md, 128k-g2-some-c16k) a plan predicted 20 MB under a 24.0 GB
    cap ran out of memory with 110 MiB reserved by the caching allocator but unallocated. The
    budget check (`fits: NO`, `run` refused) and the rules' `fits` must keep the allowance free,
    and gpu_budget_for must name the smallest budget that does fit."""
    mem = breakdown(MHA, MHA_WORK, MHA_PLAN)
    budgets = {"gpu": mem.gpu + 20 * MiB, "host": mem.host, "disk": mem.disk}
    problems = budget_problems(mem, budgets)
    assert len(problems) == 1 and problems[0].startswith("gpu needs") and "allocator allowance" in problems[0]
    assert not fits(MHA, MHA_WORK, MHA_PLAN, budgets)
    enough = dict(budgets, gpu=gpu_budget_for(mem.gpu))
    assert not budget_problems(mem, enough) and fits(MHA, MHA_WORK, MHA_PLAN, enough)
    short = dict(budgets, gpu=enough["gpu"] - 1)
    assert budget_problems(mem, short) and not fits(MHA, MHA_WORK, MHA_PLAN, short)


def test_the_allowance_covers_what_the_h200_measured():
    """Fault caught: an allowance below the measured evidence. At the 24.0 GB cap of the H200 runs
    the allocator held 110 MiB reserved but unallocated when the pinned plan ran out, and the
    memory model's peaks were within 0.12% of the measured ones (docs/PERFORMANCE.md)."""
    cap = 24_000_000_000
    assert allocator_allowance(cap) >= 110 * MiB + 0.0012 * cap
    assert gpu_usable(cap) == cap - allocator_allowance(cap)


@given(st.integers(1, 2**48))
def test_allocator_allowance_and_its_inverse(n):
    """Fault caught: the smallest-budget message and the fit check disagreeing (a named budget
    that still does not fit, or one larger than needed): gpu_budget_for is the least budget
    whose usable bytes hold a peak, and the allowance is max(floor, the percentage) written out."""
    assert allocator_allowance(n) == max(ALLOCATOR_FLOOR_BYTES, math.ceil(n * ALLOCATOR_PERCENT / 100))
    b = gpu_budget_for(n)
    assert gpu_usable(b) >= n > gpu_usable(b - 1)
