"""From measurements to a hardware profile: the fits `kvpipe calibrate` applies to its timings
(`alpha + bytes/beta` for a link, the half-rate FLOPs of small kernels) and the TOML it writes.
Pure arithmetic, no torch: every number it writes is a measurement or a fit of measurements,
each line carrying its source."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of `t = alpha + bytes / beta` over the points; returns (alpha_s, beta_bytes_per_s).
    alpha is clamped at 0 (a negative intercept is noise on a link with no fixed cost)."""
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError(f"sizes/seconds: need two or more matching points, got {len(sizes_bytes)} and {len(seconds)}")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("sizes: need at least two distinct sizes to fit a slope")
    n = len(sizes_bytes)
    mx, my = sum(sizes_bytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, seconds))
    slope = sxy / sxx
    if slope <= 0:
        raise ValueError(f"seconds: do not grow with size (slope {slope!r}); the timings are broken")
    return max(0.0, my - slope * mx), 1.0 / slope


def fit_alpha_beta_relative(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares of `t = alpha + bytes / beta` in RELATIVE error (each point weighted by
    1 / t^2), so that a series spanning 64 KiB to 64 MiB is fitted as well at its small end (where
    alpha shows) as at its large end; the plain fit lets the largest points set alpha, whose error
    there is a rounding of their time. Returns (alpha_s >= 0, beta_bytes_per_s)."""
    if len(sizes_bytes) != len(seconds) or len(sizes_bytes) < 2:
        raise ValueError(f"sizes/seconds: need two or more matching points, got {len(sizes_bytes)} and {len(seconds)}")
    if len(set(sizes_bytes)) < 2:
        raise ValueError("sizes: need at least two distinct sizes to fit a slope")
    if min(seconds) <= 0:
        raise ValueError(f"seconds: must be > 0 for a relative fit, got {min(seconds)!r}")
    # minimise sum ((a + b x - t) / t)^2: weighted normal equations, weights w = 1 / t^2
    w = [1.0 / (t * t) for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes_bytes))
    sy = sum(wi * t for wi, t in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes_bytes))
    sxy = sum(wi * x * t for wi, x, t in zip(w, sizes_bytes, seconds))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    if slope <= 0:
        raise ValueError(f"seconds: do not grow with size (slope {slope!r}); the timings are broken")
    alpha = (sy - slope * sx) / sw
    if alpha < 0:   # no fixed cost: the slope alone, through the origin, in relative error
        slope = sum(wi * x * t for wi, x, t in zip(w, sizes_bytes, seconds)) / sxx
        alpha = 0.0
    return alpha, 1.0 / slope


def copy_issue_fit(per_kind: Sequence[dict]) -> tuple[float, float]:
    """(host seconds per copy stage, per copy call) from calibrate's `host_stage_costs` record:
    least squares of median host seconds = a + b * ops over its h2d / d2h stage groups (one point
    per (phase, tag, kind, ops) group)."""
    pts = [(k["ops"], k["median_s"]) for k in per_kind if k["kind"] in ("h2d", "d2h")]
    per_stage, rate = fit_alpha_beta([o for o, _ in pts], [t for _, t in pts])
    return per_stage, 1.0 / rate


def half_rate_flops(points: Sequence[tuple[float, ...]], eff_flops_per_s: float) -> float:
    """FLOPs per kernel at which a kernel reaches half of `eff_flops_per_s`, from measured
    (kernel_flops, seconds[, memory_seconds]) points under the model rate(f) = eff * f / (f + h):
    each point gives h = f * (eff / rate - 1); the median of the points below 90% of eff is
    returned (the large ones carry no information about h). `memory_seconds` is the point's
    bytes over the HBM rate: a point that is memory-bound (its time under twice that) is left out,
    since the roofline already charges its bytes (a GEMV at 1 token is slow for its weights, not
    for its FLOPs; counting it inflated h ~3x on the H200)."""
    hs = []
    for flops, sec, *mem in points:
        if mem and sec < 2.0 * mem[0]:
            continue
        rate = flops / sec
        if rate < 0.9 * eff_flops_per_s:
            hs.append(flops * (eff_flops_per_s / rate - 1.0))
    return statistics.median(hs) if hs else 0.0


@dataclass
class Calibration:
    """What `kvpipe calibrate` measured, in SI units, with one source line per field.
    `extra` holds measurements that have no profile field (kept for the JSON record)."""

    name: str
    description: str
    source: str                      # "kvpipe calibrate on <GPU>, driver ..., torch ..., <date>"
    values: dict[str, float | int | bool] = field(default_factory=dict)   # TOML key -> value
    notes: dict[str, str] = field(default_factory=dict)                   # TOML key -> how it was measured
    extra: dict[str, object] = field(default_factory=dict)

    def set(self, key: str, value: float | int | bool, how: str, measured: bool = True) -> None:
        """Record one profile value; `how` says how it was measured (or, with measured=False,
        where it came from instead)."""
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}: measured a non-finite value {value!r} ({how})")
        self.values[key] = value
        self.notes[key] = f"measured, {how}" if measured else f"not measured: {how}"


def _fmt(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = f"{value:.4g}"
    return text if ("e" in text or "." in text) else text + ".0"   # TOML floats need a dot or exponent


def to_toml(cal: Calibration) -> str:
    """The profile as TOML, sections in the layout hw_profiles/*.toml use; every value's comment
    names the measurement it came from and the calibration's source line."""
    sections: dict[str, list[str]] = {}
    for key, value in cal.values.items():
        section, _, leaf = key.rpartition(".")
        line = f"{leaf} = {_fmt(value)}"
        sections.setdefault(section, []).append(f"{line:<36} # source: {cal.notes[key]}")
    out = [f"# Written by `kvpipe calibrate`: {cal.source}.",
           "# Each number below is a measurement on that machine or a fit of measurements, except",
           "# those marked 'not measured', which say where they come from instead.",
           f'name = "{cal.name}"', f'description = "{cal.description}"', ""]
    for section in sorted(sections, key=lambda s: (s.count("."), s)):
        out.append(f"[{section}]")
        out.extend(sections[section])
        out.append("")
    return "\n".join(out)
