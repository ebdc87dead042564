"""Head-group streaming for a caller that drives the model itself (Hugging Face `generate()`): each
layer hands over its new K/V and its queries, and the stream keeps every (layer, KV head) unit in
the KV store's tier, fetches offloaded head groups into the store's transfer slots ahead of use,
and attends group by group with the executor's exact chunked attention.

On CUDA, fetches run on an h2d stream and stores of new K/V on a d2h stream, ordered by events:
a slot is refilled as soon as its last reader is enqueued (`depth` fetches in flight, the next
layers' groups included), and a layer's prefix is fetched only after its earlier stores landed.
On CPU every copy is a plain synchronous copy made when it is needed."""
from __future__ import annotations

import torch

from kvpipe.executor.hf.masked import attend_padded
from kvpipe.executor.layers.attention import attend_chunk
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore, k_of, v_of


class HeadStream:
    """The KV of one generation on `device` in `dtype`, laid out by `layout`; `groups` maps a step's
    kind (True: a chunk of several tokens, False: one decode token) to its KV heads per group.
    A context manager: buffers and streams are taken in `open()` and given back in `close()`."""

    def __init__(self, layout: KVLayout, groups: dict[bool, int], device: torch.device,
                 dtype: torch.dtype, replay: bool = False) -> None:
        assert all(layout.kv_heads % g == 0 and g <= layout.slot_heads for g in groups.values()), groups
        self.layout, self.groups, self.replay = layout, groups, replay
        self.store = KVStore(layout, device, dtype, replay=replay)   # replay: host homes a graph can copy from
        self.cuda = self.store.cuda
        self.h2d = self.d2h = None
        self._reset_step(0, 0)

    # ---- lifetime ----------------------------------------------------------------------
    def open(self) -> "HeadStream":
        with torch.inference_mode(False):   # plain tensors: cache operations run outside inference mode too
            self.store.open()
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(self.store.device), torch.cuda.Stream(self.store.device)
        self._stored: list = [None] * self.layout.layers           # per layer: its last d2h store
        self._slot_free: list = [None] * self.layout.slots          # per slot: its last reader done
        return self

    def close(self) -> None:
        self.store.close()   # synchronizes the device first
        self.h2d = self.d2h = None

    def __enter__(self) -> "HeadStream":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one step: write each layer's new K/V, then attend ------------------------------
    def _reset_step(self, start: int, tokens: int) -> None:
        self.start, self.tokens = start, tokens
        self.jobs: list[tuple[int, int]] = []      # offloaded (layer, group) fetches of this step
        self.index: dict[tuple[int, int], int] = {}
        self.fetched: list = []
        self.issued = self.consumed = 0

    def write(self, layer: int, kv: torch.Tensor, start: int) -> None:
        """New K/V of a step, kv [B, H, T, 2, D] contiguous at positions [start, start+T): resident
        heads to their GPU home, offloaded heads to their host home. Layer 0 opens the step."""
        lo, T = self.layout, kv.shape[2]
        if layer == 0:
            self._begin_step(start, T)
        elif (start, T) != (self.start, self.tokens):
            raise ValueError(f"layer {layer}: called for tokens [{start}, {start + T}) inside a step "
                             f"over [{self.start}, {self.start + self.tokens}); layers must run in order")
        self.store.write_resident(layer, kv, start)
        n = lo.resident[layer]
        if n == lo.kv_heads:
            return
        off = tuple(range(n, lo.kv_heads))
        if not self.cuda:
            self.store.store(layer, off, kv, start)
            return
        self.d2h.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self.d2h):
            self.store.store(layer, off, kv, start)
            self._stored[layer] = self._event(self.d2h)
        kv.record_stream(self.d2h)   # made on the compute stream, read on d2h

    def _begin_step(self, start: int, tokens: int) -> None:
        # A step abandoned midway (an error raised in the model) may leave fetches unread: safe to
        # drop, since a new fetch into a slot is ordered after the old one on the same h2d stream.
        self._reset_step(start, tokens)
        lo, G = self.layout, self.groups[tokens > 1]
        if start == 0:
            return   # no prefix: nothing to fetch
        for layer, n in enumerate(lo.resident):
            for g in range(lo.kv_heads // G):
                if (g + 1) * G > n:
                    self.index[(layer, g)] = len(self.jobs)
                    self.jobs.append((layer, g))
        if self.cuda:   # every slot's last reader is enqueued: fill the ring now
            for i in range(min(lo.slots, len(self.jobs))):
                self._issue(i)

    def _issue(self, i: int) -> None:
        """Fetch job i's offloaded heads' prefix into slot i % depth."""
        assert i == self.issued, (i, self.issued)
        layer, g = self.jobs[i]
        G, n, slot = self.groups[self.tokens > 1], self.layout.resident[layer], i % self.layout.slots
        off = tuple(range(max(g * G, n), (g + 1) * G))
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                for ev in (self._slot_free[slot], self._stored[layer]):
                    if ev is not None:
                        self.h2d.wait_event(ev)
                self.store.fetch(layer, off, g * G, slot, self.start)
                self.fetched.append(self._event(self.h2d))
        else:
            self.store.fetch(layer, off, g * G, slot, self.start)
            self.fetched.append(None)
        self.issued += 1

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, scale: float,
               valid: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, T, D] of the step's tokens, kv [B, H, T, 2, D] as written -> [B, T, Hq, D];
        `valid` [B, P + T]: the keys' padding mask of a left-padded batch (None: no padding)."""
        lo = self.layout
        B, Hq, T, D = q.shape
        assert kv.shape == (B, lo.kv_heads, T, 2, D) and T == self.tokens, (q.shape, kv.shape, self.tokens)
        q = q.contiguous()
        out = q.new_empty(B, T, Hq, D)
        G, r, n, P = self.groups[T > 1], Hq // lo.kv_heads, lo.resident[layer], self.start
        for g in range(lo.kv_heads // G):
            h0, heads = g * G, tuple(range(g * G, (g + 1) * G))
            new = kv[:, h0:h0 + G]                                     # [B, G, T, 2, D]
            job = self.index.get((layer, g))
            if P == 0:
                pre = new[:, :, :0]                                    # [B, G, 0, 2, D]
            elif job is None:
                pre = self.store.resident_prefix(layer, heads, P)      # [B, G, P, 2, D], in place
            else:
                assert job == self.consumed, (job, self.consumed)
                while self.issued <= job:
                    self._issue(self.issued)
                slot = job % lo.slots
                if self.cuda:
                    torch.cuda.current_stream(self.store.device).wait_event(self.fetched[job])
                self.store.fill_resident(layer, heads, slot, P)        # mixed group: its resident heads
                pre = self.store.slot_prefix(slot, G, P)               # [B, G, P, 2, D]
            qs = slice(h0 * r, (h0 + G) * r)
            if valid is None:
                o = attend_chunk(q[:, qs], k_of(pre), v_of(pre), k_of(new), v_of(new), scale).transpose(1, 2)
            else:
                whole = torch.cat([pre, new], dim=2)                   # [B, G, P + T, 2, D]
                o = attend_padded(q[:, qs], k_of(whole), v_of(whole), valid, scale)
            out[:, :, qs] = o                                          # [B, T, G*r, D]
            if job is not None:
                self.consumed += 1
                if self.cuda:   # the slot is free once this group's attention is done: refill it
                    self._slot_free[job % lo.slots] = self._event(torch.cuda.current_stream(self.store.device))
                    if job + lo.slots < len(self.jobs):
                        self._issue(job + lo.slots)
        return out

    @staticmethod
    def _event(stream) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev
