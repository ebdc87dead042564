"""The public Python API under the CLI: `kvpipe.plan(...)` predicts a workload on a hardware
profile (no torch), `kvpipe.run(...)` executes it on this machine. Keyword arguments mirror the
command-line flags (`--decode-tokens` is `decode_tokens`), and each returns a frozen result whose
`to_json()` is exactly what `kvpipe plan --json` / `kvpipe run --json` print.

    import kvpipe
    res = kvpipe.plan(model="llama-3-8b", hw="rtx4090", context="1M")
    res.fits, res.predicted.report.timing.ttft_s, res.plan.describe()

Warnings (e.g. a context past the model's trained positions) go to the `kvpipe` logger and are
kept in `result.warnings`."""
from __future__ import annotations

import logging
import os
import sys

from kvpipe.pipeline.model import ModelSpec, load_model
from kvpipe.pipeline.plan import Plan, decode_replayed
from kvpipe.pipeline.report import Report
from kvpipe.pipeline.units import fmt_bytes, fmt_tokens
from kvpipe.pipeline.workload import Workload

from .inputs import (Knob, PlanArg, apply_replay, apply_tiers, budget, check_weights, codec_args, free_disk,
                     method_of, output_path, planner_pins, replay_pin, resolve_plan, write_output)
from .results import PlanResult, Predicted, RunResult

log = logging.getLogger("kvpipe")

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_HW = "rtx4090"           # plan's profile; run picks this machine's GPU, else this
DEFAULT_PLAN_CONTEXT = "1M"
DEFAULT_RUN_CONTEXT = "32K"      # run without a prompt file; with one, the prompt's length
DEFAULT_DECODE_TOKENS = 32       # the same for plan and run
Path_ = str | os.PathLike | None
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"


def default_alloc_conf(environ=None) -> bool:
    """Give torch's CUDA caching allocator expandable segments unless the user set
    PYTORCH_CUDA_ALLOC_CONF (then it is left alone): with fixed segments, rows died of
    fragmentation on the H200 (benchmarks/results/h200-2026-11-30-sim_check.json). Takes effect
    only before CUDA initialises. True when it set the variable."""
    env = os.environ if environ is None else environ
    if ALLOC_CONF_ENV in env:
        return False
    env[ALLOC_CONF_ENV] = ALLOC_CONF
    return True


def _predict(model, work, plan: Plan, hw, budgets, full: bool = False, max_context: int | None = None,
             replay: bool | None = None, pred=None, fuse: str = "auto") -> Predicted:
    """`replay`: decode steps as CUDA-graph replays; None: the plan's replay choice, else as
    `run --replay auto` would on a GPU. `fuse`: the fuse setting (auto|on|off; `on` refused where
    decode is not replayed). `pred`: a prediction already simulated for this plan (the planner's)."""
    from kvpipe.pipeline.fusion import decode_fused, refuse_unfusable
    from kvpipe.pipeline.memory import breakdown
    from kvpipe.pipeline.report import budget_problems
    from kvpipe.sim.simulate import simulate
    plan.check(model, work)
    problems = tuple(budget_problems(breakdown(model, work, plan), budgets))
    if replay is None:   # disk units, lossy KV and an h2d codec run eagerly (no CUDA graph holds them)
        replay = decode_replayed(model, work, plan)
    refuse_unfusable(fuse, replay)
    pred = pred or simulate(model, work, plan, hw, full=full, replay=replay, fuse=decode_fused(fuse, replay))
    return Predicted(plan, problems, pred.report, pred.trace, max_context, pred.fused, pred.compile_s)


def _searches(method, plan: PlanArg) -> bool:
    """Head-wise plans without a plan file come from the planner; the other methods from their rule."""
    from kvpipe.pipeline.plan import Method
    return plan is None and method_of(method) is Method.HEADWISE


