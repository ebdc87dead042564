"""Profile figures from prefill stages timed in a run's sequence (`kvpipe calibrate`,
executor/calibrate/prefill_stages.py): the inverse of pipeline/cost.stage_seconds for them. A
stage's measured seconds less what the simulator adds to its kernels (its small kernels and
launches, priced by the profile) is its kernels' time. The qkv and mlp stages' give each tag's
GEMM rate and small-shape half ([gpu.stage_gemm]) and, pooled, the profile's one GEMM rate; the
attention stages' give [gpu.attention_rates]: a chunk with no prefix the own (causal) call's rate
at (KV heads, chunk); a chunk over a prefix, less its own call at that rate, the prefix call's at
(KV heads x chunk, prefix keys), its flops split by (query, key) pairs as AttentionRates.seconds
splits them."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .cost import stage_small_seconds
from .hardware import HardwareProfile
from .run_rates import STAGE_GEMM_TAGS, AttentionRates, RateGrid, StageGemmRates
from .stage import Stage

# A kernel time under this share of its stage's is clamped to it (and named in `clamped`): the
# small kernels priced above the stage's own time, or a prefix call lost in the noise of its own call.
MIN_KERNEL_SHARE = 0.05


@dataclass(frozen=True)
class Timed:
    """One stage of a run and its measured device seconds."""

    stage: Stage
    seconds: float


@dataclass(frozen=True)
class StageFit:
    gemm: StageGemmRates            # per stage tag
    flops_per_s: float              # both tags' points pooled: the profile's GEMM rate ...
    half_flops: float               # ... and small-shape half
    attention: AttentionRates
    clamped: tuple[str, ...] = ()   # stages whose kernel time was clamped (MIN_KERNEL_SHARE)


def label(s: Stage) -> str:
    """A stage named with its chunk (every point's graph has the same stage names)."""
    return f"{s.name}@{s.tokens[0]}:{s.tokens[1]}"


def kernel_seconds(t: Timed, hw: HardwareProfile, clamped: list[str]) -> float:
    """The stage's measured seconds less its small kernels and launches as pipeline/cost prices them."""
    s = t.stage
    k = t.seconds - stage_small_seconds(s, hw) - s.ops * hw.launch_overhead_s
    if k < MIN_KERNEL_SHARE * t.seconds:
        clamped.append(label(s))
        k = MIN_KERNEL_SHARE * t.seconds
    return k


def gemm_fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(rate, half) of kernel seconds = (flops + half) / rate over (flops, kernel seconds, stage
    seconds) points: least squares in error relative to the stage's time (weights 1 / stage^2);
    a negative intercept refits through the origin (half 0)."""
    if len({f for f, _, _ in points}) < 2:
        raise ValueError(f"points: need two or more distinct FLOP counts, got {len(points)} points")
    w = [1.0 / (t * t) for _, _, t in points]
    sw = sum(w)
    sx = sum(wi * f for wi, (f, _, _) in zip(w, points))
    sy = sum(wi * k for wi, (_, k, _) in zip(w, points))
    sxx = sum(wi * f * f for wi, (f, _, _) in zip(w, points))
    sxy = sum(wi * f * k for wi, (f, k, _) in zip(w, points))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        slope, alpha = sxy / sxx, 0.0
    if slope <= 0:
        raise ValueError(f"seconds: do not grow with FLOPs (slope {slope!r}); the timings are broken")
    return 1.0 / slope, alpha / slope


def _grid(values: dict[tuple[int, int], list[float]], what: str) -> RateGrid:
    """A RateGrid of the median rate at each (x, y); every pair of the axes must be measured."""
    xs, ys = sorted({x for x, _ in values}), sorted({y for _, y in values})
    missing = [(x, y) for x in xs for y in ys if (x, y) not in values]
    if missing:
        raise ValueError(f"{what}: no stage timed at {missing[0]} (the grid needs every pair of its axes)")
    return RateGrid(tuple(xs), tuple(ys), tuple(tuple(statistics.median(values[(x, y)]) for y in ys) for x in xs))


def attention_fit(timed: Sequence[Timed], hw: HardwareProfile, clamped: list[str]) -> tuple[RateGrid, RateGrid]:
    """(prefix grid, own grid) of the attention stages' rates."""
    own: dict[tuple[int, int], list[float]] = {}
    pre: list[tuple[Timed, float]] = []
    for t in timed:
        start, end = t.stage.tokens
        if start == 0:
            own.setdefault((len(t.stage.heads), end), []).append(t.stage.flops / kernel_seconds(t, hw, clamped))
        else:
            pre.append((t, kernel_seconds(t, hw, clamped)))
    own_grid = _grid(own, "own")
    prefix: dict[tuple[int, int], list[float]] = {}
    for t, k in pre:
        (start, end), g = t.stage.tokens, len(t.stage.heads)
        n = end - start
        if (g, n) not in own:
            raise ValueError(f"{t.stage.name}: no first chunk of {n} tokens over {g} KV heads timed (its own call's rate)")
        own_pairs, pre_pairs = n * (n + 1) / 2, n * start
        own_flops = t.stage.flops * own_pairs / (own_pairs + pre_pairs)
        rest = k - own_flops / own_grid.at(g, n)
        if rest < MIN_KERNEL_SHARE * k:
            clamped.append(label(t.stage))
            rest = MIN_KERNEL_SHARE * k
        prefix.setdefault((g * n, start), []).append((t.stage.flops - own_flops) / rest)
    return _grid(prefix, "prefix"), own_grid


def fit(timed: Sequence[Timed], hw: HardwareProfile, dtype: str) -> StageFit:
    """The figures of prefill qkv, attn and mlp stages timed in sequence; `hw` prices their small
    kernels and launches (the profile measured so far), `dtype` the models' the stages ran in."""
    clamped: list[str] = []
    pts = {tag: [(t.stage.flops, kernel_seconds(t, hw, clamped), t.seconds) for t in timed if t.stage.tag == tag]
           for tag in STAGE_GEMM_TAGS}
    per_tag = {tag: gemm_fit(p) for tag, p in pts.items()}
    rate, half = gemm_fit([p for tag in STAGE_GEMM_TAGS for p in pts[tag]])
    gemm = StageGemmRates(per_tag["qkv"][0], per_tag["qkv"][1], per_tag["mlp"][0], per_tag["mlp"][1], dtype)
    prefix, own = attention_fit([t for t in timed if t.stage.tag == "attn"], hw, clamped)
    return StageFit(gemm, rate, half, AttentionRates(prefix, own, dtype), tuple(clamped))
