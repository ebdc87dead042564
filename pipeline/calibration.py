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


def compute_issue_fit(per_kind: Sequence[dict], phase: str) -> tuple[float, float]:
    """(host seconds per compute stage, per kernel launch) of one phase ('prefill' or 'decode') from
    a `host_stage_costs` record: least squares of median host seconds = a + b * launches over the
    phase's compute stage groups, each group weighted by its stage count `n` (the fit serves sums
    over stages: a group of 4 head stages must not pull it as hard as 126 attention stages), where
    a group's launches are its `ops` (GEMMs, attention calls) plus its `small_ops` (norms, RoPE,
    casts, merges: each one launch too; on the H200 records a prefill attention of 2 ops + 1-3
    small kernels issues in half the time of one of 5 + 12-14, which ops alone fit 50-88% long).
    A negative intercept is clamped at 0 with the slope refitted through the origin. ValueError
    naming the problem: a group without `small_ops`, fewer than two distinct launch counts, a
    slope that is not positive."""
    pts = []
    for k in per_kind:
        if k["kind"] == "compute" and k["phase"] == phase:
            if "small_ops" not in k:
                raise ValueError(f"host_stage_costs.per_kind: 'small_ops' is missing in the {phase} {k['tag']} group")
            pts.append((k["ops"] + k["small_ops"], k["median_s"], k["n"]))
    if len({x for x, _, _ in pts}) < 2:
        raise ValueError(f"host_stage_costs: phase {phase!r} needs compute stages of two or more launch counts, "
                         f"got {sorted({x for x, _, _ in pts})}")
    w = sum(n for _, _, n in pts)
    mx, my = sum(n * x for x, _, n in pts) / w, sum(n * t for _, t, n in pts) / w
    slope = sum(n * (x - mx) * (t - my) for x, t, n in pts) / sum(n * (x - mx) ** 2 for x, _, n in pts)
    if slope <= 0:
        raise ValueError(f"host_stage_costs: phase {phase!r}: host seconds do not grow with launches (slope {slope!r})")
    per_stage = my - slope * mx
    if per_stage < 0:
        slope, per_stage = sum(n * x * t for x, t, n in pts) / sum(n * x * x for x, _, n in pts), 0.0
    return per_stage, slope


def issue_gap(runs: Sequence[dict], phase: str = "prefill") -> float:
    """Host seconds per stage spent between stage issues (the lane actors' turns, stream-event
    waits, the stream switch: outside every `Span.host_s`), from calibrate's `host_stage_costs`
    runs: the phase's host wall (first issue to last, `<phase>_wall_s`) minus its stages' summed
    host seconds (`<phase>_host_s`), over its stage count (`<phase>_stages`), pooled over the runs
    (sum of gaps / sum of stages). Records written before the per-phase walls lack those keys:
    ValueError naming the first missing one. Never negative (clamped at 0)."""
    keys = (f"{phase}_wall_s", f"{phase}_host_s", f"{phase}_stages")
    for r in runs:
        for k in keys:
            if k not in r:
                raise ValueError(f"host_stage_costs.runs: {k!r} is missing (a record before per-phase walls)")
    stages = sum(r[keys[2]] for r in runs)
    if stages <= 0:
        raise ValueError(f"host_stage_costs.runs: no {phase} stages")
    return max(0.0, sum(r[keys[0]] - r[keys[1]] for r in runs) / stages)


def run_gap_fit(runs: Sequence[dict]) -> tuple[float, float]:
    """(fixed seconds per run, seconds per stage) of what a whole run's wall time holds beyond its
    stages' summed host seconds (`wall_s - host_s_sum`: run set-up, the final sync, and the gaps
    between issues), least squares over calibrate's `host_stage_costs` runs against their stage
    counts. The older records' only evidence of the gap (no per-phase walls); both clamped at 0."""
    if len({r["stages"] for r in runs}) < 2:
        raise ValueError("host_stage_costs.runs: need runs of two or more stage counts")
    xs, ys = [r["stages"] for r in runs], [r["wall_s"] - r["host_s_sum"] for r in runs]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), max(0.0, slope)


def host_issue_fields(record: dict, gap: bool = True) -> dict[str, float]:
    """HardwareProfile fields of host issue cost from one `host_stage_costs` record (calibrate's
    JSON, or sim_check's same-session probe): the prefill compute pair (compute_issue_fit), the
    copy pair (copy_issue_fit) and, with `gap`, the prefill gap between issues: `issue_gap` where
    the record has per-phase walls, else the per-stage slope of `run_gap_fit` (whole runs: set-up
    and the final sync go to its intercept). Returns {field: seconds}; `how` keys are not included."""
    per_kind = record["per_kind"]
    pre_stage, pre_launch = compute_issue_fit(per_kind, "prefill")
    copy_stage, copy_op = copy_issue_fit(per_kind)
    out = {"host_prefill_issue_s_per_stage": pre_stage, "host_prefill_issue_s_per_launch": pre_launch,
           "host_copy_s_per_stage": max(0.0, copy_stage), "host_copy_s_per_op": copy_op}
    if gap:
        runs = record["runs"]
        out["host_prefill_issue_gap_s"] = (issue_gap(runs, "prefill") if all("prefill_wall_s" in r for r in runs)
                                           else run_gap_fit(runs)[1])
    return out


def issue_spread(step_seconds: Sequence[float]) -> float:
    """The host's issue spread from repeated host-bound runs of one plan: the p90 (nearest rank)
    of their step times over the median, at least 1 (HardwareProfile.host_issue_p90)."""
    xs = sorted(step_seconds)
    if len(xs) < 2:
        raise ValueError(f"step_seconds: at least two runs are needed, got {len(xs)}")
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    return max(1.0, p90 / statistics.median(xs))


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
    values: dict[str, object] = field(default_factory=dict)   # TOML key -> value
    notes: dict[str, str] = field(default_factory=dict)                   # TOML key -> how it was measured
    extra: dict[str, object] = field(default_factory=dict)

    def set(self, key: str, value: float | int | bool, how: str, measured: bool = True) -> None:
        """Record one profile value; `how` says how it was measured (or, with measured=False,
        where it came from instead)."""
        flat = list(_leaves(value))
        if any(isinstance(v, float) and not math.isfinite(v) for v in flat):
            raise ValueError(f"{key}: measured a non-finite value {value!r} ({how})")
        self.values[key] = value
        self.notes[key] = f"measured by kvpipe calibrate, {how}" if measured else f"not measured: {how}"


def _leaves(value):
    """The numbers of a value, a list or a list of lists."""
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _fmt(value) -> str:
    if isinstance(value, (list, tuple)):   # a table's axis or rows (TOML arrays)
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
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
