"""What `kvpipe.plan(...)` and `kvpipe.run(...)` return: frozen dataclasses holding the model,
hardware, workload, budgets, plan and reports, whose `to_json()` is exactly what `--json` prints
(JSON-native: lists and string keys, so `json.loads(json.dumps(r.to_json())) == r.to_json()`)."""
from __future__ import annotations

from dataclasses import dataclass

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import kv_by_kind
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import Report, decode_step_stats
from kvpipe.pipeline.trace import Trace
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.predicted import Predicted

__all__ = ["PlanResult", "Predicted", "RunResult", "lossy_json"]

CPU_NOTE = ("measured only: no hardware profile models a CPU run (`kvpipe plan --hw NAME` predicts a GPU); "
            "on CPU the resident units live in this process's memory")


def _kinds_json(model: ModelSpec, work: Workload, plan) -> dict:
    """The KV per layer kind under `plan` and its share of the same model's KV at full attention."""
    rows = kv_by_kind(model, work, plan)
    held, full = sum(r["kv_bytes"] for r in rows), sum(r["full_bytes"] for r in rows)
    return {"kv_per_layer_kind": rows, "kv_vs_full_attention": round(held / full, 4)}


def _head(model: ModelSpec, hw: HardwareProfile, work: Workload, plan=None) -> dict:
    return {"model": {"name": model.name, "family": model.family, "layers": model.layers,
                      "kv_heads": model.kv_heads, "q_heads": model.q_heads, "head_dim": model.head_dim,
                      "dtype": model.dtype, "weight_bytes": model.weight_bytes,
                      "kv_bytes_per_token": model.kv_bytes_per_token},
            **(_kinds_json(model, work, plan) if model.windows else {}),
            "hardware": {"name": hw.name, "description": hw.description},
            "workload": {"context": work.context, "decode_tokens": work.decode_tokens, "batch": work.batch}}


def _search_json(search, model: ModelSpec) -> dict:
    """The planner's runners-up and why its choice won (nothing for a rule's or a user's plan)."""
    if search is None:
        return {}
    return {"alternatives": [{"plan": a.plan.to_json(model), "predicted": a.prediction.report.to_json()}
                             for a in search.alternatives],
            "planner": {"objective": search.objective, "ranked_on": search.ranked_on, "reason": search.reason, "fitting_plans": search.fitting,
                        "simulated": search.simulated, "pruned": search.pruned,
                        "unexplored": search.unexplored}}


@dataclass(frozen=True)
class PlanResult:
    """What `kvpipe plan` prints. `methods` (compare=True) holds every method's rule plan."""

    model: ModelSpec
    hardware: HardwareProfile
    workload: Workload
    budgets: dict[str, int]
    predicted: Predicted
    methods: dict[str, Predicted] | None = None
    warnings: tuple[str, ...] = ()
    search: object = None            # sim.planner.PlannerResult when the planner chose the plan
    max_context: int | None = None   # set by max_context=True: the workload's context is it
    lossy_choice: str | None = None  # --max-error: the options, their measured errors and the pick
    multi: object = None             # sim.multi_choice.MultiDecision for --gpus N > 1 (plan: one rank's)

    @property
    def plan(self) -> Plan:
        return self.predicted.plan

    @property
    def fits(self) -> bool:
        return self.predicted.fits

    def to_json(self) -> dict:
        out = _head(self.model, self.hardware, self.workload, self.plan)
        p = self.predicted
        out.update(plan=p.plan.to_json(self.model), fits=p.fits, problems=list(p.problems),
                   predicted=p.report_json(), budgets_bytes=dict(self.budgets), warnings=list(self.warnings),
                   lossy=lossy_json(p.plan, context=self.workload.context))
        out.update(_search_json(self.search, self.model))
        out["lossy_choice"] = self.lossy_choice
        if self.max_context is not None:
            out["max_context"] = self.max_context
        if self.multi is not None:
            out["multi_gpu"] = self.multi.to_json()
        if self.methods is not None:
            out["methods"] = {n: {"fits": r.fits, "problems": list(r.problems), "plan": r.plan.to_json(self.model),
                                  "predicted": r.report.to_json(), "max_context": r.max_context}
                              for n, r in self.methods.items()}
        return out


