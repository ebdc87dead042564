"""Predicts a workload: builds the graph, runs it in SimPy and turns the trace into a Report.

Two steady-state shortcuts keep long workloads cheap; `full=True` (`--full-sim`) turns both off.

Prefill: chunk k's cost is nearly affine in k (its attention and fetches grow with the prefix),
piecewise where the critical lane changes. When the prompt has more than `PREFILL_MIN_CHUNKS`
chunks, the first `PREFILL_WINDOW` chunks are simulated from the start, the last
`PREFILL_WINDOW + 1` chunks (with the first decode window) from a cache already home, and windows
in between are sampled coarse-to-fine: an interval is split while its middle window's steady chunk
time differs from the line through its ends by more than `PREFILL_TOL`. The chunks between windows
are summed from that piecewise-linear chunk time, and the last window is placed after them.

Decode: steps are nearly identical and their cost is affine in the step index (the context grows
by one token a step), so the first `window` steps are simulated after the prefill, a second
`window` at the end of the decode from a cache already home, and the steps between are summed from
the line through the two windows' steady steps, none of them shorter than the host's issue time
for a step. `tests/test_simulate.py` holds both shortcuts against the full simulation."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvpipe.pipeline.builder import build
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.memory import MemoryBreakdown, breakdown, chunk_sizes
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.report import Report, Timing, decode_head_ends, timing_from_trace
from kvpipe.pipeline.cost import host_issue_seconds
from kvpipe.pipeline.stage import LANE_OF_KIND, Kind, Lane, Phase, Pool
from kvpipe.pipeline.trace import Span, Trace
from kvpipe.pipeline.workload import Workload

from .engine import run

DECODE_WINDOW = 4
PREFILL_WINDOW = 3        # chunks per sampled prefill window; chunks 2.. of a window are steady
PREFILL_MIN_CHUNKS = 24   # fewer chunks than this: the prefill is simulated in full
PREFILL_TOL = 0.01        # relative gap between a sampled chunk time and the line that splits an interval
PREFILL_MAX_SAMPLES = 8   # interior windows at most
RAMP = 2                  # chunks a window needs to reach its steady state


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
    fused: bool = False                # decode steps modelled with the fused pieces (pipeline/fusion.py)
    compile_s: float | None = 0.0      # their one-time compile (profile's compile_s; None: unknown), not in total_s


_LANE_OF = {kind: lane.value for kind, lane in LANE_OF_KIND.items()}


def _scan(tr: Trace) -> tuple[dict, dict, dict]:
    """One pass over `tr`'s spans: (end of each prefill step's last compute stage by step index,
    busy seconds per lane of each prefill step, busy seconds per phase and lane as
    `Trace.lane_busy_s` sums them). Step busy is a function of the stages only, not of timing."""
    st, ends, steps = tr.graph.stages, {}, {}
    phases = {ph.value: {lane.value: 0.0 for lane in Lane} for ph in Phase}
    pre, dec, compute = phases[Phase.PREFILL.value], phases[Phase.DECODE.value], Kind.COMPUTE
    for sp in tr.spans:
        s = st[sp.stage]
        d, lane = sp.end_s - sp.start_s, _LANE_OF[s.kind]
        if s.phase is Phase.PREFILL:
            pre[lane] += d
            lanes = steps.setdefault(s.step, {})
            lanes[lane] = lanes.get(lane, 0.0) + sp.end_s - sp.start_s   # summed as before, bit for bit
            if s.kind is compute and sp.end_s > ends.get(s.step, 0.0):
                ends[s.step] = sp.end_s
        else:
            dec[lane] += d
    return ends, steps, phases


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, held constant beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class _PrefillShortcut:
    """Samples prefill windows and answers the chunk time and per-lane busy of any chunk."""

    def __init__(self, model, work, plan, hw, replay: bool, fuse: bool = False, memo: dict | None = None) -> None:
        self.args = (model, work, plan)
        self.hw, self.replay, self.fuse, self.memo = hw, replay, fuse, memo
        self.chunks = len(chunk_sizes(work.context, plan.prefill.chunk))
        self.dur: dict[float, float] = {}                 # centre index -> steady chunk time
        self.busy: dict[float, dict[str, float]] = {}     # centre index -> lane busy of one chunk
        self.peaks: list = []
        self.windows = 0

    def window(self, k: int, n: int, decode: range = range(0)) -> Trace:
        """Simulate chunks [k, k+n) (and `decode` steps) from a cache home up to chunk k. A window
        without decode steps does not depend on how decode is issued: kept in `memo` (if given)
        under the plan less its replay choice, for the plan's twin of the other choice."""
        model, work, plan = self.args
        key = (plan.with_(replay=Replay.AUTO, source=""), k, n) if self.memo is not None and not decode else None
        if key is not None and key in self.memo:
            tr, peak = self.memo[key]
        else:
            tr, pools = run(build(model, work, plan, prefill=range(k, k + n), decode=decode, fused=self.fuse),
                            self.hw, self.replay)
            peak = pools.peak
            if key is not None:
                self.memo[key] = (tr, peak)
        self.peaks.append(peak)
        self.windows += 1
        return tr

    def record(self, scan: tuple, steady: list[int]) -> float:
        """Note the steady chunk time and busy of `steady` chunks of a window (its `_scan`);
        returns their centre."""
        ends, per_step, _ = scan
        centre = statistics.fmean(steady)
        self.dur[centre] = statistics.fmean(ends[i] - ends[i - 1] for i in steady)
        busy = [per_step.get(i, {}) for i in steady]
        self.busy[centre] = {lane: statistics.fmean(b.get(lane, 0.0) for b in busy) for lane in busy[0]}
        return centre

    def refine(self, lo: float, hi: float) -> None:
        """Split [lo, hi] while the middle window's chunk time leaves the line through the ends."""
        if len(self.dur) - 2 >= PREFILL_MAX_SAMPLES or hi - lo < 2 * PREFILL_WINDOW:
            return
        k = int((lo + hi) / 2 - (RAMP + PREFILL_WINDOW - 1) / 2)
        mid = self.record(_scan(self.window(k, PREFILL_WINDOW)), list(range(k + RAMP, k + PREFILL_WINDOW)))
        line = self.dur[lo] + (self.dur[hi] - self.dur[lo]) * (mid - lo) / (hi - lo)
        if abs(self.dur[mid] - line) > PREFILL_TOL * max(self.dur[mid], 1e-12):
            self.refine(lo, mid)
            self.refine(mid, hi)

    def sum_between(self, first: int, last: int, table: dict[float, float]) -> float:
        """Sum over chunks first..last (inclusive) of the piecewise-linear interpolant of `table`."""
        points = sorted(table.items())
        return sum(_interp(points, i) for i in range(first, last + 1))


