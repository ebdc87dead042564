"""Runs a stage graph for real: checks that the graph suits the model and the prompt, allocates
every buffer the plan needs before the first token, lets the lane actors issue the stages, and
returns the measured trace with the logits and greedy tokens."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvpipe.pipeline.replay import Replay, blocker, resolve
from kvpipe.pipeline.stage import Graph, Lane, Phase, Stage
from kvpipe.pipeline.trace import Trace

from kvpipe.executor.layers.adapter import HFAdapter, spec_dtype
from kvpipe.executor.engine.interrupts import sigterm_raises
from kvpipe.executor.engine.interpreter import Interpreter
from kvpipe.executor.kv.layout import DiskOptions, KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.engine.lanes import HOST_LANES, Lanes
from kvpipe.executor.replay.capture import DecodeReplay, ReplayInterpreter
from kvpipe.executor.replay.sparse_step import lossy_blocker

MODES = ("auto", "on", "off", "issue")   # what `execute(replay=)` takes (pipeline/replay.Replay)


@dataclass(frozen=True)
class RunResult:
    """What a run measured and produced. Tensors stay on the run's device.

    `trace`: one span per stage, seconds from the run start (CUDA events on a GPU, the host clock
    on CPU), `host_s` the host time spent issuing it. `last_logits` [B, vocab] fp32 of the last
    step; `tokens` [B, decode steps + 1] greedy ids (the first from the prefill). `peak_gpu_bytes`
    torch.cuda.max_memory_allocated over the run (0 on CPU); `host_pinned_bytes` the host KV tier
    (pinned on CUDA). `moved_bytes[i]` bytes stage i copied over its lane (0 for compute).
    `step_logits` [decode steps + 1, B, vocab] fp32, only when asked for. `disk_bytes` the size
    of the disk tier's file (0 without disk units) and `disk` what its I/O did (DiskStats.to_json)."""

    trace: Trace
    last_logits: torch.Tensor
    tokens: torch.Tensor
    peak_gpu_bytes: int
    host_pinned_bytes: int
    moved_bytes: tuple[int, ...]
    step_logits: torch.Tensor | None = None
    replay: Replay = Replay.OFF   # how decode steps ran: ON replayed as CUDA graphs, ISSUE the same
                                  # step code without a graph, OFF stage by stage
    graphs: int = 0               # CUDA graphs captured
    capture_s: float = 0.0        # host seconds spent capturing them (before the first decode step)
    fused: bool = False           # decode steps ran the fused pieces (--fuse, executor/layers/fused.py)
    compile_s: float = 0.0        # host seconds compiling them (before the first capture)
    fuse_note: str | None = None  # why a fusing setting (auto) ran unfused, e.g. a failed compile
    disk_bytes: int = 0
    disk: dict | None = None
    lossy_error: dict | None = None   # LOSSY runs: errors measured in the run (executor/quant/probe.py)
    h2d_codec: dict | None = None     # h2d codec runs: what it stored (executor/codecs/h2d_store.py `stats`)
    sparse_paths: dict | None = None  # LOSSY sparse runs: gather / ranking paths taken (SparseHomes.paths)
    dequant_paths: dict | None = None  # LOSSY quantised runs: the dequantise calls by path (QuantHomes.paths)
    replay_note: str | None = None     # why replay (auto) issued a sparse run's steps eagerly after all

    @property
    def decode_issue(self) -> str:
        """How decode steps ran, in the run report's word: graph, issue or eager."""
        return self.replay.issued


def decode_steps(graph: Graph, lazy: bool = False) -> int:
    """Decode steps in the graph; ValueError unless it is a whole run (prefill, steps 0..n-1).
    `lazy`: the graph holds its first prefill chunk only, its other steps built as the run goes
    (pipeline/builder.build_lazily): the workload's."""
    phases = {s.phase for s in graph.stages}
    if Phase.PREFILL not in phases:
        raise ValueError("graph: has no prefill; the executor runs whole workloads "
                         "(build(..., prefill=True))")
    if lazy:
        assert phases == {Phase.PREFILL}, "a lazily built graph starts with its first prefill chunk"
        return graph.workload.decode_tokens
    steps = sorted({s.step for s in graph.stages if s.phase is Phase.DECODE})
    if steps != list(range(len(steps))):
        raise ValueError(f"graph: decode steps must be 0..n-1, got {steps[:3]}..")
    return len(steps)


