"""The stage graph's schedule in one pass over its stages in issue order, without an event queue.

The SimPy engine (`sim/engine.py`) and this pass compute the same schedule: a stage starts when
its lane has finished the stage before it, the host has issued it, its dependencies are done and
(replayed decode) the previous step is done; the host waits for a stage only when the launch
queue is full. Every one of those times belongs to a stage with a smaller id (dependencies,
the lane's previous stage, the stages the host waits on and the previous replayed step all come
earlier in issue order), so one sweep in id order fixes each start as the max of known times,
and each end as start + seconds: the same float operations SimPy's clock performs.

It does not model what depends on the order of simultaneous events: a copy link shared by both
directions (`pcie_duplex = false`) or pool changes on more than one lane. `exact_for` says when
it applies; `sim/engine.py` runs SimPy otherwise. `tests/test_simulate.py` holds the two equal."""
from __future__ import annotations

from collections import deque

from kvpipe.pipeline.cost import (host_issue_seconds, host_waits_for, pipelined_end, pipelined_ready, stage_seconds,
                                  unit_pipelined)
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.stage import Graph, Kind, Phase, Pool
from kvpipe.pipeline.trace import Span, Trace


def exact_for(graph: Graph, hw: HardwareProfile) -> bool:
    """Whether the pass reproduces the event simulation: copies in both directions overlap, and
    every stage that takes or frees pool memory runs on one lane (so pool changes are ordered)."""
    lanes = {s.lane for s in graph.stages if s.takes or s.frees}
    return hw.pcie_duplex and len(lanes) <= 1


def schedule(graph: Graph, hw: HardwareProfile, replay: bool = False):
    """(trace, bytes in use per pool at the end, peak bytes per pool) of `graph` on `hw`, decode
    steps replayed if `replay`."""
    stages = graph.stages
    dtype = graph.model.dtype
    n = len(stages)
    in_graph = [replay and s.phase is Phase.DECODE and s.kind is not Kind.D2H for s in stages]
    issue = [0.0] * n
    end = [0.0] * n
    start = [0.0] * n
    lane_free: dict = {}
    step_end: dict[int, float] = {}      # replayed decode step -> when its last stage ends
    prev_step = _previous_steps(stages, replay)
    queue_ops = hw.launch_queue_ops
    sec = [0.0] * n                      # each stage's seconds, once (its dependencies come before it)
    pieces = [0] * n                     # each stage's cost.unit_pipelined (0: its consumers wait for its end)
    ahead: deque[tuple[int, int]] = deque()
    queued, host = 0, 0.0
    replayed_from = None                 # id of the first replayed stage, once the host got there
    for s in stages:   # one body per stage, inline: the simulator's hottest loop
        i = s.id
        if not (replay and s.phase is Phase.DECODE):   # issued eagerly, in graph order
            while ahead and queued + s.ops > queue_ops:   # the launch queue is full
                j, k = ahead.popleft()
                if end[j] > host:
                    host = end[j]
                queued -= k
            host += host_issue_seconds(s, hw)
            issue[i] = host
            ahead.append((i, s.ops))
            queued += s.ops
        elif replayed_from is None:      # the host syncs with the prefill, captures, then replays
            replayed_from = i
            host = _replay_issue(stages, i, in_graph, end, host, hw, issue)
        t = issue[i]
        lane = s.lane
        free = lane_free.get(lane, 0.0)
        if free > t:
            t = free
        gate = prev_step.get(s.step) if s.phase is Phase.DECODE else None
        if gate is not None and step_end[gate] > t:
            t = step_end[gate]
        piped_dep = False
        for d in s.deps:
            ready = end[d]
            if pieces[d]:   # LOSSY: a unit-pipelined score's consumers start after its first piece
                ready, piped_dep = pipelined_ready(stages[d], start[d], end[d], sec[d], in_graph[d]), True
            if ready > t:
                t = ready
        start[i] = t
        sec[i] = stage_seconds(s, hw, dtype, in_graph[i])
        pieces[i] = unit_pipelined(s, in_graph[i])
        e = t + sec[i]
        if piped_dep:   # LOSSY: after a unit-pipelined score, its last piece's gathers (the engine's ops)
            for d in s.deps:
                e = max(e, pipelined_end(s, stages[d], end[d], sec[i], in_graph[d]))   # 0 for other deps
        end[i] = e
        lane_free[lane] = e
        if not in_graph[i] and host_waits_for(s, hw) and e > host:   # the host reads the encode's sizes back
            host = e
        if replay and s.phase is Phase.DECODE and e > step_end.get(s.step, -1.0):
            step_end[s.step] = e
    used, peak = _pools(graph)
    return Trace(graph, "sim", [Span(i, start[i], end[i]) for i in range(n)]), used, peak


def _previous_steps(stages, replay: bool) -> dict[int, int]:
    """Replayed decode step -> the step before it (empty without `replay`)."""
    if not replay:
        return {}
    order = sorted({s.step for s in stages if s.phase is Phase.DECODE})
    return dict(zip(order[1:], order))


def _replay_issue(stages, first: int, in_graph, end, host: float, hw, issue) -> float:
    """Issue times of the replayed decode stages (ids from `first` on), as `executor/replay/capture.py`
    runs them: sync with every eagerly issued stage, capture one step, then per step one replay
    and the write-backs issued eagerly after it. Returns the host's clock after the last."""
    for j in range(first):
        if end[j] > host:
            host = end[j]
    steps: dict[int, list] = {}
    for s in stages[first:]:
        steps.setdefault(s.step, []).append(s)
    order = sorted(steps)
    host += sum(host_issue_seconds(s, hw) for s in steps[order[0]] if in_graph[s.id])
    for k in order:
        host += hw.graph_replay_s
        for s in steps[k]:
            if in_graph[s.id]:
                issue[s.id] = host
        for s in steps[k]:
            if not in_graph[s.id]:
                host += host_issue_seconds(s, hw)
                issue[s.id] = host
    return host


def _pools(graph: Graph) -> tuple[dict, dict]:
    """(bytes in use at the end, peak bytes) per pool: the static buffers plus the stages' takes
    and frees, in the order their (single) lane runs them."""
    used = {p: graph.static_bytes(p) for p in Pool}
    peak = dict(used)
    for s in graph.stages:
        for pool, b in s.takes:
            used[pool] += b
            if used[pool] > peak[pool]:
                peak[pool] = used[pool]
        for pool, b in s.frees:
            used[pool] -= b
    return used, peak
