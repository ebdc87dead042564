"""The public Python API under the CLI: `kvpipe.plan(...)` predicts a workload on a hardware
profile (no torch), `kvpipe.run(...)` executes it on this machine. Each takes a `PlanOptions` /
`RunOptions` (kvpipe/options.py) or their fields as keyword arguments, which mirror the
command-line flags (`--decode-tokens` is `decode_tokens`); each parses, asks the decision layer
(sim/decide.py), then simulates or executes, and returns a frozen result whose `to_json()` is
exactly what `kvpipe plan --json` / `kvpipe run --json` print.

    import kvpipe
    res = kvpipe.plan(model="llama-3-8b", hw="rtx4090", context="1M")
    res.fits, res.predicted.report.timing.ttft_s, res.plan.describe()

Warnings (e.g. a context past the model's trained positions) go to the `kvpipe` logger and are
kept in `result.warnings`."""
from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import fields, replace

from kvpipe.pipeline.model import ModelSpec, load_model
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.units import fmt_bytes, fmt_tokens
from kvpipe.pipeline.workload import Workload
from kvpipe.pipeline.report import NoPlanFits   # a ValueError: valid input, nothing fits the budgets

from .inputs import check_weights, free_disk, write_output
from .options import DEFAULT_HW, DEFAULT_RUN_CONTEXT, PlanOptions, RunOptions
from .results import PlanResult, Predicted, RunResult  # noqa: F401

log = logging.getLogger("kvpipe")

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"


def default_alloc_conf(environ=None) -> bool:
    """Give torch's CUDA caching allocator expandable segments unless the user set
    PYTORCH_CUDA_ALLOC_CONF (then it is left alone): fixed segments die of fragmentation where a
    plan leaves little room. Takes effect only before CUDA initialises. True when it set it."""
    env = os.environ if environ is None else environ
    if ALLOC_CONF_ENV in env:
        return False
    env[ALLOC_CONF_ENV] = ALLOC_CONF
    return True


def _options(cls, options, kwargs):
    """`options` (with `kwargs` over it), or the options that `kwargs` name."""
    if options is None:
        return cls(**kwargs)
    if isinstance(options, str):   # plan("llama-3-8b"): the model, as the CLI's first choice
        return cls(model=options, **kwargs)
    if not isinstance(options, cls):
        raise ValueError(f"options: expected {cls.__name__} or a model name, got {type(options).__name__}")
    return replace(options, **kwargs) if kwargs else options


def _keywords(cls) -> inspect.Signature:
    """plan/run's signature as help() shows it: the options, or each field as a keyword."""
    first = inspect.Parameter("options", inspect.Parameter.POSITIONAL_ONLY, default=None)
    return inspect.Signature([first] + [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
                                        for f in fields(cls)])


def _logged(warnings) -> tuple[str, ...]:
    for w in warnings:
        log.warning(w)
    return tuple(warnings)


def model_spec(model, dtype: str | None = None) -> ModelSpec:
    """--model's shapes: a preset, a config.json or its folder, or a .gguf file's metadata."""
    from . import checkpoint
    if checkpoint.is_gguf(model):
        from kvpipe.pipeline.model import from_hf_config
        spec = from_hf_config(checkpoint.gguf_config(model, dtype), name=str(model))
        return replace(spec, dtype=dtype) if dtype else spec
    return load_model(model, dtype)


def context_warnings(model: ModelSpec, work: Workload, generated: bool = False) -> tuple[str, ...]:
    """Logged at once (before a long run), and kept in the result. `generated`: said in new
    tokens (a generation's decode steps make one more; the last one's K/V is never written)."""
    if model.max_positions is not None and work.kv_capacity > model.max_positions:
        made = f"up to {work.decode_tokens + 1} new" if generated else f"{work.decode_tokens} decode"
        return _logged([f"context: {work.context} prompt + {made} tokens run past the model's "
                        f"max_position_embeddings ({model.max_positions}); it was not trained for those positions"])
    return ()


