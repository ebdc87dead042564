"""The interpreter: resolves each stage's payload key (phase, step, layer, heads, tokens, slot) to
tensors and runs it: model pieces through the adapter, copies through the KV store. It holds the
activations that live between the stages of a step; the lanes decide when each stage is issued."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpipe.pipeline.stage import Graph, Lane, Phase, Stage

from kvpipe.executor.engine.decoding import argmax_rows
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.kv.store import KVStore, k_of, v_of


@dataclass
class _Step:
    """Activations of the step in flight on the compute lane (mutable: stages update them)."""

    phase: Phase
    step: int
    start: int
    hidden: torch.Tensor                          # [B, T, hidden] residual stream
    rope: tuple[torch.Tensor, torch.Tensor]       # cos, sin [1, T, D]
    q: torch.Tensor | None = None                 # [B, Hq, T, D] of the current layer
    out: torch.Tensor | None = None               # [B, T, Hq, D] attention output, filled per group


class Interpreter:
    """Callable on a Stage; results: `tokens` (filled in place), `last_logits`, `moved` bytes."""

    def __init__(self, graph: Graph, adapter: HFAdapter, store: KVStore, lanes,
                 prompt: torch.Tensor, tokens: torch.Tensor, step_logits: torch.Tensor | None,
                 decoding=None) -> None:
        self.adapter, self.store, self.lanes = adapter, store, lanes
        self.decoding = decoding          # engine/decoding.py: who picks each token (None: greedy)
        self.prompt, self.tokens, self.step_logits = prompt, tokens, step_logits  # [B, ctx], [B, N+1]
        self.context = graph.workload.context
        self.group = {Phase.PREFILL: graph.plan.prefill.group, Phase.DECODE: graph.plan.decode.group}
        self.moved = [0] * len(graph.stages)
        self.last_logits: torch.Tensor | None = None
        self._cur: _Step | None = None
        self._kv: dict[tuple, list] = {}   # (phase, step, layer) -> [new K/V [B, H, T, 2, D], users left]
        self._ops = {"embed": self._embed, "qkv": self._qkv, "attn": self._attn, "mlp": self._mlp,
                     "head": self._head, "kv_fetch": self._fetch, "kv_store": self._store,
                     "kv_read": self._disk_read, "kv_write": self._disk_write,
                     "kv_compress": self._compress, "kv_decompress": self._decompress,
                     "quant": self._quant, "dequant": self._dequant,
                     "gpu_compress": self._gpu_compress, "gpu_decompress": self._gpu_decompress,
                     "score": self._score}
        self.q = store.q                  # LOSSY: quantised homes of the offloaded units, else None
        self.lossy_error: dict[str, float] | None = None   # measured once (executor/quant/probe.py)
        self._recs: dict[tuple, tuple] = {}   # (phase, step, layer) -> (records, first block)
        self.coded = store.coded          # host units stored compressed (executor/codecs/h2d_store.py), else None
        self.sp = store.sparse            # LOSSY: sparse decode's selection state (executor/sparse/homes.py), else None
        self._sel: dict[tuple, torch.Tensor] = {}   # (step, layer) -> selected tokens [B, n_off, N]
        # where the offloaded K/V lives, chosen once (quantised and compressed homes never coexist):
        # its fetch and disk_read serve the kv_fetch and kv_read stages
        self._home = next(h for h in (self.q, self.coded, store) if h is not None)

    def __call__(self, s: Stage) -> None:
        op = self._ops.get(s.tag)
        if op is None:
            raise ValueError(f"stage {s.name}: the executor has no op for tag {s.tag!r}")
        if s.id >= len(self.moved):   # a graph built as it runs (pipeline/builder.build_lazily)
            self.moved += [0] * (s.id + 1 - len(self.moved))
        op(s)

    # ---- compute lane ------------------------------------------------------------------
    def _step(self, s: Stage) -> _Step:
        cur = self._cur
        assert cur is not None and (cur.phase, cur.step) == (s.phase, s.step), (s.name, cur and cur.step)
        return cur

    def _embed(self, s: Stage) -> None:
        start, end = s.tokens
        if s.phase is Phase.PREFILL:
            ids = self.prompt[:, start:end]                     # [B, T]
        else:
            assert (start, end) == (self.context + s.step, self.context + s.step + 1), s.tokens
            ids = self.tokens[:, s.step:s.step + 1]            # [B, 1]: stays on the device
        hidden, rope = self.adapter.embed(ids, start, seen=self.context if s.phase is Phase.PREFILL else None)
        self._cur = _Step(s.phase, s.step, start, hidden, rope)

    def _qkv(self, s: Stage) -> None:
        cur = self._step(s)
        q, kv = self.adapter.qkv(s.layer, cur.hidden, cur.rope)  # [B, Hq, T, D], [B, H, T, 2, D]
        if not self.store.layout.ring(s.layer):   # a ring's rows are written once attention read them (_mlp)
            self.store.write_resident(s.layer, kv, cur.start)
        if self.sp is not None:           # LOSSY: the offloaded keys' summaries and sketch
            self.sp.append(s.layer, kv, cur.start)
        B, Hq, T, D = q.shape
        cur.q, cur.out = q, q.new_empty(B, T, Hq, D)
        lo = self.store.layout
        self._kv[(s.phase, s.step, s.layer)] = [kv, 1 + (lo.resident[s.layer] < lo.kv_heads)]

    def _attn(self, s: Stage) -> None:
        cur = self._step(s)
        heads, P = s.heads, s.tokens[0]
        h0, G, r = heads[0], len(heads), self.adapter.r
        new = self._kv[(s.phase, s.step, s.layer)][0][:, h0:h0 + G]   # [B, G, T, 2, D]
        sel = self._sel.get((s.step, s.layer)) if s.phase is Phase.DECODE else None
        N = self.sp.attended(sel, P) if sel is not None else P
        if s.slot is not None and N < P:   # LOSSY: sparse decode
            self._attn_sparse(s, cur, new, N)
            return
        first = self.store.layout.first_kept(s.layer, P)   # a ring layer's window starts there
        if s.slot is not None:                  # offloaded heads were fetched into the slot
            self.store.fill_resident(s.layer, heads, s.slot, P, first)
            pre = self.store.slot_prefix(s.slot, G, P - first)           # [B, G, P - first, 2, D]
        elif P == 0:
            pre = new[:, :, :0]                                          # [B, G, 0, 2, D]
        else:
            pre = self.store.resident_prefix(s.layer, heads, P, first)   # [B, G, P - first, 2, D]
        qs = slice(h0 * r, (h0 + G) * r)
        o = self.adapter.attend(s.layer, cur.q[:, qs], k_of(pre), v_of(pre), k_of(new), v_of(new), first)
        cur.out[:, :, qs] = o.transpose(1, 2)                            # [B, T, G*r, D]

    def _attn_sparse(self, s: Stage, cur: _Step, new: torch.Tensor, N: int) -> None:
        """LOSSY: the group's offloaded heads attend the N selected tokens the fetch put in the
        slot (plus their own token); its resident heads, if any, their whole prefix, apart."""
        heads, P, r = s.heads, s.tokens[0], self.adapter.r
        n = self.store.layout.resident[s.layer]
        h0, k = heads[0], max(0, min(len(heads), n - heads[0]))       # k resident heads lead the group
        parts = [(h0, k, self.store.resident_prefix(s.layer, heads[:k], P) if k else None),
                 (h0 + k, len(heads) - k, self.store.slot_prefix(s.slot, len(heads), N)[:, k:])]
        for first, G, pre in parts:
            if G == 0:
                continue
            qs = slice(first * r, (first + G) * r)
            nw = new[:, first - h0:first - h0 + G]
            o = self.adapter.attend(s.layer, cur.q[:, qs], k_of(pre), v_of(pre), k_of(nw), v_of(nw))
            cur.out[:, :, qs] = o.transpose(1, 2)

    def _score(self, s: Stage) -> None:
        """LOSSY: select the tokens every offloaded unit of the layer fetches this step."""
        cur = self._step(s)
        n, r = self.store.layout.resident[s.layer], self.adapter.r
        sel = self.sp.select(s.layer, cur.q[:, n * r:], s.tokens[1])
        if self.sparse_probe_due:          # measured once, on the first scored layer
            self.sparse_probe(s.layer, cur.q[:, n * r:], sel, s.tokens[1])
        self.lanes.protect(sel, Lane.H2D)   # made on the compute stream, read by the gathers
        self._sel[(s.step, s.layer)] = sel

    @property
    def sparse_probe_due(self) -> bool:
        return "sparse_recall_mean" not in (self.lossy_error or {})

    def sparse_probe(self, layer: int, q_off: torch.Tensor, sel: torch.Tensor, P: int) -> None:
        """LOSSY: the sparse selection's error (executor/sparse/probe.py) for the queries q_off
        [B, n_off * r, 1, D] of a layer's offloaded heads and the selection `sel` [B, n_off, N] of
        a step over a `P`-token cache (with quant: of the K/V read back, beside its figures)."""
        from kvpipe.executor.sparse.probe import measure
        r, B = self.adapter.r, q_off.shape[0]
        home = self.store.host[layer] if self.q is None else self.q.prefix(layer, P)
        got = measure(q_off[:, :, 0].reshape(B, -1, r, q_off.shape[-1]), home[:, :, :P], self.sp.tokens(sel, P),
                      self.adapter.body.layers[layer].self_attn.scaling)
        if self.q is not None:
            got["sparse_probe_tokens"] = got.pop("probe_tokens")
        self.lossy_error = {**(self.lossy_error or {}), **got}

    def _mlp(self, s: Stage) -> None:
        cur = self._step(s)
        if s.phase is Phase.DECODE:
            self._sel.pop((s.step, s.layer), None)
        self._write_ring(s)
        cur.hidden = self.adapter.mlp(s.layer, cur.hidden, cur.out)
        cur.q = cur.out = None
        self._release((s.phase, s.step, s.layer))

    def _write_ring(self, s: Stage) -> None:
        """A ring layer's new K/V go home once every attention of the layer has read the ring."""
        if self.store.layout.ring(s.layer):
            self.store.write_resident(s.layer, self._kv[(s.phase, s.step, s.layer)][0], self._step(s).start)

    def _head(self, s: Stage) -> None:
        cur = self._step(s)
        logits = self.adapter.head(cur.hidden)                           # [B, V] fp32
        idx = 0 if s.phase is Phase.PREFILL else s.step + 1
        if self.decoding is None:
            self.tokens[:, idx] = argmax_rows(logits)                    # greedy, on the device
        else:
            self.tokens[:, idx] = self.decoding.pick(logits, idx)
            self.decoding.produced(self.tokens, idx)
        if self.step_logits is not None:
            self.step_logits[idx] = logits
        self.last_logits = logits
        self._cur = None

    # ---- copy lanes --------------------------------------------------------------------
    def _fetch(self, s: Stage) -> None:
        first = s.tokens[0]   # past 0 only for a ring layer (its window's first token)
        assert first == self.store.layout.first_kept(s.layer, s.tokens[1]) and s.slot is not None, (s.name, s.tokens)
        base = s.group * self.group[s.phase]
        if s.phase is Phase.DECODE and self.sp is not None:   # LOSSY: only the selected tokens
            self.moved[s.id] = self.sp.gather(s.layer, s.heads, base, s.slot, self._sel[(s.step, s.layer)])
            return
        self.moved[s.id] = self._home.fetch(s.layer, s.heads, base, s.slot, s.tokens[1], *((first,) if first else ()))

    def _store(self, s: Stage) -> None:
        key = (s.phase, s.step, s.layer)
        if self.q is not None:            # LOSSY: the records `quant` made go home
            recs, block0 = self._recs.pop(key)
            if recs.numel():                  # most decode steps fill no block
                self.lanes.protect(recs, Lane.D2H)
            self.moved[s.id] = self.q.store(s.layer, s.heads, recs, block0)
            self._release(key)
            return
        if self.coded is not None:        # the blocks `gpu_compress` encoded go home
            rec = self._recs.pop(key)
            if rec is not None:
                for t in rec[2:5]:            # high and low planes, encoded blocks
                    self.lanes.protect(t, Lane.D2H)
            self.moved[s.id] = self.coded.store(s.layer, s.heads, rec)
            self._release(key)
            return
        kv = self._kv[key][0]
        self.lanes.protect(kv, Lane.D2H)   # allocated on the compute stream, read on d2h
        self.moved[s.id] = self.store.store(s.layer, s.heads, kv, s.tokens[0])
        self._release(key)

    # ---- disk lane (runs on a worker thread, after the CUDA work it depends on is done) -------
    def _disk_read(self, s: Stage) -> None:
        assert s.tokens[0] == self.store.layout.disk_first(s.layer, s.tokens[1]) and s.slot is not None, (s.name, s.tokens)
        base = s.group * self.group[s.phase]
        self.moved[s.id] = self._home.disk_read(s.layer, s.heads, base, s.slot, s.tokens[1])

    def _disk_write(self, s: Stage) -> None:
        if self.q is not None:
            self.moved[s.id] = self.q.disk_write(s.layer, s.heads)
            return
        if s.codec != "none":        # kv_compress encoded the frames
            self.moved[s.id] = self.store.disk_flush(s.layer, s.heads)
            return
        start, end = s.tokens
        self.moved[s.id] = self.store.disk_write(s.layer, s.heads, start, end - start)

    # ---- cpu lane: the disk link's codec ----------------------------------------------------
    def _compress(self, s: Stage) -> None:
        start, end = s.tokens
        self.moved[s.id] = self.store.disk_write(s.layer, s.heads, start, end - start)

    def _decompress(self, s: Stage) -> None:
        base = s.group * self.group[s.phase]
        self.moved[s.id] = self.store.disk_decode(s.layer, s.heads, base, s.slot, s.tokens[1])

    # ---- LOSSY: quantise before the store, dequantise after the fetch (compute lane) -----------
    def _quant(self, s: Stage) -> None:
        key = (s.phase, s.step, s.layer)
        kv = self._kv[key][0]
        recs, block0, full = self.q.encode(s.layer, kv, s.tokens[0])
        self._recs[key] = (recs, block0)
        if self.lossy_error is None and s.phase is Phase.PREFILL and s.tokens[0] == 0 and full.shape[2]:
            from kvpipe.executor.quant.probe import measure
            cur, n = self._step(s), self.store.layout.resident[s.layer]
            r = self.adapter.r
            self.lossy_error = measure(self.q.codec, cur.q[:, n * r:], kv[:, n:], full, recs,
                                       self.adapter.body.layers[s.layer].self_attn.scaling)

    def _dequant(self, s: Stage) -> None:
        base = s.group * self.group[s.phase]
        sel = self._sel.get((s.step, s.layer)) if s.phase is Phase.DECODE and self.sp is not None else None
        if sel is not None:   # LOSSY, sparse too: only the selected blocks' records were fetched
            self.q.decode_selected(s.layer, s.heads, base, s.slot, sel.shape[-1], s.tokens[1])
            return
        self.q.decode(s.layer, s.heads, base, s.slot, s.tokens[1])

    # ---- lossless GPU codec of the h2d link (gpu lane) --------------------------------------------
    def _gpu_compress(self, s: Stage) -> None:
        key = (s.phase, s.step, s.layer)
        self._recs[key] = self.coded.encode(s.layer, self._kv[key][0], s.tokens[0])

    def _gpu_decompress(self, s: Stage) -> None:
        self.coded.decode(s.layer, s.heads, s.group * self.group[s.phase], s.slot, s.tokens[1])

    def _release(self, key: tuple) -> None:
        entry = self._kv[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._kv[key]
