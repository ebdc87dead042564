"""What a `HeadwiseCache` changes on its model while it is live, and gives back with the last one:
the attention implementation (`kvpipe_headwise`) and a `generate` wrapper. The wrapper lets a
cache check a call before any work (capacity, sequences per batch), pass HF the plan's prefill
chunk when the caller gave none, and hand the cache to transformers under the argument name the
installed version reads (`cache`, or `past_key_values` before it)."""
from __future__ import annotations

import functools
import inspect
import weakref

import torch

from kvpipe.executor.hf.attention import IMPLEMENTATION, UNPADDED, register

_LIVE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
CACHE_NAMES = ("cache", "past_key_values")


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword the model's forward (and so generate) reads its cache from."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def attach(model: torch.nn.Module, is_ours) -> None:
    """One more live cache on `model`; the first switches the attention and wraps generate.
    `is_ours(obj)` tells a kvpipe cache (its `prepare_generate(args, kwargs)` runs first)."""
    state = _LIVE.get(model)
    if state is None:
        state = _LIVE[model] = {"live": 0, "previous": model.config._attn_implementation}
        model.set_attn_implementation(register())
        model.generate = _wrap(model, type(model).generate.__get__(model), is_ours)
    state["live"] += 1


def detach(model: torch.nn.Module) -> None:
    """One live cache fewer; the last gives the model back its attention and its generate."""
    state = _LIVE.get(model)
    if state is None:
        return
    state["live"] -= 1
    if state["live"] == 0:
        del _LIVE[model]
        model.__dict__.pop("generate", None)
        if model.config._attn_implementation == IMPLEMENTATION:
            model.set_attn_implementation(state["previous"])


def live(model: torch.nn.Module) -> int:
    return _LIVE[model]["live"] if model in _LIVE else 0


def _wrap(model: torch.nn.Module, generate, is_ours):
    name = cache_argument(model)

    @functools.wraps(generate)
    def wrapped(*args, **kwargs):
        given = [k for k in CACHE_NAMES if kwargs.get(k) is not None]
        cache = kwargs[given[0]] if given else None
        if cache is None or not is_ours(cache):
            return generate(*args, **kwargs)
        if len(given) > 1:
            raise ValueError("cache: given twice (as cache= and as past_key_values=)")
        kwargs[name] = kwargs.pop(given[0])
        cache.prepare_generate(args, kwargs)
        mask = kwargs.get("attention_mask")
        token = UNPADDED.set(mask is not None and bool(mask.all()))   # one check per call, not per step
        try:
            return generate(*args, **kwargs)
        finally:
            UNPADDED.reset(token)

    return wrapped


def request(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int, int, bool]:
    """What one generate() call asks of its cache: (prompts, prompt tokens, the most tokens per
    sequence it writes, sequences per forward, whether the caller chose a prefill chunk). The
    last new token is sampled, never attended: a cache of prompt + max_new_tokens - 1 suffices;
    prompt lookup may verify up to prompt_lookup_num_tokens candidates past that."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if ids is None:
        raise ValueError("input_ids: generate() with a HeadwiseCache needs the prompt (input_ids or inputs_embeds)")
    config = kwargs.get("generation_config") or model.generation_config
    get = lambda k: kwargs[k] if kwargs.get(k) is not None else getattr(config, k, None)   # noqa: E731
    prompts, tokens = ids.shape[0], ids.shape[1]
    new = get("max_new_tokens")
    written = tokens + new - 1 if new is not None else (get("max_length") or tokens + 1) - 1
    written += get("prompt_lookup_num_tokens") or 0
    beams, returns = get("num_beams") or 1, get("num_return_sequences") or 1
    return prompts, tokens, written, prompts * (beams if beams > 1 else returns), get("prefill_chunk_size") is not None
