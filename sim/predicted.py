"""One plan's prediction as the decision layer hands it over: the plan, whether it fits, and the
simulated report and trace."""
from __future__ import annotations

from dataclasses import dataclass

from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import Report, Timing
from kvpipe.pipeline.trace import Trace


@dataclass(frozen=True)
class Predicted:
    """One plan's prediction: whether it fits the budgets (else `problems`, one line per pool),
    and the simulated report and trace. `max_context` is set for `compare`. `fused`: decode steps
    modelled with the fused pieces; `compile_s` their one-time compile (None: the profile does not
    say), reported beside total_s, not in it (`run` pays it once per process, in its warm-up).
    `report` is a median run's (the profile's host figures); `p90` the same plan's timing on a
    run at the host's 90th-percentile issue speed (None: the profile knows no spread, p90 = p50)."""

    plan: Plan
    problems: tuple[str, ...]
    report: Report
    trace: Trace
    max_context: int | None = None
    fused: bool = False
    compile_s: float | None = 0.0
    p90: Timing | None = None

    def timing_at(self, quantile: str) -> Timing:
        """The predicted timing of a median (p50) or a slow (p90) run."""
        return self.p90 if quantile == "p90" and self.p90 is not None else self.report.timing

    def report_json(self) -> dict:
        """The report's JSON with the fused-decode setting and its compile time."""
        t = self.timing_at("p90")
        p90 = {"ttft_s": t.ttft_s, "decode_s_per_token": t.decode_s_per_token, "total_s": t.total_s}
        return {**self.report.to_json(), "p90": p90, "fused_decode": self.fused, "compile_s": self.compile_s}

    @property
    def fits(self) -> bool:
        return not self.problems
