"""Whether a codec pays on a link, decided by the simulator: the plan is simulated with each
lossless codec that serves the link (and with none), and the fastest total wins. A codec pays
only when stored bytes / link rate plus the codec stages, as they overlap in the schedule, beat
the raw transfer; where it loses, `none` is chosen. `with_tiers` applies the user's --disk and
--codec over a plan, a link given as LINK=auto chosen here."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvpipe.pipeline.codecs import REGISTRY
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.workload import Workload

from .simulate import simulate


@dataclass(frozen=True)
class CodecChoice:
    """The chosen codec of `link` and the predicted total seconds of every candidate."""

    link: str
    chosen: str
    total_s: tuple[tuple[str, float], ...]

    def describe(self) -> str:
        rows = ", ".join(f"{name} {t:.3g} s" for name, t in self.total_s)
        return f"codec on {self.link}: {self.chosen} (predicted total: {rows})"


def with_codec(plan: Plan, link: str, name: str) -> Plan:
    pick = lambda p: replace(p, codecs=tuple(sorted({**dict(p.codecs), link: name}.items())))
    return plan.with_(prefill=pick(plan.prefill), decode=pick(plan.decode))


def candidates(link: str, hw: HardwareProfile) -> list[str]:
    """`none` and the lossless codecs serving `link` whose rates the profile holds."""
    rated = {c.name for c in hw.codecs}
    return ["none"] + [c.name for c in REGISTRY.values()
                       if c.name != "none" and c.lossless and link in c.links and c.name in rated]


def choose_codec(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile,
                 link: str) -> tuple[Plan, CodecChoice]:
    """The plan with the codec on `link` that the simulator predicts fastest (ties: none)."""
    totals = []
    for name in candidates(link, hw):
        pred = simulate(model, work, with_codec(plan, link, name), hw)
        totals.append((name, pred.report.timing.total_s))
    best = min(totals, key=lambda nt: (nt[1], nt[0] != "none"))[0]
    return with_codec(plan, link, best), CodecChoice(link, best, tuple(totals))


def with_tiers(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, disk: int | None = None,
               codecs: tuple[tuple[str, str], ...] = ()) -> Plan:
    """`plan` with `disk` offloaded units on disk (None: as it is) and each (link, codec) pair; a
    codec `auto` is the one the simulator predicts fastest (said in the plan's source)."""
    if disk is not None:
        if disk > model.units - plan.resident:
            raise ValueError(f"disk: {disk} exceeds the {model.units - plan.resident} offloaded units")
        plan = plan.with_(disk=disk)
    fixed = {link: name for link, name in codecs if name != "auto"}
    if fixed:
        pick = lambda p: replace(p, codecs=tuple(sorted({**dict(p.codecs), **fixed}.items())))   # noqa: E731
        plan = plan.with_(prefill=pick(plan.prefill), decode=pick(plan.decode))
    for link in (link for link, name in codecs if name == "auto"):
        plan, choice = choose_codec(model, work, plan, hw, link)
        plan = plan.with_(source=f"{plan.source}; {choice.describe()}")
    return plan
