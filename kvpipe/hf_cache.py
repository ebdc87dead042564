"""`HeadwiseCache`: a transformers `Cache` that lets Hugging Face's own `model.generate(...)` run
with kvpipe's head-wise KV placement. Each (layer, KV head) unit lives where the plan puts it
(resident on the device, or offloaded to host RAM, pinned on CUDA); offloaded head groups are
streamed to the device group by group, and attention is kvpipe's exact chunked attention.

    import kvpipe
    cache = kvpipe.HeadwiseCache(model, max_length=prompt_len + new_tokens, resident="none", group=1)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False)

Only public transformers extension points are used: `Cache`/`CacheLayerMixin` for the cache, and
an attention implementation registered with `AttentionInterface` (`kvpipe_headwise`, see
`kvpipe.executor.hf.attention`). While a cache is live its model runs that implementation and a
`generate` that checks each call up front (executor/hf/generate.py); the last live cache's
`close()` (or leaving a `with` block) gives both back. `copy.deepcopy` copies the KV, never the
model. Beam search, `crop`, `batch_repeat_interleave` and `batch_select_indices` act on every home."""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.hf import generate as hfgen
from kvpipe.executor.hf.attention import IMPLEMENTATION, PendingKV
from kvpipe.executor.hf.headstream import HeadStream
from kvpipe.executor.hf.homes import duplicate, materialise, regather
from kvpipe.executor.hf import loop
from kvpipe.executor.hf.static import StaticStep
from kvpipe.executor.hf.knobs import budgets, knob_plan, layout
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.workload import Workload


