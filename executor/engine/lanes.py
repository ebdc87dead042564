"""Lane actors: one asyncio task per lane issues that lane's stages in issue order. A stage first
awaits (on the host) that each dependency has been ENQUEUED, then on CUDA makes its lane's stream
wait for the dependency's end event and enqueues its own work between a start and an end event;
the host never blocks on the GPU until the run is over. Actors take turns stage by stage, so a
copy lane issues a prefetch as soon as its slot's last reader is enqueued, not only when compute
waits for it. On CPU the same actors run the work synchronously, timed by the host clock.
`turns` (a seeded random.Random) shuffles whose turn comes next: on CPU, where the work runs as it
is issued, that is how tests see many interleavings (a missing dependency then shows as wrong
bits). Host lanes (disk, cpu) run each stage on a worker thread once the stream work it depends
on has finished, timed by the host clock; such a stage counts as enqueued when it is done.
Either way the result is one Span per stage."""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpipe.pipeline.stage import Graph, Lane, Stage
from kvpipe.pipeline.trace import Span

STREAM_LANES = (Lane.GPU, Lane.H2D, Lane.D2H)
HOST_LANES = (Lane.DISK, Lane.CPU)   # a worker thread each: disk I/O, CPU codecs
TURN_YIELDS = (0, 0, 1, 1, 2, 3, 8, 40)   # turns an actor lets pass after a stage, in shuffled mode
# CUDA stream priority per lane (lower is higher, CUDA's convention; torch maps a value outside the
# device's range to its nearest end). Priorities order only thread blocks waiting for an SM, so they
# never change what a kernel computes: they matter where the H2D lane runs kernels beside compute,
# the UVA gathers of a LOSSY sparse step (executor/sparse/homes.py), which then take freed SM slots
# before the score kernels queued beside them; compute in turn outranks the sparse step's upkeep
# stream (device_step.side, priority 0). Copy-engine copies are not affected, and output bits are
# the same under any priorities (their measured effect: docs/PERFORMANCE.md).
LANE_PRIORITY = {Lane.GPU: -1, Lane.H2D: -2, Lane.D2H: 0}


def cross_lane_waits(graph: Graph, first: int = 0) -> list[tuple[int, ...]]:
    """Per stage (from stage `first` on), the dependencies it must wait for on other lanes: the
    latest one per lane suffices, since a lane runs in issue order (same-lane deps are implied)."""
    stages, waits = graph.stages, []
    for s in stages[first:]:
        latest: dict[Lane, int] = {}
        for d in s.deps:
            if not 0 <= d < s.id:
                raise ValueError(f"graph: stage {s.id} ({s.name}) depends on stage {d}, which is not issued before it")
            lane = stages[d].lane
            if lane is not s.lane and d > latest.get(lane, -1):
                latest[lane] = d
        waits.append(tuple(sorted(latest.values())))
    return waits


class _Book:
    """A run's per-stage bookkeeping (enqueued futures, cross-lane waits, marks, host seconds, each
    lane's order), extended as the graph grows: `more` (pipeline/builder.build_lazily) appends one
    step (a prefill chunk, a decode step) per `next()`, called when the compute lane has issued
    every stage it has, so a step's stages are built just before they are issued, and no token
    waits for the stages of the steps after it."""

    def __init__(self, graph: Graph, more: Iterator | None, loop) -> None:
        self.graph, self.more, self.loop = graph, more, loop
        self.enqueued, self.waits, self.marks, self.host_s = [], [], [], []
        self.orders: dict[Lane, list[Stage]] = {lane: [] for lane in Lane}
        self.grown = loop.create_future()   # resolved at each growth (and at the end)
        self.spawn: Callable[[Lane], None] = lambda lane: None   # an actor for a lane new to the run
        self._extend()

    @property
    def complete(self) -> bool:
        return self.more is None

    def _extend(self) -> None:
        stages, first = self.graph.stages, len(self.enqueued)
        self.waits += cross_lane_waits(self.graph, first)
        for s in stages[first:]:
            self.enqueued.append(self.loop.create_future())
            self.orders[s.lane].append(s)
        self.marks += [()] * (len(stages) - first)
        self.host_s += [0.0] * (len(stages) - first)

    def grow(self) -> None:
        """The next step's stages (none left: the graph is complete)."""
        lanes = {lane for lane, order in self.orders.items() if order}
        if next(self.more, None) is None:
            self.more = None
        self._extend()
        for lane, order in self.orders.items():
            if order and lane not in lanes:
                self.spawn(lane)
        self.grown.set_result(None)
        self.grown = self.loop.create_future()

    async def feed(self, lane: Lane) -> AsyncIterator[Stage]:
        """The lane's stages in issue order; the compute lane grows the graph when it runs out,
        the other lanes wait for it to."""
        i, order = 0, self.orders[lane]
        while True:
            if i < len(order):
                yield order[i]
                i += 1
            elif self.complete:
                return
            elif lane is Lane.GPU:
                self.grow()
            else:
                await asyncio.shield(self.grown)