def decode_mode(graph: Graph, setting: Replay | str, device: torch.device, dtype: torch.dtype,
                lazy: bool = False) -> Replay:
    """How this run issues decode steps under `setting` (one of MODES): the rule the planner
    predicts with (pipeline/replay.py) on this device and the weights' dtype, ON and ISSUE refused
    (ValueError naming replay) where it forbids them."""
    mode = resolve(Replay.parse(setting, MODES), blocker(graph.model, graph.workload, graph.plan, device.type,
                                                         spec_dtype(dtype)), decode_steps(graph, lazy))
    assert mode is Replay.OFF or not any(s.lane in HOST_LANES for s in graph.stages), \
        "host-lane stages under replay: pipeline/replay.blocker misses a reason"
    return mode


def execute(graph: Graph, hf_model: torch.nn.Module, prompt_ids: torch.Tensor,
            device: str | torch.device | None = None, *, keep_logits: bool = False,
            stage_hook: Callable[[Stage], None] | None = None, turns: random.Random | None = None,
            replay: Replay | str = Replay.OFF, disk: DiskOptions | None = None, fuse: str | None = None,
            decoding=None, store: KVStore | None = None, more: Iterator[int] | None = None) -> RunResult:
    """Run `graph` with `hf_model` (already on `device`, default: the model's) on `prompt_ids`
    [B, context]. Greedy decoding; bitwise independent of where the KV cache lives.
    `stage_hook(stage)` is called on the stage's lane (its stream current) after the stage's
    dependency waits, outside its span: a progress bar, or a test delaying streams at random.
    `turns` (seeded) randomises the lane actors' turn order (tests: many interleavings on CPU).
    `replay` (pipeline/replay.Replay or its name; `decode_mode`): the plan's choice as the decision
    layer made it; `on` raises a ValueError where decode cannot be replayed (CPU, fp32, batch > 1,
    disk units); under `auto` a sparse run whose steps cannot replay issues them eagerly and says
    why (`replay_note`). `fuse` (auto|on|off, None: pipeline/fusion.fuse_mode()): replayed decode
    steps with fused elementwise work (executor/layers/fused.py); eager decode is never fused.
    `disk` says where the disk units' file goes (default: the system temp dir); it is removed
    when the run ends, however it ends. `decoding` (engine/decoding.py, None: greedy) picks each
    token and skips the decode steps past the end of a generation. `store`: an open KVStore whose
    tokens before the graph's first prefill chunk are home (engine/live.py), left open; None: one
    is opened for the graph and closed when it ends. `more`: `graph` holds its first prefill chunk
    and this iterator appends its other steps (pipeline/builder.build_lazily); an eager run builds
    each step as its compute lane reaches it (with `decoding`, none past the generation's end), a
    replayed one all of them before it starts."""
    adapter = HFAdapter(hf_model)
    device = adapter.device if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if adapter.device != device:
        raise ValueError(f"device: the model is on {adapter.device}, the run asks for {device}")
    w = graph.workload
    n_decode = decode_steps(graph, lazy=more is not None)
    adapter.check(graph.model, w.kv_capacity)
    if tuple(prompt_ids.shape) != (w.batch, w.context):
        raise ValueError(f"prompt_ids: shape {tuple(prompt_ids.shape)}, the workload needs "
                         f"[batch, context] = [{w.batch}, {w.context}]")
    mode = decode_mode(graph, replay, device, adapter.dtype, lazy=more is not None)
    if more is not None and mode is not Replay.OFF:   # a replayed run takes its steps whole
        more = _finish(more)
    elif more is not None and decoding is not None:   # an early stop ends the graph: no step past it is built
        more = _while_needed(more, decoding)
    auto = Replay.parse(replay, MODES) is Replay.AUTO
    cuda = device.type == "cuda"
    with torch.inference_mode():
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        prompt = prompt_ids.to(device=device, dtype=torch.long)
        # every column is written by a head stage (the prefill's column 0, decode step k's k + 1);
        # empty, not zeros: a fill kernel here ran outside every stage (tests/test_diag.py's range check)
        tokens = torch.empty(w.batch, n_decode + 1, dtype=torch.long, device=device)
        step_logits = (torch.empty(n_decode + 1, w.batch, graph.model.vocab, device=device)
                       if keep_logits else None)
        extra = {}
        own = KVStore(KVLayout.of(graph), device, adapter.dtype, disk, replay=mode is not Replay.OFF) \
            if store is None else nullcontext(store)
        with sigterm_raises(), own as store, Lanes(device, turns=turns) as lanes:
            why = lossy_blocker(graph, store) if mode is not Replay.OFF else None   # LOSSY sparse: known once the store is open
            if why and not auto:
                raise ValueError(f"replay: {why}; use --replay off")
            if why:   # a fallback, reported: the plan left replay to the run (auto)
                mode, extra = Replay.OFF, dict(replay_note=why)
            if mode is Replay.OFF:
                interp = Interpreter(graph, adapter, store, lanes, prompt, tokens, step_logits, decoding)
                spans = lanes.run(graph, interp if decoding is None else decoding.gate(interp), before=stage_hook,
                                  more=more)
            else:
                interp = ReplayInterpreter(graph, adapter, store, lanes, prompt, tokens, step_logits, decoding,
                                           fuse=fuse)
                spans, extra = _prefill_then_replay(graph, interp, lanes, tokens, step_logits, stage_hook,
                                                    capture=mode is Replay.ON)
            peak = torch.cuda.max_memory_allocated(device) if cuda else 0
            host, disk_bytes = store.host_bytes, store.disk_bytes
            disk_stats = store.disk.stats.to_json() if store.disk is not None else None
            if disk_stats is not None:   # the file's size, and per layer kind
                disk_stats.update(store.disk_file_json(graph.model.layer_kinds))
            codec_stats = store.coded.stats() if store.coded is not None else None
            sparse_paths = store.sparse.paths() if store.sparse is not None else None
            dequant_paths = store.q.paths() if store.q is not None else None
    note = "measured with CUDA events" if cuda else "measured with the host clock (CPU, no overlap)"
    if mode is not Replay.OFF:
        note += (f"; decode steps issued as {'CUDA-graph replays' if mode is Replay.ON else 'device steps'}: "
                 "one span per step on its head stage, the step's other compute/h2d stages empty at its end")
    trace = Trace(graph, "real", spans, note=note)
    moved = tuple(interp.moved) + (0,) * (len(graph.stages) - len(interp.moved))   # stages never issued
    return RunResult(trace, interp.last_logits, tokens, peak, host, moved, step_logits,
                     disk_bytes=disk_bytes, disk=disk_stats, lossy_error=interp.lossy_error, h2d_codec=codec_stats,
                     sparse_paths=sparse_paths, dequant_paths=dequant_paths, **extra)