def _shifted(tr: Trace, shift: float, note: str) -> Trace:
    return Trace(tr.graph, tr.source, [Span(s.stage, s.start_s + shift, s.end_s + shift, s.host_s)
                                       for s in tr.spans], note)


@dataclass(frozen=True)
class _Prefill:
    """The run simulated up to the first decode window, and what the report needs of its prefill."""
    trace: Trace                     # the whole run, or its last window placed at `shift`
    peaks: tuple                     # peak bytes per pool of each simulated piece
    shift: float                     # seconds the trace was moved by (0.0: a whole trace)
    busy: dict                       # prefill busy seconds per lane
    prefill_s: float
    ttft_s: float
    note: str = ""                   # how the prefill was shortened ("": simulated in full)


def _prefill_whole(model, work, plan, hw, decode: range, replay: bool, fuse: bool) -> _Prefill:
    """The prefill and `decode` steps simulated in one piece."""
    trace, pools = run(build(model, work, plan, decode=decode, fused=fuse), hw, replay)
    head = timing_from_trace(trace)
    return _Prefill(trace, (pools.peak,), 0.0, trace.lane_busy_s()["prefill"], head.prefill_s, head.ttft_s)


def _prefill_sampled(model, work, plan, hw, decode: range, replay: bool, fuse: bool,
                     memo: dict | None) -> _Prefill:
    """The prefill's shortcut: the first and last windows (the last with `decode`) simulated,
    windows between sampled and the other chunks summed from their steady chunk time."""
    W = PREFILL_WINDOW
    C = len(chunk_sizes(work.context, plan.prefill.chunk))
    ps = _PrefillShortcut(model, work, plan, hw, replay, fuse, memo)
    a = ps.window(0, W)
    z0 = C - W - 1                                   # the last window: chunks z0 .. C-1
    z = ps.window(z0, W + 1, decode)
    sa, sz = _scan(a), _scan(z)
    lo = ps.record(sa, list(range(RAMP, W)))
    hi = ps.record(sz, list(range(z0 + RAMP, C - 1)))  # the last chunk also runs the head
    ps.refine(lo, hi)
    # Real end of chunk `anchor` (z's first steady chunk): a's last end plus the chunks between.
    anchor = z0 + RAMP
    e_a = sa[0][W - 1]
    shift = e_a + ps.sum_between(W, anchor, ps.dur) - sz[0][anchor]
    trace = _shifted(z, shift, "")
    zb, ab, zs = sz[2]["prefill"], sa[2]["prefill"], sz[1]
    own = {lane: sum(zs.get(i, {}).get(lane, 0.0) for i in range(z0, C)) for lane in zb}
    prefill_busy = {lane: ab[lane] + own[lane]
                    + ps.sum_between(W, z0 - 1, {c: b.get(lane, 0.0) for c, b in ps.busy.items()})
                    for lane in zb}
    st = z.graph.stages
    prefill_s = max(sp.end_s for sp in trace.spans if st[sp.stage].phase is Phase.PREFILL)
    ttft_s = max(sp.end_s for sp in trace.spans
                 if st[sp.stage].phase is Phase.PREFILL and st[sp.stage].tag == "head")
    note = (f"prefill chunks 0..{W - 1} and {z0}..{C - 1} simulated, {ps.windows - 2} windows of "
            f"{W} chunks sampled between, the other chunks summed from their steady chunk time")
    return _Prefill(trace, tuple(ps.peaks), shift, prefill_busy, prefill_s, ttft_s, note)


