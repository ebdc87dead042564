"""The decode loop a `HeadwiseCache` hands to HF's `generate()` (`custom_generate=`, called in place
of HF's `_sample` with HF's own logits processors, stopping criteria and generation config):
HF's chunked prefill (`_prefill`), then every decode token by the static-shape step
(executor/hf/static.py), replayed as a CUDA graph where it can be. Token choice is HF's own ops
(processors, argmax or softmax + multinomial on the same generator), so tokens equal HF's loop's.
The host learns whether generation stopped `LAG` steps late, through pinned memory and events:
it never waits on the step it just issued; the steps issued past the stop are dropped (tokens
cut, the cache's length set back). A streamer given to generate() gets each token as it is made
(its copy to the host is the per-token sync the caller asked for).

Where the step cannot be captured or run static, `blocker` says why and generate() runs HF's own
loop (the cache records the reason)."""
from __future__ import annotations

import inspect

import torch

from kvpipe.executor.engine.decoding import LAG
from kvpipe.pipeline.replay import shape_blocker

DECODE = ("auto", "graph", "static", "eager")   # HeadwiseCache(decode=...)
# Whether decode="auto" captures the step of plans with offloaded heads on CUDA (HF's own loop
# decodes them when not; decode="graph" or "static" always runs the step).
OFFLOADED_AUTO = False
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def blocker(cache, model, kwargs: dict, sequences: int, unpadded: bool, graph: bool) -> str | None:
    """Why this generate() call's decode cannot run the static step (graph: nor be captured), or None."""
    lo = cache.layout
    if (not OFFLOADED_AUTO and cache.decode == "auto" and cache.device.type == "cuda"
            and any(n < lo.kv_heads for n in lo.resident)):
        return "offloaded heads on CUDA: decode='auto' leaves them to HF's loop (decode='graph' captures the step)"
    if graph and getattr(cache.plan, "replay_blocker", None):   # pipeline/replay.py's rule: the plan's own reasons
        return f"graph replay: {cache.plan.replay_blocker}"
    if graph:
        why = shape_blocker(_DTYPES.get(cache.dtype, str(cache.dtype)), sequences, lo.head_dim, cache.device.type)
        if why:
            return f"graph replay {why}"
    if sequences != 1:
        return f"the static step runs batch 1, generate() runs {sequences} sequences"
    if not unpadded:
        return "a padded attention_mask (the static step runs un-padded prompts)"
    if not hasattr(model, "_prefill") or "custom_generate" not in inspect.signature(type(model).generate).parameters:
        return "this transformers version takes no custom_generate callable (or has no _prefill)"
    for k in ("custom_generate", "assistant_model", "synced_gpus", "prefix_allowed_tokens_fn"):
        if kwargs.get(k) not in (None, False):
            return f"generate() was given {k}"
    config = kwargs.get("generation_config") or model.generation_config
    get = lambda k: kwargs[k] if kwargs.get(k) is not None else getattr(config, k, None)   # noqa: E731
    if get("return_dict_in_generate"):
        return "return_dict_in_generate (scores, logits and hidden states are kept by HF's loop)"
    if (get("num_beams") or 1) > 1 or get("prompt_lookup_num_tokens") or get("dola_layers") or get("penalty_alpha"):
        return "not greedy or multinomial sampling (beam, assisted, DoLa or contrastive decoding)"
    return None


def choose(cache, args: tuple, kwargs: dict, sequences: int, argument: str) -> None:
    """Hand generate() the static-step decode loop where it can run; sets the cache's
    `decode_path` (graph, static or eager) and `decode_note` (why not the static step)."""
    mask, ids = kwargs.get("attention_mask"), args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if mask is not None:
        unpadded = bool(mask.all())
    else:   # HF infers a padding mask from pad tokens in the prompt
        config = kwargs.get("generation_config") or cache.model.generation_config
        pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        unpadded = pad is None or not torch.is_tensor(ids) or not bool((ids == pad).any())
    graph = cache.decode in ("auto", "graph")
    why = "decode='eager'" if cache.decode == "eager" else None
    why = why or blocker(cache, cache.model, kwargs, sequences, unpadded, graph)
    if why and cache.decode in ("graph", "static"):
        raise ValueError(f"decode: {cache.decode!r} cannot run: {why}; use decode='auto'")
    cache.decode_path, cache.decode_note = ("eager" if why else "graph" if graph else "static"), why
    if not why:
        kwargs["custom_generate"] = make_decode(cache, argument, kwargs.get("streamer"))


