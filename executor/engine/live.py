"""A conversation's KV kept on the engine between calls: one KVStore opened for `capacity` tokens
in the plan's placement (GPU, pinned host RAM, disk) and left open, so every (layer, KV head) unit
stays where the plan put it; each `extend` runs a graph whose prefill starts past the tokens
already home, so a next turn or a next question prefills only its new tokens. A KV directory
(executor/kv/saved.py) loads into the same store: `kvpipe generate --load-kv`, `kvpipe chat` and a
server's prefix reuse share this one mechanism.

Chunking: the new tokens are prefilled in the plan's chunks counted from the first new token (and
from each of `breaks`). On CPU and GPU a matmul's bits can depend on the chunk's shape, so the
continuation equals bit for bit an uninterrupted run whose chunks break at the same tokens
(`chunk_starts`); where the saved length is a multiple of the chunk, that is the plain run.

A load may run behind the next prefill (`load(..., overlap=True)`): each prefill stage of layer L
first waits until L's units are home (and, on a stream lane, for their H2D copies' events), so
the question's prefill streams layer L while later layers still load; a failed load raises its
error at the first stage that needs it, and empties the conversation."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from kvpipe.pipeline.builder import build_lazily
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.replay import Replay, blocker, resolve
from kvpipe.pipeline.stage import Graph, Phase, Stage
from kvpipe.pipeline.workload import Workload

from kvpipe.executor.engine.decoding import token_row
from kvpipe.executor.engine.lanes import HOST_LANES
from kvpipe.executor.engine.runner import MODES, RunResult, execute
from kvpipe.executor.kv.loader import Loading, LoadStats
from kvpipe.executor.kv.layout import DiskOptions, KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.layers.adapter import HFAdapter, spec_dtype


def chunk_starts(start: int, total: int, chunk: int, breaks=()) -> tuple[int, ...]:
    """First tokens of the prefill chunks over [start, total): every `chunk` tokens from `start`
    and again from each break inside the range."""
    marks = sorted({start, *(b for b in breaks if start < b < total)})
    ends = marks[1:] + [total]
    return tuple(s for a, b in zip(marks, ends) for s in range(a, b, chunk))


def unsupported(layout: KVLayout) -> str | None:
    """Why a kept conversation cannot run this layout (None: it can)."""
    if layout.quant_bits or layout.sparse is not None:
        return "its KV is LOSSY (--lossy/--sparse)"
    if layout.h2d_codec != "none" or layout.disk_codec != "none":
        return "it stores the KV through a codec (--codec)"
    if layout.batch != 1:
        return "its batch is not 1"
    return None


class LiveSession:
    """The engine side of a conversation (batch 1); a context manager (the store opens on enter).
    `tokens` are the ids whose K/V is home, positions 0 .. len(tokens) - 1."""

    def __init__(self, spec: ModelSpec, plan: Plan, hf_model: torch.nn.Module, device: torch.device,
                 capacity: int, kv_dir: str | None = None, replay: Replay | str = Replay.OFF,
                 fuse: str | None = None) -> None:
        if capacity < 2:
            raise ValueError(f"max-context: must be at least 2 tokens, got {capacity}")
        self.spec, self.plan, self.hf, self.device = spec, plan, hf_model, torch.device(device)
        self.capacity, self.kv_dir, self.replay, self.fuse = capacity, kv_dir, replay, fuse
        self.tokens: list[int] = []
        self.store: KVStore | None = None
        self.pending: Loading | None = None   # a load the next prefill runs behind (`load`)
        self.loaded: LoadStats | None = None  # the last load's figures
        self._waited: set = set()             # (stream, layer) pairs that waited for a pending load's copies
        self._last: tuple | None = None   # (shape key, whole stage graph, its steps' first stages) of the last run
        self.layout = KVLayout.of(Graph(spec, Workload(capacity - 1, 1, 1), plan))
        why = unsupported(self.layout)
        if why:
            raise ValueError(f"plan: a kept conversation (save-kv, load-kv, chat) needs an exact plan "
                             f"without codecs, and {why}")

    @property
    def length(self) -> int:
        return len(self.tokens)

    def open(self) -> "LiveSession":
        dtype = HFAdapter(self.hf).dtype
        work = Workload(self.capacity - 1, 1, 1)
        mode = resolve(Replay.parse(self.replay, MODES),
                       blocker(self.spec, work, self.plan, self.device.type, spec_dtype(dtype)), 1)
        self.store = KVStore(self.layout, self.device, dtype, DiskOptions(self.kv_dir),
                             replay=mode is not Replay.OFF).open()
        return self

    def close(self) -> None:
        self._abandon()   # no reader may still write into the homes being freed
        if self.store is not None:
            self.store.close()
        self.store, self.tokens = None, []

    def __enter__(self) -> "LiveSession":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def extend(self, ids: list[int], decode_tokens: int = 0, decoding=None, breaks=(),
               keep_logits: bool = False, stage_hook=None) -> RunResult:
        """Prefill `ids` past the tokens already home (they must start with them), then run
        `decode_tokens` decode steps (`decoding` picks the tokens, engine/decoding.py; None: greedy).
        Afterwards the K/V of `ids` and of every kept generated token but the last is home."""
        prompt = token_row(ids)             # [1, total]
        ids = prompt[0].numpy().tolist()    # plain ints, compared with the tokens home
        if ids[:self.length] != self.tokens or len(ids) + decode_tokens > self.capacity:
            self.settle()   # the load must end (or fail) before any refusal leaves the conversation as it is
        if ids[:self.length] != self.tokens:
            raise ValueError("tokens: the conversation's tokens are not a prefix of the new ones")
        if len(ids) + decode_tokens > self.capacity:
            raise ValueError(f"max-context: the conversation is full: {len(ids)} tokens + {decode_tokens} "
                             f"to generate exceed its {self.capacity}-token capacity")
        if len(ids) == self.length:      # the next token needs the last one's logits: run it again
            self.rewind(self.length - 1)
        elif not self.store.marks.holds(self.length):   # decode run past the end overwrote a window
            self.rewind(0)
        total, plan = len(ids), self.plan
        if plan.prefill.chunk > total:   # one chunk; the store was sized for the plan's chunk
            plan = replace(plan, prefill=replace(plan.prefill, chunk=total))
        key = (total, decode_tokens, plan, chunk_starts(self.length, total, plan.prefill.chunk, breaks))
        graph, more = self._graph(key)
        try:
            res = execute(graph, self.hf, prompt, self.device, keep_logits=keep_logits,
                          stage_hook=self._hook(stage_hook), replay=self.replay, fuse=self.fuse,
                          decoding=decoding, store=self.store, more=more)
        except BaseException:    # Ctrl-C, an error: what is home stays the conversation so far
            if self.store.cuda:
                torch.cuda.synchronize(self.device)   # no copy of the stopped run still in flight
            self._abandon()      # a failed load empties the conversation
            self._truncate_disk()
            raise
        self.settle()
        self._keep(key, graph)
        kept = decoding.finish() if decoding is not None else decode_tokens + 1
        made = res.tokens[0, :kept].cpu().tolist()
        self.tokens = ids + made[:kept - 1]
        self._truncate_disk()
        return res

    def _graph(self, key: tuple) -> tuple[Graph, Iterator]:
        """The run's stage graph holding its first prefill chunk, and the iterator that appends its
        other steps as the run reaches them (runner.execute's `more`): building a step costs host
        time (0.3 s for the decode steps of a 128K prompt and 64 new tokens), which then never
        precedes a token that does not need it. A shape that repeats (a server's next question of
        the same length) reuses the last run's stages, revealed step by step too (the run's setup
        is per stage)."""
        total, decode_tokens, plan, starts = key
        if self._last is None or self._last[0] != key:
            return build_lazily(self.spec, Workload(total, decode_tokens, 1), plan, starts=starts)
        _, whole, bounds = self._last
        ends = bounds + [len(whole.stages)]
        graph = Graph(whole.model, whole.workload, whole.plan, whole.stages[:ends[0]], whole.static)

        def reveal() -> Iterator[int]:
            for k, (a, b) in enumerate(zip(ends, ends[1:])):
                graph.stages += whole.stages[a:b]
                yield k
        return graph, reveal()

    def _keep(self, key: tuple, graph: Graph) -> None:
        """Remember the whole graph of a run that ended, with the first stage of each step past
        its first (every step starts with its embed). A graph an early stop cut short is not kept."""
        bounds = [s.id for s in graph.stages if s.tag == "embed"][1:]
        if len(bounds) == len(key[3]) - 1 + key[1]:
            self._last = (key, graph, bounds)

    def rewind(self, n: int) -> None:
        """Keep the first `n` tokens' K/V (a conversation whose later tokens changed); none where a
        window layer's ring no longer holds the keys position n sees (the next call prefills all)."""
        self._abandon() if n == 0 else self.settle()   # rewind(0) is the reset after a failed load too
        if not 0 <= n <= self.length:
            raise ValueError(f"rewind: {n} is outside 0..{self.length}")
        if self.store is not None and not self.store.marks.holds(n):
            n = 0
        if self.store is not None:
            self.store.marks.forget(n)
        self.tokens = self.tokens[:n]
        self._truncate_disk()

    def _truncate_disk(self) -> None:
        """Disk rows grow at their end (a ring row's too): decode steps run past the end
        (engine/decoding.LAG) wrote tokens the conversation does not keep; their rows are cut back
        to its length (a ring row's within what it still holds: RingMarks.holds decided)."""
        disk = self.store.disk
        if disk is not None:   # a run stopped after its rings moved on: emptied (the next extend prefills all)
            n = self.length if self.store.marks.holds(self.length) else 0
            for row in range(disk.rows):
                disk.truncate(row, n * self.store.token_bytes)

    # ---- a saved KV directory (executor/kv/saved.py) ---------------------------------------
    def load(self, directory, man: dict, overlap: bool = False) -> LoadStats | None:
        """Fill the empty store from a KV directory whose manifest is `man`; its tokens become the
        conversation's. Waits and returns the LoadStats, or with `overlap` returns None at once: the
        next `extend` runs behind the load (`settle` joins it)."""
        from kvpipe.executor.kv import saved
        if self.length or self.pending is not None:
            raise ValueError("load-kv: the conversation already holds tokens (reset it first)")
        job = saved.start(self.store, directory, man)
        self.pending, self._waited = job, set()
        self.tokens = [int(t) for t in man["tokens"][:job.reader.n]]
        return None if overlap else self.settle()

    def settle(self) -> LoadStats | None:
        """Join a load in flight; its stats (None: none was). Its error is raised, the conversation
        then empty."""
        if self.pending is None:
            return None
        job, self.pending = self.pending, None
        try:
            self.loaded = job.wait()
        except BaseException:
            self.tokens = []
            self._truncate_disk()
            raise
        return self.loaded

    def _abandon(self) -> None:
        """Stop a load in flight and `settle` it, its error dropped (a caller already raising, or
        closing): an unfinished load keeps nothing."""
        if self.pending is not None:
            self.pending.cancel()
        try:
            self.settle()
        except Exception:
            pass

    def _hook(self, stage_hook):
        """The lanes' `before` hook: the pending load's gate, then the caller's hook."""
        if self.pending is None:
            return stage_hook
        self.pending.path = "overlapped"

        def before(s: Stage) -> None:
            self._gate(s)
            if stage_hook is not None:
                stage_hook(s)
        return before

    def _gate(self, s: Stage) -> None:
        """A prefill stage of layer L behind a pending load: wait until L's units are home; on a
        stream lane (its stream current) the stream also waits for their H2D copies, once a layer."""
        job = self.pending
        if job is None or s.layer is None or s.phase is not Phase.PREFILL:
            return
        events = job.ready(s.layer)
        if not events or s.lane in HOST_LANES:
            return
        stream = torch.cuda.current_stream(self.device)
        if (stream.cuda_stream, s.layer) not in self._waited:
            self._waited.add((stream.cuda_stream, s.layer))
            for ev in events:
                stream.wait_event(ev)
