"""The static-shape decode step of a `HeadwiseCache`: one token through HF's own model forward with
every input the step reads in fixed device buffers (token id, position, keys attended), its new
K/V written at the device-held position (as HF's StaticCache indexes its writes) and attention
over the whole capacity with the length read on the device (`attend_decode`, the kernel graph
replay captures in executor/replay/). Offloaded head groups are fetched into the transfer slots
as the engine's replayed steps fetch them: a prefix rounded up to a bucket of tokens (the only host
integer a step bakes in, so one graph serves a bucket's steps). On CUDA each bucket's step is
captured once as a CUDA graph and replayed; each bucket keeps the tensors its own capture made (its
logits and the new K/V the write-back copies home: another bucket's capture must not rebind them,
since a later generate() on the cache replays the bucket again). Issued without a graph the same
step is the reference the replay equals bit for bit, and on CPU it runs with a length-masked
attention of the same meaning.

Streams (`Lanes`; on CPU every copy is synchronous). Inside the step (captured or issued) every
copy and kernel runs on the launching stream: fetches of homes into slots, resident writes, the
new token into the slot, attention; no cross-stream work is captured. Between steps, as the
engine's replayed decode does it: the write-back of the step's new K/V of offloaded heads to
their host homes runs on the d2h stream after an edge from the step (its K/V are made), and the
next step waits for it (its fetches read those rows; a replay overwrites the K/V it copies).
`join` and `hand_back` order the HeadStream's prefill copies around the decode."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from kvpipe.executor.hf.attention import PendingKV
from kvpipe.executor.layers.attention import attend_decode
from kvpipe.executor.replay.capture import BUCKET_TOKENS, bucket_len


def attend_masked(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_decode`'s meaning without FA2 (CPU, other dtypes): q [1, Hq, 1, D], kv [1, H, S, 2, D],
    keys [0, lens) attended -> [1, 1, Hq, D]. Unwritten rows are zeroed first (they may hold NaN)."""
    H, S = kv.shape[1], kv.shape[2]
    valid = (torch.arange(S, device=kv.device) < lens.to(kv.device))        # [S]
    k = torch.where(valid[:, None], kv[0, :, :, 0], 0).repeat_interleave(q.shape[1] // H, dim=0)
    v = torch.where(valid[:, None], kv[0, :, :, 1], 0).repeat_interleave(q.shape[1] // H, dim=0)
    out = torch.nn.functional.scaled_dot_product_attention(q[0], k, v, attn_mask=valid[None, None], scale=scale)
    return out.view(1, q.shape[1], 1, -1).transpose(1, 2)


class StaticStep:
    """The decode step's device buffers over an opened HeadStream (batch 1), and the step itself:
    `run(model, cache, argument)` issues it, or replays the graph captured for its bucket.
    `group`: KV heads per attended group (the plan's decode group); `recorder`: what captures the
    step (`capture(fn) -> (graph, fn's outputs)`; default CUDA graphs on CUDA, none on CPU);
    `lanes`: the streams and their edges (default `Lanes` on CUDA, none on CPU: synchronous)."""

    def __init__(self, stream, group: int, recorder=None, lanes=None) -> None:
        store, lo = stream.store, stream.layout
        assert lo.batch == 1 and lo.kv_heads % group == 0, (lo.batch, group)
        dev = store.device
        self.store, self.layout, self.group, self.graph_wanted = store, lo, group, True
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.lens = torch.ones(1, dtype=torch.int32, device=dev)
        self.cu_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        self.cu_k = torch.tensor([0, lo.capacity], dtype=torch.int32, device=dev)
        self.fa2 = store.cuda and store.dtype in (torch.bfloat16, torch.float16)
        self.offloaded = any(n < lo.kv_heads for n in lo.resident)
        self.copy_len = 0                     # tokens each prefix fetch moves (the step's bucket)
        # what captures the step: CUDA graphs, or a stand-in with their meaning (tests/graph_tape.py)
        self.recorder = recorder if recorder is not None else CudaGraphs(dev) if store.cuda else None
        self.lanes = lanes if lanes is not None else Lanes(stream) if store.cuda else None
        self.landed = None                    # the last write-back's event on the d2h lane
        self.issued = True                    # the step last run was issued (its K/V not a graph's)
        self._writes: dict[int, torch.Tensor] = {}   # layer -> the new K/V of the forward running
        self.pending: tuple = ()              # ((layer, K/V), ...) of the step last run, for write_back
        self.graphs: dict[int, Captured] = {}  # bucket -> its captured step
        self.replays = 0

    # ---- called by the cache's layers inside the model forward ------------------------
    def write(self, layer: int, kv: torch.Tensor) -> PendingKV:
        """kv [1, H, 1, 2, D]: the token's K/V; resident heads' part written home at the
        device-held position, offloaded heads' part kept for `write_back`."""
        n = self.layout.resident[layer]
        if n:
            self.store.gpu[layer].index_copy_(2, self.pos, kv[:, :n])
        if n < self.layout.kv_heads:
            self._writes[layer] = kv
        return PendingKV(self, layer, kv)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float, valid=None) -> torch.Tensor:
        """q [1, Hq, 1, D] -> [1, 1, Hq, D], group by group: a resident group over its home, another
        over a slot holding its fetched prefix, its resident heads' prefix and the new token."""
        assert valid is None, "the static step runs un-padded batches only"
        lo, G, store = self.layout, self.group, self.store
        n, r, q = lo.resident[layer], q.shape[1] // lo.kv_heads, q.contiguous()
        out = q.new_empty(1, 1, q.shape[1], q.shape[-1])
        for g in range(lo.kv_heads // G):
            h0 = g * G
            if h0 + G <= n:
                buf = store.gpu[layer][:, h0:h0 + G]                        # [1, G, S, 2, D]
            else:
                slot = g % lo.slots   # one stream: a slot is refilled only after its last reader
                store.fetch(layer, tuple(range(max(h0, n), h0 + G)), h0, slot, self.copy_len)
                store.fill_resident(layer, tuple(range(h0, h0 + G)), slot, self.copy_len)
                buf = store.slots[slot][:, :G]
                buf.index_copy_(2, self.pos, kv[:, h0:h0 + G])
            qs = slice(h0 * r, (h0 + G) * r)
            if self.fa2:
                out[:, :, qs] = attend_decode(q[:, qs], buf, self.lens, self.cu_q, self.cu_k, scale)
            else:
                out[:, :, qs] = attend_masked(q[:, qs], buf, self.lens, scale)
        return out

    # ---- the step --------------------------------------------------------------------
    def set_inputs(self, token: torch.Tensor, position: torch.Tensor, prefix: int) -> None:
        """Token [1] or [1, 1] long and position [1] long (device tensors: copies, no host sync);
        `prefix`: the same position as a host int, for the bucket of the prefix fetches."""
        self.ids.copy_(token.view(1, 1))
        self.pos.copy_(position.view(1))
        self.lens.copy_(position.view(1) + 1)
        self.copy_len = bucket_len(prefix, BUCKET_TOKENS, self.layout.capacity) if self.offloaded else 0

    def write_back(self, position: int) -> None:
        """The step's new K/V of offloaded heads to their host homes at `position`, on the d2h lane
        after the step (an edge from the launching stream); `run` makes the next step wait for it."""
        lo, lanes = self.layout, self.lanes
        if not self.pending:
            return
        if lanes is None:
            for layer, kv in self.pending:
                self.store.store(layer, tuple(range(lo.resident[layer], lo.kv_heads)), kv, position)
            return
        lanes.wait(lanes.d2h, lanes.record(lanes.main()))   # the step's K/V are made before they are read
        with lanes.use(lanes.d2h):
            for layer, kv in self.pending:
                self.store.store(layer, tuple(range(lo.resident[layer], lo.kv_heads)), kv, position)
                if self.issued:   # the allocator may reuse issued K/V only once d2h read them
                    lanes.protect(kv, lanes.d2h)
            self.landed = lanes.record(lanes.d2h)

    def join(self) -> None:
        """Before the first step: the HeadStream's prefill copies (h2d fetches, d2h stores) done."""
        if self.lanes is not None:
            main = self.lanes.main()
            for lane in (self.lanes.h2d, self.lanes.d2h):
                self.lanes.wait(main, self.lanes.record(lane))

    def hand_back(self) -> None:
        """After the last step: the HeadStream's own copies (the next prefill's d2h stores and h2d
        fetches) start after the steps' slot and home writes, write-backs included."""
        if self.lanes is not None:
            lanes = self.lanes
            main, back = lanes.main(), lanes.record(lanes.d2h)
            lanes.wait(main, back)
            step = lanes.record(main)
            lanes.wait(lanes.h2d, step)
            lanes.wait(lanes.d2h, step)

    def _forward(self, model, cache, argument: str) -> tuple[torch.Tensor, tuple]:
        """One issue of the step -> (logits [1, 1, V], its new K/V of offloaded heads). Each call
        collects its writes afresh: a captured bucket keeps its own tensors, whatever runs later."""
        self._writes = {}
        extra = {argument: cache}
        if "cache_position" in inspect.signature(type(model).forward).parameters:   # older transformers
            extra["cache_position"] = self.pos
        out = model(input_ids=self.ids, position_ids=self.pos.view(1, 1), use_cache=True, logits_to_keep=1,
                    return_dict=True, **extra)
        return out.logits, tuple(sorted(self._writes.items()))

    def run(self, model, cache, argument: str) -> torch.Tensor:
        """The step for the inputs set: by its bucket's graph once captured, else issued -> logits [1, 1, V].
        First the launching stream waits for the last write-back (issued outside any capture)."""
        if self.landed is not None:
            self.lanes.wait(self.lanes.main(), self.landed)
            self.landed = None
        self.issued = self.recorder is None or not self.graph_wanted
        if self.issued:
            logits, self.pending = self._forward(model, cache, argument)
            return logits
        step = self.graphs.get(self.copy_len)
        if step is None:
            graph, (logits, kv) = self.recorder.capture(lambda: self._forward(model, cache, argument))
            step = self.graphs[self.copy_len] = Captured(graph, logits, kv)
        step.graph.replay()
        self.pending = step.kv
        self.replays += 1
        return step.logits

    def close(self) -> None:
        if self.graphs:
            if self.store.cuda:
                torch.cuda.synchronize(self.store.device)
            for step in self.graphs.values():
                step.graph.reset()
            self.graphs.clear()
        self.pending = ()


@dataclass(frozen=True)
class Captured:
    """One bucket's captured step: its graph and the tensors its replays write (the logits and the
    new K/V of offloaded heads that write_back copies home), all made by its own capture."""

    graph: object
    logits: torch.Tensor
    kv: tuple


class CudaGraphs:
    """Captures steps as CUDA graphs sharing one memory pool (nano-vllm's capture_cudagraph)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pool = device, None

    def capture(self, fn):
        """Warm up on a side stream (fn issued for real: every write it makes the replay makes
        again with the same values), then capture the same call -> (graph, fn's outputs)."""
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            fn()
        main.wait_stream(side)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class Lanes:
    """The CUDA streams of a static step over a HeadStream: the launching stream (`main()`, the
    current one), the stream's d2h and h2d streams, events and waits between them. A test stands
    in a recorder of the same methods (tests/graph_tape.py StreamLog) to check the edges on CPU."""

    def __init__(self, stream) -> None:
        self.device, self.d2h, self.h2d = stream.store.device, stream.d2h, stream.h2d

    def main(self):
        return torch.cuda.current_stream(self.device)

    def use(self, lane):
        return torch.cuda.stream(lane)

    @staticmethod
    def record(lane) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(lane)
        return ev

    @staticmethod
    def wait(lane, event) -> None:
        lane.wait_event(event)

    @staticmethod
    def protect(t: torch.Tensor, lane) -> None:
        t.record_stream(lane)
