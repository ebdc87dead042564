"""The choice of a multi-GPU layout: every TP/PP split of the GPUs the model allows (within the
user's --tp/--pp pins), each rank's plan decided by sim/decide.py on its shard under the per-GPU
budgets, the whole machine's time from it (sim/multi.py); the layout that fits and minimises the
objective wins."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.units import fmt_bytes
from kvpipe.pipeline.workload import Workload

from .decide import Decision, Request, Target, decide
from .multi import (Collectives, Layout, collectives, combined_report, layouts, peer_problem, rank_budgets,
                    rank_hardware, shard)
from .predicted import Predicted


@dataclass(frozen=True)
class LayoutOption:
    """One layout considered: the rank's decision and the whole machine's prediction, or why not."""

    layout: Layout
    rank_model: ModelSpec
    budgets: dict[str, int]            # one rank's
    hardware: HardwareProfile          # one rank's link under the shared host bandwidth
    decision: Decision | None = None   # None: refused (`why`)
    predicted: Predicted | None = None  # the whole machine's
    collectives: Collectives | None = None
    why: str | None = None

    @property
    def fits(self) -> bool:
        return self.predicted is not None and self.predicted.fits

    def to_json(self) -> dict:
        out = {**self.layout.to_json(), "fits": self.fits, "why": self.why}
        if self.predicted is not None:
            t = self.predicted.report.timing
            out.update(prefill_s=t.prefill_s, decode_s_per_token=t.decode_s_per_token, total_s=t.total_s,
                       problems=list(self.predicted.problems))
        return out


@dataclass(frozen=True)
class MultiDecision:
    """The chosen layout (its rank's plan is what every rank runs on its shard) and the others."""

    chosen: LayoutOption
    options: tuple[LayoutOption, ...]
    objective: str

    @property
    def predicted(self) -> Predicted:
        return self.chosen.predicted

    def to_json(self) -> dict:
        c = self.chosen
        return {**c.layout.to_json(), "objective": self.objective,
                "rank_model": {"name": c.rank_model.name, "layers": c.rank_model.layers,
                               "kv_heads": c.rank_model.kv_heads, "q_heads": c.rank_model.q_heads,
                               "intermediate": c.rank_model.intermediate, "weight_bytes": c.rank_model.weight_bytes,
                               "kv_bytes_per_token": c.rank_model.kv_bytes_per_token},
                "rank_budgets_bytes": dict(c.budgets),
                "rank_link_bytes_per_s": {"h2d": c.hardware.h2d_bytes_per_s, "d2h": c.hardware.d2h_bytes_per_s},
                "host_mem_bytes_per_s": c.hardware.host_mem_bytes_per_s,
                "rank_predicted": c.decision.predicted.report_json(),
                "collectives": c.collectives.to_json(),
                "layouts": [o.to_json() for o in self.options]}

    def describe(self) -> list[str]:
        """Text lines: the layout, one rank's share, the collectives, the other layouts."""
        c, coll = self.chosen, self.chosen.collectives
        h2d = c.hardware.h2d_bytes_per_s / 1e9
        lines = [f"gpus: {c.layout.gpus} (tp {c.layout.tp}, pp {c.layout.pp}); each rank: {c.rank_model.kv_heads} KV "
                 f"heads of {c.rank_model.layers} layers, weights {fmt_bytes(c.rank_model.weight_bytes)}, "
                 f"host link {h2d:.1f} GB/s",
                 f"  collectives: prefill {coll.prefill_s * 1e3:.1f} ms, decode {coll.decode_s_per_token * 1e3:.3f} ms "
                 f"per token ({coll.allreduces_per_token} all-reduces per step), added serially"]
        for o in self.options:
            if o is not c:
                what = o.why or (f"decode {o.predicted.report.timing.decode_s_per_token * 1e3:.1f} ms/token, total "
                                 f"{o.predicted.report.timing.total_s:.1f} s" + ("" if o.fits else ", does not fit"))
                lines.append(f"  other layout tp {o.layout.tp}, pp {o.layout.pp}: {what}")
        return lines


def _key(objective: str) -> Callable[[LayoutOption], tuple]:
    def key(o: LayoutOption) -> tuple:
        t = o.predicted.report.timing
        value = {"total": t.total_s, "ttft": t.ttft_s, "decode": t.decode_s_per_token or 0.0}[objective]
        return (not o.fits, value, o.layout.pp)
    return key


def consider(model: ModelSpec, work: Workload, hw: HardwareProfile, budgets: dict[str, int], layout: Layout,
             request: Callable[[ModelSpec], Request], target: Target = Target()) -> LayoutOption:
    """One layout: refused where the GPU link has no figures or a rank's weights exceed the GPU
    budget, else its rank decided and the machine's time predicted."""
    rank, rb, rhw = shard(model, layout), rank_budgets(budgets, layout), rank_hardware(hw, layout)
    base = LayoutOption(layout, rank, rb, rhw)
    why = peer_problem(hw, layout)
    if why is None and rank.weight_bytes > rb["gpu"]:
        why = (f"gpu-mem: {fmt_bytes(rb['gpu'])} per GPU cannot hold a rank's weights "
               f"({fmt_bytes(rank.weight_bytes)} of {fmt_bytes(model.weight_bytes)})")
    if why is not None:
        return replace(base, why=why)
    try:
        dec = decide(rank, work, rhw, rb, request(rank), target)
    except ValueError as e:   # a pin this rank's shard cannot take
        return replace(base, why=str(e).splitlines()[0])
    coll = collectives(model, work, dec.plan, hw, layout)
    whole = replace(dec.predicted, report=combined_report(dec.predicted.report, coll, layout))
    return replace(base, decision=dec, predicted=whole, collectives=coll)


def decide_multi(model: ModelSpec, work: Workload, hw: HardwareProfile, budgets: dict[str, int], gpus: int,
                 request: Callable[[ModelSpec], Request], tp: int | None = None, pp: int | None = None,
                 objective: str = "total", target: Target = Target()) -> MultiDecision:
    """The best layout of `gpus` GPUs for `model` (fits first, then `objective`, then fewer
    stages); ValueError naming the flag where no layout can be considered at all."""
    opts = tuple(consider(model, work, hw, budgets, lay, request, target) for lay in layouts(model, gpus, tp, pp))
    ranked = sorted((o for o in opts if o.predicted is not None), key=_key(objective))
    if not ranked:
        raise ValueError(opts[0].why)
    return MultiDecision(ranked[0], opts, objective)
