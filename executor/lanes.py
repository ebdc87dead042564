"""Lane actors: one asyncio task per lane issues that lane's stages in issue order. A stage first
awaits (on the host) that each dependency has been ENQUEUED, then on CUDA makes its lane's stream
wait for the dependency's end event and enqueues its own work between a start and an end event;
the host never blocks on the GPU until the run is over. Actors take turns stage by stage, so a
copy lane issues a prefetch as soon as its slot's last reader is enqueued, not only when compute
waits for it. On CPU the same actors run the work synchronously, timed by the host clock.
`turns` (a seeded random.Random) shuffles whose turn comes next: on CPU, where the work runs as it
is issued, that is how tests see many interleavings (a missing dependency then shows as wrong
bits). Either way the result is one Span per stage."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

import torch

from kvpipe.pipeline.stage import Graph, Lane, Stage
from kvpipe.pipeline.trace import Span

STREAM_LANES = (Lane.GPU, Lane.H2D, Lane.D2H)
TURN_YIELDS = (0, 0, 1, 1, 2, 3, 8, 40)   # turns an actor lets pass after a stage, in shuffled mode


def cross_lane_waits(graph: Graph) -> list[tuple[int, ...]]:
    """Per stage, the dependencies it must wait for on other lanes: the latest one per lane
    suffices, since a lane runs in issue order (same-lane deps are implied by the order)."""
    stages, waits = graph.stages, []
    for s in stages:
        latest: dict[Lane, int] = {}
        for d in s.deps:
            if not 0 <= d < s.id:
                raise ValueError(f"graph: stage {s.id} ({s.name}) depends on stage {d}, which is not issued before it")
            lane = stages[d].lane
            if lane is not s.lane and d > latest.get(lane, -1):
                latest[lane] = d
        waits.append(tuple(sorted(latest.values())))
    return waits


class CudaStreams:
    """The stream operations the actors use, on one CUDA device (tests pass a recording fake
    with the same methods to check the wait logic on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def follow_current(self, stream: torch.cuda.Stream) -> None:
        """`stream` starts after whatever the caller enqueued on the current stream."""
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def use(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    def protect(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def seconds(self, base: torch.cuda.Event, event: torch.cuda.Event) -> float:
        return base.elapsed_time(event) / 1e3


class Lanes:
    """The lanes of one device: a stream each (made in `open()`), or the host on CPU.
    `streams`: the stream operations (default: CudaStreams on a CUDA device, none on CPU);
    `turns`: a seeded generator that randomises the actors' turn order (None: fixed order)."""

    def __init__(self, device: torch.device, streams: CudaStreams | None = None,
                 turns: random.Random | None = None) -> None:
        self.device = torch.device(device)
        if streams is None and self.device.type == "cuda":
            streams = CudaStreams(self.device)
        self.ops, self.turns = streams, turns
        self.streams: dict[Lane, object] = {}

    def open(self) -> "Lanes":
        if self.ops is not None:
            self.streams = {lane: self.ops.new_stream() for lane in STREAM_LANES}
        return self

    def close(self) -> None:
        if self.ops is not None:
            self.ops.synchronize()
        self.streams = {}

    def __enter__(self) -> "Lanes":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def protect(self, tensor: torch.Tensor, lane: Lane) -> None:
        """`tensor` (allocated on another lane's stream) is used on `lane`: keep its memory from
        being reused before that lane's work is done."""
        if self.ops is not None:
            self.ops.protect(tensor, self.streams[lane])

    def run(self, graph: Graph, issue: Callable[[Stage], None],
            before: Callable[[Stage], None] | None = None) -> list[Span]:
        """Issue every stage of `graph` with `issue` (called with the lane's stream current);
        returns the spans, in seconds from the start of the run. `before(stage)`, if given, runs
        on the lane after the stage's dependency waits and outside its span (progress, tests)."""
        used = {s.lane for s in graph.stages}
        if not used <= set(STREAM_LANES):
            raise ValueError(f"lanes: {sorted(l.value for l in used - set(STREAM_LANES))} have no actor yet")
        return asyncio.run(self._run(graph, issue, before))

    async def _pass_turns(self) -> None:
        """Let other actors go: one turn in fixed order, a random number when shuffled."""
        n = 1 if self.turns is None else self.turns.choice(TURN_YIELDS)
        for _ in range(n):
            await asyncio.sleep(0)

    async def _run(self, graph: Graph, issue: Callable[[Stage], None],
                   before: Callable[[Stage], None] | None) -> list[Span]:
        loop = asyncio.get_running_loop()
        ops, n = self.ops, len(graph.stages)
        enqueued = [loop.create_future() for _ in range(n)]
        waits = cross_lane_waits(graph)
        marks: list[tuple] = [()] * n     # (start, end): stream events, or perf_counter seconds
        host_s = [0.0] * n
        if ops is not None:  # the run starts after whatever the caller enqueued (inputs, buffers)
            ops.follow_current(self.streams[Lane.GPU])
        base = self._mark(None)

        async def actor(lane: Lane, order: list[Stage]) -> None:
            stream = self.streams.get(lane)
            if stream is not None:
                ops.wait(stream, base)   # nothing of this run starts before the base mark
            ctx = ops.use(stream) if stream is not None else contextlib.nullcontext()
            if self.turns is not None:
                await self._pass_turns()
            for s in order:
                for d in s.deps:
                    if not enqueued[d].done():   # shielded: a cancelled waiter (Ctrl-C) must not
                        await asyncio.shield(enqueued[d])   # cancel the future other lanes share
                with ctx:
                    if stream is not None:
                        for d in waits[s.id]:
                            ops.wait(stream, marks[d][1])   # the dependency's END event
                    if before is not None:
                        before(s)
                    t0 = time.perf_counter()
                    start = self._mark(stream)
                    issue(s)
                    marks[s.id] = (start, self._mark(stream))
                    host_s[s.id] = time.perf_counter() - t0
                enqueued[s.id].set_result(None)
                await self._pass_turns()   # one stage per turn: every lane issues as early as it may

        actors = [(lane, order) for lane, order in graph.lane_order().items() if order]
        if self.turns is not None:
            self.turns.shuffle(actors)
        await asyncio.gather(*(actor(lane, order) for lane, order in actors))
        if ops is not None:
            ops.synchronize()
            sec = lambda ev: ops.seconds(base, ev)
        else:
            sec = lambda t: t - base
        return [Span(i, sec(a), sec(b), host_s[i]) for i, (a, b) in enumerate(marks)]

    def _mark(self, stream):
        """A point in time on `stream` (None: the compute stream for the base mark)."""
        if self.ops is None:
            return time.perf_counter()
        return self.ops.record(stream if stream is not None else self.streams[Lane.GPU])
