"""`HeadwiseCache`: a transformers `Cache` that lets Hugging Face's own `model.generate(...)` run
with kvpipe's head-wise KV placement. Each (layer, KV head) unit lives where the plan puts it
(resident on the device, or offloaded to host RAM, pinned on CUDA); offloaded head groups are
streamed to the device group by group, and attention is kvpipe's exact chunked attention.

    import kvpipe
    cache = kvpipe.HeadwiseCache(model, max_length=prompt_len + new_tokens, resident="none", group=1)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)

Only public transformers extension points are used: `Cache`/`CacheLayerMixin` for the cache, and
an attention implementation registered with `AttentionInterface` (`kvpipe_headwise`, see
`kvpipe.executor.hf.attention`). The constructor switches the model to that implementation with
`model.set_attn_implementation`; `close()` (or leaving a `with` block) frees the KV buffers and
switches the model back."""
from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.hf.headstream import HeadStream
from kvpipe.executor.hf.attention import IMPLEMENTATION, PendingKV, register
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.pipeline.memory import allocator_allowance, breakdown, gpu_usable
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, Plan, Tier, placement
from kvpipe.pipeline.rules import default_plan, max_resident, spill_to_disk
from kvpipe.pipeline.workload import Workload


class HeadwiseCache(Cache):
    """KV cache for `model.generate(..., past_key_values=cache)` placed and streamed by a kvpipe plan.

    `max_length`: tokens per sequence the cache holds (prompt + new tokens); buffers of that size
    are allocated at the first forward. `batch`: sequences per call (un-padded, one length).
    Plan knobs, as in `kvpipe run`: `resident` units kept on the device ("none", "all", "max" = as
    many as `gpu_mem` holds, "auto" = the rule's, or a count), `group` KV heads per streamed group,
    `chunk` prefill tokens per step the plan budgets for, `depth` transfer slots; `gpu_mem` /
    `host_mem` budgets in bytes (default: the whole device / host RAM). Or `plan=` a kvpipe `Plan`
    instead of the knobs. HF chunks the prompt only when asked: pass
    `prefill_chunk_size=cache.plan.prefill.chunk` to `generate` for long prompts.

    Changes the model's attention implementation to `kvpipe_headwise` (kvpipe's exact attention;
    with other caches it still runs un-padded causal attention exactly); `close()` restores it."""

    def __init__(self, model: torch.nn.Module, max_length: int, *, resident: str | int = "auto",
                 group: int | None = None, chunk: int | None = None, depth: int | None = None,
                 batch: int = 1, gpu_mem: int | None = None, host_mem: int | None = None,
                 plan: Plan | None = None) -> None:
        adapter = HFAdapter(model)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length: must be a positive token count, got {max_length!r}")
        spec, work = adapter.spec(), Workload(max_length, 0, batch)
        adapter.check(spec, max_length)
        if plan is not None:
            if (resident, group, chunk, depth, gpu_mem, host_mem) != ("auto", None, None, None, None, None):
                raise ValueError("plan: give either plan= or the knobs (resident, group, chunk, depth, budgets)")
            if not isinstance(plan, Plan):
                raise ValueError(f"plan: expected a kvpipe Plan, got {type(plan).__name__}")
            plan.check(spec, work)
            if plan.disk:
                raise ValueError(f"plan: {plan.disk} disk units; the executor has no disk tier yet")
        else:
            plan = _knob_plan(spec, work, _budgets(adapter.device, gpu_mem, host_mem), resident, group,
                              chunk, depth)
        self.plan, self.model, self.max_length = plan, model, max_length
        self.layout = _layout(spec, plan, batch, max_length)
        self.device, self.dtype = adapter.device, adapter.dtype
        self.stream: HeadStream | None = None
        super().__init__(layers=[HeadwiseLayer(self, i) for i in range(spec.layers)])
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(register())

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Free the KV buffers and give the model back its previous attention implementation."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        for layer in self.layers:
            layer.reset()
            layer.is_initialized = False
        if self.model.config._attn_implementation == IMPLEMENTATION:
            self.model.set_attn_implementation(self._previous_attention)

    def __enter__(self) -> "HeadwiseCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- called by the layers ----------------------------------------------------------
    def _open(self, key_states: torch.Tensor) -> None:
        """Allocate every buffer of the plan at the first forward (HF's lazy initialisation)."""
        lo = self.layout
        B, H, _, D = key_states.shape
        if (B, H, D) != (lo.batch, lo.kv_heads, lo.head_dim):
            raise ValueError(f"batch: the cache was built for [batch, kv heads, head dim] = "
                             f"[{lo.batch}, {lo.kv_heads}, {lo.head_dim}], the model passes [{B}, {H}, {D}]")
        if key_states.device != self.device or key_states.dtype != self.dtype:
            raise ValueError(f"device: K/V on {key_states.device} {key_states.dtype}, the cache expects "
                             f"{self.device} {self.dtype}")
        if self.model.config._attn_implementation != IMPLEMENTATION:
            raise ValueError(f"attention: the model runs {self.model.config._attn_implementation!r}, not "
                             f"{IMPLEMENTATION!r} (was the cache closed?)")
        groups = {True: self.plan.prefill.group, False: self.plan.decode.group}
        self.stream = HeadStream(lo, groups, self.device, self.dtype).open()

    def _write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> PendingKV:
        T = key_states.shape[2]
        if start + T > self.max_length:
            raise ValueError(f"max_length: {start + T} tokens exceed the cache's {self.max_length}")
        kv = torch.stack((key_states, value_states), dim=3)   # [B, H, T, 2, D], contiguous
        self.stream.write(layer, kv, start)
        return PendingKV(self.stream, layer, kv)

    @property
    def is_compileable(self) -> bool:
        return False


