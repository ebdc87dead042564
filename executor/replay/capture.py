"""Graph replay of decode steps: each decode step is captured once as a CUDA graph across the
compute and h2d streams (events as edges) and replayed, so the host issues one launch per step
instead of hundreds of stages.

Nothing a step reads changes shape from one step to the next: the token id, its position and
the number of keys attended live in static device buffers that the host refreshes before each
replay (`DeviceStep`); attention reads the length on the device (`attention.attend_decode`), new
K/V are written at a device-held index, and prefix copies move a fixed bucket of `bucket` tokens
(rounded up; the extra tokens are never attended), so one graph serves up to `bucket`
consecutive steps and a run captures ceil(steps / bucket) + 1 graphs at most, all before its
first decode step, in one memory pool. The write-back of each step's new K/V to pinned host RAM
(its host offset moves every step) is issued eagerly on the d2h stream after the replay, and the
next replay waits for it. Eager issue (`capture=False`) runs the very same step code without a
graph: the reference the replay is tested against bitwise. Whether a decode can be replayed is
the rule of pipeline/replay.py, which the planner predicts with (executor/engine/runner.py asks it). With fused decode
pieces (the default where they run: --fuse, executor/layers/fused.py) their compilation runs before the
first capture (`compile_s`, printed on stderr); under auto a failed compile leaves the decode unfused.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from kvpipe.pipeline.stage import Graph, Kind, Lane, Phase, Stage
from kvpipe.pipeline.trace import Span

from kvpipe.executor.layers import decode_triton
from kvpipe.executor.replay import sparse_step as lossy_replay
from kvpipe.executor.replay.device_step import DeviceStep, ReplayInterpreter
from kvpipe.executor.replay.window_step import open_windows
from kvpipe.executor.engine.lanes import Lanes, cross_lane_waits

BUCKET_TOKENS = 128      # prefix copies are rounded up to this many tokens (<= 0.4% extra at 32K)


def bucket_len(prefix: int, bucket: int, capacity: int) -> int:
    """Tokens a prefix copy moves for a step with `prefix` cached tokens: rounded up to `bucket`."""
    return min(capacity, -(-prefix // bucket) * bucket)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    template: int                           # the step whose stages were captured
    kv: dict[int, torch.Tensor]             # layer -> the step's new K/V [1, H, 1, 2, D] (static)


class DecodeReplay:
    """Runs every decode step of `graph` after its prefill, by graph replay (`capture=True`) or by
    eager issue of the same step code. Use as a context manager (frees the graphs on exit)."""

    def __init__(self, graph: Graph, interp: ReplayInterpreter, lanes: Lanes, tokens: torch.Tensor,
                 step_logits: torch.Tensor | None, *, capture: bool = True,
                 bucket: int = BUCKET_TOKENS) -> None:
        if bucket <= 0:
            raise ValueError(f"bucket: must be positive, got {bucket}")
        self.graph, self.interp, self.lanes = graph, interp, lanes
        self.store = interp.store
        self.tokens, self.step_logits = tokens, step_logits
        self.capture, self.bucket = capture, bucket
        self.context = graph.workload.context
        self.steps: list[list[Stage]] = []
        for s in graph.stages:
            if s.phase is Phase.DECODE:
                while len(self.steps) <= s.step:
                    self.steps.append([])
                self.steps[s.step].append(s)
        self.waits = cross_lane_waits(graph)
        self.captured: dict[int, _Captured] = {}
        self.capture_s = 0.0
        self.compile_s = 0.0     # host seconds compiling the fused decode pieces (0 unfused)
        self.dev: DeviceStep | None = None

    # ---- lifetime ------------------------------------------------------------------------
    def __enter__(self) -> "DecodeReplay":
        lo, device = self.store.layout, self.store.device
        if lo.batch != 1:
            raise ValueError(f"replay: needs batch 1, got {lo.batch}")
        n = len(self.steps)
        i32 = dict(dtype=torch.int32, device=device)
        self.pos_all = torch.arange(self.context, self.context + n, dtype=torch.long, device=device)
        self.lens_all = (self.pos_all + 1).to(torch.int32)
        self.dev = DeviceStep(ids=torch.empty(1, 1, dtype=torch.long, device=device),
                              pos=torch.empty(1, dtype=torch.long, device=device),
                              lens=torch.empty(1, **i32),
                              logits=torch.empty(1, self.graph.model.vocab, dtype=torch.float32, device=device),
                              cu_q=torch.tensor([0, 1], **i32), cu_k=torch.tensor([0, lo.capacity], **i32),
                              windows=open_windows(lo, device))
        self.lossy = self.store.sparse is not None   # LOSSY sparse steps (executor/replay/sparse_step.py)
        if self.lossy:
            spec = self.graph.plan.lossy
            prefixes = [self.context + k for k in range(n)]
            rows = [lossy_replay.step_args(spec, p) for p in prefixes]
            self.rows = rows
            self.args_all = torch.tensor(rows, dtype=torch.long, device=device)
            self.sp_lens_all = (self.args_all[:, lossy_replay.ATTENDED] + 1).to(torch.int32).view(n, 1)
            by: dict[int, list[int]] = {}
            for k, p in enumerate(prefixes):
                by.setdefault(lossy_replay.ranked(spec, p), []).append(k)
            self.buckets = {key: lossy_replay.bucket_of(spec, [rows[k] for k in ks], [prefixes[k] for k in ks])
                            for key, ks in by.items()}
            self.dev = replace(self.dev, args=torch.zeros(lossy_replay.ARGS, dtype=torch.long, device=device),
                               sp_lens=torch.ones(1, **i32))
            # the slot rows a bucket's offloaded heads can attend: its widest fetch, the exact tail
            # and the step's own token; the attention reads only those (splits sized to them)
            g = spec.group if spec.blocks else 1
            widths = {key: min(lo.capacity, (b.n_max + 1) * g) for key, b in self.buckets.items()}
            self.sp_width = {key: (w, torch.tensor([0, w], **i32)) for key, w in widths.items()}
            if self.store.q is not None:
                self.store.q.open_replay()
        self.rings = [i for i in range(lo.layers) if lo.ring(i)]
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.store.device)
        for c in self.captured.values():
            if c.graph is not None:
                c.graph.reset()
        self.captured.clear()
        self.interp.dev = None

    # ---- keys and capture ----------------------------------------------------------------
    def key(self, k: int) -> int:
        """The copy length step k's graph bakes in (0 when the step copies no prefix); sparse
        steps (LOSSY): the ranked tokens (blocks) of the step's bucket (they copy no prefix)."""
        if self.lossy:
            return lossy_replay.ranked(self.graph.plan.lossy, self.context + k)
        copies = any(s.kind is Kind.H2D or (s.tag == "attn" and s.slot is not None) for s in self.steps[k])
        return bucket_len(self.context + k, self.bucket, self.store.layout.capacity) if copies else 0

    def _issue(self, stages: list[Stage]) -> dict[int, torch.cuda.Event]:
        """Issue one step's stages (not its d2h write-backs) on their lanes' streams, cross-lane
        dependencies inside the step as events; the other streams fork from and join the compute
        stream, so under capture they belong to the graph."""
        streams, gpu = self.lanes.streams, self.lanes.streams[Lane.GPU]
        step_ids = {s.id for s in stages}
        fork = torch.cuda.Event()
        fork.record(gpu)
        lanes = {s.lane for s in stages if s.kind is not Kind.D2H} - {Lane.GPU}
        for lane in lanes:
            streams[lane].wait_event(fork)
        ev: dict[int, torch.cuda.Event] = {}
        last: dict[Lane, torch.cuda.Event] = {}
        for s in stages:
            if s.kind is Kind.D2H:
                continue
            stream = streams[s.lane]
            with torch.cuda.stream(stream):
                for d in self.waits[s.id]:
                    if d in step_ids:
                        assert d in ev, f"{s.name} waits on this step's write-back {self.graph.stages[d].name}"
                        stream.wait_event(ev[d])
                self.interp(s)
                e = torch.cuda.Event()
                e.record(stream)
            ev[s.id] = self.interp.early_end.pop(s.id, e)   # LOSSY sparse score: its first unit's select
            last[s.lane] = e
        for lane, e in last.items():
            if lane is not Lane.GPU:
                gpu.wait_event(e)
        return ev

    def _take_kv(self, k: int) -> dict[int, torch.Tensor]:
        """The new K/V of step k's layers that still await their write-back."""
        keys = [key for key in self.interp._kv if key[0] is Phase.DECODE and key[1] == k]
        return {key[2]: self.interp._kv.pop(key)[0] for key in keys}

    def _dev_for(self, key: int) -> DeviceStep:
        """The step buffers as a graph of `key` reads them (its copy length, or its sparse shapes)."""
        if self.lossy:
            w, cu_k = self.sp_width[key]
            return replace(self.dev, copy_len=0, bucket=self.buckets[key], sp_width=w, sp_cu_k=cu_k)
        return replace(self.dev, copy_len=key)

    def _refresh(self, k: int) -> None:
        """Step k's inputs into the static buffers (on the current stream)."""
        self.dev.pos.copy_(self.pos_all[k:k + 1])
        self.dev.lens.copy_(self.lens_all[k:k + 1])
        if self.lossy:
            self.dev.args.copy_(self.args_all[k])
            self.dev.sp_lens.copy_(self.sp_lens_all[k])

    def _first_sparse_step(self) -> None:
        """LOSSY sparse: step 0 issued once without a graph before any capture, so that every
        Triton kernel is compiled outside a capture, and the selection's error is measured on it
        (the probe, as the eager path measures its first step; it needs host syncs). Every write
        it makes the real step 0 makes again with the same values (its token, K/V, sketch and
        tail entries at the same device-held places); `run` puts its input token back after."""
        gpu = self.lanes.streams[Lane.GPU]
        with torch.cuda.stream(gpu):
            self.dev.ids.copy_(self.tokens[:, 0:1])
            self._refresh(0)
        self.interp.dev = self._dev_for(self.key(0))
        self.interp.probe_ref = None
        self._issue(self.steps[0])
        torch.cuda.synchronize(self.store.device)
        self._take_kv(0)
        self.interp._sel.clear()
        self.interp._sel_events.clear()
        if self.interp.probe_ref is not None:
            layer, q_off, sel = self.interp.probe_ref
            self.interp.probe_ref = None
            self.interp.sparse_probe(layer, q_off, sel[..., :self.rows[0][lossy_replay.N]], self.context)

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        gpu = self.lanes.streams[Lane.GPU]
        for k in range(len(self.steps)):
            key = self.key(k)
            if key in self.captured:
                continue
            self.interp.dev = self._dev_for(key)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool, stream=gpu):
                self._issue(self.steps[k])
            self.captured[key] = _Captured(g, k, self._take_kv(k))
        torch.cuda.synchronize(self.store.device)
        self.capture_s = time.perf_counter() - t0

    # ---- the decode ------------------------------------------------------------------------
    def run(self, base: torch.cuda.Event, before=None) -> list[Span]:
        """Every decode step, after the prefill already enqueued; spans in seconds from `base`.
        A replayed step has one measured span, on its `head` stage (the whole replay); its other
        compute and h2d stages get empty spans at the step's end; write-backs are timed."""
        streams = self.lanes.streams
        gpu, d2h = streams[Lane.GPU], streams[Lane.D2H]
        for lane in (Lane.H2D, Lane.D2H):
            gpu.wait_stream(streams[lane])   # the prefill's copies are home before any step
        if self.interp.fused is not None:    # compiled outside any capture (auto: unfused if it fails)
            with torch.cuda.stream(gpu):
                self.compile_s = self.interp.warm_fused(self.pos_all[:1])
            if self.interp.fused is not None:
                logging.getLogger("kvpipe").info(f"fused decode pieces compiled and warmed in {self.compile_s:.1f} s")
        if self.lossy:
            self._first_sparse_step()
        if self.capture:   # the decode attention's kernels compiled outside the captures
            m = self.graph.model
            decode_triton.warm(self.store.device, self.store.dtype, m.q_heads, m.kv_heads, m.head_dim)
            self._capture_all()
        dev = self.dev
        marks: dict[int, tuple] = {}
        host: dict[int, float] = {}
        moved = self.interp.moved
        with torch.cuda.stream(gpu):
            dev.ids.copy_(self.tokens[:, 0:1])
        decoding = self.interp.decoding
        for k, stages in enumerate(self.steps):
            if decoding is not None and decoding.halted(k, wait=True):   # past the end: not run
                e = _event(gpu)
                marks.update((s.id, (e, e)) for s in stages)
                continue
            t0 = time.perf_counter()
            key = self.key(k)
            gpu.wait_stream(d2h)             # last step's write-backs done: host prefix whole, K/V free
            with torch.cuda.stream(gpu):
                if before is not None:
                    for s in stages:
                        before(s)
                start = _event(gpu)
                self._refresh(k)
                if self.capture:
                    c = self.captured[key]
                    c.graph.replay()
                    kv = c.kv
                    for s, t in zip(stages, self.steps[c.template]):
                        moved[s.id] = moved[t.id]
                else:
                    self.interp.dev = self._dev_for(key)
                    self._issue(stages)
                    kv = self._take_kv(k)
                self.tokens[:, k + 1:k + 2].copy_(dev.ids)
                for layer in self.rings:   # the step's own K/V went to its ring row in the step
                    self.store.marks.wrote(layer, self.context + k + 1)
                if decoding is not None:
                    decoding.produced(self.tokens, k + 1)
                if self.step_logits is not None:
                    self.step_logits[k + 1].copy_(dev.logits)
                end = _event(gpu)
            d2h.wait_stream(gpu)
            with torch.cuda.stream(d2h):
                for s in stages:
                    if s.kind is Kind.D2H:
                        a = _event(d2h)
                        if not self.capture:
                            self.lanes.protect(kv[s.layer], Lane.D2H)
                        if self.lossy and self.store.q is not None:   # a filled block's record, if any
                            moved[s.id] = self.store.q.store_filled(s.layer, s.heads, s.tokens[0])
                        else:
                            moved[s.id] = self.store.store(s.layer, s.heads, kv[s.layer], s.tokens[0])
                        marks[s.id] = (a, _event(d2h))
            for s in stages:
                if s.kind is not Kind.D2H:
                    marks[s.id] = (start, end) if s.tag == "head" else (end, end)
            head = next(s.id for s in stages if s.tag == "head")
            host[head] = time.perf_counter() - t0   # refresh, replay (or issue) and write-backs
        self.interp.last_logits = dev.logits
        torch.cuda.synchronize(self.store.device)
        if self.lossy and self.store.q is not None:
            self.store.q.check_overflow()
        sec = lambda ev: base.elapsed_time(ev) / 1e3
        return [Span(i, sec(a), sec(b), host.get(i, 0.0)) for i, (a, b) in sorted(marks.items())]


def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev
