"""The measured error of each lossy option the planner may pick, carried as data with its source:
the mean relative error of the attention output against exact float64 attention, on the synthetic
needle set and on the random-weights probe (benchmarks/lossy_error.py, which writes both; the
figures below are copied from its JSON file, and the tests check them against a copy of that
file, tests/fixtures/lossy-error.json). Beside them, where it was measured, the trained-model
figure: SmolLM2-135M-Instruct on a needle in a haystack of prose (MODEL_SOURCE, benchmarks/lossy_needle.py
via `python -m benchmarks.lossy_error --model-needles`; copy tests/fixtures/lossy-needle.json): the
attention-output error its runs measured, with the needle accuracy beside it. `--max-error`
admits an option only where the WORST of its figures (synthetic needle set, random-weights probe,
trained model) is within the budget: each misses something (the synthetic set real keys, the probe
trained attention, the trained model contexts past 8K), so none alone may admit an option. The
needle accuracy is reported, not budgeted (a 135M model at <= 8K: a floor, not a forecast)."""
from __future__ import annotations

from dataclasses import dataclass

SOURCE = "benchmarks/results/cpu-2026-12-01-lossy-error.json"   # every row: needle set and probe
COMMAND = "python -m benchmarks.lossy_error"
MODEL_SOURCE = "benchmarks/results/mixed-2026-12-02-lossy-needle.json"   # the trained-model rows
SPARSE_SKETCH = 2   # the sparse rows were measured with the 2-bit token sketch, chunks 64, sink 64,
                    # recent 256: LossySpec's defaults, which a sparse pick uses


@dataclass(frozen=True)
class MeasuredError:
    """Mean relative error of the attention output of the option named `row` (its row name in
    both JSON files): `needle` on the needle set (32K tokens, 8 cases x 8 steps x 4 query heads,
    in `needle_source`), `probe` on the random-weights probe (4 cases x 16K tokens, in
    `probe_source`)."""

    row: str
    needle: float
    probe: float
    needle_source: str = SOURCE
    probe_source: str = SOURCE
    probe_row: str | None = None    # the row's name in the probe's table, where it differs from `row`
    model: float | None = None      # trained model: mean attention-output error its runs measured
    accuracy: float | None = None   # trained model: needle accuracy (exact's is MODEL_EXACT_ACCURACY)
    model_row: str | None = None    # the option's name in MODEL_SOURCE's summary
    model_source: str = MODEL_SOURCE

    def __post_init__(self) -> None:
        for f in ("needle", "probe"):
            v = getattr(self, f)
            if not isinstance(v, float) or not v >= 0:
                raise ValueError(f"{f}: must be a measured error >= 0, got {v!r}")
        for f in ("row", "needle_source", "probe_source"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ValueError(f"{f}: must be a non-empty string, got {getattr(self, f)!r}")

        if self.model is not None and not (isinstance(self.model, float) and self.model >= 0):
            raise ValueError(f"model: must be a measured error >= 0 or None, got {self.model!r}")

    @property
    def worst(self) -> float:
        return max(self.needle, self.probe, 0.0 if self.model is None else self.model)

    @property
    def sources(self) -> str:
        out = [self.needle_source] + ([self.probe_source] if self.probe_source != self.needle_source else [])
        return ", ".join(out + ([self.model_source] if self.model is not None else []))

    def describe(self) -> str:
        model = "" if self.model is None else (f", SmolLM2-135M needle set {self.model:.2g} with needle "
                                               f"accuracy {self.accuracy:.0%} (exact {MODEL_EXACT_ACCURACY:.0%})")
        return (f"measured attention-output rel. error {self.worst:.2g} (needle set {self.needle:.2g}, "
                f"random-weights probe {self.probe:.2g}{model}; {self.sources})")


MODEL = {
    "int8": (0.0041793, 11 / 30),
    "int4": (0.085747, 14 / 30),
    "sparse 20%": (0.18014, 10 / 30),
    "sparse 30%": (0.15151, 11 / 30),
    "sparse 50%": (0.088573, 11 / 30),
    "sparse 20% + int4": (0.20492, 11 / 30),
}
"""Trained-model rows (MODEL_SOURCE "summary", SmolLM2-135M-Instruct, greedy, every unit offloaded,
30 prompts: 15 at 2K and 5 each at 4K, 6K and 8K, needle depths 10-90%): option -> (mean
attention-output rel. error, needle accuracy). Sparse 50% is measured but is no planner option
(neither synthetic figure has it)."""
MODEL_EXACT_ACCURACY = 11 / 30   # the exact runs' needle accuracy on the same prompts


def _model(row: str) -> dict:
    err, acc = MODEL.get(row, (None, None))
    return {} if err is None else {"model": err, "accuracy": acc, "model_row": row}


MEASURED = {(quant, group): MeasuredError(f"{quant} (group {group})", needle=needle, probe=probe, **_model(quant))
            for quant, group, needle, probe in (
                ("int8", 64, 0.00657, 0.0093),
                ("int4", 32, 0.09535, 0.12942),
            )}
"""(quant, group) -> its measured error."""

SPARSE_MEASURED = {f: MeasuredError(f"sparse {f:.0%}, {SPARSE_SKETCH}-bit token sketch", needle=needle, probe=probe,
                                     **_model(f"sparse {f:.0%}"))
                   for f, needle, probe in (
                       (0.1, 0.04284, 1.5095),
                       (0.2, 0.01998, 0.80137),
                       (0.3, 0.01093, 0.50875),
                   )}
"""Sparse decode fraction F -> its measured error. The probe's random weights spread attention
almost evenly, so a fraction of the tokens holds little more than that fraction of the mass: its
figure is far above the needle set's, and it is the one that binds."""

SPARSE_QUANT_MEASURED = {(f, quant): MeasuredError(f"sparse {f:.0%} + {quant}, {group}-token blocks ({rank})",
                                                   needle=needle, probe=probe,
                                                   probe_row=f"sparse {f:.0%} + {quant}, {group}-token blocks ({rank}), "
                                                             f"{SPARSE_SKETCH}-bit sketch",
                                                   **_model(f"sparse {f:.0%} + {quant}"))
                         for f, quant, group, rank, needle, probe in (
                             (0.2, "int4", 32, "sum", 0.12135, 1.93808),
                         )}
"""(sparse fraction F, quantisation) -> the measured error of both at once (whole quantised blocks
selected by the sum of their tokens' sketch shares; LossySpec's defaults: int4 group 32, chunks 64,
sink 64, recent 256). Its probe figure is above 1 (recall 0.28 at 20% of the tokens): a block's
summed share averages its 32 tokens, so on the probe's evenly spread attention the blocks chosen
hold little more than their share, and int4's error adds to what is left out. A budget is below 1
(--max-error), so the planner lists it and never picks it."""
