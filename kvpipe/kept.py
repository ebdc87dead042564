"""Generation on a kept conversation (kvpipe/conversation.py): one turn's run on the live engine
session (`generate_on`), and `kvpipe generate --save-kv/--load-kv` (`generate_kept`).

--load-kv composes the prompt with the saved conversation: with the chat template, the prompt is
a new user turn after the saved messages, rendered with them (the saved tokens must be a prefix of
the rendering, else it is refused); without it, the prompt's tokens follow the saved ones.
--save-kv keeps the tokens of the prompt's turns without the opened assistant turn (the whole
prompt without a template), and the prefill breaks its chunks there, so a continuation from the
saved KV equals bit for bit an uninterrupted run whose chunks break at the same token."""
from __future__ import annotations

import time
from dataclasses import replace

from kvpipe.pipeline.sampling import Sampling
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload

from . import api, textio


def generate_on(conv, ids: list[int], n: int, *, breaks=(), stop=(), ignore_eos: bool = False,
                temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
                seed: int | None = None, stream=None, cancel=None, interrupt=None):
    """Up to `n` tokens after the prompt `ids` on `conv`'s engine session (its tokens home);
    `cancel()` or `interrupt()`, asked after each token, True stops there (finish reason
    "cancelled" or "interrupted")."""
    from kvpipe.executor.engine.decoding import Decoding
    from kvpipe.executor.engine.session import output_digest
    from .generation import GenerateResult, _stops, _timings
    e, stops = conv.engine, _stops(stop)
    seed = conv.seed if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an integer, got {seed!r}")
    sampling = Sampling.choose(dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    repetition_penalty=repetition_penalty, seed=seed), conv.ck.sampling)
    out = textio.Output(conv.tok, n, frozenset() if ignore_eos else frozenset(conv.ck.eos_ids), stops, stream)
    take, why = textio.taker(out, cancel, interrupt)
    decoding = Decoding(sampling, ids, e.spec.vocab, n, e.device, take)
    res = conv.live.extend(ids, n - 1, decoding, breaks=breaks)
    kept = decoding.finish()
    if out.finish_reason is None:
        out.close()
    first = min(s.tokens[0] for s in res.trace.graph.stages if s.phase is Phase.PREFILL and s.tag == "embed")
    run = replace(e.base, workload=Workload(len(ids), n - 1, 1), measured=api._measured_report(res),
                  real_trace=res.trace, tokens=res.tokens.cpu().tolist(), output_digest=output_digest(res),
                  decode_issue={"mode": res.decode_issue, "graphs": res.graphs, "capture_s": res.capture_s,
                                "fused": res.fused, "compile_s": res.compile_s, "fuse_note": res.fuse_note},
                  disk=res.disk)
    timings = dict(_timings(run, kept, len(ids) - first), prefill_tokens=len(ids) - first, reused_tokens=first)
    return GenerateResult(out.text, list(out.tokens), why[0] if why else out.finish_reason,
                          len(ids), conv.chat, sampling,
                          timings, decoding.digest(kept), run)


def refuse_inexact(options: dict, what: str) -> None:
    """Before the model loads: a kept conversation's KV is exact and stored without codecs, so the
    LOSSY and codec flags are one line naming the flag, not an error after the weights load."""
    for name in ("lossy", "sparse", "max_error"):
        if options.get(name) is not None:
            raise ValueError(f"{name.replace('_', '-')}: {what} keeps its KV exact; LOSSY options do not apply")
    codecs = [c for c in options.get("codec") or () if not str(c).endswith("=none")]
    if codecs:
        raise ValueError(f"codec: {what} stores its KV without codecs (got {codecs[0]})")


def check_saved_dtype(man: dict, model, dtype: str | None) -> None:
    """Before a .gguf converts (seconds) for a dtype the saved KV does not hold: the run's dtype is
    --dtype, else fp32 for a .gguf (as it converts); a directory's own is checked once read."""
    from kvpipe.pipeline.model import DTYPE_BYTES
    from .checkpoint import is_gguf
    from .conversation import check_dtype
    want = dtype or ("fp32" if is_gguf(model) else None)
    if want in DTYPE_BYTES:
        check_dtype(man, want)