def _choose(spec, work, profile, budgets, method, group, chunk, resident, plan, objective, full=False,
            disk=None, codec=(), h2d_codecs=True, fuse: str = "auto", replay: bool | None = None):
    """(the plan's prediction, the planner's result or None). --disk/--codec are not dimensions of
    the search yet: given, they apply over the planner's plan, which is then simulated again.
    `replay`: the replay pin (--replay on/off; None: the planner decides, a rule's plan runs as
    `run --replay auto` would, a plan file's as it says)."""
    from .inputs import _is_auto
    if _searches(method, plan):
        from kvpipe.sim.planner import search
        found = search(spec, work, profile, budgets, planner_pins(spec, group, chunk, resident, replay), objective,
                       full=full, h2d_codecs=h2d_codecs and not any(str(c).startswith("h2d=")
                                                                    for c in codec_args(codec)),
                       fuse=fuse)
        if _is_auto(disk) and not codec:
            return _predict(spec, work, found.best.plan, profile, budgets, pred=found.best.prediction,
                            fuse=fuse), found
        chosen = apply_replay(spec, work, _tiers(spec, work, found.best.plan, profile, disk, codec), replay)
        return _predict(spec, work, chosen, profile, budgets, full=full, fuse=fuse), found
    chosen = resolve_plan(spec, work, budgets, method, group, chunk, resident, plan)
    chosen = apply_replay(spec, work, _tiers(spec, work, chosen, profile, disk, codec), replay)
    return _predict(spec, work, chosen, profile, budgets, full=full, fuse=fuse), None


def _lossy_plan(spec, work, budgets, first, lossy, sparse, rechoose, pin=None):
    """The exact plan of `first` (a Predicted) with the LOSSY opt-in on, and the planner's result
    where it searched again (else None). The search ranks exact plans; the lossy GPU bytes (the
    sparse sketch and chunk summaries, quantised byte slots) come on top, so a plan that fit exact
    may not fit lossy (512K sparse 0.2 on 24 GB: 5.0 GiB of summaries). Where the planner chose the
    plan (`rechoose`: budgets -> (Predicted, found), None where the user gave the plan) and the lossy
    plan does not fit, it searches again with the GPU budget less those bytes, up to 3 times, and
    keeps the first plan that fits with them; if none does, the original, which then reports
    "fits: NO" (plan) or is refused (run). Where the planner chose, the lossy plan's replay choice
    is made again: `pin` (the --replay pin: True, False, or None for `run --replay auto`), and None
    where the plan cannot replay (quantised KV alone); the exact plan's choice (often eager at the
    PCIe floor, where the host's issue cost hides) does not carry over to a sparse decode, which
    moves a fraction of the bytes and is host-bound unless replayed. A user's plan keeps its own."""
    from dataclasses import replace

    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.memory import breakdown, gpu_usable
    from kvpipe.pipeline.units import fmt_bytes
    from kvpipe.sim.planner import NoPlanFits
    spec_l = LossySpec(lossy, sparse=sparse)
    if rechoose is None:
        return first.plan.with_(lossy=spec_l), None

    lossy_of = lambda exact: exact.with_lossy(spec_l, pin)   # noqa: E731
    plan = lossy_of(first.plan)
    exact, extra, found = first.plan, 0, None
    for _ in range(3):
        lossy_gpu = breakdown(spec, work, exact.with_(lossy=spec_l)).gpu
        if lossy_gpu <= gpu_usable(budgets["gpu"]):   # fits with the allocator's allowance
            return lossy_of(exact), found
        extra = max(extra, lossy_gpu - breakdown(spec, work, exact).gpu)   # what the lossy option adds
        try:
            again, found = rechoose(dict(budgets, gpu=budgets["gpu"] - extra))
        except NoPlanFits:
            break
        exact = again.plan
        if found is not None:
            found = replace(found, reason=f"{found.reason}; searched with the GPU budget less the lossy "
                                          f"option's {fmt_bytes(extra)} (summaries, sketch or byte slots)")
    return plan, None


def _max_context(spec, work, budgets, method, group=None, chunk=None, resident=None, plan=None) -> int:
    """Largest prompt that fits: over the planner's space for head-wise, the rule's plan otherwise."""
    from kvpipe.pipeline.plan import Method
    if _searches(method, plan):
        from kvpipe.sim.planner import max_context
        return max_context(spec, work.decode_tokens, work.batch, budgets, planner_pins(spec, group, chunk, resident))
    from kvpipe.pipeline.rules import max_context
    m = read_plan_method(plan, spec) if plan is not None else method_of(method, Method.HEADWISE)
    return max_context(m, spec, work.decode_tokens, work.batch, budgets)


def read_plan_method(plan: PlanArg, spec: ModelSpec):
    from .inputs import read_plan
    return read_plan(plan, spec).method


