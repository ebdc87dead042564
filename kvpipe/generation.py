"""`kvpipe.generate(...)`: text in, text out on the engine of `kvpipe run`. The prompt is tokenized
(the model's chat template applied by default), the planner places its KV as for `run`, the
engine prefills it and decodes until an end-of-sequence token, a stop string or `max_new_tokens`,
each token chosen on the device (greedy or seeded sampling, pipeline/sampling.py) and streamed as
text while the next ones are computed. Returns a GenerateResult, whose `to_json()` is what
`kvpipe generate --json` prints."""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpipe.pipeline.sampling import Sampling

from . import api, checkpoint, textio
from .results import lossy_json

DEFAULT_MAX_NEW_TOKENS = 256
# kvpipe.run's arguments that generate passes through (the plan, budgets, device and LOSSY knobs);
# the workload and prompt are generate's own
_OWN = {"model", "context", "decode_tokens", "batch", "prompt_file", "seed", "progress", "prompt_ids", "decoding"}
RUN_OPTIONS = tuple(p for p in inspect.signature(api.run).parameters if p not in _OWN)


@dataclass(frozen=True)
class GenerateResult:
    """One generation. `text` the completion (None without a tokenizer: `tokens` only), without
    the EOS token or the stop string; `tokens` the generated ids, ending with the one that ended
    it; `finish_reason` stop (EOS or a stop string), length, cancelled (`cancel`) or interrupted
    (`interrupt`: what was made so far); `timings`
    measured (CUDA events on a GPU): ttft_s (the prefill), prefill and decode tokens per second; `output_digest` sha256 of
    the tokens and a checksum of every step's logits (equal digests, equal bits)."""

    text: str | None
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    chat_template: bool
    sampling: Sampling
    timings: dict
    output_digest: str
    run: api.RunResult           # the run underneath: plan, prediction, measured trace, device
    saved_kv: dict | None = None  # --save-kv: directory, tokens, replaced_tokens (None: a new one), note

    @property
    def plan(self):
        return self.run.plan

    @property
    def kv_placement(self) -> dict:
        """(layer, KV head) units of the prompt's KV per tier, as the plan placed them."""
        spec, p = self.run.model, self.run.plan
        return {"gpu": p.resident, "host": spec.units - p.resident - p.disk, "disk": p.disk}

    @property
    def decode_replayed(self) -> bool:
        return (self.run.decode_issue or {}).get("mode") == "graph"

    def to_json(self) -> dict:
        r = self.run
        return {"text": self.text, "tokens": list(self.tokens), "finish_reason": self.finish_reason,
                "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens)},
                "timings": dict(self.timings), "plan": r.plan.to_json(r.model), "plan_line": r.plan.describe(),
                "kv_units": self.kv_placement, "device": r.device, "decode": (r.decode_issue or {}).get("mode"),
                "chat_template": self.chat_template, "sampling": self.sampling.to_json(),
                "output_digest": self.output_digest, "lossy": lossy_json(r.plan, r.lossy_error, run=True,
                                                                context=r.workload.context),
                "warnings": list(r.warnings),
                **({"saved_kv": {k: v for k, v in self.saved_kv.items() if k != "note"}} if self.saved_kv else {})}


def _timings(run: api.RunResult, n: int, prompt_tokens: int) -> dict:
    """TTFT and rates from the measured trace, over the n tokens kept (decode steps 0..n-2)."""
    st = run.real_trace.graph.stages
    ttft = run.measured.timing.ttft_s
    heads = {st[sp.stage].step: sp.end_s for sp in run.real_trace.spans
             if st[sp.stage].tag == "head" and st[sp.stage].phase.value == "decode"}
    decode_s = heads[n - 2] - ttft if n >= 2 else 0.0
    return {"ttft_s": ttft, "prefill_tokens_per_s": prompt_tokens / ttft if ttft > 0 else None,
            "decode_s": decode_s, "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else None,
            "decode_s_per_token": decode_s / (n - 1) if n >= 2 else None}