def lossy_json(plan: Plan, measured: dict | None = None, run: bool = False, context: int | None = None) -> dict | None:
    """None for an exact plan; else what is lossy and its measured error (a plan measures none;
    a run passes what it measured); with `context`, what a sparse step there selects."""
    if plan.lossy is None:
        return None
    out = plan.lossy.to_json(context)
    if measured and "sparse_recall_mean" in measured and "k_rel_err" in measured:   # sparse over int8/int4
        out["measured_error"] = dict(measured)
        out["error_note"] = ("measured in this run: k/v/attn_rel_err on the first prefill chunk's first offloaded "
                             "layer (quantised blocks against exact, the chunk's last query, float64); sparse_* at "
                             "the first decode step on the first offloaded layer (attention mass on the selected "
                             "blocks and the output's relative error against the whole prefix, both over the "
                             "dequantised K/V, float64); not a task accuracy")
    elif measured and "sparse_recall_mean" in measured:
        out["measured_error"] = dict(measured)
        out["error_note"] = ("measured in this run at the first decode step on the first offloaded layer: "
                             "each offloaded unit's query heads, exact attention mass on the selected tokens "
                             "(recall) and the output's relative error against the whole prefix (float64); "
                             "not a task accuracy")
    elif measured:
        out["measured_error"] = dict(measured)
        out["error_note"] = ("measured in this run on the first prefill chunk's first offloaded layer: "
                             "K/V relative error of its quantised blocks, and the chunk's last query "
                             "attending the chunk (float64) with and without quantisation; not a task accuracy")
    elif run:
        out["error_note"] = ("nothing measured: no decode step scored an offloaded unit" if plan.lossy.sparse is not None
                             else "nothing measured: no full quantisation block of an offloaded unit in the first prefill chunk")
    if out["measured_error"] is None and not run:
        out["error_note"] = ("not measured by plan: python -m benchmarks.lossy_error measures it on a "
                             "synthetic needle set")
    return out


@dataclass(frozen=True)
class RunResult:
    """What `kvpipe run` prints: the prediction on `hardware` next to the measurement on `device`,
    the greedy `tokens` [batch][decode_tokens + 1] and `output_digest` (sha256 of the final logits
    and the ids: equal digests, equal bits)."""

    model: ModelSpec
    hardware: HardwareProfile
    workload: Workload
    budgets: dict[str, int]
    predicted: Predicted
    measured: Report
    real_trace: Trace
    tokens: list[list[int]]
    output_digest: str
    device: str
    attention: str
    weights: str          # "random weights" or the model directory
    warnings: tuple[str, ...] = ()
    decode_issue: dict | None = None   # {"mode": graph|issue|eager, "graphs": n, "capture_s": s, "fuse": setting,
                                       #  "fused": ran fused, "compile_s": s, "fuse_note": why unfused or None}
    disk: dict | None = None   # the disk tier's I/O: bytes, seconds, checksum cost, notes (None: no disk units)
    search: object = None  # sim.planner.PlannerResult when the planner chose the plan
    lossy_error: dict | None = None   # LOSSY runs: the error measured in the run (executor/quant/probe.py)
    lossy_choice: str | None = None   # --max-error: the options, their measured errors and the pick

    @property
    def plan(self) -> Plan:
        return self.predicted.plan

    @property
    def modelled(self) -> bool:
        """Whether the prediction speaks for this run: hardware profiles model GPUs, not a CPU."""
        return not self.device.startswith("cpu")

    def to_json(self) -> dict:
        out = _head(self.model, self.hardware, self.workload, self.plan)
        measured = self.measured.to_json()
        measured.pop("gpu_breakdown_bytes")
        measured["decode_steps"] = decode_step_stats(self.real_trace)
        if self.modelled:
            out.update(_search_json(self.search, self.model))
        else:   # no profile predicts a CPU run: no figures in its name
            out.update(hardware=None, prediction_note=CPU_NOTE)
        out.update(plan=self.plan.to_json(self.model), fits=True,
                   predicted=self.predicted.report_json() if self.modelled else None,
                   measured=measured, tokens=[list(t) for t in self.tokens], output_digest=self.output_digest,
                   device=self.device, attention=self.attention, budgets_bytes=dict(self.budgets),
                   warnings=list(self.warnings), disk=self.disk, lossy=lossy_json(self.plan, self.lossy_error, run=True,
                                                                        context=self.workload.context))
        out["lossy_choice"] = self.lossy_choice
        if self.decode_issue is not None:
            out["decode_issue"] = dict(self.decode_issue)
        return out