class HeadwiseLayer(CacheLayerMixin):
    """One layer's view of a HeadwiseCache: its length; the data lives in the cache's stream."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: HeadwiseCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer, self.length = owner, layer, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.owner.stream is None:
            self.owner._open(key_states)
        self.batch_size = key_states.shape[0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[PendingKV, PendingKV]:
        """Write the new K/V ([B, H, T, D] each) where the plan places them; hand the attention
        function a PendingKV in place of the whole K/V (it streams the prefix itself)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pending = self.owner._write(self.layer, key_states, value_states, self.length)
        self.length += key_states.shape[2]
        return pending, pending

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_length

    def reset(self) -> None:
        self.length = 0

    def _unsupported(self, *args, **kwargs) -> None:
        raise ValueError("HeadwiseCache: beam search, num_return_sequences > 1 and cache cropping "
                         "(assisted decoding) are not supported")

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = _unsupported


def _budgets(device: torch.device, gpu_mem: int | None, host_mem: int | None) -> dict[str, int]:
    from kvpipe.executor.engine.session import device_budget, host_ram_bytes

    for name, v in (("gpu_mem", gpu_mem), ("host_mem", host_mem)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{name}: must be a positive byte count, got {v!r}")
    return {"gpu": gpu_mem or device_budget(device), "host": host_mem or host_ram_bytes(), "disk": 0}


def _knob_plan(spec: ModelSpec, work: Workload, budgets: dict[str, int], resident, group, chunk,
               depth) -> Plan:
    """The head-wise rule plan with the knobs applied, checked against the budgets (as `kvpipe run`)."""
    plan = default_plan(Method.HEADWISE, spec, work, budgets)
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
        plan = max_resident(spec, work, plan, budgets["gpu"])
    if plan.resident < spec.units and spill_to_disk(spec, work, plan, budgets["host"]).disk:
        raise ValueError(f"host_mem: the offloaded KV does not fit in {budgets['host']} bytes "
                         "(the executor has no disk tier yet)")
    need = breakdown(spec, work, plan).gpu
    if need > gpu_usable(budgets["gpu"]):
        raise ValueError(f"gpu_mem: the plan needs {need} bytes on the device and the "
                         f"allocator's allowance {allocator_allowance(budgets['gpu'])}, the budget is {budgets['gpu']}")
    return plan


def _layout(spec: ModelSpec, plan: Plan, batch: int, capacity: int) -> KVLayout:
    """The KV store layout of `plan` (as KVLayout.of, for a workload HF drives)."""
    tiers = placement(spec, plan)
    resident = tuple(sum(tiers[(layer, h)] is Tier.GPU for h in range(spec.kv_heads)) for layer in range(spec.layers))
    offloaded = any(n < spec.kv_heads for n in resident)
    phases = (plan.prefill, plan.decode)
    return KVLayout(batch, spec.kv_heads, spec.head_dim, capacity, resident,
                    max(p.depth for p in phases) if offloaded else 0, max(p.group for p in phases))