def compose(man: dict, text: str, prompt_format: str, tok, spec, chat: bool, flag: str) -> tuple[list[int], list | None]:
    """(the new full prompt's ids, its messages or None) of a prompt after a saved conversation."""
    from .generation import encode
    saved = [int(t) for t in man["tokens"]]
    if man.get("chat_template") and not chat and prompt_format == "text":   # raw text after a closed user turn
        raise ValueError("no-chat: the saved KV is a chat (its template applied); continue it with the template, "
                         "or save it with --no-chat")
    if man.get("chat_template") and chat and prompt_format == "text":
        msgs = list(man.get("messages") or []) + [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids], msgs
    if prompt_format == "text" and tok is not None:
        new = tok(text, add_special_tokens=False)["input_ids"]
        if not new:
            raise ValueError(f"{flag}: tokenizes to no tokens")
        return saved + list(new), None
    return saved + encode(text, prompt_format, tok, spec, False, None, flag)[0], None


def load_timings(stats, held_s: float, figures: dict) -> dict:
    """The timings a --load-kv run adds: `kv_load_s` the load's own seconds (start to the last
    block verified), `kv_load_held_s` what kept the prefill from starting (the model's fingerprint, then
    the readers' start: the rest ran behind the prefill, inside its TTFT), and `kv_load`."""
    return {"kv_load_s": stats.seconds, "kv_load_bytes": stats.bytes, "kv_load_held_s": held_s,
            "kv_load": dict(stats.to_json(), **figures)}


def generate_kept(model, prompt, prompt_file, prompt_format, chat, system, n, stdin, save_kv, load_kv,
                  max_context, gen: dict, options: dict):
    """`generate(save_kv=..., load_kv=...)` on a Conversation of the prompt's size."""
    from kvpipe.executor.kv import saved
    from .conversation import Conversation, common_prefix
    from .generation import encode, load, room
    from kvpipe.executor.layers.loader import progress_bars
    refuse_inexact(options, "a kept conversation (--save-kv, --load-kv)")
    previous = saved.check_target(save_kv) if save_kv is not None else None
    man = saved.read_manifest(load_kv) if load_kv is not None else None
    if man is not None and system is not None:
        raise ValueError("system: the saved conversation has its own system turn (--load-kv)")
    if man is not None:
        check_saved_dtype(man, model, options.get("dtype"))
    if prompt_format not in textio.FORMATS:
        raise ValueError(f"prompt-format: expected text or ids, got {prompt_format!r}")
    text = textio.read_prompt(prompt, prompt_file, stdin)
    ck, spec, tok = load(model, options.get("dtype"), options.get("random_weights", False))
    flag = "prompt-file" if prompt_file else "prompt"
    if man is not None:
        from .conversation import check_early
        ids, msgs = compose(man, text, prompt_format, tok, spec, chat, flag)
        check_early(man, spec, max_context or len(ids) + n)
    else:
        ids, templated = encode(text, prompt_format, tok, spec, chat, system, flag)
        msgs = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": text}] if templated else None
    room(len(ids), max_context)   # before the model loads: a prompt the capacity cannot hold
    with progress_bars(False):   # as plain generate: no loading bars around the text
        conv = Conversation(model, loaded=(ck, spec, tok), max_context=max_context or len(ids) + n,
                            chat=chat and msgs is not None, system=system, seed=gen["seed"], max_new_tokens=n,
                            **options)
    loaded, wrote = {}, None
    from kvpipe.executor.engine.session import executing
    try:
        if save_kv is not None:   # before any work: a window layer's ring cannot be saved
            saved.refuse_rings(conv.live.layout, "save-kv")
        if man is not None:   # the prefill runs behind the load, layer by layer (LiveSession.load)
            t0 = time.perf_counter()
            conv.load(load_kv, overlap=True)   # another model's KV refused here, before the line below
            held = time.perf_counter() - t0
        executing(f"up to {n} new tokens", conv.engine.device)   # as plain generate: a line before the prefill's wait
        cut = len(ids) if msgs is None else common_prefix(ids, conv.render(msgs, opened=False))
        res = conv.append(ids, breaks=(cut,) if save_kv is not None else (), max_new_tokens=n, **gen)
        if man is not None:
            loaded = load_timings(conv.live.loaded, held, conv.load_figures)
        if save_kv is not None:
            conv.messages = msgs
            done = conv.save(save_kv, upto=cut)
            wrote = {"directory": str(save_kv), "tokens": done["tokens_saved"],
                    "replaced_tokens": previous["tokens_saved"] if previous else None,
                    "note": saved.replaced_note(previous)}
    finally:
        conv.close()
    return replace(res, timings=dict(res.timings, **loaded), saved_kv=wrote)