def _tiers(spec, work, chosen: Plan, profile, disk, codec) -> Plan:
    """--disk and --codec over the resolved plan; links given as LINK=auto get the codec the
    simulator predicts fastest (said in the plan's source)."""
    from kvpipe.sim.codec_choice import choose_codec
    chosen, auto = apply_tiers(spec, chosen, disk, codec)
    for link in auto:
        chosen, choice = choose_codec(spec, work, chosen, profile, link)
        chosen = chosen.with_(source=f"{chosen.source}; {choice.describe()}")
    return chosen


def _room_warning(model: ModelSpec, work: Workload, pred, budgets, chunk: Knob) -> tuple[str, ...]:
    """A prefill chunk the user pinned is not held to the planner's room rule (three of its MLP
    blocks beside the live bytes, within the allocator's slack): say when it breaks it, since
    such runs died of fragmentation on the H200 (benchmarks/results/h200-2026-11-30-sim_check.json)."""
    from .inputs import _is_auto
    from kvpipe.pipeline.rules import gpu_fill
    from kvpipe.sim.planner import fragmentation_room
    if _is_auto(chunk) or not budgets.get("gpu"):
        return ()
    plan = pred.plan
    room = fragmentation_room(model, work, plan)
    free = gpu_fill(budgets["gpu"]) - pred.report.peak_bytes["gpu"]
    if free >= room:
        return ()
    w = (f"chunk: {fmt_tokens(plan.prefill.chunk)}-token chunks leave the CUDA allocator {fmt_bytes(max(free, 0))} "
         f"beside the predicted peak, under the {fmt_bytes(room)} (three MLP blocks) runs needed on the H200; the "
         "run may die of fragmentation: a smaller --chunk, or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    log.warning(w)
    return (w,)


def _warnings(model: ModelSpec, work: Workload) -> tuple[str, ...]:
    """Logged at once (before a long run), and kept in the result."""
    out = []
    if model.max_positions is not None and work.kv_capacity > model.max_positions:
        out.append(f"context: {work.context} prompt + {work.decode_tokens} decode tokens exceed the model's "
                   f"max_position_embeddings ({model.max_positions}); it was not trained for those positions")
    for w in out:
        log.warning(w)
    return tuple(out)


def plan(model: str = DEFAULT_MODEL, hw: str = DEFAULT_HW, context: str | int = DEFAULT_PLAN_CONTEXT,
         decode_tokens: int = DEFAULT_DECODE_TOKENS, batch: int = 1, gpu_mem: str | int | None = None,
         host_mem: str | int | None = None, disk_mem: str | int | None = None, method: str | None = None,
         group: Knob = None, chunk: Knob = None, resident: Knob = None, plan: PlanArg = None,
         compare: bool = False, full_sim: bool = False, trace: Path_ = None, plot: Path_ = None,
         disk: Knob = None, kv_dir: Path_ = None, codec: str | list[str] = (),
         lossy: str | None = None, sparse: float | None = None,
         objective: str = "total", out: Path_ = None, max_context: bool = False,
         max_error: float | None = None, fuse: str | None = None, replay: str = "auto") -> PlanResult:
    """Predict latency and memory of `model` on hardware profile `hw` (no GPU, no torch).
    Budgets default to the profile's. Head-wise plans come from the planner (sim/planner.py),
    which minimises `objective` (total, ttft or decode); `group`/`chunk`/`resident` other than
    None or "auto" pin those dimensions; `plan` (a file, dict or Plan) replaces the search.
    `disk` offloaded units go to disk (None/auto: what host RAM cannot hold); `kv_dir`, when
    given, makes its free space the disk budget; `codec` is LINK=NAME (or a list), NAME `auto`
    letting the simulator decide. LOSSY opt-ins, never chosen for the user: `lossy` "int8"/"int4"
    quantises the offloaded KV, `sparse` F fetches a fraction F of the tokens per decode step
    (pipeline/lossy.py). `max_error`: an attention-output error budget within which the planner
    may pick int8/int4 or a sparse fraction by their measured error (sim/lossy_choice.py);
    without it, never lossy.
    `fuse` auto|on|off (None: KVPIPE_FUSE, else auto; pipeline/fusion.py): replayed decode steps
    with fused elementwise work, its one-time compile reported beside the total.
    `replay` auto|on|off: decode steps as CUDA-graph replays; auto lets the planner score both
    where decode can be replayed (its choice is the plan's `replay`), on/off pin it (on refused
    where decode cannot be replayed: disk units, lossy KV, an h2d codec, fp32, batch > 1).
    `max_context` answers the largest context that fits, with its plan;
    `out` writes the plan for `run(plan=...)`. `trace`/`plot` paths are checked first and written
    last. ValueError names the argument for bad input."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.fusion import fuse_mode
    trace_path, plot_path = output_path(trace, "trace"), output_path(plot, "plot")
    out_path = output_path(out, "out")   # a .json in an existing folder
    _check_max_error(max_error, lossy, sparse)
    fuse = fuse_mode(fuse)
    pin = replay_pin(replay)
    if pin and lossy is not None and sparse is None:
        raise ValueError("replay: decode replay cannot run quantised KV without --sparse (it runs eagerly); "
                         "use --replay off or auto")
    spec = load_model(model)
    profile = load_profile(hw)
    work = Workload.parse(context, decode_tokens, batch)
    budgets = {"gpu": budget(gpu_mem, profile.gpu_mem_bytes, "gpu-mem"),
               "host": budget(host_mem, profile.host_mem_bytes, "host-mem"),
               "disk": budget(disk_mem, free_disk(kv_dir) if kv_dir is not None else profile.disk_bytes, "disk-mem")}
    check_weights(spec, budgets)
    largest = None
    if max_context:
        largest = _max_context(spec, work, budgets, method, group, chunk, resident, plan)
        if not largest:
            raise ValueError("context: no context fits the budgets (raise --gpu-mem, --host-mem or --disk-mem)")
        work = Workload(largest, work.decode_tokens, work.batch)
    warnings = _warnings(spec, work)
    main, found = _choose(spec, work, profile, budgets, method, group, chunk, resident, plan, objective, full_sim,
                          disk, codec, h2d_codecs=lossy is None and sparse is None, fuse=fuse, replay=pin)
    warnings += _room_warning(spec, work, main, budgets, chunk)
    chosen = main.plan
    if lossy is not None or sparse is not None:   # explicit opt-in only, over the exact plan
        rechoose = (lambda b: _choose(spec, work, profile, b, method, group, chunk, resident, plan, objective,
                                      full_sim, disk, codec, h2d_codecs=False, fuse=fuse, replay=pin)) \
            if _searches(method, plan) else None
        chosen, again = _lossy_plan(spec, work, budgets, main, lossy, sparse, rechoose, pin)
        found = again or found
        main = _predict(spec, work, chosen, profile, budgets, full=full_sim, replay=None,
                        fuse=fuse)
    choice = None
    if max_error is not None:      # LOSSY only from the explicit budget, by measured error
        from kvpipe.sim.lossy_choice import choose_lossy
        exact = main

        def predict(p: Plan) -> Predicted:   # a candidate that cannot fuse is predicted unfused, not refused
            return exact if p is chosen else _predict(spec, work, p, profile, budgets, full=full_sim,
                                                      replay=None, fuse="auto" if fuse == "on" else fuse)
        main, choice = choose_lossy(chosen, max_error, objective, predict,
                                    refuse="not with --replay on (the lossy choice runs under --replay auto)" if pin else None,
                                    replay=pin)
        chosen = main.plan
    methods = None
    if compare:
        from kvpipe.pipeline.plan import Method
        methods = {}
        for m in Method:
            if m is chosen.method:
                pred = main
            else:
                pred, _ = _choose(spec, work, profile, budgets, m, None, None, None, None, objective, full_sim,
                                  fuse=fuse, replay=False if pin is False else None)   # on: where they can
            ctx = (_max_context(spec, work, budgets, method, group, chunk, resident, plan) if m is chosen.method
                   else _max_context(spec, work, budgets, m))
            methods[m.value] = Predicted(pred.plan, pred.problems, pred.report, pred.trace, ctx)
    if out_path:
        import json
        write_output(out_path, "out", lambda p: p.write_text(json.dumps(chosen.to_json(spec), indent=2)))
    if trace_path:
        from kvpipe.pipeline.trace import write_chrome
        write_output(trace_path, "trace", lambda p: write_chrome(p, main.trace))
    if plot_path:
        from kvpipe.analysis.timeline import plot_timeline
        write_output(plot_path, "plot", lambda p: plot_timeline(
            p, main.trace, title=f"{spec.name} on {profile.name}, {fmt_tokens(work.context)}"))
    return PlanResult(spec, profile, work, budgets, main, methods, warnings, found, largest,
                      choice.describe() if choice else None)


def _check_max_error(max_error, lossy, sparse) -> None:
    """--max-error is a budget in (0, 1) and excludes the explicit opt-ins (ValueError naming it)."""
    if max_error is None:
        return
    from kvpipe.sim.lossy_choice import check_budget
    check_budget(max_error)
    if lossy is not None or sparse is not None:
        raise ValueError("max-error: the planner picks within the budget; give --max-error or --lossy/--sparse, not both")


def executor_replay(flag: str, plan: Plan) -> str:
    """The executor's `replay` argument for `run --replay FLAG` over `plan`: a flag other than
    auto as given (a plan that disagrees was refused before); auto: the plan's replay choice (on /
    off), or auto where it has none (replayed where this device, dtype and batch allow)."""
    if flag != "auto" or plan.replay is None:
        return flag
    return "on" if plan.replay else "off"


def run(model: str = DEFAULT_MODEL, hw: str | None = None, context: str | int | None = None,
        decode_tokens: int = DEFAULT_DECODE_TOKENS, batch: int = 1, gpu_mem: str | int | None = None,
        host_mem: str | int | None = None, disk_mem: str | int | None = None, method: str | None = None,
        group: Knob = None, chunk: Knob = None, resident: Knob = None, plan: PlanArg = None,
        random_weights: bool = False, device: str | None = None, dtype: str | None = None, seed: int = 0,
        prompt_file: Path_ = None, progress: bool = True, warmup: bool = True, replay: str = "auto",
        trace: Path_ = None, plot: Path_ = None, disk: Knob = None, kv_dir: Path_ = None,
        codec: str | list[str] = (), objective: str = "total", lossy: str | None = None,
        sparse: float | None = None, max_error: float | None = None, fuse: str | None = None,
        prompt_ids: list[int] | None = None, decoding=None) -> RunResult:
    """Execute on this machine (torch and transformers needed) and measure next to the
    prediction. `device` defaults to cuda when available; budgets to the GPU's memory and this
    machine's RAM and the free space of `kv_dir` (the disk tier's directory, default the system
    temp dir, its file removed however the run ends); `context` to the prompt file's length,
    else 32K; `hw` to the bundled profile of this GPU; `disk` and `codec` as for `plan`. The
    plan is refused before anything is allocated when it does not fit. Unless PYTORCH_CUDA_ALLOC_CONF
    is set, it is set to expandable_segments:True before CUDA starts. LOSSY opt-in: `lossy`
    "int8"/"int4" stores the offloaded KV quantised (executor/quant/store.py); `sparse` F fetches a
    fraction F of each decode step's offloaded tokens, chosen by a key sketch kept on the GPU
    (executor/sparse/homes.py; with `lossy` too it selects whole quantised blocks; not over disk
    units yet). `max_error` as
    for `plan`. `fuse` auto|on|off (None: KVPIPE_FUSE, else auto): replayed decode steps with fused
    elementwise work where it can run; a compile that fails under auto runs unfused with one
    warning; `on` is refused where decode is not replayed. `replay` auto|on|off: auto runs decode
    as the plan's replay choice says (the planner scores replayed and eager decode where this run
    can replay; None: replayed on CUDA with bf16/fp16, batch 1), on/off pin it; a plan file's
    replay true is refused where this run cannot replay. `prompt_ids` (instead of `prompt_file`)
    and `decoding` (executor/engine/decoding.py: token choice and early stop) serve `generate`."""
    trace_path, plot_path = output_path(trace, "trace"), output_path(plot, "plot")
    _check_max_error(max_error, lossy, sparse)
    loaded = sys.modules.get("torch")
    if loaded is None or not loaded.cuda.is_initialized():   # before CUDA starts, or it is too late
        default_alloc_conf()
    try:
        import torch  # noqa: F401
        from kvpipe.executor.engine import session
    except ImportError as e:
        raise ValueError(f"run: needs torch and transformers ({e.name} missing): pip install 'kvpipe[run]'") from None
    from kvpipe.executor.layers.attention import kernel_label
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.report import timing_from_trace

    dev = session.resolve_device(device)
    spec = load_model(model, dtype)
    attention = kernel_label(dev, session.TORCH_DTYPES[spec.dtype])  # validates KVPIPE_ATTN
    prompt = session.read_prompt(prompt_file, model, spec.vocab) if prompt_file is not None else prompt_ids
    if context is None:
        context = len(prompt) if prompt is not None else DEFAULT_RUN_CONTEXT
    work = Workload.parse(context, decode_tokens, batch)
    if prompt is not None and len(prompt) != work.context:
        more = "exceed" if len(prompt) > work.context else "fall short of"
        raise ValueError(f"prompt-file: its {len(prompt)} tokens {more} the context {work.context}; "
                         "omit --context to use the prompt's length")
    from kvpipe.executor.replay.capture import resolve_mode   # `replay` refused before anything is loaded
    issue = resolve_mode(replay, dev, session.TORCH_DTYPES[spec.dtype], work.batch, spec.head_dim)
    from kvpipe.pipeline.fusion import fuse_mode, refuse_unfusable   # a bad --fuse or KVPIPE_FUSE too
    fuse = fuse_mode(fuse)
    refuse_unfusable(fuse, issue != "eager")   # `on` where decode is not replayed (CPU, fp32, --replay off)
    profile = load_profile(hw or session.guess_profile(dev) or DEFAULT_HW)
    free = free_disk(kv_dir)                # also checks --kv-dir; the disk budget the search may place units within
    budgets = {"gpu": budget(gpu_mem, session.device_budget(dev), "gpu-mem"),
               "host": budget(host_mem, session.host_ram_bytes(), "host-mem"),
               "disk": budget(disk_mem, free, "disk-mem")}
    check_weights(spec, budgets)
    if plan is not None:   # read once
        from .inputs import read_plan
        plan = read_plan(plan, spec)
        if plan.replay and replay == "auto" and issue == "eager" and work.decode_tokens:
            from kvpipe.executor.replay.capture import replay_supported
            why = replay_supported(dev, session.TORCH_DTYPES[spec.dtype], work.batch, spec.head_dim)
            raise ValueError(f"plan.replay: true, but decode replay {why} ({dev}); set it to false or null "
                             "in the plan file, or give --replay off")
    # The search scores what this run can execute: both where it replays decode (--replay auto on
    # CUDA), else the pin (on; off, or a device or dtype that cannot replay: eager).
    pin = True if replay == "on" else None if replay == "auto" and issue == "graph" else False
    from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
    from kvpipe.pipeline.codecs import parse_codec
    for link, name in (parse_codec(c) for c in codec_args(codec)):
        if link == "h2d" and name not in ("none", "auto"):
            check_available(name, dev)   # refused before the prediction (its profile may not rate it)
    # The planner of `run` tries an h2d codec as `plan` does, where this run can execute one (CUDA
    # and nvCOMP; the H200 ran it bit-exact at 0.90x the raw-PCIe floor, 2026-11-30).
    try:
        check_available("nvcomp-ans-planes", dev)   # CUDA and nVCOMP
        runnable = lossy is None and sparse is None
    except ValueError:
        runnable = False
    first, found = _choose(spec, work, profile, budgets, method, group, chunk, resident, plan, objective,
                           disk=disk, codec=codec, h2d_codecs=runnable, fuse=fuse, replay=pin)
    chosen = first.plan
    if lossy is not None or sparse is not None:   # LOSSY, explicit opt-in only, over the exact plan
        rechoose = (lambda b: _choose(spec, work, profile, b, method, group, chunk, resident, plan, objective,
                                      disk=disk, codec=codec, h2d_codecs=False, fuse=fuse, replay=pin)) \
            if _searches(method, plan) else None
        chosen, again = _lossy_plan(spec, work, budgets, first, lossy, sparse, rechoose, pin)
        found = again or found
    mode = executor_replay(replay, chosen)   # what the executor is told
    if mode != replay:
        issue = resolve_mode(mode, dev, session.TORCH_DTYPES[spec.dtype], work.batch, spec.head_dim)
    sp = chosen.lossy
    if sp is not None and sp.sparse is not None and (chosen.disk or sp.sketch is None
                                                     or chosen.decode.codec("h2d") != "none"):
        raise ValueError("sparse: kvpipe run executes --sparse over host-RAM units (the token sketch): "
                         "not with disk units, an h2d codec or a plan with sketch null")
    choice = None
    if max_error is not None:   # LOSSY only from the explicit budget, by measured error
        from kvpipe.sim.lossy_choice import choose_lossy
        replay_ok = issue == "graph" and work.decode_tokens > 0 and not chosen.disk
        picked, choice = choose_lossy(chosen, max_error, objective, lambda p: _predict(
            spec, work, p, profile, budgets, replay=replay_ok and p.replay_blocker is None,   # quantised alone: eager
            fuse="auto" if fuse == "on" else fuse),
            refuse="not with --replay on (the lossy choice runs under --replay auto)" if replay == "on" else None,
            replay=pin)
        chosen = picked.plan
    if chosen.lossy is not None and any(p.codec("disk") != "none" for p in (chosen.prefill, chosen.decode)):
        raise ValueError("codec: a disk codec cannot run with --lossy (quantised records go to disk as they are)")
    h2d = chosen.decode.codec("h2d")
    if h2d != "none":   # a GPU codec on h2d (a plan file's): nvCOMP on a CUDA GPU (executor/codecs/nvcomp_ans_planes.py)
        check_available(h2d, dev)
    if chosen.replay_blocker and issue != "eager":   # no CUDA graph for these
        if replay != "auto":
            raise ValueError(f"replay: {chosen.replay_blocker}; use --replay off or auto")
        issue, mode = "eager", "off"
    refuse_unfusable(fuse, issue != "eager")   # `on` over a plan whose decode is eager (its replay false)
    replayed = issue == "graph" and work.decode_tokens > 0
    predicted = _predict(spec, work, chosen, profile, budgets, replay=replayed, fuse=fuse)
    if predicted.problems:   # refused before anything is allocated
        raise ValueError(f"budget: the plan does not fit: {'; '.join(predicted.problems)}")
    warnings = _warnings(spec, work) + _room_warning(spec, work, predicted, budgets, chunk)
    if chosen.lossy is not None and chosen.resident >= spec.units:
        warnings += ("lossy: every KV unit is resident on the GPU; nothing is quantised (the run is exact)",)
        log.warning(warnings[-1])
    graph = build(spec, work, chosen)
    hf = session.load_hf_model(model, random_weights, dev, session.TORCH_DTYPES[spec.dtype], seed)
    ids = session.prompt_tensor(prompt, work.batch, work.context, spec.vocab, seed)
    measured = session.run_graph(graph, hf, ids, dev, budgets["gpu"], progress=progress, warmup=warmup,
                                 replay=mode, kv_dir=None if kv_dir is None else str(kv_dir), fuse=fuse,
                                 decoding=decoding)
    res, real = measured.result, measured.result.trace
    if res.fuse_note:   # auto ran unfused (e.g. a failed compile): one line, and predict what ran
        log.warning(res.fuse_note)
        warnings += (res.fuse_note,)
    if res.replay_note:   # LOSSY sparse: the executor found a reason to issue the steps eagerly
        log.warning(f"replay: {res.replay_note}; decode issued eagerly")
        warnings += (f"replay: {res.replay_note}; decode issued eagerly",)
        replayed = False
        predicted = _predict(spec, work, chosen, profile, budgets, replay=False, fuse="off")
    if res.fused != predicted.fused:
        predicted = _predict(spec, work, chosen, profile, budgets, replay=replayed, fuse="off")
    mrep = Report(timing_from_trace(real), real.lane_busy_s(),
                  {"gpu": res.peak_gpu_bytes, "host": res.host_pinned_bytes, "disk": res.disk_bytes}, {}, (real.note,))
    if trace_path:
        from kvpipe.pipeline.trace import write_chrome
        write_output(trace_path, "trace", lambda p: write_chrome(p, predicted.trace, real))
    if plot_path:
        from kvpipe.analysis.timeline import plot_timeline
        write_output(plot_path, "plot", lambda p: plot_timeline(
            p, predicted.trace, real, title=f"{spec.name} {fmt_tokens(work.context)} on {dev}"))
    return RunResult(spec, profile, work, budgets, predicted, mrep, real, res.tokens.cpu().tolist(),
                     measured.digest, str(dev), attention, "random weights" if random_weights else str(model),
                     warnings, {"mode": res.decode_issue, "graphs": res.graphs, "capture_s": res.capture_s,
                                "fuse": fuse, "fused": res.fused, "compile_s": res.compile_s,
                                "fuse_note": res.fuse_note, "sparse": res.sparse_paths,
                                "dequant": res.dequant_paths},
                     res.disk, found, res.lossy_error, choice.describe() if choice else None)
