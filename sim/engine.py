"""Runs a stage graph in SimPy: one process per lane consuming its stages in issue order, each
waiting on its dependencies' events, then for the stage's cost. Memory pools track the peak."""
from __future__ import annotations

import simpy

from kvpipe.pipeline.cost import stage_seconds
from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.stage import Graph, Lane, Pool
from kvpipe.pipeline.trace import Span, Trace


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


def run(graph: Graph, hw: HardwareProfile) -> tuple[Trace, Pools]:
    """Simulate `graph` on `hw`; returns the trace and the pools (with peaks)."""
    env = simpy.Environment()
    dtype = graph.model.dtype
    stages = graph.stages
    done = [env.event() for _ in stages]
    spans: list[Span | None] = [None] * len(stages)
    pools = Pools(graph)
    # Without duplex, the two copy directions queue on one link.
    link = None if hw.pcie_duplex else simpy.Resource(env, capacity=1)

    seconds = [stage_seconds(s, hw, dtype) for s in stages]
    timeout = env.timeout

    def lane_proc(order, shared):
        for s in order:
            for d in s.deps:
                ev = done[d]
                if not ev.processed:
                    yield ev
            req = None
            if shared is not None:
                req = shared.request()
                yield req
            start = env.now
            if s.takes:
                pools.take(s.takes)
            yield timeout(seconds[s.id])
            if s.frees:
                pools.free(s.frees)
            if req is not None:
                shared.release(req)
            spans[s.id] = Span(s.id, start, env.now)
            done[s.id].succeed()

    for lane, order in graph.lane_order().items():
        if order:
            env.process(lane_proc(order, link if lane in (Lane.H2D, Lane.D2H) else None))
    env.run()
    assert all(sp is not None for sp in spans), "simulation ended with stages that never ran"
    return Trace(graph, "sim", spans), pools
