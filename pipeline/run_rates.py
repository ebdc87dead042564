"""Measured rates at the shapes a run has: the prefill attention kernels' FLOP/s over a grid of
call shapes (`AttentionRates`, `kvpipe calibrate`'s [gpu.attention_rates]), the qkv and mlp
stages' GEMM rates (`StageGemmRates`, [gpu.stage_gemm]), and the shapes calibrate measures them at
(the planner's chunks and groups, the prefixes real plans reach).

A prefill chunk of n tokens over a P-token prefix attends in two fused calls per head group of G
KV heads (executor/layers/attention.attend_chunk): the chunk over itself, causal (`own`, G*r query
heads of n rows), and the chunk over the prefix (`prefix`, G heads of r*n folded rows against P
keys). Their rates differ with the shape (few rows per call leave SMs idle; short prefixes do not
amortise a tile's set-up), so one `attention_efficiency` for every shape runs long shapes fast and
short ones slow."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Prefill chunks (sim/space.CHUNKS: tests/test_calibrate_shapes.py holds them equal) and the
# groups the planner searches: calibrate measures attention and GEMMs at these.
CALIBRATE_CHUNKS = (1024, 2048, 4096, 8192, 16384, 32768)
CALIBRATE_GROUPS = (1, 2, 4, 8)
# The grid of the prefix call: KV heads x chunk tokens per call, and prefix keys (a 128K run's
# last chunk reaches ~128K; beyond, the rate is flat: the call is long enough to be steady).
PREFIX_ROWS = (1024, 4096, 16384, 65536, 262144)
PREFIX_KEYS = (2048, 8192, 32768, 131072)
# The grid of the own (causal) call: KV heads per call and chunk tokens (every chunk the planner picks).
OWN_GROUPS = (1, 2, 4, 8)
OWN_CHUNKS = CALIBRATE_CHUNKS
# A prefix grid row of R rows is measured as a chunk of R / G tokens over G = R / ROWS_PER_HEAD KV
# heads (1 to 8): the (group, chunk) pairs of plans at 32K-128K (4 x 4096, 8 x 8192).
ROWS_PER_HEAD = 4096


def prefix_call(rows: int, groups=OWN_GROUPS, chunks=OWN_CHUNKS) -> tuple[int, int]:
    """(KV heads per call, chunk tokens) that calibrate times a prefix grid row of `rows` at: a
    pair of the own grid (its own call's rate is known), so the prefix call's share is the rest."""
    g = max([x for x in groups if x <= max(1, rows // ROWS_PER_HEAD)] or [min(groups)])
    if rows % g or rows // g not in chunks:
        raise ValueError(f"rows: {rows} is not {g} KV heads x a chunk of {tuple(chunks)}")
    return g, rows // g


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """(lower index, upper index, weight of the upper) of x on a log scale, clamped to the axis."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    hi = next(i for i, a in enumerate(axis) if a >= x)
    lo = hi - 1
    return lo, hi, (math.log(x) - math.log(axis[lo])) / (math.log(axis[hi]) - math.log(axis[lo]))


@dataclass(frozen=True)
class RateGrid:
    """FLOP/s of one kernel over a rectangular grid: `rates[i][j]` at (xs[i], ys[j]), axes strictly
    ascending and positive. `at(x, y)` interpolates the log of the rate bilinearly in log x and
    log y, and holds the edge value outside the grid (no extrapolation)."""

    xs: tuple[int, ...]
    ys: tuple[int, ...]
    rates: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for name in ("xs", "ys"):
            axis = tuple(getattr(self, name))
            if not axis or any(a <= 0 for a in axis) or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"{name}: must be positive and strictly ascending, got {axis!r}")
            object.__setattr__(self, name, axis)
        rates = tuple(tuple(float(v) for v in row) for row in self.rates)
        if len(rates) != len(self.xs) or any(len(row) != len(self.ys) for row in rates):
            raise ValueError(f"rates: must be {len(self.xs)} rows of {len(self.ys)}, got "
                             f"{[len(r) for r in rates]}")
        if any(not math.isfinite(v) or v <= 0 for row in rates for v in row):
            raise ValueError("rates: every rate must be finite and > 0")
        object.__setattr__(self, "rates", rates)

    def at(self, x: float, y: float) -> float:
        i0, i1, wx = _bracket(self.xs, x)
        j0, j1, wy = _bracket(self.ys, y)
        lg = lambda i, j: math.log(self.rates[i][j])
        low = (1 - wy) * lg(i0, j0) + wy * lg(i0, j1)
        high = (1 - wy) * lg(i1, j0) + wy * lg(i1, j1)
        return math.exp((1 - wx) * low + wx * high)


@dataclass(frozen=True)
class AttentionRates:
    """The prefill attention calls' FLOP/s on one machine, for `dtype` models: `prefix` over (KV
    heads x chunk tokens per call, prefix keys), `own` over (KV heads per call, chunk tokens)."""

    prefix: RateGrid
    own: RateGrid
    dtype: str = "bf16"

    def seconds(self, flops: float, heads: int, start: int, n: int) -> float:
        """GPU seconds of a prefill attention stage of `flops` (both calls) for a chunk of `n`
        tokens at `start` over `heads` KV heads: the flops split between the calls by their
        (query, key) pairs (the chunk's causal pairs, n * start over the prefix), each at its rate."""
        own_pairs, pre_pairs = n * (n + 1) / 2, n * start
        own = flops * own_pairs / (own_pairs + pre_pairs)
        t = own / self.own.at(heads, n)
        if start:
            t += (flops - own) / self.prefix.at(heads * n, start)
        return t

    def peak(self) -> float:
        """The fastest rate anywhere in either grid."""
        return max(v for g in (self.prefix, self.own) for row in g.rates for v in row)

    def estimate_efficiency(self, eff_flops_per_s: float) -> float:
        """The profile's single `attention_efficiency` beside the grids: the fastest grid rate over
        the GEMM rate, so the planner's estimate (sim/estimate.py, one efficiency for every
        shape) stays a lower bound of the simulated time."""
        return min(1.0, self.peak() / eff_flops_per_s)


STAGE_GEMM_TAGS = ("qkv", "mlp")   # the prefill stages whose GEMMs [gpu.stage_gemm] rates


@dataclass(frozen=True)
class StageGemmRates:
    """A prefill stage's GEMMs at their rate in a run, per stage tag ([gpu.stage_gemm]): a qkv or
    mlp stage's GEMM seconds are `(flops + half) / rate` with its own pair (the qkv stage's narrow
    k and v projections run below the mlp's wide GEMMs), for `dtype` models."""

    qkv_flops_per_s: float
    qkv_half_flops: float
    mlp_flops_per_s: float
    mlp_half_flops: float
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for tag in STAGE_GEMM_TAGS:
            rate, half = getattr(self, f"{tag}_flops_per_s"), getattr(self, f"{tag}_half_flops")
            if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
                raise ValueError(f"{tag}_flops_per_s: must be a finite number > 0, got {rate!r}")
            if not (isinstance(half, (int, float)) and math.isfinite(half) and half >= 0):
                raise ValueError(f"{tag}_half_flops: must be a finite number >= 0, got {half!r}")
            object.__setattr__(self, f"{tag}_flops_per_s", float(rate))
            object.__setattr__(self, f"{tag}_half_flops", float(half))

    def of(self, tag: str) -> tuple[float, float] | None:
        """(rate, half) of stage tag `tag`, None for a tag the table does not rate."""
        if tag not in STAGE_GEMM_TAGS:
            return None
        return getattr(self, f"{tag}_flops_per_s"), getattr(self, f"{tag}_half_flops")
