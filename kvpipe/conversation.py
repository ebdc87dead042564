"""`kvpipe.Conversation`: generation that keeps its KV between calls. The plan is decided once for
the conversation's capacity (`max_context` tokens), the model loaded once, and one engine session
(executor/engine/live.py) holds every (layer, KV head) unit where the plan placed it; each call
prefills only the tokens past those already home, then decodes. `save(dir)` writes the KV of the
conversation's turns to a KV directory (executor/kv/saved.py) and `load(dir)` continues from one:
`kvpipe generate --save-kv/--load-kv`, `kvpipe chat` and a server's prefix reuse use this API.

How turns compose with the chat template: a conversation is its list of messages; a turn renders
them all (the new user turn last, the assistant's turn opened) and reuses the longest prefix of
those tokens whose K/V is home, rewinding past it (the assistant's reply is rendered as the
template renders it, which is what a one-shot run over the whole conversation sees). A save keeps
the tokens of the turns without the opened assistant turn, so the next user turn appends to them;
a load refuses a prompt whose tokens do not start with the saved ones."""
from __future__ import annotations

import dataclasses
import time

from kvpipe.pipeline.workload import Workload

from . import api
from .fingerprint import fingerprint
from .options import RunOptions

DEFAULT_MAX_CONTEXT = 32768   # chat's capacity when the model allows more positions
PREFIX_BLOCK = 4096           # tokens common_prefix compares at once


def common_prefix(a, b, block: int = PREFIX_BLOCK) -> int:
    """Tokens two id sequences (lists, tuples) share from the start. Compared a block at a time
    as lists (in C): a server's 128K-token prompts in 1 ms, where a loop over the ids takes 12."""
    m, n = min(len(a), len(b)), 0
    while n + block <= m and list(a[n:n + block]) == list(b[n:n + block]):
        n += block
    while n < m and a[n] == b[n]:
        n += 1
    return n


@dataclasses.dataclass
class _Engine:
    """What a conversation decided and loaded once."""

    spec: object
    plan: object
    hf: object
    device: object
    base: api.RunResult       # the run result's fixed part (plan, prediction, device); per turn replaced
    hashes: dict = dataclasses.field(default_factory=dict)   # fingerprint per weights-hash method, on first use

    def fingerprint(self, method: str | None = None) -> dict:
        key = method or "default"
        if key not in self.hashes:
            self.hashes[key] = fingerprint(self.hf, method)
        return self.hashes[key]