def _check_options(options: dict) -> None:
    unknown = sorted(set(options) - set(RUN_OPTIONS))
    if unknown:
        raise ValueError(f"{unknown[0].replace('_', '-')}: not an option of generate "
                         f"(it takes kvpipe.run's plan options: {', '.join(RUN_OPTIONS)})")
    if options.get("prompt_file") is not None:
        raise ValueError("prompt-file: give it as generate(prompt_file=...)")


def _max_new(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"max-new-tokens: expected a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"max-new-tokens: must be at least 1, got {value}")
    return value


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: expected non-empty strings, got {s!r}")
    return stops


def room(prompt: int, max_context: int | None) -> int | None:
    """New tokens `max_context` leaves after a `prompt`-token prompt (None: no cap); ValueError
    where it cannot hold the prompt and a new token."""
    if max_context is None:
        return None
    if type(max_context) is not int or max_context < 1:
        raise ValueError(f"max-context: expected a positive number of tokens, got {max_context!r}")
    if max_context - prompt < 1:
        raise ValueError(f"max-context: {max_context} tokens cannot hold the prompt's {prompt} tokens and a new one")
    return max_context - prompt


def _within(n: int, prompt: int, max_context: int | None) -> tuple[int, tuple[str, ...]]:
    """(new tokens to generate, the warning when --max-context cut them): the prompt and the new
    tokens within `max_context` (None: no cap)."""
    left = room(prompt, max_context)
    if left is None or n <= left:
        return n, ()
    return left, api._logged([f"max-new-tokens: {n} new tokens do not fit --max-context {max_context} after the "
                              f"prompt's {prompt} tokens, so at most {left} are generated"])


def load(model, dtype, random_weights):
    """(checkpoint, its ModelSpec, tokenizer or None) of `model`."""
    from kvpipe.pipeline.model import load_model
    if model is None:
        raise ValueError("model: give --model: a model directory, a .gguf file, or a preset / config.json "
                         "with --random-weights")
    ck = checkpoint.resolve(model, dtype, random_weights)
    spec = replace(load_model(ck.model, dtype), name=str(model))   # named as the user gave it, not its cache folder
    tok = None
    if ck.tokenizer is not None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(ck.tokenizer, local_files_only=True)
    return ck, spec, tok


def prepare(model, prompt, prompt_file, prompt_format, chat, system, dtype, random_weights, stdin=None):
    """(checkpoint, its ModelSpec, tokenizer or None, prompt ids, chat template applied), checked
    before any run."""
    if model is None:
        load(model, dtype, random_weights)
    if prompt_format not in textio.FORMATS:
        raise ValueError(f"prompt-format: expected text or ids, got {prompt_format!r}")
    text = textio.read_prompt(prompt, prompt_file, stdin)
    ck, spec, tok = load(model, dtype, random_weights)
    ids, templated = encode(text, prompt_format, tok, spec, chat, system, "prompt-file" if prompt_file else "prompt")
    return ck, spec, tok, ids, templated


def encode(text, prompt_format, tok, spec, chat, system, flag="prompt"):
    """(prompt ids, chat template applied) of the prompt's text."""
    if prompt_format == "ids":
        if system is not None:
            raise ValueError("system: needs a text prompt (--prompt-format text)")
        return textio.parse_ids(text, spec.vocab, flag), False
    if tok is None:
        raise ValueError("prompt-format: the model has no tokenizer; give token ids with --prompt-format ids")
    ids, templated = textio.encode(tok, text, chat, system)
    bad = [i for i in ids if i >= spec.vocab]
    if bad:
        raise ValueError(f"model: its tokenizer gives id {bad[0]}, outside the model's vocabulary ({spec.vocab})")
    return ids, templated


def generate(model: str | os.PathLike | None = None, prompt: str | list[int] | None = None, *,
             prompt_file: str | os.PathLike | None = None, prompt_format: str = "text", chat: bool = True,
             system: str | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             stop: str | list[str] | tuple = (), ignore_eos: bool = False, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, seed: int = 0,
             stream: Callable[[str], None] | None = None, stdin=None, save_kv: str | os.PathLike | None = None,
             load_kv: str | os.PathLike | None = None, max_context: int | None = None,
             cancel: Callable[[], bool] | None = None, interrupt: Callable[[], bool] | None = None,
             **options) -> GenerateResult:
    """Generate a completion of `prompt` (or the text of `prompt_file`, or `stdin`) with `model`:
    a local HF directory, a .gguf file (converted once into a cache, checkpoint.py), or a preset /
    config.json with random_weights=True. `prompt_format` "ids" takes whitespace-separated token
    ids as they are (no chat template), and so does a `prompt` of ids (a list of ints, a 1-D
    tensor). The chat template is applied where the tokenizer has one (`chat=False` turns it off;
    `system` is the system turn). Generation stops at the generation
    config's EOS ids (unless `ignore_eos`), at any `stop` string, or after `max_new_tokens`
    tokens. Sampling fields left None come from the generation config where it samples
    (`do_sample`), else greedy; temperature 0 is greedy. `stream(text)` receives the text as it
    is generated. `options`: kvpipe.run's plan, budget, device and LOSSY arguments (`resident`,
    `group`, `gpu_mem`, `lossy`, ...). `save_kv` writes the prompt's KV to a KV directory and
    `load_kv` continues from one, the prompt a new user turn after the saved conversation (only its
    tokens prefilled; kvpipe/kept.py); `max_context` their capacity (default: prompt + max_new_tokens).
    `cancel()`, asked after each token, True stops the generation there (finish reason
    "cancelled": a server's client went away). `interrupt()`, asked likewise, True stops there
    with finish reason "interrupted", keeping the prompt's KV (a `save_kv` still saves it: Ctrl-C
    in `kvpipe generate`). ValueError names the argument for bad input."""
    _check_options(options)
    if prompt is not None and not isinstance(prompt, str):   # token ids, as HF users pass input_ids
        prompt, prompt_format = textio.ids_text(prompt), "ids"
    n = _max_new(max_new_tokens)
    stops = _stops(stop)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an integer, got {seed!r}")
    if save_kv is not None or load_kv is not None:
        from .kept import generate_kept
        return generate_kept(model, prompt, prompt_file, prompt_format, chat, system, n, stdin, save_kv, load_kv,
                             max_context, dict(stop=stops, ignore_eos=ignore_eos, temperature=temperature,
                                               top_k=top_k, top_p=top_p, min_p=min_p, stream=stream,
                                               interrupt=interrupt,
                                               repetition_penalty=repetition_penalty, seed=seed), options)
    ck, spec, tok, ids, templated = prepare(model, prompt, prompt_file, prompt_format, chat, system,
                                      options.get("dtype"), options.get("random_weights", False), stdin)
    n, capped = _within(n, len(ids), max_context)
    sampling = Sampling.choose(dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    repetition_penalty=repetition_penalty, seed=seed), ck.sampling)
    try:
        from kvpipe.executor.engine.decoding import Decoding
        from kvpipe.executor.engine.session import resolve_device
    except ImportError as e:
        raise ValueError(f"generate: needs torch and transformers ({e.name} missing): pip install 'kvpipe[run]'") from None
    eos = frozenset() if ignore_eos else frozenset(ck.eos_ids)
    out = textio.Output(tok, n, eos, stops, stream)
    take, why = textio.taker(out, cancel, interrupt)
    decoding = Decoding(sampling, ids, spec.vocab, n,
                        resolve_device(options.get("device")), take)
    run = api.run(model=str(model), decode_tokens=n - 1, seed=seed, prompt_ids=ids, progress=False,
                  decoding=decoding, **options)   # the model as given: run resolves a .gguf to the same folder
    run = replace(run, warnings=tuple(run.warnings) + capped)
    kept = decoding.finish()
    if out.finish_reason is None:   # cancelled or interrupted, or the last token taken without ending
        out.close()
    assert kept == len(out.tokens), (kept, len(out.tokens))
    return GenerateResult(out.text, list(out.tokens), why[0] if why else out.finish_reason,
                          len(ids), templated, sampling,
                          _timings(run, kept, len(ids)), decoding.digest(kept), run)