def _while_needed(more: Iterator, decoding) -> Iterator:
    """`more`'s steps until the generation is known to end (decoding.stop_at): then none, so a
    stop (EOS, a stop string, Ctrl-C) with thousands of tokens of room left costs no step past it."""
    while decoding.stop_at is None:
        step = next(more, None)
        if step is None:
            return
        yield step


def _finish(more: Iterator) -> None:
    """Build every step `more` has left (returns None: no more to build)."""
    for _ in more:
        pass


def _prefill_then_replay(graph: Graph, interp: ReplayInterpreter, lanes: Lanes, tokens: torch.Tensor,
                         step_logits: torch.Tensor | None, hook, capture: bool) -> tuple[list, dict]:
    """The prefill issued stage by stage, then every decode step replayed; spans from one base."""
    m = next(i for i, s in enumerate(graph.stages) if s.phase is Phase.DECODE)
    assert all(s.phase is Phase.DECODE for s in graph.stages[m:]), "prefill stages come first"
    prefill = Graph(graph.model, graph.workload, graph.plan, graph.stages[:m], graph.static)
    base = torch.cuda.Event(enable_timing=True)
    base.record(lanes.streams[Lane.GPU])   # the lanes' own base mark follows at once on this stream
    spans = lanes.run(prefill, interp, before=hook)
    with DecodeReplay(graph, interp, lanes, tokens, step_logits, capture=capture) as rep:
        spans = spans + rep.run(base, before=hook)
        extra = dict(replay=Replay.ON if capture else Replay.ISSUE, graphs=len(rep.captured),
                     capture_s=rep.capture_s, fused=interp.fused is not None, compile_s=rep.compile_s,
                     fuse_note=interp.fuse_note)
    assert [sp.stage for sp in spans] == list(range(len(graph.stages)))
    return spans, extra