class CudaStreams:
    """The stream operations the actors use, on one CUDA device (tests pass a recording fake
    with the same methods to check the wait logic on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self, priority: int = 0) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device, priority=priority)

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

    def release(self) -> None:
        """Free what torch keeps per stream after the streams are gone: cuBLAS holds a workspace
        (32 MiB on Hopper) per (handle, stream) in the caching allocator and never frees it, so
        every run's new compute stream would leave one behind, counted as allocated by the next
        run in the same process. Freed here after the lanes synchronised; the next GEMM on a live
        stream makes its own again."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()

    def seconds(self, base: torch.cuda.Event, event: torch.cuda.Event) -> float:
        return base.elapsed_time(event) / 1e3

    def finish(self, event: torch.cuda.Event) -> None:
        """Block the calling host thread until `event` has happened (host lanes)."""
        event.synchronize()


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
            self.streams = {lane: self.ops.new_stream(LANE_PRIORITY[lane]) for lane in STREAM_LANES}
        return self

    def close(self) -> None:
        self.streams = {}
        if self.ops is not None:
            self.ops.synchronize()
            release = getattr(self.ops, "release", None)   # test fakes record without it
            if release is not None:
                release()

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
            before: Callable[[Stage], None] | None = None, more: Iterator | None = None) -> list[Span]:
        """Issue every stage of `graph` with `issue` (called with the lane's stream current);
        returns the spans, in seconds from the start of the run. `before(stage)`, if given, runs
        on the lane after the stage's dependency waits and outside its span (progress, tests).
        `more`: the graph's steps still to build (_Book), built as the compute lane needs them."""
        used = {s.lane for s in graph.stages}
        if not used <= set(STREAM_LANES + HOST_LANES):
            raise ValueError(f"lanes: {sorted(l.value for l in used - set(STREAM_LANES + HOST_LANES))} have no actor")
        return asyncio.run(self._run(graph, issue, before, more))

    async def _pass_turns(self) -> None:
        """Let other actors go: one turn in fixed order, a random number when shuffled."""
        n = 1 if self.turns is None else self.turns.choice(TURN_YIELDS)
        for _ in range(n):
            await asyncio.sleep(0)

    async def _run(self, graph: Graph, issue: Callable[[Stage], None],
                   before: Callable[[Stage], None] | None, more: Iterator | None) -> list[Span]:
        loop = asyncio.get_running_loop()
        ops, book = self.ops, _Book(graph, more, loop)
        if ops is not None:  # the run starts after whatever the caller enqueued (inputs, buffers)
            ops.follow_current(self.streams[Lane.GPU])
        base = self._mark(None)
        host = any(s.lane in HOST_LANES for s in graph.stages) or (more is not None and graph.plan.disk > 0)
        host_base = self._host_base(base) if host else None
        tasks = []
        book.spawn = lambda lane: tasks.append(loop.create_task(actor(lane)))

        async def actor(lane: Lane) -> None:
            if lane in HOST_LANES:
                return await self._host_actor(book, lane, issue, before)
            stream = self.streams.get(lane)
            if stream is not None:
                ops.wait(stream, base)   # nothing of this run starts before the base mark
            ctx = ops.use(stream) if stream is not None else contextlib.nullcontext()
            if self.turns is not None:
                await self._pass_turns()
            async for s in book.feed(lane):
                for d in s.deps:
                    if not book.enqueued[d].done():   # shielded: a cancelled waiter (Ctrl-C) must not
                        await asyncio.shield(book.enqueued[d])   # cancel the future other lanes share
                with ctx:
                    if stream is not None:
                        for d in book.waits[s.id]:
                            if graph.stages[d].lane not in HOST_LANES:   # host lanes: already done
                                ops.wait(stream, book.marks[d][1])   # the dependency's END event
                    if before is not None:
                        before(s)
                    t0 = time.perf_counter()
                    start = self._mark(stream)
                    issue(s)
                    book.marks[s.id] = (start, self._mark(stream))
                    book.host_s[s.id] = time.perf_counter() - t0
                book.enqueued[s.id].set_result(None)
                await self._pass_turns()   # one stage per turn: every lane issues as early as it may

        lanes = [lane for lane, order in book.orders.items() if order]
        if self.turns is not None:
            self.turns.shuffle(lanes)
        for lane in lanes:
            book.spawn(lane)
        while not all(t.done() for t in tasks):   # a lane new to a grown graph adds its actor
            await asyncio.gather(*tasks)
        if ops is not None:
            ops.synchronize()
            sec = lambda ev: ev - host_base if isinstance(ev, float) else ops.seconds(base, ev)
        else:
            sec = lambda t: t - base
        return [Span(i, sec(a), sec(b), book.host_s[i]) for i, (a, b) in enumerate(book.marks)]

    def _host_base(self, base) -> float:
        """The host clock at the base mark (on a GPU: once it reaches the mark)."""
        if self.ops is None:
            return base
        self.ops.finish(base)
        return time.perf_counter()

    async def _host_actor(self, book: _Book, lane: Lane, issue, before) -> None:
        """A host lane: each stage waits (on its worker thread) until the stream work it depends
        on has finished, then runs there; its marks are host-clock seconds, and it counts as
        enqueued once done, so stream lanes after it need no event."""
        loop, stages = asyncio.get_running_loop(), book.graph.stages

        def work(s: Stage, events) -> tuple[float, float]:
            for ev in events:
                self.ops.finish(ev)
            if before is not None:
                before(s)
            t0 = time.perf_counter()
            issue(s)
            return t0, time.perf_counter()

        with ThreadPoolExecutor(1, thread_name_prefix="kvpipe-lane") as pool:
            async for s in book.feed(lane):
                for d in s.deps:
                    if not book.enqueued[d].done():
                        await asyncio.shield(book.enqueued[d])
                events = [book.marks[d][1] for d in book.waits[s.id]
                          if self.ops is not None and stages[d].lane not in HOST_LANES]
                t0, t1 = await asyncio.shield(loop.run_in_executor(pool, work, s, events))
                book.marks[s.id] = (t0, t1)
                book.host_s[s.id] = t1 - t0
                book.enqueued[s.id].set_result(None)
                await self._pass_turns()

    def _mark(self, stream):
        """A point in time on `stream` (None: the compute stream for the base mark)."""
        if self.ops is None:
            return time.perf_counter()
        return self.ops.record(stream if stream is not None else self.streams[Lane.GPU])