class HeadwiseCache(Cache):
    """KV cache for `model.generate(..., cache=cache)` (`past_key_values=` before transformers 5.2x;
    either name works while the cache is live) placed and streamed by a kvpipe plan.

    `max_length`: tokens per sequence the cache holds (prompt + new tokens); buffers of that size
    are allocated at the first forward, and generate() is refused up front when it would need more.
    `batch`: the most sequences per call (prompts × num_beams or num_return_sequences).
    Plan knobs, as in `kvpipe run`: `resident` units kept on the device ("none", "all", "max" = as
    many as `gpu_mem` holds, "auto" = the rule's, or a count), `group` KV heads per streamed group,
    `chunk` prefill tokens per step (generate() prefills the prompt in chunks of it unless given
    `prefill_chunk_size`), `depth` transfer slots; `gpu_mem` / `host_mem` budgets in bytes or as
    the CLI writes them ("24GB"; default: the whole device / host RAM). Or `plan=` a kvpipe `Plan`.
    `decode`: "auto" (decode tokens by the static-shape step replayed as a CUDA graph where it can
    be captured, else HF's own loop), "graph" (refused where it cannot), "static" (the same step
    without a graph: the graph's reference, and the path on CPU), "eager" (HF's loop). After a
    generate(), `decode_path` says which ran and `decode_note` why not the graph; `replays` counts."""

    def __init__(self, model: torch.nn.Module, max_length: int, *, resident: str | int = "auto",
                 group: int | None = None, chunk: int | None = None, depth: int | None = None,
                 batch: int = 1, gpu_mem: int | str | None = None, host_mem: int | str | None = None,
                 plan: Plan | None = None, decode: str = "auto") -> None:
        adapter = HFAdapter(model)
        if decode not in loop.DECODE:
            raise ValueError(f"decode: expected one of {', '.join(loop.DECODE)}, got {decode!r}")
        for name, v in (("max_length", max_length), ("batch", batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive count, got {v!r}")
        spec, work = adapter.spec(), Workload(max_length, 0, batch)
        adapter.check(spec, max_length)
        if any(0 < w < max_length for w in spec.windows):   # the head streams attend every cached key
            raise ValueError(f"sliding_window: {min(w for w in spec.windows if w)} < max_length {max_length}: not supported")
        if plan is not None:
            if (resident, group, chunk, depth, gpu_mem, host_mem) != ("auto", None, None, None, None, None):
                raise ValueError("plan: give either plan= or the knobs (resident, group, chunk, depth, budgets)")
            if not isinstance(plan, Plan):
                raise ValueError(f"plan: expected a kvpipe Plan, got {type(plan).__name__}")
            plan.check(spec, work)
            if plan.disk:
                raise ValueError(f"plan: {plan.disk} disk units; the executor has no disk tier yet")
        else:
            plan = knob_plan(spec, work, budgets(adapter.device, gpu_mem, host_mem), resident, group,
                             chunk, depth)
        self.plan, self.model, self.max_length, self.batch = plan, model, max_length, batch
        self.layout = layout(spec, plan, batch, max_length)
        self.device, self.dtype = adapter.device, adapter.dtype
        self.stream: HeadStream | None = None
        self.decode, self.static, self._in_static = decode, None, False
        self.decode_path, self.decode_note, self._replays, self._live = None, None, 0, False
        self.step_recorder = self.step_lanes = None   # the static step's capture and streams; None: CUDA's (tests: graph_tape.py)
        super().__init__(layers=[HeadwiseLayer(self, i) for i in range(spec.layers)])
        self._attach()

    # ---- lifetime ----------------------------------------------------------------------
    def _attach(self) -> None:
        hfgen.attach(self.model, lambda c: isinstance(c, HeadwiseCache))
        self._live = True

    def close(self) -> None:
        """Free the KV buffers; the last live cache of the model gives it back its previous
        attention implementation and its own generate."""
        self._drop_static()
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        for layer in self.layers:
            layer.reset()
        if self._live:
            self._live = False
            hfgen.detach(self.model)

    def __enter__(self) -> "HeadwiseCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __deepcopy__(self, memo: dict) -> "HeadwiseCache":
        """A live cache holding a copy of every unit's K/V, sharing the model (never copied)."""
        new = type(self).__new__(type(self))
        memo[id(self)], memo[id(self.model)] = new, self.model
        state = {k: v for k, v in self.__dict__.items() if k not in ("stream", "_live", "static")}
        new.__dict__.update(copy.deepcopy(state, memo))
        new.static = None
        new.stream = None if self.stream is None else duplicate(self.stream, self.get_seq_length())
        new._live = False
        new._attach()
        return new

    # ---- generate() ------------------------------------------------------------------
    def prepare_generate(self, args: tuple, kwargs: dict) -> None:
        """Check one generate() call before any work; default its prefill chunk to the plan's."""
        prompts, tokens, written, sequences, chunked = hfgen.request(self.model, args, kwargs)
        config = kwargs.get("generation_config") or self.model.generation_config
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            raise ValueError("output_attentions: not supported with HeadwiseCache (its attention "
                             "computes no weight matrix)")
        if written > self.max_length:
            raise ValueError(f"max_length: generate() writes up to {written} tokens per sequence (a prompt "
                             f"of {tokens} and max_new_tokens), the cache holds {self.max_length}; "
                             f"build it with max_length={written}")
        if sequences > self.batch:
            raise ValueError(f"batch: generate() runs {sequences} sequences ({prompts} prompts × num_beams "
                             f"or num_return_sequences), the cache holds {self.batch}; build it with "
                             f"batch={sequences}")
        if not chunked and tokens - self.get_seq_length() > self.plan.prefill.chunk:
            kwargs["prefill_chunk_size"] = self.plan.prefill.chunk
        loop.choose(self, args, kwargs, sequences, hfgen.cache_argument(self.model))

    # ---- the static decode step (executor/hf/static.py) ---------------------------------
    def _open_static(self) -> StaticStep:
        if self.static is None or self.static.store is not self.stream.store:
            self._drop_static()
            self.static = StaticStep(self.stream, self.plan.decode.group, self.step_recorder, self.step_lanes)
        self.static.graph_wanted = self.decode_path == "graph" or self.step_recorder is not None
        return self.static

    def _static_step(self, argument: str) -> torch.Tensor:
        self._in_static = True
        try:
            return self.static.run(self.model, self, argument)
        finally:
            self._in_static = False

    def _drop_static(self) -> None:
        if self.static is not None:
            self._replays += self.static.replays
            self.static.close()
            self.static = None

    def _set_length(self, tokens: int) -> None:
        for layer in self.layers:
            layer.length = tokens

    @property
    def replays(self) -> int:   # decode steps run by CUDA graph replay over the cache's life
        return self._replays + (self.static.replays if self.static is not None else 0)

    # ---- called by the layers ----------------------------------------------------------
    def _open(self, key_states: torch.Tensor) -> None:
        """Allocate every buffer of the plan at the first forward (HF's lazy initialisation)."""
        lo = self.layout
        B, H, _, D = key_states.shape
        if B > self.batch or (H, D) != (lo.kv_heads, lo.head_dim):
            raise ValueError(f"batch: the cache was built for [batch, kv heads, head dim] = "
                             f"[{self.batch}, {lo.kv_heads}, {lo.head_dim}], the model passes [{B}, {H}, {D}]")
        if key_states.device != self.device or key_states.dtype != self.dtype:
            raise ValueError(f"device: K/V on {key_states.device} {key_states.dtype}, the cache expects "
                             f"{self.device} {self.dtype}")
        if not self._live or self.model.config._attn_implementation != IMPLEMENTATION:
            raise ValueError(f"attention: the model runs {self.model.config._attn_implementation!r}, not "
                             f"{IMPLEMENTATION!r} (was the cache closed?)")
        self.layout = replace(lo, batch=B)
        groups = {True: self.plan.prefill.group, False: self.plan.decode.group}
        self.stream = HeadStream(self.layout, groups, self.device, self.dtype, self.decode != "eager").open()

    def _write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> PendingKV:
        B, T = key_states.shape[0], key_states.shape[2]
        if start + T > self.max_length:
            raise ValueError(f"max_length: {start + T} tokens exceed the cache's {self.max_length}")
        if B != self.layout.batch:
            raise ValueError(f"batch: the cache holds {self.layout.batch} sequences, the model passes {B} "
                             "(num_return_sequences over a filled cache: call cache.batch_repeat_interleave)")
        kv = torch.stack((key_states, value_states), dim=3)   # [B, H, T, 2, D], contiguous
        if self._in_static:
            return self.static.write(layer, kv)
        self.stream.write(layer, kv, start)
        return PendingKV(self.stream, layer, kv)

    # ---- whole-cache operations (every unit, every tier) ------------------------------
    def _regather(self, index: torch.Tensor) -> None:
        if self.stream is None:
            return
        if index.numel() > self.batch:
            raise ValueError(f"batch: {index.numel()} sequences exceed the cache's batch={self.batch}")
        self._drop_static()
        self.stream = regather(self.stream, index.reshape(-1).long())
        self.layout = self.stream.layout
        for layer in self.layers:
            layer.batch_size = self.layout.batch

    reorder_cache = _regather   # beam_idx [B]: sequence i becomes sequence beam_idx[i]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.stream is not None:
            self._regather(torch.arange(self.layout.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.stream is not None:
            self._regather(torch.arange(self.layout.batch)[indices.cpu() if torch.is_tensor(indices) else indices])

    @property
    def is_compileable(self) -> bool:
        return False


class HeadwiseLayer(CacheLayerMixin):
    """One layer's view of a HeadwiseCache: its length; the data lives in the cache's stream.
    `keys` / `values` are a copy ([B, H, length, D] on the device) read from the tiers on access."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: HeadwiseCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer, self.length = owner, layer, 0

    def _read(self, which: int) -> torch.Tensor | None:
        if not self.is_initialized or self.owner.stream is None:
            return None
        return materialise(self.owner.stream, self.layer, self.length)[:, :, :, which]

    def _set(self, value) -> None:
        if value is not None:   # CacheLayerMixin's constructor sets None; real writes go through update()
            raise ValueError("keys/values: a HeadwiseCache layer's K/V are a read-only copy; write through update()")

    keys = property(lambda self: self._read(0), _set)
    values = property(lambda self: self._read(1), _set)

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
        if not self.owner._in_static:   # the static step's length is set by its loop (a replay runs no Python)
            self.length += key_states.shape[2]
        return pending, pending

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(keys, offset) of a step of `query_length` tokens (older transformers pass cache_position)."""
        q = query_length.shape[0] if torch.is_tensor(query_length) else query_length
        return self.length + q, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_length

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False

    def crop(self, tokens: int) -> None:
        """Drop the last -tokens tokens (tokens < 0), or keep the first `tokens` (> 0, the older
        transformers form). The homes stay: later writes overwrite the dropped positions."""
        tokens = int(tokens)   # assisted decoding passes a 0-d tensor
        keep = self.length + tokens if tokens < 0 else min(self.length, tokens) if tokens > 0 else self.length
        self.length = max(0, keep)

    def _whole_cache(self, *args, **kwargs) -> None:
        raise ValueError("HeadwiseCache: reorder or resize the batch on the cache (cache.reorder_cache, "
                         "batch_repeat_interleave, batch_select_indices), not on one layer")

    reorder_cache = batch_repeat_interleave = batch_select_indices = _whole_cache
