"""The engine: one worker thread that runs the requests one at a time on the server's one
`kvpipe.Conversation` (the model loaded and the plan decided once, for the server's context), fed
by a bounded queue. One at a time because one long request already saturates the host-to-GPU link
(its offloaded KV streams through it every decode step) and the plan's budgets are sized for it
alone: the plan has a batch dimension, but batching long requests multiplies their KV (B times
the bytes on every tier and link) and would make each request wait for the slowest. A full
queue is 429 with Retry-After (wait.py). Each request is `append(ids, reuse=True)`: the longest common
prefix of its prompt and the tokens home (the previous request's prompt and answer) is kept, only
the rest prefilled, and that count is its `cached_tokens`. With a prefix cache (prefix_cache.py),
a kept entry that shares more of the prompt than the tokens home is loaded first; and the tokens
home are kept as an entry before a request discards most of them (keeps less than half). Text goes from the worker to the event
loop through an asyncio queue per request; `Job.cancel()` (the client went away, the server
stops) ends the generation after its next token, and the conversation rewinds what it added; one
cut by the server stopping is answered 503, never as a finished answer."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from .admission import kv_bytes
from kvpipe.conversation import common_prefix
from .protocol import ApiError, Query
from .wait import WaitEstimate

log = logging.getLogger("kvpipe")


@dataclass
class Job:
    """One admitted request on its way through the engine. `events` (on the event loop) receives
    ("text", str), then ("done", GenerateResult) or ("error", ApiError). `by_shutdown`: cancelled
    because the server stops (its client still listens and must learn the answer is cut)."""

    query: Query
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    by_shutdown: bool = False

    def cancel(self, shutdown: bool = False) -> None:
        self.by_shutdown = self.by_shutdown or shutdown   # set before the event the worker reads
        self.cancelled.set()

    def push(self, kind: str, payload) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


class Engine:
    """`submit(job)` queues (ApiError 429 when full, 503 when stopping); `stop()` refuses new
    work, cancels what is queued and running, waits for the worker to finish its run, and closes
    the conversation (its KV freed, the disk tier's file removed)."""

    def __init__(self, conv, admission, metrics, max_queue: int = 16, cache=None) -> None:
        self.conv, self.admission, self.metrics, self.cache = conv, admission, metrics, cache
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.current: Job | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.wait = WaitEstimate()   # Retry-After of a full queue

    def start(self) -> None:
        if self.cache is not None:
            self.metrics.cache_stats(self.cache.stats())
        self.thread = threading.Thread(target=self._work, name="kvpipe-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            wait = self.wait.seconds(self.queue.qsize())
            raise ApiError(429, f"the queue is full ({self.queue.maxsize} requests waiting); retry in {wait} s",
                           code="queue_full", headers={"Retry-After": str(wait)}) from None
        self.metrics.queue_depth = self.queue.qsize()

    def cancel_all(self) -> None:
        """Refuse new work; cancel what is queued (answered 503) and the running generation."""
        self.stopping = True
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.push("error", ApiError(503, "the server is shutting down", code="shutting_down"))
        job = self.current
        if job is not None:
            job.cancel(shutdown=True)

    def stop(self, timeout_s: float = 60.0) -> None:
        self.cancel_all()
        self.queue.put(None)   # the worker's signal to leave (room: the queue was just emptied)
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.close()

    def close(self) -> None:
        if self.conv is not None and (self.thread is None or not self.thread.is_alive()):
            self.conv.close()
            self.conv = None
            if self.cache is not None:   # no kept entry outlives the server
                self.cache.clear()
                self.cache.store.close()

    def kept_kv(self) -> dict:
        """KV bytes per tier of the tokens home, as the conversation's plan places them."""
        e = self.conv.engine
        return kv_bytes(e.spec, e.plan, len(self.conv.live.tokens))

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            self.metrics.queue_depth = self.queue.qsize()
            if job is None:
                return
            if job.cancelled.is_set():   # its client left while it waited
                job.push("error", ApiError(499, "cancelled", code="cancelled"))
                continue
            self.current = job
            if self.stopping:   # cancel_all ran between the get and here: it did not see this job
                job.cancel(shutdown=True)
            self.wait.started()
            try:
                self._run(job)
            finally:
                self.current = None
                self.wait.finished()

    def _run(self, job: Job) -> None:
        q = job.query
        self.metrics.started(kv_bytes(self.conv.engine.spec, self.conv.engine.plan, len(job.ids) + q.max_tokens))
        res = None
        try:
            self.route(job.ids)
            res = self.conv.append(job.ids, reuse=True, max_new_tokens=q.max_tokens, stop=q.stop,
                                   ignore_eos=q.ignore_eos, seed=q.seed, stream=lambda piece: job.push("text", piece),
                                   cancel=job.cancelled.is_set, **q.sampling)
        except ValueError as e:   # the run's own refusal (its plan does not fit after all, ...)
            job.push("error", ApiError(400, str(e).splitlines()[0], code="refused"))
        except Exception as e:    # noqa: BLE001  (answered as 500, never a dropped connection)
            log.exception("kvpipe serve: generation failed")
            job.push("error", ApiError(500, f"generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                       code="engine_error"))
        finally:
            t = res.timings if res is not None else {}
            self.metrics.finished(len(job.ids) if res else 0, len(res.tokens) if res else 0, t.get("ttft_s"),
                                  t.get("decode_s_per_token"), res is not None and res.finish_reason == "cancelled",
                                  cached=t.get("reused_tokens", 0), kept=len(self.conv.live.tokens), kv=self.kept_kv())
            if self.cache is not None:
                self.metrics.cache_stats(self.cache.stats())
        if res is not None and res.finish_reason == "cancelled" and job.by_shutdown:
            job.push("error", ApiError(503, f"the server is shutting down: the answer was cut after "
                                            f"{len(res.tokens)} tokens", code="shutting_down"))
        elif res is not None:
            job.push("done", res)

    # ---- the prefix cache -------------------------------------------------------------------
    def route(self, ids: list[int]) -> None:
        """Let the conversation hold the best kept start of `ids`: the tokens home, or the cache's
        entry sharing more of them (loaded). Tokens home that the request would mostly discard
        are kept as an entry first."""
        c, live = self.cache, self.conv.live
        if c is None or not c.enabled:
            return
        own = common_prefix(live.tokens, ids)
        entry, n = c.best(ids)
        taken = c.take(entry) if entry is not None and n > own else None
        if taken is None:
            c.miss()
        if live.length and (taken is not None or 2 * own < live.length):
            self._keep_live()
        if taken is not None:
            self._load(taken, n)

    def _keep_live(self) -> None:
        from .cache_store import predicted_bytes
        conv = self.conv
        try:
            self.cache.keep(conv.live.tokens, conv.save, predicted_bytes(conv.live.store, conv.live.length))
        except (OSError, ValueError) as e:
            log.warning("kvpipe serve: prefix cache: %d tokens not kept (%s)", conv.live.length,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)

    def _load(self, entry, n: int) -> None:
        """Continue from `entry` (its files dropped afterwards: its KV is the conversation's now);
        one that cannot be loaded (a checksum, a file) is dropped and the request prefills cold."""
        conv = self.conv
        conv.reset()
        try:
            conv.load(entry.handle)
            self.cache.hit(n)
        except (OSError, ValueError) as e:
            conv.reset()    # a partial load keeps nothing
            self.cache.failed()
            log.warning("kvpipe serve: prefix cache entry of %d tokens dropped, prefilling cold (%s)",
                        len(entry.tokens), str(e).splitlines()[0] if str(e) else type(e).__name__)
        finally:
            self.cache.store.drop(entry.handle)
