"""Predicts a workload: builds the graph, runs it in SimPy and turns the trace into a Report.

Shortcut: decode steps are nearly identical and their cost is affine in the step index (the
context grows by one token a step), so for long decodes the prefill and the first `window` steps
are simulated in full, a second `window` at the end of the decode is simulated from a cache
already home, and the steps between are summed from the line through the two windows' steady
steps, none of them shorter than the host's issue time for a step. `tests/test_simulate.py` holds
it within 1% of the full simulation."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvpipe.pipeline.builder import build
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import MemoryBreakdown, breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.report import Report, Timing, decode_head_ends, timing_from_trace
from kvpipe.pipeline.cost import host_issue_seconds
from kvpipe.pipeline.stage import Kind, Phase, Pool
from kvpipe.pipeline.trace import Trace
from kvpipe.pipeline.workload import Workload

from .engine import run

DECODE_WINDOW = 8


def replays_decode(model: ModelSpec, work: Workload) -> bool:
    """Whether `kvpipe run --replay auto` replays this workload's decode steps on a CUDA GPU
    (mirrors executor.replay.replay_supported: bf16/fp16 FA2 varlen, batch 1)."""
    return model.dtype in ("bf16", "fp16") and work.batch == 1 and model.head_dim % 8 == 0 \
        and model.head_dim <= 256 and work.decode_tokens > 0


def host_step_s(graph, hw: HardwareProfile, replay: bool) -> float:
    """Host seconds to issue one decode step of `graph` (its first): every stage eagerly, or one
    replay plus the eager write-backs."""
    first = min(s.step for s in graph.stages if s.phase is Phase.DECODE)
    step = [s for s in graph.stages if s.phase is Phase.DECODE and s.step == first]
    if replay:
        return hw.graph_replay_s + sum(host_issue_seconds(s, hw) for s in step if s.kind is Kind.D2H)
    return sum(host_issue_seconds(s, hw) for s in step)


@dataclass(frozen=True)
class Prediction:
    report: Report
    trace: Trace
    memory: MemoryBreakdown


def simulate(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, *,
             full: bool = False, window: int = DECODE_WINDOW, replay: bool = False) -> Prediction:
    """Predict `work` under `plan` on `hw`; `replay`: decode steps as CUDA-graph replays (as
    `kvpipe run --replay` executes them), else issued stage by stage."""
    mem = breakdown(model, work, plan)
    M = work.decode_tokens
    if full or M <= 2 * window:
        trace, pools = run(build(model, work, plan), hw, replay)
        timing, busy, note = timing_from_trace(trace), trace.lane_busy_s(), ""
    else:
        trace, pools = run(build(model, work, plan, decode=range(window)), hw, replay)
        # The end window runs after `lead` steps of lead-in, so that the host has fallen into its
        # steady distance ahead of the GPU (the launch queue fills over a few steps).
        lead = min(window, M - 2 * window)
        late, _ = run(build(model, work, plan, prefill=False, decode=range(M - window - lead, M)), hw, replay)
        head = timing_from_trace(trace)
        e1, e2 = decode_head_ends(trace), decode_head_ends(late)[lead:]
        d1 = [b - a for a, b in zip(e1, e1[1:])]          # steps 1 .. window-1
        d2 = [b - a for a, b in zip(e2, e2[1:])]          # steps M-window+1 .. M-1
        half = window // 2
        de, ke = statistics.fmean(d1[half - 1:]), statistics.fmean(range(half, window))
        dl, kl = statistics.fmean(d2[half - 1:]), statistics.fmean(range(M - window + half, M))
        slope = (dl - de) / (kl - ke)
        n = M - window
        # A step never takes less than the host needs to issue it: the early window may still
        # run on work the host queued during the prefill, the line through it would not see that.
        host = host_step_s(late.graph, hw, replay)
        between = sum(max(de + slope * (k - ke), host) for k in range(window, M))
        tail = trace.end_s - e1[-1]
        total = e1[-1] + between + tail
        per_token = (sum(d1) + between) / (M - 1)
        timing = Timing(head.prefill_s, head.ttft_s, per_token, total)
        busy = trace.lane_busy_s()
        b1 = busy["decode"]
        b2 = {lane: v * window / (window + lead) for lane, v in late.lane_busy_s()["decode"].items()}
        busy["decode"] = {lane: b1[lane] + n * (b1[lane] + b2[lane]) / (2 * window) for lane in b1}
        note = (f"prefill and decode steps 0..{window - 1} simulated in full; steps {window}..{M - 1} "
                f"extrapolated from a window of {window} steps at the end")
    peak = {p.value: pools.peak[p] for p in Pool}
    notes = (note,) if note else ()
    trace.note = note
    report = Report(timing, busy, peak, mem.gpu_breakdown(), notes)
    return Prediction(report, trace, mem)