def make_decode(cache, argument: str, streamer):
    """The `custom_generate` callable for one generate() call over `cache`; generate() passes a
    callable no streamer, so the call's own is kept here."""

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config,
               synced_gpus=False, **model_kwargs):
        model_kwargs.pop("streamer", None)
        return run(cache, argument, model, input_ids, logits_processor, stopping_criteria,
                   generation_config, streamer, model_kwargs)

    return decode


def _pick(processors, ids: torch.Tensor, logits: torch.Tensor, sample: bool) -> torch.Tensor:
    """HF's token choice from the step's logits [1, V] -> token [1] (device; no host sync)."""
    scores = processors(ids, logits[:, -1].to(copy=True, dtype=torch.float32))
    if sample:   # torch.multinomial's own one-sample draw, without its validity check (an .item() per token)
        probs = torch.softmax(scores, dim=-1)
        return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)
    return torch.argmax(scores, dim=-1)


def run(cache, argument: str, model, input_ids, processors, criteria, config, streamer, model_kwargs):
    """Prefill by HF, then decode by the static step -> the sequences [1, prompt + new]."""
    device = input_ids.device
    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=True)
    step = cache._open_static()
    step.join()
    P = cache.get_seq_length()
    limit = criteria.max_length if criteria.max_length is not None else cache.max_length + 1
    budget = limit - input_ids.shape[1]                     # MaxLengthCriteria: tokens still allowed
    positions = torch.arange(P, P + max(budget, 1), device=device)
    pinned = device.type == "cuda"
    stops = _Stops(max(budget, 1), pinned)
    unfinished = torch.ones(1, dtype=torch.long, device=device)
    logits, stop, k = outputs.logits, None, 0
    del outputs
    if budget <= 0:
        return input_ids
    while k < budget:
        token = _pick(processors, input_ids, logits, config.do_sample)
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(token.cpu())
        unfinished = unfinished & ~criteria(input_ids, None)
        stops.record(k, unfinished.max().view(1) == 0, device)
        stop = stops.first(k - LAG)
        if stop is not None or k + 1 == budget:
            break
        step.set_inputs(token, positions[k], P + k)
        logits = cache._static_step(argument)
        step.write_back(P + k)
        cache._set_length(P + k + 1)
        k += 1
    step.hand_back()
    if stop is None:
        stop = stops.first(k)
    made = k + 1 if stop is None else stop + 1
    cache._set_length(P + made - 1)                         # the last token's K/V is never written
    if streamer is not None:
        streamer.end()
    return input_ids[:, :input_ids.shape[1] - (k + 1 - made)]


class _Stops:
    """Per token: whether every sequence had finished, copied to pinned host memory as it is made."""

    def __init__(self, n: int, pinned: bool) -> None:
        self.flags = torch.zeros(n, dtype=torch.bool, pin_memory=pinned)
        self.events: list = []
        self.seen = 0          # flags read so far (none of them set)

    def record(self, i: int, flag: torch.Tensor, device: torch.device) -> None:
        self.flags[i:i + 1].copy_(flag, non_blocking=True)
        ev = None
        if device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        self.events.append(ev)

    def first(self, upto: int) -> int | None:
        """The first token index <= upto whose flag is set, waiting for those flags' copies (issued
        LAG steps back: the device is past them), or None."""
        while self.seen <= upto:
            ev = self.events[self.seen]
            if ev is not None and not ev.query():
                ev.synchronize()
            if bool(self.flags[self.seen]):
                return self.seen
            self.seen += 1
        return None
