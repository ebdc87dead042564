"""Closed-form lane busy of a plan: the seconds each lane (gpu, h2d, d2h, disk) spends on one step,
summed from the same cost inputs the graph builder gives each stage, without building the graph.

The planner uses it to rank plans and to prune them. A lane runs its stages one at a time, so its
busy time bounds the simulated time from below; a step's busy time is convex in the step's start
token (costs are affine in the prefix, rooflines take a max), so by Jensen's inequality the busy
of a run of equal steps is at least their count times the busy at their mean start. `Estimate`
holds those lower bounds and, for ranking, the sum over steps of the busiest lane. For decode
issued stage by stage (no graph replay) the host is a lane too: it issues every stage of a step
one after the other (`decode_host_seconds`). `tests/test_planner.py` checks the lane sums against
the simulator's."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvpipe.pipeline import layer_ops
from kvpipe.pipeline.cost import compute_seconds, replayed_decode_attention_seconds, small_seconds
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import (attn_ws_bytes, chunk_sizes, hidden_bytes, layer_act_bytes,
                                    logits_bytes, mlp_act_bytes)
from kvpipe.pipeline.layer_kinds import first_visible, ring_tokens
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, Tier, placement
from kvpipe.pipeline.workload import Workload

LANES = ("gpu", "h2d", "d2h", "disk")
SEGMENTS = 6   # runs of prefill chunks evaluated at their mean start


def layer_classes(model: ModelSpec, resident: int, disk: int, windows_first: bool = False) -> Counter:
    """How many layers share each (offloaded heads, disk heads) split."""
    tiers = placement(model, Plan(Method.HEADWISE, PhasePlan(1, 1), PhasePlan(1, 1), resident, disk,
                                  disk_windows_first=windows_first))
    classes: Counter = Counter()
    for layer in range(model.layers):
        off = tuple(h for h in range(model.kv_heads) if tiers[(layer, h)] is not Tier.GPU)
        dsk = tuple(h for h in range(model.kv_heads) if tiers[(layer, h)] is Tier.DISK)
        classes[(off, dsk)] += 1
    return classes


def _group_kinds(off: tuple, dsk: tuple, H: int, G: int) -> Counter:
    """Counter of (offloaded, on disk) head counts over the layer's head groups of size G."""
    kinds: Counter = Counter()
    for g in range(H // G):
        heads = range(g * G, (g + 1) * G)
        kinds[(sum(h in heads for h in off), sum(h in heads for h in dsk))] += 1
    return kinds


def phase_layout(model: ModelSpec, classes: Counter, G: int) -> tuple:
    """Per layer class: (layers, offloaded heads, heads on disk, ((offloaded, on disk) per group ->
    groups)); what a step's cost needs of the placement, computed once per plan and group size."""
    return tuple((count, len(off), len(dsk), tuple(_group_kinds(off, dsk, model.kv_heads, G).items()))
                 for (off, dsk), count in classes.items())


def step_busy(model: ModelSpec, work: Workload, hw: HardwareProfile, layout: tuple, G: int,
              prefill: bool, start: int, n: int, with_head: bool, replayed: bool = False,
              fused: bool = False) -> dict[str, float]:
    """Busy seconds per lane of one step over tokens [start, start+n), as the builder's stages cost;
    `layout` from `phase_layout` for group size G; `replayed`: a decode step inside a CUDA graph
    (its kernels cost the graph node time instead of a launch); `fused`: with the fused decode
    pieces' small kernels (layer_ops' fused forms, as the builder counts them)."""
    m, B = model, work.batch
    fused = fused and not prefill
    qkv_ops, mlp_ops, head_ops = ((layer_ops.fused_qkv, layer_ops.fused_mlp, layer_ops.fused_head) if fused
                                  else (layer_ops.qkv, layer_ops.mlp, layer_ops.head))
    b, ut, dt = m.dtype_bytes, m.kv_unit_bytes_per_token, m.dtype
    busy = dict.fromkeys(LANES, 0.0)
    hid = hidden_bytes(m, B, n)
    gpu = compute_seconds(0.0, 2 * hid, 1, hw, dt, "embed", replayed) + _small(layer_ops.embed(m, B * n), hw, replayed)
    qkv_w = m.hidden * (m.q_heads + 2 * m.kv_heads) * m.head_dim * b
    mlp_w = m.layer_weight_bytes - qkv_w
    la, ma = layer_act_bytes(m, B, n), mlp_act_bytes(m, B, n)
    q_heads = G * m.gqa_ratio
    ws = attn_ws_bytes(m, B, n, G)
    attn_flops, keys = m.attn_work_floor(start, n, q_heads)   # every layer costed as the cheapest kind: a bound
    fetched = min([start] + [start - first_visible(start, w) for w in m.windows
                             if ring_tokens(w, work.kv_capacity)])   # a ring layer fetches its window only
    attn_flops *= B
    mlp = compute_seconds(B * n * m.mlp_flops_per_token, mlp_w + ma + la, 8, hw, dt, "mlp", replayed) \
        + _small(mlp_ops(m, B * n), hw, replayed)
    for count, n_off, n_dsk, kinds in layout:
        resident = m.kv_heads - n_off
        layer = compute_seconds(B * n * m.qkv_flops_per_token, qkv_w + la + B * n * resident * ut, 6,
                                hw, dt, "qkv", replayed) + mlp + _small(qkv_ops(m, B * n, resident), hw, replayed)
        h2d = disk = 0.0
        for (o, d), k in kinds:
            copy_in = 2 * B * fetched * (G - o) * ut if o else 0
            mem = B * keys * G * ut + 2 * B * n * q_heads * m.head_dim * b + 2 * ws + copy_in
            table = (replayed_decode_attention_seconds(G, B * keys * G * ut, mem, hw)
                     if replayed and not prefill else None)   # the measured call, as cost.stage_seconds
            kernel = table if table is not None else compute_seconds(
                attn_flops, mem, 5 if start else 2, hw, dt, "attn", replayed,
                prefill)   # decode: split-KV, no small-shape term (cost.py)
            layer += k * (kernel + (small_seconds(1 + bool(o and start), 0.0, hw, True) if replayed
                                    else _small(layer_ops.attn(m, B * n, G, start), hw, False)))
            if o and start > 0:
                h2d += k * (B * o * hw.h2d_alpha_s + B * fetched * o * ut / hw.h2d_bytes_per_s)
            if d and start > 0:
                disk += k * (B * d * hw.disk_alpha_s + B * fetched * d * ut / hw.disk_read_bytes_per_s)   # ring rows too
        d2h = 0.0
        stored = min([n] + [ring_tokens(w, work.kv_capacity) or n for w in m.windows])   # a ring keeps its tail
        if n_off:
            d2h = B * n_off * hw.d2h_alpha_s + B * stored * n_off * ut / hw.d2h_bytes_per_s
        if n_dsk:
            disk += B * n_dsk * hw.disk_alpha_s + B * stored * n_dsk * ut / hw.disk_write_bytes_per_s
        for lane, v in (("gpu", layer), ("h2d", h2d), ("d2h", d2h), ("disk", disk)):
            busy[lane] += count * v
    if with_head:
        gpu += compute_seconds(B * m.head_flops_per_token, m.head_weight_bytes + logits_bytes(m, B), 3,
                               hw, dt, "head", replayed) + _small(head_ops(m, B), hw, replayed)
    busy["gpu"] += gpu
    return busy


def decode_host_seconds(model: ModelSpec, work: Workload, hw: HardwareProfile, layout: tuple, G: int) -> float:
    """Host seconds to issue one decode step stage by stage (`cost.host_issue_seconds` of each of
    the builder's stages: embed, per layer qkv, one attn per group and mlp, a fetch per group with
    offloaded heads, a disk read per group with disk heads, the layer's store and disk write, and
    the head). Plans without codecs or lossy KV (those a graph could replay): their extra stages
    are not counted. `simulate.host_step_s` sums the same over a built step."""
    B = work.batch
    compute = lambda ops: hw.host_issue_s_per_stage + ops * hw.host_issue_s_per_op
    copy = ((lambda ops: (hw.host_copy_s_per_stage or 0.0) + ops * hw.host_copy_s_per_op)
            if hw.host_copy_s_per_op is not None else compute)
    total = compute(1) + compute(3)   # embed, head
    for count, n_off, n_dsk, kinds in layout:
        layer = compute(6) + compute(8)   # qkv, mlp
        for (o, d), k in kinds:
            layer += k * (compute(5) + (copy(B * o) if o else 0.0) + (compute(B * d) if d else 0.0))
        if n_off:
            layer += copy(B * n_off)
        if n_dsk:
            layer += compute(B * n_dsk)
        total += count * layer
    return total


def _small(ops: layer_ops.SmallOps, hw: HardwareProfile, replayed: bool) -> float:
    return small_seconds(ops.kernels, ops.bytes, hw, replayed)


def _bound(busy: dict[str, float], hw: HardwareProfile) -> float:
    """A step's time if its lanes overlapped perfectly (copies share one link without duplex)."""
    link = busy["h2d"] + busy["d2h"] if not hw.pcie_duplex else max(busy["h2d"], busy["d2h"])
    return max(busy["gpu"], link, busy["disk"])


@dataclass(frozen=True)
class Estimate:
    """Lower bounds from lane busy (seconds) and, for ranking, estimates that sum the busiest lane
    of each step. `prefill_busy` and `decode_busy` are lower bounds of the lanes' totals;
    `last_prefill` and `decode_step` are the busy of the last prefill chunk and of the longest
    decode step; `depth` transfer slots let that many fetches run ahead of their step.
    `decode_host_s`: host seconds to issue one decode step stage by stage where the planner
    counts it (its eager-decode plans; 0 otherwise): the host issues every decode stage one after
    the other, so the run takes at least `decode_tokens` times it."""

    prefill_busy: dict[str, float]
    decode_busy: dict[str, float]
    last_prefill: dict[str, float]
    decode_step: dict[str, float]
    decode_tokens: int
    depth: int
    prefill_s: float          # ranking estimate: sum over steps of the busiest lane
    decode_s_per_token: float | None
    total_s: float
    decode_host_s: float = 0.0

    def ttft_bound(self) -> float:
        """Every prefill compute, fetch and disk read ends before the first token (the last
        chunk's disk writes may not)."""
        p = self.prefill_busy
        return max(p["gpu"], p["h2d"], p["disk"] - self.last_prefill["disk"])

    def _after(self, lane: str, steps: float) -> float:
        """Busy of `steps` decode steps on `lane` that cannot run before the first of them starts."""
        # A step's busy grows with its start, so the last `steps` steps hold at least that share.
        share = self.decode_busy[lane] * steps / self.decode_tokens
        return max(0.0, share - self.depth * self.decode_step[lane])

    def lower_bound(self, objective: str, ttft_s: float | None = None) -> float:
        """A value the fully simulated objective cannot go under: each lane runs one stage at a
        time, decode compute waits for the first token, and fetches run at most `depth` ahead.
        `ttft_s`: the first token's time where it is known (a simulation of the same prefill: the
        planner's replayed twin of an eager-decode plan; how decode is issued does not move a
        prefill stage, as every lane runs its prefill stages before its decode ones), for the
        total objective in place of the lanes' bound on it."""
        M = self.decode_tokens
        if objective == "ttft":
            return self.ttft_bound()
        if objective == "decode" and M == 1:     # the one step's compute follows the first token
            return self.decode_busy["gpu"]
        if objective == "decode" and M > 1:
            gpu = self.decode_busy["gpu"] / M
            return max(gpu, max(self._after(lane, M - 1) for lane in ("h2d", "disk")) / (M - 1))
        whole = max(max(self.prefill_busy[lane] + self.decode_busy[lane] for lane in LANES),
                    M * self.decode_host_s)
        if not M:
            return whole
        after = max(self.decode_busy["gpu"], self._after("h2d", M), self._after("disk", M))
        return max(whole, max(self.ttft_bound(), ttft_s or 0.0) + after)

    def score(self, objective: str) -> float:
        if objective == "ttft":
            return self.prefill_s
        if objective == "decode" and self.decode_s_per_token is not None:
            return self.decode_s_per_token
        return self.total_s


def prefill_estimate(model, work, hw, layout: tuple, G: int, chunk: int):
    """(lane busy lower bounds, busy of the last chunk, ranking estimate) of the prefill."""
    sizes = chunk_sizes(work.context, chunk)
    C = len(sizes)
    busy = dict.fromkeys(LANES, 0.0)
    est = 0.0

    def add(count: int, start: float, n: int, head: bool) -> dict[str, float]:
        nonlocal est
        b = step_busy(model, work, hw, layout, G, True, int(start), n, head)
        for lane in LANES:
            busy[lane] += count * b[lane]
        est += count * _bound(b, hw)
        return b

    last = add(1, 0, sizes[0], C == 1)
    if C > 2:   # chunks 1 .. C-2: equal size, convex in the start; runs at their mean start
        mids = list(range(1, C - 1))
        per = max(1, -(-len(mids) // SEGMENTS))
        for i in range(0, len(mids), per):
            run = mids[i:i + per]
            add(len(run), chunk * (run[0] + run[-1]) / 2, chunk, False)
    if C > 1:
        last = add(1, chunk * (C - 1), sizes[-1], True)
    return busy, last, est


def decode_estimate(model, work, hw, layout: tuple, G: int, replayed: bool = False, fused: bool = False):
    """(lane busy lower bounds, busy of the longest step, busiest lane of a mean step)."""
    M = work.decode_tokens
    if not M:
        return dict.fromkeys(LANES, 0.0), dict.fromkeys(LANES, 0.0), None
    b = step_busy(model, work, hw, layout, G, False, int(work.context + (M - 1) / 2), 1, True, replayed, fused)
    longest = step_busy(model, work, hw, layout, G, False, work.context + M - 1, 1, True, replayed, fused)
    return {lane: M * b[lane] for lane in LANES}, longest, _bound(b, hw)
