"""Bytes each pool holds for a plan: static buffers (weights, KV homes, transfer slots) and the
transient activations of one chunk. The graph builder allocates exactly these, so the simulator's
measured peak and this closed form agree (a test checks it). Where decode will be replayed the
host homes are pinned by torch in power-of-two blocks (pipeline/pinned_blocks.carve): the host
pool then counts the blocks, their slack included (`host_slack`), as the executor pins them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .layer_kinds import ring_tokens
from .model import ModelSpec
from .pinned_blocks import carve
from .plan import Plan, Tier, decode_replayed
from .windows import (disk_rings, disk_unit_bytes, rings, slot_tokens, staging_row_bytes, tier_counts,
                      window_homes, window_scratch_bytes)
from .workload import Workload

FP32 = 4

# The CUDA caching allocator's allowance: GPU bytes a plan must leave unused under the budget, so
# that it "fits" only with headroom for the allocator's fragmentation and the memory model's error:
# the floor is about twice the fragmentation plus model error measured at a 24 GB cap; the
# percentage, which takes over above a 25 GiB budget, is eight times the model's error, so the
# allowance grows with the budget (an assumption above 24 GB; evidence: docs/PERFORMANCE.md).
ALLOCATOR_FLOOR_BYTES = 256 * 2**20
ALLOCATOR_PERCENT = 1


def allocator_allowance(gpu_budget: int) -> int:
    """Bytes of a GPU budget kept for the caching allocator: max(256 MiB, 1% of the budget)."""
    return max(ALLOCATOR_FLOOR_BYTES, -(-int(gpu_budget) * ALLOCATOR_PERCENT // 100))


def gpu_usable(gpu_budget: int) -> int:
    """The most GPU bytes a plan's predicted peak may take under `gpu_budget`: the budget less the
    allocator's allowance (0 when the allowance takes it all)."""
    return max(0, int(gpu_budget) - allocator_allowance(gpu_budget))


