"""`HeadwiseCache`'s plan from its knobs (as `kvpipe run` resolves them), the budgets they are
checked against, and the KV store layout of a plan for a workload HF drives."""
from __future__ import annotations

from dataclasses import replace

import torch

from kvpipe.executor.kv.layout import KVLayout
from kvpipe.pipeline.memory import allocator_allowance, breakdown, gpu_usable
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, Plan, Tier, placement
from kvpipe.pipeline.rules import default_plan, max_resident, spill_to_disk
from kvpipe.pipeline.units import parse_bytes
from kvpipe.pipeline.workload import Workload


def budget_bytes(name: str, v) -> int | None:
    """A budget given as bytes or as the CLI writes it ("24GB", "24GiB"); None: not given."""
    if v is None:
        return None
    if isinstance(v, str):
        v = parse_bytes(v, name)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: must be a positive size (bytes, or e.g. '24GB'), got {v!r}")
    return v


def budgets(device: torch.device, gpu_mem, host_mem) -> dict[str, int]:
    from kvpipe.executor.engine.session import device_budget, host_ram_bytes

    gpu, host = budget_bytes("gpu_mem", gpu_mem), budget_bytes("host_mem", host_mem)
    return {"gpu": gpu or device_budget(device), "host": host or host_ram_bytes(), "disk": 0}


def knob_plan(spec: ModelSpec, work: Workload, budget: dict[str, int], resident, group, chunk,
              depth) -> Plan:
    """The head-wise rule plan with the knobs applied, checked against the budgets (as `kvpipe run`)."""
    plan = default_plan(Method.HEADWISE, spec, work, budget)
    pre, dec = plan.prefill, plan.decode
    if group is not None:
        pre, dec = replace(pre, group=group), replace(dec, group=group)
    if chunk is not None:
        pre = replace(pre, chunk=chunk)
    if depth is not None:
        pre, dec = replace(pre, depth=depth), replace(dec, depth=depth)
    named = {"auto": plan.resident, "none": 0, "all": spec.units, "max": 0}
    if isinstance(resident, str) and resident in named:
        count = named[resident]
    elif isinstance(resident, int) and not isinstance(resident, bool) and 0 <= resident <= spec.units:
        count = resident
    else:
        raise ValueError(f"resident: expected none, all, max, auto or a count in 0..{spec.units}, got {resident!r}")
    plan = Plan(Method.HEADWISE, pre, dec, count, 0, "HeadwiseCache knobs over " + plan.source)
    plan.check(spec, work)
    if resident == "max":
        plan = max_resident(spec, work, plan, budget["gpu"])
    if plan.resident < spec.units and spill_to_disk(spec, work, plan, budget["host"]).disk:
        raise ValueError(f"host_mem: the offloaded KV does not fit in {budget['host']} bytes "
                         "(the executor has no disk tier yet)")
    need = breakdown(spec, work, plan).gpu
    if need > gpu_usable(budget["gpu"]):
        raise ValueError(f"gpu_mem: the plan needs {need} bytes on the device and the "
                         f"allocator's allowance {allocator_allowance(budget['gpu'])}, the budget is {budget['gpu']}")
    return plan


def layout(spec: ModelSpec, plan: Plan, batch: int, capacity: int) -> KVLayout:
    """The KV store layout of `plan` (as KVLayout.of, for a workload HF drives)."""
    tiers = placement(spec, plan)
    resident = tuple(sum(tiers[(layer, h)] is Tier.GPU for h in range(spec.kv_heads)) for layer in range(spec.layers))
    offloaded = any(n < spec.kv_heads for n in resident)
    phases = (plan.prefill, plan.decode)
    return KVLayout(batch, spec.kv_heads, spec.head_dim, capacity, resident,
                    max(p.depth for p in phases) if offloaded else 0, max(p.group for p in phases))

