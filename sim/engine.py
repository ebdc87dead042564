"""Runs a stage graph in SimPy: one process per lane consuming its stages in issue order, each
waiting on its dependencies' events and on the host having issued it, then for the stage's cost.
Memory pools track the peak.

The host is a resource too: one process issues the stages in graph order, each costing
`host_issue_seconds`; it waits for the GPU only when `launch_queue_ops` launches are in flight
(CUDA's launch queue is full), so where the GPU's share of a stage is smaller
than its issue cost the host binds. With `replay` the decode steps are CUDA-graph replays (as
executor/replay/capture.py runs them): the host synchronises after the prefill, captures (one eager
issue of a step), then per step pays `graph_replay_s` and issues the step's write-backs eagerly;
on the device each replayed kernel costs `graph_node_s` instead of a launch, and a step starts
only when the previous one (its write-backs included) is done.

`run` takes the one-pass schedule of `sim/onepass.py` instead of the event loop wherever the two
agree (copies overlap in both directions, pool changes on one lane): the same times, faster."""
from __future__ import annotations

from collections import deque

import simpy

from kvpipe.pipeline.cost import (host_issue_seconds, host_waits_for, pipelined_end, stage_seconds,
                                  unit_pipelined)
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.stage import Graph, Kind, Lane, Phase, Pool
from kvpipe.pipeline.trace import Span, Trace

from .codec_sync import decompress_waits
from .onepass import exact_for, schedule


class Pools:
    """Bytes in use per pool, starting with the graph's static buffers; peaks are kept."""

    def __init__(self, graph: Graph) -> None:
        self.used = {p: graph.static_bytes(p) for p in Pool}
        self.peak = dict(self.used)

    def take(self, items) -> None:
        for pool, n in items:
            self.used[pool] += n
            if self.used[pool] > self.peak[pool]:
                self.peak[pool] = self.used[pool]

    def free(self, items) -> None:
        for pool, n in items:
            self.used[pool] -= n


def run(graph: Graph, hw: HardwareProfile, replay: bool = False) -> tuple[Trace, Pools]:
    """Simulate `graph` on `hw` (decode steps replayed as CUDA graphs if `replay`); returns the
    trace and the pools (with peaks). Where its result is the same (`onepass.exact_for`), the
    one-pass schedule computes it several times faster than the event simulation."""
    synced = decompress_waits(graph, hw)
    if exact_for(graph, hw) and not synced:   # its waits point forward: events only
        trace, used, peak = schedule(graph, hw, replay)
        pools = Pools(graph)
        pools.used, pools.peak = used, peak
        return trace, pools
    return run_events(graph, hw, replay, synced)


def run_events(graph: Graph, hw: HardwareProfile, replay: bool = False,
               synced: dict[int, int] | None = None) -> tuple[Trace, Pools]:
    """`run` as a SimPy event simulation: one process per lane and one for the host. `synced`:
    `codec_sync.decompress_waits(graph, hw)` where the caller has it already."""
    if synced is None:   # a GPU codec's decode waits for the fetches issued before it
        synced = decompress_waits(graph, hw)
    sim = _Events(graph, hw, replay, synced)
    env = sim.env
    # Without duplex, the two copy directions queue on one link.
    link = None if hw.pcie_duplex else simpy.Resource(env, capacity=1)
    env.process(sim.host())
    for lane, order in graph.lane_order().items():
        if order:
            env.process(sim.lane(order, link if lane in (Lane.H2D, Lane.D2H) else None))
    env.run()
    assert all(sp is not None for sp in sim.spans), "simulation ended with stages that never ran"
    return Trace(graph, "sim", sim.spans), sim.pools


def _replay_steps(stages, replay: bool) -> tuple[dict[int, list[int]], list[int], dict[int, int]]:
    """(replayed decode step -> its stage ids, the steps in order, stage id -> the step it must
    wait for); all empty without `replay`."""
    steps: dict[int, list[int]] = {}
    if replay:
        for s in stages:
            if s.phase is Phase.DECODE:
                steps.setdefault(s.step, []).append(s.id)
    step_order = sorted(steps)
    gate = {}
    for prev, k in zip(step_order, step_order[1:]):
        for i in steps[k]:
            gate[i] = prev
    return steps, step_order, gate