def gpu_budget_for(gpu_bytes: float) -> int:
    """The smallest GPU budget whose usable bytes hold a peak of `gpu_bytes` (gpu_usable's inverse):
    the least n with both n - ALLOCATOR_FLOOR_BYTES >= need and
    n - ceil(n * P / 100) = floor(n * (100 - P) / 100) >= need, P = ALLOCATOR_PERCENT."""
    need = math.ceil(gpu_bytes)
    if need <= 0:
        return 1
    return max(need + ALLOCATOR_FLOOR_BYTES, -(-need * 100 // (100 - ALLOCATOR_PERCENT)))


def pool_limits(budgets: dict[str, int]) -> dict[str, int]:
    """The most each pool's peak may take and still fit: the GPU budget less the allocator's
    allowance, the host and disk budgets whole."""
    return {"gpu": gpu_usable(budgets["gpu"]), "host": budgets["host"], "disk": budgets["disk"]}


def over_limits(mem: MemoryBreakdown, budgets: dict[str, int]) -> list[str]:
    """The pools whose peak exceeds what their budget allows (`pool_limits`), in `mem.pools()` order."""
    limits = pool_limits(budgets)
    return [pool for pool, need in mem.pools().items() if need > limits[pool]]


def hidden_bytes(m: ModelSpec, batch: int, tokens: int) -> int:
    """The residual stream of a chunk, alive across all layers of the step."""
    return batch * tokens * m.hidden * m.dtype_bytes


def layer_act_bytes(m: ModelSpec, batch: int, tokens: int) -> int:
    """Normed input, q, new k/v and the attention output of one layer, alive qkv -> mlp."""
    per_tok = m.hidden + 2 * m.q_heads * m.head_dim + 2 * m.kv_heads * m.head_dim
    return batch * tokens * per_tok * m.dtype_bytes


def attn_ws_bytes(m: ModelSpec, batch: int, tokens: int, group: int) -> int:
    """fp32 partial outputs and log-sum-exps of the prefix and chunk halves for one head group."""
    q = group * m.gqa_ratio
    return 2 * batch * tokens * q * (m.head_dim + 1) * FP32


def mlp_act_bytes(m: ModelSpec, batch: int, tokens: int) -> int:
    """o_proj output, normed input, gate, up and their product."""
    return batch * tokens * (2 * m.hidden + 3 * m.intermediate) * m.dtype_bytes


def logits_bytes(m: ModelSpec, batch: int) -> int:
    """Logits of the last position only, in fp32."""
    return batch * m.vocab * FP32


def step_act_bytes(m: ModelSpec, batch: int, tokens: int, group: int, with_head: bool) -> int:
    """Peak transient bytes of one step (a prefill chunk or a decode token)."""
    body = layer_act_bytes(m, batch, tokens) + max(attn_ws_bytes(m, batch, tokens, group),
                                                   mlp_act_bytes(m, batch, tokens))
    head = logits_bytes(m, batch) if with_head else 0
    return hidden_bytes(m, batch, tokens) + max(body, head)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per pool, the GPU split by what holds it. `host_slack`: the unused tails of the
    power-of-two blocks that torch-pinned host homes are carved from (replayed decode), 0 else."""

    weights: int
    gpu_kv: int
    gpu_buffers: int
    activations: int
    host_kv: int
    host_buffers: int
    disk_kv: int
    host_slack: int = 0

    @property
    def gpu(self) -> int:
        return self.weights + self.gpu_kv + self.gpu_buffers + self.activations

    @property
    def host(self) -> int:
        return self.host_kv + self.host_buffers + self.host_slack

    @property
    def disk(self) -> int:
        return self.disk_kv

    def pools(self) -> dict[str, int]:
        return {"gpu": self.gpu, "host": self.host, "disk": self.disk}

    def gpu_breakdown(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.gpu_kv, "buffers": self.gpu_buffers,
                "activations": self.activations}


def slot_bytes(m: ModelSpec, work: Workload, group: int, tokens: int | None = None) -> int:
    """One transfer slot: a whole head group's K/V of `tokens` (default: the full length)."""
    return work.batch * group * (work.kv_capacity if tokens is None else tokens) * m.kv_unit_bytes_per_token


def chunk_sizes(context: int, chunk: int) -> list[int]:
    return [min(chunk, context - s) for s in range(0, context, chunk)]


def breakdown(m: ModelSpec, work: Workload, plan: Plan) -> MemoryBreakdown:
    unit = work.batch * work.kv_capacity * m.kv_unit_bytes_per_token
    # Tier counts of `placement` without building it (the planner asks for thousands of plans).
    resident = min(plan.resident, m.units)
    disk = min(plan.disk, m.units - resident)
    count = {Tier.GPU: resident, Tier.DISK: disk, Tier.HOST: m.units - resident - disk}
    phases = [plan.prefill] + ([plan.decode] if work.decode_tokens else [])
    # Slots are shared by the phases: as many as the deepest phase, each as large as the largest group.
    kept = rings(m, work, plan)
    depth, group = max(p.depth for p in phases), max(p.group for p in phases)
    row = work.kv_capacity * m.kv_unit_bytes_per_token
    if kept and count[Tier.DISK]:
        row = staging_row_bytes(m, work, plan, kept)
    ring = depth * work.batch * group * row     # a disk unit's read: its whole length, a ring row's window
    slots = depth * slot_bytes(m, work, group, slot_tokens(m, work, kept)) if count[Tier.HOST] + count[Tier.DISK] else 0
    staging = ring if count[Tier.DISK] else 0
    chunk = plan.prefill.chunk   # only the last chunk also holds the logits
    last = work.context - (-(-work.context // chunk) - 1) * chunk   # chunk_sizes(...)[-1], not built
    act = step_act_bytes(m, work.batch, last, plan.prefill.group, True)
    if work.context > chunk:
        act = max(act, step_act_bytes(m, work.batch, min(chunk, work.context), plan.prefill.group, False))
    if work.decode_tokens:
        act = max(act, step_act_bytes(m, work.batch, 1, plan.decode.group, True))
    gpu_kv, home = count[Tier.GPU] * unit, unit
    if plan.lossy is not None:   # LOSSY: offloaded homes hold the KV as stored (quantised or not),
        cap = work.kv_capacity   # the GPU the sparse selection's summaries and sketch of every offloaded unit
        off = count[Tier.HOST] + count[Tier.DISK]
        home = work.batch * plan.lossy.unit_bytes(cap, m.head_dim, m.dtype_bytes)
        gpu_kv += off * work.batch * plan.lossy.gpu_summary_bytes(cap, m.head_dim, m.dtype_bytes)
    if slots and plan.decode.codec("h2d") != "none":   # GPU codec on h2d: executor/codecs/h2d_store.py's buffers
        slots += h2d_codec_bytes(m, work, plan, count[Tier.HOST])
    host_kv, disk_kv = count[Tier.HOST] * home, count[Tier.DISK] * home
    if kept:   # window layers keep rings: every layer's units at their own length
        gpu_kv, host_kv, disk_kv = window_homes(m, work, plan, kept)
    slots += window_scratch_bytes(m, work, plan)
    # Replayed decode (no disk units, lossy KV or codec): torch pins the homes, carved from blocks.
    slack = pinned_homes_bytes(m, work, resident, kept) - host_kv if decode_replayed(m, work, plan) else 0
    return MemoryBreakdown(weights=m.weight_bytes, gpu_kv=gpu_kv, gpu_buffers=slots,
                           activations=act, host_kv=host_kv, host_buffers=staging,
                           disk_kv=disk_kv, host_slack=slack)


def pinned_homes_bytes(m: ModelSpec, work: Workload, resident: int, ring: tuple[int, ...] = ()) -> int:
    """Host bytes torch pins for the KV homes of a plan with `resident` units and none on disk,
    as the executor takes them where decode is replayed (executor/kv/store.py, pinned.HostArena):
    one home per layer that keeps heads on the host (its heads not resident, `placement`'s split),
    all carved in one call out of power-of-two blocks (pinned_blocks.carve), slack included; a
    layer keeping a ring (`ring`, windows.rings) holds its ring's tokens."""
    L, H = m.layers, m.kv_heads
    tok = work.batch * m.kv_unit_bytes_per_token
    held = lambda layer: ring[layer] if ring and ring[layer] else work.kv_capacity   # noqa: E731
    homes = [max(0, H - resident // L - (layer < resident % L)) * held(layer) * tok for layer in range(L)]
    homes = [b for b in homes if b > 0]
    return carve(homes).total_bytes if homes else 0


def h2d_codec_bytes(m: ModelSpec, work: Workload, plan: Plan, host_units: int) -> int:
    """GPU bytes of a GPU codec on h2d (executor/codecs/h2d_store.py): the decoded high plane and the low
    plane of one slot's group (shared by the slots: decoding runs on the gpu lane in order), and
    the exact tail of every host unit (a block not yet full)."""
    from .codecs import H2D_BLOCK_TOKENS
    group = max(plan.prefill.group, plan.decode.group)
    tail = min(H2D_BLOCK_TOKENS, plan.prefill.chunk, work.context, work.kv_capacity)   # h2d_store's block
    return slot_bytes(m, work, group) + host_units * work.batch * tail * m.kv_unit_bytes_per_token


def kv_by_kind(m: ModelSpec, work: Workload, plan: Plan | None = None) -> list[dict]:
    """The KV cache per layer kind ('full', 'sliding W'), in the order the kinds first appear:
    `layers`; `kv_bytes`, what the executor holds for them under `plan` (every tier together: a
    window layer's units keep a ring of W - 1 + REWIND_TOKENS tokens, on disk a ring of blocks,
    windows.disk_unit_bytes; without a plan, as an exact plan with no disk units keeps them), of
    which `disk_bytes` on disk; `window_bytes`, what their windows still see at the end of the
    run; `full_bytes`, their KV at full length."""
    per_tok = work.batch * m.kv_unit_bytes_per_token
    cap = work.kv_capacity
    if plan is None:
        kept = tuple(ring_tokens(w, cap) for w in m.windows) if m.windows else ()
        counts, on_disk = [(0, m.kv_heads, 0)] * m.layers, ()
    else:
        kept, counts = rings(m, work, plan), tier_counts(m, plan)
        on_disk = disk_rings(plan, kept)
    out: dict[str, dict] = {}
    for layer, (kind, w) in enumerate(zip(m.layer_kinds, m.windows or (0,) * m.layers)):
        row = out.setdefault(kind, {"kind": kind, "layers": 0, "kv_bytes": 0, "disk_bytes": 0,
                                    "window_bytes": 0, "full_bytes": 0})
        gpu, host, disk = counts[layer]
        held = kept[layer] if kept and kept[layer] else cap
        disk_bytes = disk * disk_unit_bytes(m, work, plan, on_disk[layer] if on_disk else 0) if disk else 0
        row["layers"] += 1
        row["kv_bytes"] += (gpu + host) * held * per_tok + disk_bytes
        row["disk_bytes"] += disk_bytes
        row["window_bytes"] += m.kv_heads * (min(w, cap) if w else cap) * per_tok
        row["full_bytes"] += m.kv_heads * cap * per_tok
    return list(out.values())
