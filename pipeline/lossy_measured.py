"""The measured error of each quantisation option, carried as data with its source: the mean
relative error of the attention output against exact float64 attention, on the synthetic needle
set and on the random-weights probe (benchmarks/lossy_error.py, which writes both; the figures
below are copied from its JSON, and tests/test_lossy_choice.py checks them against that file).
`--max-error` admits an option only where the WORSE of its two figures is within the budget.
Neither figure is a task accuracy: we have no trained weights."""
from __future__ import annotations

from dataclasses import dataclass

SOURCE = "benchmarks/results/lossy-error-2026-11-30-quant.json"
COMMAND = "python -m benchmarks.lossy_error"


@dataclass(frozen=True)
class MeasuredError:
    """Mean relative error of the attention output: `needle` on the needle set (32K tokens, 8
    cases x 8 steps x 4 query heads), `probe` on the random-weights probe (4 cases x 16K tokens)."""

    quant: str
    group: int
    needle: float
    probe: float

    def __post_init__(self) -> None:
        for f in ("needle", "probe"):
            v = getattr(self, f)
            if not isinstance(v, float) or not v >= 0:
                raise ValueError(f"{f}: must be a measured error >= 0, got {v!r}")

    @property
    def worst(self) -> float:
        return max(self.needle, self.probe)

    def describe(self) -> str:
        return (f"measured attention-output rel. error {self.worst:.2g} (needle set {self.needle:.2g}, "
                f"random-weights probe {self.probe:.2g}; {SOURCE})")


MEASURED = {(m.quant, m.group): m for m in (
    MeasuredError("int8", 64, needle=0.00657, probe=0.0093),
    MeasuredError("int4", 32, needle=0.08463, probe=0.12479),
)}