class _Events:
    """One event simulation's state: per-stage events, seconds and spans, and the processes of
    the host and of each lane. The processes bind what they use to locals first: hot loops."""

    def __init__(self, graph: Graph, hw: HardwareProfile, replay: bool, synced: dict[int, int]) -> None:
        env = self.env = simpy.Environment()
        stages = self.stages = graph.stages
        self.hw, self.replay, self.synced = hw, replay, synced
        self.done = [env.event() for _ in stages]
        self.issued = [env.event() for _ in stages]
        self.spans: list[Span | None] = [None] * len(stages)
        self.pools = Pools(graph)
        dtype = graph.model.dtype
        in_graph = self.in_graph = [replay and s.phase is Phase.DECODE and s.kind is not Kind.D2H
                                    for s in stages]
        self.seconds = [stage_seconds(s, hw, dtype, in_graph[s.id]) for s in stages]
        self.pieces = [unit_pipelined(s, in_graph[s.id]) for s in stages]
        # LOSSY: a unit-pipelined score stage -> its first piece selected
        self.ready = {s.id: env.event() for s in stages if self.pieces[s.id]}
        self.steps, self.step_order, self.gate = _replay_steps(stages, replay)
        self.left = {k: len(ids) for k, ids in self.steps.items()}
        self.step_done = {k: env.event() for k in self.steps}

    def first_piece(self, i: int):
        yield self.env.timeout(self.seconds[i] / self.pieces[i])
        self.ready[i].succeed()

    def host(self):
        """Issues the eager stages in graph order, waiting only on a full launch queue, then the
        replayed steps."""
        stages, hw, issued, done = self.stages, self.hw, self.issued, self.done
        timeout = self.env.timeout
        eager = [s for s in stages if not (self.replay and s.phase is Phase.DECODE)]
        ahead: deque[tuple[int, int]] = deque()   # issued stages not yet known done, with their ops
        queued = 0
        for s in eager:
            if issued[s.id].triggered:   # issued early, before a host sync (below)
                continue
            while ahead and queued + s.ops > hw.launch_queue_ops:   # the launch queue is full
                i, n = ahead.popleft()
                if not done[i].processed:
                    yield done[i]
                queued -= n
            yield timeout(host_issue_seconds(s, hw))
            issued[s.id].succeed()
            ahead.append((s.id, s.ops))
            queued += s.ops
            if host_waits_for(s, hw) and not done[s.id].processed:   # a GPU codec's encode reads sizes back
                yield from self.fetches_before_sync(s)
                yield done[s.id]
        if self.steps:
            yield from self.host_replay(eager)

    def fetches_before_sync(self, s):
        """The executor's h2d lane had issued the fetches a decode before `s` waits for
        (sim/codec_sync.py) before the host blocked on `s`: issue them first."""
        stages, hw, issued = self.stages, self.hw, self.issued
        last = max((f for d, f in self.synced.items() if d < s.id), default=-1)
        for x in stages[s.id + 1:last + 1]:
            if x.lane is Lane.H2D and not issued[x.id].triggered:
                yield self.env.timeout(host_issue_seconds(x, hw))
                issued[x.id].succeed()

    def host_replay(self, eager):
        """Synchronise with the prefill, capture one step, then per step one replay and the
        write-backs issued eagerly after it."""
        stages, hw, issued, done, in_graph = self.stages, self.hw, self.issued, self.done, self.in_graph
        steps, step_order, timeout = self.steps, self.step_order, self.env.timeout
        for s in eager:
            if not done[s.id].processed:
                yield done[s.id]
        yield timeout(sum(host_issue_seconds(stages[i], hw) for i in steps[step_order[0]] if in_graph[i]))
        for k in step_order:
            yield timeout(hw.graph_replay_s)
            for i in steps[k]:
                if in_graph[i]:
                    issued[i].succeed()
            for i in steps[k]:
                if not in_graph[i]:      # write-backs, issued eagerly after the replay
                    yield timeout(host_issue_seconds(stages[i], hw))
                    issued[i].succeed()

    def lane(self, order, shared):
        """Runs `order` (one lane's stages) in turn, each once issued and its waits are done;
        `shared`: the copy link both directions queue on, or None."""
        env, stages, issued, done, ready = self.env, self.stages, self.issued, self.done, self.ready
        seconds, spans, pools, synced = self.seconds, self.spans, self.pools, self.synced
        gate, step_done, steps, left = self.gate, self.step_done, self.steps, self.left
        timeout, first_piece = env.timeout, self.first_piece
        for s in order:
            if not issued[s.id].processed:
                yield issued[s.id]
            if s.id in gate and not step_done[gate[s.id]].processed:
                yield step_done[gate[s.id]]
            for d in s.deps + ((synced[s.id],) if s.id in synced else ()):
                ev = ready.get(d, done[d])
                if not ev.processed:
                    yield ev
            req = None
            if shared is not None:
                req = shared.request()
                yield req
            start = env.now
            if s.takes:
                pools.take(s.takes)
            if s.id in ready:
                env.process(first_piece(s.id))
            yield timeout(seconds[s.id])
            for d in s.deps:                 # a unit-pipelined score: its last piece's gathers after it
                if d in ready:
                    if not done[d].processed:
                        yield done[d]
                    floor = pipelined_end(s, stages[d], spans[d].end_s, seconds[s.id], True)
                    if floor > env.now:
                        yield timeout(floor - env.now)
            if s.frees:
                pools.free(s.frees)
            if req is not None:
                shared.release(req)
            spans[s.id] = Span(s.id, start, env.now)
            done[s.id].succeed()
            if s.id in steps.get(s.step, ()) and s.phase is Phase.DECODE:
                left[s.step] -= 1
                if left[s.step] == 0:
                    step_done[s.step].succeed()
