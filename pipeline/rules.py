"""Each method's rule plan, with no search: its knobs, then as many offloaded units in host RAM as
the budget allows and the rest on disk. The baselines (standard, chunked, layerwise) always run
their rule; a head-wise plan comes from the planner (sim/planner.py) unless the user gives one.
The memory bounds every plan is held to (HOST_KV_FRACTION, `gpu_fill`, `fits`) live here too, so
the rules, the planner and the decision layer (sim/decide.py) apply one set."""
from __future__ import annotations

from .memory import breakdown, gpu_usable, over_limits
from .model import ModelSpec
from .plan import Method, PhasePlan, Plan
from .workload import Workload

DEFAULT_CHUNK = 4096      # tokens; keeps a Llama-3-8B chunk's activations near 0.5 GiB
HOST_KV_FRACTION = 0.9    # of the host budget that KV and staging may take (the rest: OS, process)
GPU_FILL_FRACTION = 0.95  # of the GPU budget `max_resident` fills (the rest: allocator slack, kernel workspaces)

RULES = {
    Method.STANDARD: "rule: everything on the GPU, the prompt in one pass",
    Method.CHUNKED: f"rule: everything on the GPU, prompt chunks of {DEFAULT_CHUNK} tokens",
    Method.LAYERWISE: "rule: whole layers offloaded, ping-pong (depth 2)",
    Method.HEADWISE: "rule (HeadInfer's default): one KV head per group, "
                     "ping-pong, no resident heads unless the whole cache fits",
}


def method_plan(method: Method, model: ModelSpec, work: Workload) -> Plan:
    """The method's knobs before placement is settled (everything offloaded except for the
    all-GPU methods)."""
    H, U = model.kv_heads, model.units
    chunk = min(work.context, DEFAULT_CHUNK)
    if method is Method.STANDARD:
        return Plan(method, PhasePlan(H, work.context, 1), PhasePlan(H, 1, 1), U, 0, RULES[method])
    if method is Method.CHUNKED:
        return Plan(method, PhasePlan(H, chunk, 1), PhasePlan(H, 1, 1), U, 0, RULES[method])
    group = H if method is Method.LAYERWISE else 1
    return Plan(method, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), 0, 0, RULES[method])


def first_true(lo: int, hi: int, pred) -> int:
    """Smallest x in [lo, hi) with pred(x), for pred false then true; hi when it is never true."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
    return lo


def spill_to_disk(model: ModelSpec, work: Workload, plan: Plan, host_budget: int) -> Plan:
    """Put on disk the fewest offloaded units for the host pool to fit its KV share."""
    host_fits = lambda disk: breakdown(model, work, plan.with_(disk=disk)).host <= host_budget * HOST_KV_FRACTION
    offloaded = model.units - plan.resident
    return plan.with_(disk=min(first_true(0, offloaded, host_fits), offloaded))


def default_plan(method: Method, model: ModelSpec, work: Workload, budgets: dict[str, int]) -> Plan:
    plan = method_plan(method, model, work)
    if method is Method.HEADWISE:
        everything = plan.with_(resident=model.units)
        if breakdown(model, work, everything).gpu <= gpu_usable(budgets["gpu"]):
            return everything
    if plan.resident < model.units:
        plan = spill_to_disk(model, work, plan, budgets["host"])
    return plan


def gpu_fill(gpu_budget: int) -> float:
    """The GPU bytes resident units the search or a rule chooses may fill: GPU_FILL_FRACTION of the
    budget, never past what the allocator's allowance leaves (memory.gpu_usable, which binds below a
    5 GiB budget)."""
    return min(gpu_budget * GPU_FILL_FRACTION, gpu_usable(gpu_budget))


def max_resident(model: ModelSpec, work: Workload, plan: Plan, gpu_budget: int) -> Plan:
    """The plan with as many resident units as `gpu_fill` of the budget holds (0 if none)."""
    too_many = lambda n: breakdown(model, work, plan.with_(resident=n, disk=0)).gpu > gpu_fill(gpu_budget)
    return plan.with_(resident=max(first_true(1, model.units + 1, too_many) - 1, 0))


def fits(model: ModelSpec, work: Workload, plan: Plan, budgets: dict[str, int]) -> bool:
    """Every pool's peak within its limit (memory.pool_limits: the GPU's less the allocator's allowance)."""
    return not over_limits(breakdown(model, work, plan), budgets)


def max_context(method: Method, model: ModelSpec, decode_tokens: int, batch: int,
                budgets: dict[str, int], limit: int = 2**30) -> int:
    """Largest prompt the method's rule plan fits under the budgets (0 if none)."""
    def ok(ctx: int) -> bool:
        work = Workload(ctx, decode_tokens, batch)
        return fits(model, work, default_plan(method, model, work, budgets), budgets)
    return first_true(1, limit + 1, lambda ctx: not ok(ctx)) - 1
