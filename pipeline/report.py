"""What a run reports, predicted or measured: phase times, lane utilisation, critical lane and peak
memory per pool; plus the budget check that says which pool does not fit."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .memory import MemoryBreakdown, allocator_allowance, over_limits
from .stage import Phase
from .trace import Trace
from .units import fmt_bytes, fmt_seconds


class NoPlanFits(ValueError):
    """Valid input, but no plan fits the budgets (exit 3); the message names the smallest budget that would."""


@dataclass(frozen=True)
class Timing:
    """Seconds: prefill until every prompt K/V is home; TTFT until the first token's logits;
    decode per token as the mean steady-state step; total for the whole workload."""

    prefill_s: float
    ttft_s: float
    decode_s_per_token: float | None
    total_s: float


def decode_head_ends(tr: Trace) -> list[float]:
    """End times of the decode steps' `head` stages (each step's token ready), in order."""
    st = tr.graph.stages
    return sorted(sp.end_s for sp in tr.spans if st[sp.stage].phase is Phase.DECODE and st[sp.stage].tag == "head")


def decode_step_stats(tr: Trace) -> dict | None:
    """Per decode step of a measured trace: the step's time (from the previous step's token to its
    own; the first step follows the prefill and is left out) and the host seconds spent issuing
    its stages, each as p50 / p90 / max, so a slow run shows whether its host was slow. None
    with fewer than two decode steps."""
    ends = decode_head_ends(tr)
    if len(ends) < 2:
        return None
    steps = [b - a for a, b in zip(ends, ends[1:])]
    host: dict[int, float] = {}
    for sp in tr.spans:
        st = tr.graph.stages[sp.stage]
        if st.phase is Phase.DECODE:
            host[st.step] = host.get(st.step, 0.0) + sp.host_s
    issue = [host[k] for k in sorted(host)[1:]]
    return {"steps": len(steps), "step_s": _quantiles(steps), "host_issue_s": _quantiles(issue)}


def _quantiles(xs: list[float]) -> dict:
    """p50 / p90 (nearest rank) and max of `xs`."""
    xs = sorted(xs)
    rank = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return {"p50": rank(0.5), "p90": rank(0.9), "max": xs[-1]}


def timing_from_trace(tr: Trace) -> Timing:
    stages = tr.graph.stages
    prefill_end = ttft = 0.0
    for sp in tr.spans:
        st = stages[sp.stage]
        if st.phase is Phase.PREFILL:
            prefill_end = max(prefill_end, sp.end_s)
            if st.tag == "head":
                ttft = sp.end_s
    heads = decode_head_ends(tr)
    steps = [b - a for a, b in zip([ttft] + heads, heads)]
    per_token = statistics.fmean(steps[1:]) if len(steps) > 1 else (steps[0] if steps else None)
    return Timing(prefill_end, ttft, per_token, tr.end_s)


@dataclass(frozen=True)
class Report:
    """`phase_busy_s` holds busy seconds per phase and lane (see Trace.lane_busy_s)."""

    timing: Timing
    phase_busy_s: dict[str, dict[str, float]]
    peak_bytes: dict[str, int]
    gpu_breakdown_bytes: dict[str, int]
    notes: tuple[str, ...] = ()

    @property
    def lane_busy_s(self) -> dict[str, float]:
        lanes = next(iter(self.phase_busy_s.values()))
        return {lane: sum(p[lane] for p in self.phase_busy_s.values()) for lane in lanes}

    @property
    def lane_utilisation(self) -> dict[str, float]:
        total = self.timing.total_s or 1.0
        return {lane: busy / total for lane, busy in self.lane_busy_s.items()}

    @property
    def critical_lane(self) -> str:
        """The lane busiest over the whole workload: the one that bounds it."""
        busy = self.lane_busy_s
        return max(busy, key=lambda lane: busy[lane])

    def critical_lane_of(self, phase: str) -> str | None:
        busy = self.phase_busy_s.get(phase, {})
        return max(busy, key=lambda lane: busy[lane]) if any(busy.values()) else None

    def to_json(self) -> dict:
        t = self.timing
        return {"prefill_s": t.prefill_s, "ttft_s": t.ttft_s, "decode_s_per_token": t.decode_s_per_token,
                "total_s": t.total_s, "peak_bytes": dict(self.peak_bytes),
                "gpu_breakdown_bytes": dict(self.gpu_breakdown_bytes), "critical_lane": self.critical_lane,
                "critical_lane_by_phase": {ph: self.critical_lane_of(ph) for ph in self.phase_busy_s},
                "lane_utilisation": {k: round(v, 4) for k, v in self.lane_utilisation.items()}}


def budget_problems(mem: MemoryBreakdown, budgets: dict[str, int]) -> list[str]:
    """One line per pool whose peak exceeds what its budget allows (memory.pool_limits: the GPU
    budget less the caching allocator's allowance): 'gpu needs 23.5 GiB + 256.0 MiB allocator
    allowance, 22.4 GiB available'."""
    need = mem.pools()
    room = lambda pool: f" + {fmt_bytes(allocator_allowance(budgets[pool]))} allocator allowance" if pool == "gpu" else ""
    return [f"{pool} needs {fmt_bytes(need[pool])}{room(pool)}, {fmt_bytes(budgets[pool])} available"
            for pool in over_limits(mem, budgets)]


def fmt_s(x: float | None) -> str:
    return fmt_seconds(x)   # ms / s / min s / h min: see units.fmt_seconds


def format_report(rep: Report, measured: Report | None = None, p90: Timing | None = None) -> list[str]:
    """Rows of the report table; with `measured`, predicted and measured side by side; with `p90`,
    the prediction of a slow run (the host's p90 issue speed) beside the median one's."""
    t, m = rep.timing, measured.timing if measured else None
    times = lambda x: (x.prefill_s, x.ttft_s, x.decode_s_per_token, x.total_s) if x else (None,) * 4  # noqa: E731
    labels = ("prefill", "time to first token", "decode per token", "total")
    out = [f"  {'':22}{'predicted':>14}" + (f"{'p90 run':>14}" if p90 else "") + (f"{'measured':>14}" if m else "")]
    for label, a, b, c in zip(labels, times(t), times(p90), times(m)):
        out.append(f"  {label:22}{fmt_s(a):>14}" + (f"{fmt_s(b):>14}" if p90 else "") + (f"{fmt_s(c):>14}" if m else ""))
    for pool in ("gpu", "host", "disk"):
        line = f"  {'peak ' + pool:22}{fmt_bytes(rep.peak_bytes[pool]):>14}"
        if measured and pool in measured.peak_bytes:
            line += f"{fmt_bytes(measured.peak_bytes[pool]):>14}"
        out.append(line)
    out.append("    gpu = " + " + ".join(f"{k} {fmt_bytes(v)}" for k, v in rep.gpu_breakdown_bytes.items()))
    util = ", ".join(f"{k} {v:.0%}" for k, v in rep.lane_utilisation.items() if rep.lane_busy_s[k] > 0)
    by_phase = ", ".join(f"{ph} {rep.critical_lane_of(ph)}" for ph in rep.phase_busy_s if rep.critical_lane_of(ph))
    out.append(f"  critical lane: {rep.critical_lane} ({by_phase}); busy: {util}")
    return out