class Conversation:
    """A conversation with `model` (as `kvpipe.generate` takes it) of at most `max_context` tokens
    (default: the model's positions, at most DEFAULT_MAX_CONTEXT); `options` are kvpipe.run's plan,
    budget and device options. A context manager; `close()` frees the KV. ValueError names the
    argument for bad input."""

    def __init__(self, model, *, max_context: int | None = None, chat: bool = True, system: str | None = None,
                 seed: int = 0, max_new_tokens: int = 256, loaded: tuple | None = None, **options) -> None:
        """`loaded`: (checkpoint, ModelSpec, tokenizer) already resolved (generation.load)."""
        from kvpipe.executor.engine.live import LiveSession
        from .generation import load
        self.ck, self.model_spec, self.tok = loaded or load(model, options.get("dtype"),
                                                            options.get("random_weights", False))
        self.chat = bool(chat and self.tok is not None and getattr(self.tok, "chat_template", None))
        if system is not None and not self.chat:
            raise ValueError("system: needs the chat template (the tokenizer has none, or --no-chat was given)")
        self.system, self.seed = system, seed
        cap = max_context or min(self.model_spec.max_positions or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 2:
            raise ValueError(f"max-context: expected a token count of at least 2, got {max_context!r}")
        self.capacity = cap
        self.engine = _start(self.ck, self.model_spec, cap, max(1, min(max_new_tokens, cap // 2)), seed, options)
        e = self.engine
        self.live = LiveSession(e.spec, e.plan, e.hf, e.device, cap, options.get("kv_dir"),
                                e.plan.replay, options.get("fuse")).open()
        self.messages: list[dict] = self._system()
        self.turns = 0
        self.load_figures: dict = {}   # the last load's fingerprint seconds (load)

    # ---- lifetime -------------------------------------------------------------------------
    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def close(self) -> None:
        self.live.close()

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the conversation (its KV too); the plan and the model stay."""
        self.live.rewind(0)
        self.messages, self.turns = self._system(), 0

    @property
    def tokens(self) -> list[int]:
        """The ids whose K/V is home."""
        return list(self.live.tokens)

    # ---- turns ------------------------------------------------------------------------------
    def render(self, messages: list[dict], opened: bool = True) -> list[int]:
        """Token ids of `messages` through the chat template (`opened`: the assistant's turn opened)."""
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=opened, tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    def say(self, text: str, **gen):
        """One chat turn: `text` as the user's message; returns the GenerateResult of the reply."""
        if not self.chat:
            raise ValueError("chat: the model has no chat template; use append(ids)")
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = self.render(msgs)
        res = self.append(ids, reuse=True, **gen)
        self.messages = msgs + [{"role": "assistant", "content": res.text or ""}]
        return res

    def append(self, ids: list[int], *, reuse: bool = False, breaks=(), max_new_tokens: int = 256, **gen):
        """Generate after the prompt `ids`, which must start with `tokens` (`reuse`: the longest
        common prefix is kept and the rest rewound); prefills only the ids past it. A call stopped
        by `cancel` (generate_on) is rewound to the tokens it reused."""
        from .kept import generate_on
        home = self.live.tokens
        if reuse and ids[:len(home)] != home:
            self.live.rewind(common_prefix(home, ids))
        elif ids[:len(home)] != home:
            raise ValueError(f"load-kv: the saved conversation's {len(home)} tokens are not a prefix of the new "
                             f"prompt's tokens (they differ at token {common_prefix(home, ids)})")
        room = self.capacity - len(ids)
        if room < 1 and not home:   # nothing kept yet: the prompt alone is too long
            raise ValueError(f"max-context: the prompt's {len(ids)} tokens leave no room in the conversation's "
                             f"{self.capacity}; a larger --max-context")
        if room < 1:
            raise ValueError(f"max-context: the conversation is full ({len(ids)} tokens of {self.capacity}); "
                             "/reset, or a larger --max-context")
        cut = api._logged([f"max-new-tokens: {max_new_tokens} new tokens do not fit: the conversation holds "
                           f"{len(ids)} of its {self.capacity} tokens (--max-context), so at most {room} are "
                           "generated"]) if max_new_tokens > room else ()
        res = generate_on(self, ids, min(max_new_tokens, room), breaks=breaks, **gen)
        if cut:   # kept with the run's warnings: --json shows it beside finish_reason "length"
            res = dataclasses.replace(res, run=dataclasses.replace(res.run, warnings=tuple(res.run.warnings) + cut))
        if res.finish_reason == "cancelled":   # keep nothing of a cancelled call: only what it reused
            self.live.rewind(res.timings["reused_tokens"])
        else:   # a dropped turn (cancelled, or Ctrl-C raised above) is no turn of the conversation
            self.turns += 1
        return res

    # ---- KV directories ---------------------------------------------------------------------
    def saved_length(self, messages: list[dict] | None = None) -> int:
        """Tokens a save keeps: those of the turns (with the template: the rendering of the
        messages without the opened assistant turn, as far as it matches what is home)."""
        home = self.live.tokens
        if not self.chat:
            return len(home)
        return common_prefix(home, self.render(messages if messages is not None else self.messages, opened=False))

    def save(self, directory, upto: int | None = None) -> dict:
        """Write the conversation's KV (every tier; `saved_length` tokens, at most `upto`) and its
        manifest to `directory`."""
        from kvpipe.executor.kv import saved
        self.live.settle()   # a load still in flight (load(overlap=True)) ends first
        n = min(self.saved_length(), self.live.length if upto is None else upto)
        if n < 1:
            raise ValueError("save-kv: the conversation holds no tokens yet")
        e = self.engine
        meta = {"model": {"name": self.model_spec.name, **e.fingerprint()}, "dtype": self.model_spec.dtype,
                "tokens": self.live.tokens[:n], "chat_template": self.chat, "messages": self.messages,
                "plan": e.plan.to_json(e.spec), "capacity": self.capacity}
        return saved.save(self.live.store, n, self.live.length, directory, meta)

    def load(self, directory, overlap: bool = False) -> dict:
        """Continue from a KV directory (the conversation must be empty); refuses another model,
        dtype, or a capacity too short, naming the mismatch. The model's fingerprint is checked
        before the readers start; `overlap`: the load goes on behind the next turn's prefill
        (LiveSession.load). `load_figures`: the fingerprint's seconds."""
        from kvpipe.executor.kv import saved
        man = saved.read_manifest(directory)
        check_early(man, self.model_spec, self.capacity)
        if self.live.length:
            raise ValueError("load-kv: the conversation already holds tokens (reset it first)")
        t0 = time.perf_counter()
        self._check_model(man)   # alone: beside the readers it waited on them for the GIL (8x longer)
        self.load_figures = {"fingerprint_s": time.perf_counter() - t0}
        self.live.load(directory, man, overlap=True)   # joined below unless `overlap`
        if not overlap:
            self.live.settle()
        self.messages = list(man.get("messages") or self._system())
        self.turns = sum(m.get("role") == "user" for m in self.messages)   # a kept turn: its user message
        return man

    def _check_model(self, man: dict) -> None:
        check_manifest(man, self.model_spec, self.engine.fingerprint((man.get("model") or {}).get("weights_hash")))


def check_dtype(man: dict, dtype: str, flag: str = "load-kv") -> None:
    """A saved KV of another dtype than the run's, refused on one line."""
    if man.get("dtype") != dtype:
        raise ValueError(f"{flag}: saved in {man.get('dtype')}, this model runs in {dtype} (--dtype)")


def check_early(man: dict, spec, capacity: int, flag: str = "load-kv") -> None:
    """The mismatches found before the model loads: dtype, and a capacity too short."""
    check_dtype(man, spec.dtype, flag)
    if len(man.get("tokens", ())) >= capacity:
        raise ValueError(f"{flag}: the saved {len(man['tokens'])} tokens leave no room in a {capacity}-token "
                         "context (--max-context)")


def check_manifest(man: dict, spec, fp: dict, flag: str = "load-kv") -> None:
    """One line naming the first mismatch between a saved KV's model and this one."""
    saved_model = man.get("model") or {}
    if saved_model.get("config_sha256") != fp["config_sha256"]:
        raise ValueError(f"{flag}: saved with another model ({saved_model.get('name')!r}, config "
                         f"{str(saved_model.get('config_sha256'))[:12]}), this is {spec.name!r} (config {fp['config_sha256'][:12]})")
    if saved_model.get("weights_sha256") != fp["weights_sha256"]:
        raise ValueError(f"{flag}: saved with other weights of {spec.name!r} (weights "
                         f"{str(saved_model.get('weights_sha256'))[:12]}, these are {fp['weights_sha256'][:12]})")


def planned_workload(capacity: int, new_tokens: int) -> Workload:
    """What a conversation's plan is decided for: a prompt that leaves room for `new_tokens`, then
    their decode steps, the first token coming from the prefill, as `kvpipe generate` decides a
    prompt of `capacity - new_tokens` tokens with --max-new-tokens `new_tokens` (the same plan)."""
    return Workload(capacity - new_tokens, new_tokens - 1, 1)


def _start(ck, spec, capacity: int, decode: int, seed: int, options: dict) -> _Engine:
    """The plan for `capacity` tokens, `decode` of them generated, decided as kvpipe.run decides
    it, the model loaded."""
    from kvpipe.executor.layers.attention import kernel_label
    session = api._executor()
    work = planned_workload(capacity, decode)
    opts = RunOptions(**dict(options, model=ck.model, context=work.context, decode_tokens=work.decode_tokens,
                             seed=seed, progress=False))
    dev = session.resolve_device(opts.device)
    attention = kernel_label(dev, session.TORCH_DTYPES[spec.dtype])
    profile, budgets, req, decision = api.decide_run(opts, spec, work, session, dev)
    warnings = api.context_warnings(spec, work)
    hf = session.load_hf_model(opts.model, opts.random_weights, dev, session.TORCH_DTYPES[spec.dtype], seed)
    if dev.type == "cuda":
        _warm_up(session, spec, work, decision.plan, hf, dev, budgets["gpu"], opts, req.fuse)
    base = api.RunResult(spec, profile, work, budgets, decision.predicted, None, None, [], "", str(dev), attention,
                         "random weights" if opts.random_weights else str(opts.model), warnings,
                         search=decision.search)
    return _Engine(spec, decision.plan, hf, dev, base)


def _warm_up(session, spec, work, plan, hf, dev, gpu_budget: int, opts, fuse) -> None:
    """The allocator capped and, unless asked not to, kvpipe run's untimed warm-up (TTFTs honest)."""
    import torch
    from kvpipe.pipeline.stage import Graph
    from kvpipe.executor.kv.layout import DiskOptions
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_budget / total), dev)
    if opts.warmup:
        ids = torch.zeros(1, work.context, dtype=torch.long)
        session.warm_up(Graph(spec, work, plan), hf, ids, dev, replay=plan.replay,
                        disk=DiskOptions(None if opts.kv_dir is None else str(opts.kv_dir)), fuse=fuse)
        session.release_cached_pinned()
