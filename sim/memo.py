"""Simulations kept across searches: a prediction depends on the model, workload, plan, profile and
how decode is issued, never on the budgets, so searches of one card under several host budgets
(the buyer's table) simulate each plan once. Passed explicitly; nothing is kept between calls."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.workload import Workload

from .simulate import Prediction, simulate


@dataclass
class SimMemo:
    """Predictions and prefill windows by (model, workload, profile, plan, issue); `hits` counts reuses."""

    sims: dict = field(default_factory=dict)
    windows: dict = field(default_factory=dict)
    hits: int = 0

    def windows_for(self, model: ModelSpec, work: Workload, hw: HardwareProfile) -> dict:
        """simulate()'s window memo for this model, workload and profile (its keys name the plan only)."""
        return self.windows.setdefault((model, work, repr(hw)), {})

    def simulate(self, model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, *,
                 full: bool = False, replay: bool = False, fuse: bool = False) -> Prediction:
        """simulate(), once per distinct input (the plan's `source` label does not change a prediction)."""
        key = (model, work, replace(plan, source=""), repr(hw), full, replay, fuse)
        if key in self.sims:
            self.hits += 1
            return self.sims[key]
        pred = simulate(model, work, plan, hw, full=full, replay=replay, fuse=fuse,
                        memo=self.windows_for(model, work, hw))
        self.sims[key] = pred
        return pred
