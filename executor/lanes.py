"""Lane actors: one asyncio task per lane issues that lane's stages in issue order. A stage first
awaits (on the host) that each dependency has been ENQUEUED, then on CUDA makes its lane's stream
wait for the dependency's end event and enqueues its own work between a start and an end event;
the host never blocks on the GPU until the run is over. Actors take turns stage by stage, so a
copy lane issues a prefetch as soon as its slot's last reader is enqueued, not only when compute
waits for it. On CPU the same actors run the work synchronously, timed by the host clock.
Either way the result is one Span per stage."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import torch

from kvpipe.pipeline.stage import Graph, Lane, Stage
from kvpipe.pipeline.trace import Span

STREAM_LANES = (Lane.GPU, Lane.H2D, Lane.D2H)


def cross_lane_waits(graph: Graph) -> list[tuple[int, ...]]:
    """Per stage, the dependencies it must wait for on other lanes: the latest one per lane
    suffices, since a lane runs in issue order (same-lane deps are implied by the order)."""
    stages, waits = graph.stages, []
    for s in stages:
        latest: dict[Lane, int] = {}
        for d in s.deps:
            assert d < s.id, f"stage {s.id} depends on a later stage {d}"
            lane = stages[d].lane
            if lane is not s.lane and d > latest.get(lane, -1):
                latest[lane] = d
        waits.append(tuple(sorted(latest.values())))
    return waits


class Lanes:
    """The lanes of one device: a CUDA stream each (made in `open()`), or the host on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streams: dict[Lane, torch.cuda.Stream] = {}

    def open(self) -> "Lanes":
        if self.cuda:
            self.streams = {lane: torch.cuda.Stream(self.device) for lane in STREAM_LANES}
        return self

    def close(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.streams = {}

    def __enter__(self) -> "Lanes":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def protect(self, tensor: torch.Tensor, lane: Lane) -> None:
        """`tensor` (allocated on another lane's stream) is used on `lane`: keep its memory from
        being reused before that lane's work is done."""
        if self.cuda:
            tensor.record_stream(self.streams[lane])

    def run(self, graph: Graph, issue: Callable[[Stage], None],
            before: Callable[[Stage], None] | None = None) -> list[Span]:
        """Issue every stage of `graph` with `issue` (called with the lane's stream current);
        returns the spans, in seconds from the start of the run. `before(stage)`, if given, runs
        on the lane after the stage's dependency waits and outside its span (progress, tests)."""
        used = {s.lane for s in graph.stages}
        if not used <= set(STREAM_LANES):
            raise ValueError(f"lanes: {sorted(l.value for l in used - set(STREAM_LANES))} have no actor yet")
        return asyncio.run(self._run(graph, issue, before))

    async def _run(self, graph: Graph, issue: Callable[[Stage], None],
                   before: Callable[[Stage], None] | None) -> list[Span]:
        loop = asyncio.get_running_loop()
        n = len(graph.stages)
        enqueued = [loop.create_future() for _ in range(n)]
        waits = cross_lane_waits(graph)
        marks: list[tuple] = [()] * n     # (start, end): CUDA events, or perf_counter seconds
        host_s = [0.0] * n
        if self.cuda:  # the run starts after whatever the caller enqueued (inputs, buffers)
            self.streams[Lane.GPU].wait_stream(torch.cuda.current_stream(self.device))
        base = self._mark(None)

        async def actor(lane: Lane, order: list[Stage]) -> None:
            stream = self.streams.get(lane)
            if stream is not None:
                stream.wait_event(base)   # nothing of this run starts before the base mark
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            for s in order:
                for d in s.deps:
                    if not enqueued[d].done():   # shielded: a cancelled waiter (Ctrl-C) must not
                        await asyncio.shield(enqueued[d])   # cancel the future other lanes share
                with ctx:
                    for d in waits[s.id]:
                        if stream is not None:
                            stream.wait_event(marks[d][1])
                    if before is not None:
                        before(s)
                    t0 = time.perf_counter()
                    start = self._mark(stream)
                    issue(s)
                    marks[s.id] = (start, self._mark(stream))
                    host_s[s.id] = time.perf_counter() - t0
                enqueued[s.id].set_result(None)
                await asyncio.sleep(0)   # one stage per turn: every lane issues as early as it may

        await asyncio.gather(*(actor(lane, order) for lane, order in graph.lane_order().items() if order))
        if self.cuda:
            torch.cuda.synchronize(self.device)
            sec = lambda ev: base.elapsed_time(ev) / 1e3
        else:
            sec = lambda t: t - base
        return [Span(i, sec(a), sec(b), host_s[i]) for i, (a, b) in enumerate(marks)]

    def _mark(self, stream: torch.cuda.Stream | None):
        """A point in time on `stream` (None: the compute stream for the base mark)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else self.streams[Lane.GPU])
        return ev