def _decode_whole(pre: _Prefill) -> tuple[Timing, dict]:
    """(timing, decode busy per lane) where every decode step is in `pre`'s trace."""
    trace = pre.trace
    heads = decode_head_ends(trace)
    steps = [b - a for a, b in zip([pre.ttft_s] + heads, heads)]
    per_token = statistics.fmean(steps[1:]) if len(steps) > 1 else (steps[0] if steps else None)
    return Timing(pre.prefill_s, pre.ttft_s, per_token, trace.end_s), trace.lane_busy_s()["decode"]


def _decode_extrapolated(model, work, plan, hw, pre: _Prefill, window: int, replay: bool,
                         fuse: bool) -> tuple[Timing, dict, dict, str]:
    """(timing, decode busy per lane, the end window's peak per pool, note): the decode's shortcut,
    a window at the end simulated and the steps between summed from the line through both."""
    M, trace = work.decode_tokens, pre.trace
    # The end window runs after `lead` steps of lead-in, so that the host has fallen into its
    # steady distance ahead of the GPU (the launch queue fills over a few steps).
    lead = min(window, M - 2 * window)
    late, late_pools = run(build(model, work, plan, prefill=False, decode=range(M - window - lead, M), fused=fuse),
                           hw, replay)
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
    timing = Timing(pre.prefill_s, pre.ttft_s, per_token, total)
    b1 = trace.lane_busy_s()["decode"]
    b2 = {lane: v * window / (window + lead) for lane, v in late.lane_busy_s()["decode"].items()}
    busy = {lane: b1[lane] + n * (b1[lane] + b2[lane]) / (2 * window) for lane in b1}
    note = (f"decode steps 0..{window - 1} simulated after the prefill; steps {window}..{M - 1} "
            f"extrapolated from a window of {window} steps at the end")
    return timing, busy, late_pools.peak, note


def simulate(model: ModelSpec, work: Workload, plan: Plan, hw: HardwareProfile, *,
             full: bool = False, window: int = DECODE_WINDOW, replay: bool = False,
             fuse: bool = False, memo: dict | None = None) -> Prediction:
    """Predict `work` under `plan` on `hw`; `replay`: decode steps as CUDA-graph replays (as
    `kvpipe run --replay` executes them), else issued stage by stage; `fuse` (replayed only): with
    the fused decode pieces (`kvpipe run --fuse`), whose one-time compile is `compile_s`. `memo`:
    a dict kept across calls for one model, workload and profile, where the prefill shortcut's
    windows without decode steps are kept (the planner simulates a plan replayed and eager)."""
    fuse = fuse and replay
    mem = breakdown(model, work, plan)
    M = work.decode_tokens
    whole_decode = full or M <= 2 * window
    first_decode = range(M) if whole_decode else range(window)
    if full or len(chunk_sizes(work.context, plan.prefill.chunk)) < PREFILL_MIN_CHUNKS:
        pre = _prefill_whole(model, work, plan, hw, first_decode, replay, fuse)
    else:
        pre = _prefill_sampled(model, work, plan, hw, first_decode, replay, fuse, memo)
    notes, peaks = [pre.note] if pre.note else [], list(pre.peaks)
    if whole_decode:
        timing, decode_busy = _decode_whole(pre)
    else:
        timing, decode_busy, late_peak, note = _decode_extrapolated(model, work, plan, hw, pre, window,
                                                                    replay, fuse)
        peaks.append(late_peak)
        notes.append(note)
    peak = {p.value: max(pk[p] for pk in peaks) for p in Pool}
    trace = pre.trace
    trace.note = "; ".join(notes)
    if pre.shift:
        trace.note += (f"; this trace holds the last {PREFILL_WINDOW + 1} prefill chunks on, placed at "
                       f"{pre.shift:.3f} s (--full-sim for a whole trace)")
    busy = {"prefill": pre.busy, "decode": decode_busy}
    report = Report(timing, busy, peak, mem.gpu_breakdown(), tuple(notes))
    return Prediction(report, trace, mem, fuse, hw.compile_s if fuse else 0.0)