def budget_warnings(profile, budgets: dict) -> tuple[str, ...]:
    """A --gpu-mem above the profile's card (host RAM is the user's machine, any size): the plan
    would count on GPU memory the card does not have (logged at once, kept in the result)."""
    have = profile.gpu_mem_bytes
    if not have or budgets.get("gpu", 0) <= have:
        return ()
    return _logged([f"gpu-mem: {fmt_bytes(budgets['gpu'])} is more than the {fmt_bytes(have)} of GPU memory "
                    f"{profile.name} has; the plan counts on memory the card does not have"])


def room_warning(model: ModelSpec, work: Workload, pred: Predicted, budgets: dict, chunk_pinned: bool) -> tuple[str, ...]:
    """A prefill chunk the user pinned is not held to the planner's room rule (three of its MLP
    blocks beside the live bytes, within the allocator's slack): say when it breaks it, since such
    runs die of fragmentation."""
    from kvpipe.pipeline.rules import gpu_fill
    from kvpipe.sim.planner import fragmentation_room
    if not chunk_pinned or not budgets.get("gpu"):
        return ()
    room = fragmentation_room(model, work, pred.plan)
    free = gpu_fill(budgets["gpu"]) - pred.report.peak_bytes["gpu"]
    if free >= room:
        return ()
    return _logged([f"chunk: {fmt_tokens(pred.plan.prefill.chunk)}-token chunks leave the CUDA allocator "
                    f"{fmt_bytes(max(free, 0))} beside the predicted peak, under the {fmt_bytes(room)} (three MLP "
                    "blocks) the planner leaves it; the run may die of fragmentation: a smaller --chunk, or "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"])


def decide_run(opts: RunOptions, spec, work: Workload, session, dev) -> tuple:
    """(profile, budgets, request, decision) of a run of `work` on `dev`: this machine's budgets,
    the decision layer's plan, refused (NoPlanFits, ValueError) before anything is allocated.
    `kvpipe run` and a Conversation's engine decide through here."""
    from kvpipe.sim.decide import Target, decide
    profile, budgets = machine(opts, session, dev)
    check_weights(spec, budgets)
    req = opts.request(spec)
    session.check_codecs(req.codecs, dev)
    decision = decide(spec, work, profile, budgets, req, Target(dev.type, session.h2d_codec_runs(dev)))
    session.check_runnable(decision.plan, dev, spec)
    if decision.predicted.problems:
        raise NoPlanFits(f"budget: the plan does not fit: {'; '.join(decision.predicted.problems)}")
    return profile, budgets, req, decision


def machine(opts: RunOptions, session, dev) -> tuple:
    """(profile, budgets) of a run on `dev`: --hw, else the profile of the GPU found, else
    DEFAULT_HW; the budgets of this machine's GPU, RAM and --kv-dir's disk as the options cap them."""
    profile = load_hw(opts.hw or session.guess_profile(dev) or DEFAULT_HW)
    return profile, opts.budgets(session.device_budget(dev), session.host_ram_bytes(), free_disk(opts.kv_dir))


def load_hw(name):
    """The hardware profile `name`, a ValueError naming `hw` when there is none or it is broken
    (the profile's own "hw profile 'x.toml': ..." names no flag)."""
    from kvpipe.hw_profiles import load_profile
    try:
        return load_profile(name)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("hw:") else f"hw: {e}") from None


def plan(options: PlanOptions | None = None, /, **kwargs) -> PlanResult:
    """Predict latency and memory of `model` on hardware profile `hw` (no GPU, no torch); the
    fields of PlanOptions say what each argument does. Budgets default to the profile's.
    Head-wise plans come from the planner, which minimises `objective`; `group`/`chunk`/`resident`
    other than None or "auto" pin those dimensions; `plan` (a file, dict or Plan) replaces the
    search. LOSSY options are never chosen for the user: `lossy`/`sparse` opt in, `max_error`
    lets the planner pick within a measured error budget. `replay` auto lets the planner score
    replayed and eager decode (its choice is the plan's `replay`), on/off pin it. `max_context`
    answers the largest context that fits; `out` writes the plan for `run(plan=...)`; `trace` and
    `plot` paths are checked first and written last. ValueError names the argument for bad input."""
    from kvpipe.sim import decide as d
    opts = _options(PlanOptions, options, kwargs)
    paths = opts.output_paths()
    spec, profile = model_spec(opts.model), load_hw(opts.hw)
    work = Workload.parse(opts.context, opts.decode_tokens, opts.batch)
    disk = free_disk(opts.kv_dir) if opts.kv_dir is not None else profile.disk_bytes
    budgets = opts.budgets(profile.gpu_mem_bytes, profile.host_mem_bytes, disk)
    over = budget_warnings(profile, budgets)
    if (opts.gpus or 1) > 1:
        return _plan_gpus(opts, paths, spec, profile, work, budgets)
    check_weights(spec, budgets)
    req = opts.request(spec, full=opts.full_sim)
    largest = None
    if opts.max_context:
        largest = d.max_context(spec, work, budgets, req)
        if not largest:
            raise NoPlanFits("context: no context fits the budgets (raise --gpu-mem, --host-mem or --disk-mem)")
        work = Workload(largest, work.decode_tokens, work.batch)
    warnings = over + context_warnings(spec, work)
    decision = d.decide(spec, work, profile, budgets, req)
    warnings += room_warning(spec, work, decision.predicted, budgets, req.chunk is not None)
    methods = d.compare(spec, work, profile, budgets, req, decision.predicted) if opts.compare else None
    _write_plan_outputs(paths, spec, profile, work, decision.predicted)
    return PlanResult(spec, profile, work, budgets, decision.predicted, methods, warnings, decision.search, largest,
                      decision.lossy_choice.describe() if decision.lossy_choice else None)


def _plan_gpus(opts: PlanOptions, paths: dict, spec, profile, work, budgets) -> PlanResult:
    """`plan` on several GPUs (sim/multi_choice.py): budgets per GPU, host RAM and disk shared."""
    from kvpipe.sim.multi_choice import decide_multi
    if opts.compare or opts.max_context:
        raise ValueError(f"gpus: --{'compare' if opts.compare else 'max-context'} answers for one GPU; drop --gpus")
    objective = opts.objective
    multi = decide_multi(spec, work, profile, budgets, opts.gpus, lambda rank: opts.request(rank, full=opts.full_sim),
                         opts.tp, opts.pp, objective)
    warnings = context_warnings(spec, work)
    _write_plan_outputs(paths, spec, profile, work, multi.predicted)
    return PlanResult(spec, profile, work, budgets, multi.predicted, None, warnings, multi=multi)


def _write_plan_outputs(paths: dict, spec, profile, work, pred: Predicted) -> None:
    if paths["out"]:
        import json
        write_output(paths["out"], "out", lambda p: p.write_text(json.dumps(pred.plan.to_json(spec), indent=2)))
    if paths["trace"]:
        from kvpipe.pipeline.trace import write_chrome
        write_output(paths["trace"], "trace", lambda p: write_chrome(p, pred.trace))
    if paths["plot"]:
        from kvpipe.analysis.timeline import plot_timeline
        write_output(paths["plot"], "plot", lambda p: plot_timeline(
            p, pred.trace, title=f"{spec.name} on {profile.name}, {fmt_tokens(work.context)}"))


def run(options: RunOptions | None = None, /, *, prompt_ids: list[int] | None = None, decoding=None,
        **kwargs) -> RunResult:
    """Execute on this machine (torch and transformers needed) and measure next to the
    prediction; the fields of RunOptions say what each argument does. `device` defaults to cuda
    when available; budgets to the GPU's memory, this machine's RAM and the free space of `kv_dir`
    (the disk tier's directory, default the system temp dir, its file removed however the run
    ends); `context` to the prompt file's length, else 32K; `hw` to the bundled profile of this
    GPU. The plan is decided as `plan` decides it, for what this machine can run, and refused
    before anything is allocated when it does not fit or this executor cannot run it. Unless
    PYTORCH_CUDA_ALLOC_CONF is set, it is set to expandable_segments:True before CUDA starts.
    The executor runs the plan's replay choice; where a sparse run's steps cannot replay after
    all it issues them eagerly and says why (a warning). `prompt_ids` (instead of `prompt_file`)
    and `decoding` (executor/engine/decoding.py: token choice and early stop) serve `generate`."""
    opts = _options(RunOptions, options, kwargs)
    if (opts.gpus or 1) > 1:
        from .multi_run import run_gpus
        return run_gpus(opts)
    paths = opts.output_paths()
    session = _executor()
    from kvpipe.executor.layers.attention import kernel_label
    dev = session.resolve_device(opts.device)
    given = str(opts.model)
    shown = "random weights" if opts.random_weights else given
    from . import checkpoint
    if checkpoint.is_gguf(given):   # converted once (the folder generate uses), run from there
        opts = replace(opts, model=checkpoint.resolve(given, opts.dtype, opts.random_weights).model)
    spec = replace(load_model(opts.model, opts.dtype), name=given)
    _check_files(opts, session)
    attention = kernel_label(dev, session.TORCH_DTYPES[spec.dtype])  # validates KVPIPE_ATTN
    prompt, work = _prompt(opts, spec, session, prompt_ids)
    profile, budgets, req, decision = decide_run(opts, spec, work, session, dev)
    warnings = context_warnings(spec, work, generated=decoding is not None) + room_warning(spec, work, decision.predicted, budgets,
                                                           req.chunk is not None)
    lossy = decision.plan.lossy
    if lossy is not None and decision.plan.resident >= spec.units:   # both act on offloaded units only
        idle = (["nothing is quantised"] if lossy.quant else []) + \
            (["sparse decode selects only among offloaded units, so every token is attended"] if lossy.sparse else [])
        home = "the GPU" if dev.type == "cuda" else f"the {dev.type.upper()}"   # resident: with the compute
        warnings += _logged([f"lossy: every KV unit is resident on {home}; {'; '.join(idle)} (the run is exact)"])
    from kvpipe.pipeline.builder import build, build_lazily
    from kvpipe.executor.layers.loader import progress_bars
    with progress_bars(opts.progress):
        hf = session.load_hf_model(opts.model, opts.random_weights, dev, session.TORCH_DTYPES[spec.dtype], opts.seed)
    ids = session.prompt_tensor(prompt, work.batch, work.context, spec.vocab, opts.seed)
    # a generation's steps are built as the run reaches them (runner.execute: an eager decode builds none past an early stop)
    graph, more = build_lazily(spec, work, decision.plan) if decoding else (build(spec, work, decision.plan), None)
    measured = session.run_graph(graph, hf, ids, dev, budgets["gpu"],
                                 progress=opts.progress, warmup=opts.warmup, replay=decision.plan.replay,
                                 kv_dir=None if opts.kv_dir is None else str(opts.kv_dir), fuse=req.fuse,
                                 decoding=decoding, more=more)
    res = measured.result
    predicted, notes = _as_ran(spec, work, profile, budgets, req, decision.predicted, res)
    _write_run_outputs(paths, spec, work, predicted, res.trace, dev)
    return RunResult(spec, profile, work, budgets, predicted, _measured_report(res), res.trace,
                     res.tokens.cpu().tolist(), measured.digest, str(dev), attention,
                     shown, warnings + notes,
                     {"mode": res.decode_issue, "graphs": res.graphs, "capture_s": res.capture_s, "fuse": req.fuse,
                      "fused": res.fused, "compile_s": res.compile_s, "fuse_note": res.fuse_note,
                      "sparse": res.sparse_paths, "dequant": res.dequant_paths},
                     res.disk, decision.search, res.lossy_error,
                     decision.lossy_choice.describe() if decision.lossy_choice else None)


def _check_files(opts: RunOptions, session) -> None:
    """Before any work: the weights files open, and the disk tier's folder is rid of the files of
    runs that died without removing theirs (said in one line)."""
    import tempfile
    from kvpipe.executor.disk.io import reclaim
    from kvpipe.executor.layers.loader import check_weight_files
    if not opts.random_weights and session.has_weights(opts.model):
        check_weight_files(opts.model)
    kv_dir = tempfile.gettempdir() if opts.kv_dir is None else str(opts.kv_dir)
    n, nbytes = reclaim(kv_dir)
    if n:
        log.info(f"removed {n} KV file{'s' if n > 1 else ''} ({fmt_bytes(nbytes)}) left in {kv_dir} "
                 "by runs that ended without cleanup")


def _as_ran(spec, work, profile, budgets, req, predicted: Predicted, res) -> tuple[Predicted, tuple[str, ...]]:
    """The prediction of what the executor ran, and its notes: where it reported a fallback (an
    unfused compile under fuse auto, a sparse run issued eagerly), the plan predicted as it ran."""
    from kvpipe.sim.decide import predict
    notes = _logged([res.fuse_note] if res.fuse_note else [])   # auto ran unfused (e.g. a failed compile)
    replayed = res.replay is not Replay.OFF
    if res.replay_note:   # LOSSY sparse: the executor found a reason to issue the steps eagerly
        notes += _logged([f"replay: {res.replay_note}; decode issued eagerly"])
        predicted = predict(spec, work, predicted.plan, profile, budgets, req, fuse="off", replayed=False)
    if res.fused != predicted.fused:
        predicted = predict(spec, work, predicted.plan, profile, budgets, req, fuse="off", replayed=replayed)
    return predicted, notes


def _measured_report(res):
    from kvpipe.pipeline.report import Report, timing_from_trace
    real = res.trace
    return Report(timing_from_trace(real), real.lane_busy_s(),
                  {"gpu": res.peak_gpu_bytes, "host": res.host_pinned_bytes, "disk": res.disk_bytes}, {}, (real.note,))


def _write_run_outputs(paths: dict, spec, work, predicted: Predicted, real, dev) -> None:
    if paths["trace"]:
        from kvpipe.pipeline.trace import write_chrome
        write_output(paths["trace"], "trace", lambda p: write_chrome(p, predicted.trace, real))
    if paths["plot"]:
        from kvpipe.analysis.timeline import plot_timeline
        write_output(paths["plot"], "plot", lambda p: plot_timeline(
            p, predicted.trace, real, title=f"{spec.name} {fmt_tokens(work.context)} on {dev}"))


def _executor():
    """executor.engine.session, torch imported (CUDA's allocator configured first)."""
    loaded = sys.modules.get("torch")
    if loaded is None or not loaded.cuda.is_initialized():   # before CUDA starts, or it is too late
        default_alloc_conf()
    try:
        import torch  # noqa: F401
        from kvpipe.executor.engine import session
    except ImportError as e:
        raise ValueError(f"run: needs torch and transformers ({e.name} missing): pip install 'kvpipe[run]'") from None
    return session


def _prompt(opts: RunOptions, spec: ModelSpec, session, ids=None) -> tuple[list[int] | None, Workload]:
    """The prompt's ids (`ids`, the prompt file's, or None: random) and the workload, its context
    the prompt's by default."""
    prompt = session.read_prompt(opts.prompt_file, opts.model, spec.vocab) if opts.prompt_file is not None else ids
    context = opts.context
    if context is None:
        context = len(prompt) if prompt is not None else DEFAULT_RUN_CONTEXT
    work = Workload.parse(context, opts.decode_tokens, opts.batch)
    if prompt is not None and len(prompt) != work.context:
        more = "exceed" if len(prompt) > work.context else "fall short of"
        raise ValueError(f"prompt-file: its {len(prompt)} tokens {more} the context {work.context}; "
                         "omit --context to use the prompt's length")
    return prompt, work


plan.__signature__ = _keywords(PlanOptions)
run.__signature__ = _keywords(RunOptions)
