"""One plan's prediction as the decision layer hands it over: the plan, whether it fits, and the
simulated report and trace."""
from __future__ import annotations

from dataclasses import dataclass

from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import Report
from kvpipe.pipeline.trace import Trace


@dataclass(frozen=True)
class Predicted:
    """One plan's prediction: whether it fits the budgets (else `problems`, one line per pool),
    and the simulated report and trace. `max_context` is set for `compare`. `fused`: decode steps
    modelled with the fused pieces; `compile_s` their one-time compile (None: the profile does not
    say), reported beside total_s, not in it (`run` pays it once per process, in its warm-up)."""

    plan: Plan
    problems: tuple[str, ...]
    report: Report
    trace: Trace
    max_context: int | None = None
    fused: bool = False
    compile_s: float | None = 0.0

    def report_json(self) -> dict:
        """The report's JSON with the fused-decode setting and its compile time."""
        return {**self.report.to_json(), "fused_decode": self.fused, "compile_s": self.compile_s}

    @property
    def fits(self) -> bool:
        return not self.problems
