"""The decode step as graph replay needs it: every input of the step (token, position, keys
attended) in static device buffers (`DeviceStep`), and the interpreter's decode ops rewritten to
read them (`ReplayInterpreter`): new K/V written at a device-held index, attention that reads its
length on the device (`attention.attend_decode`), prefix copies of a fixed bucket length. The
same ops serve a captured graph and eager issue; prefill runs the eager ops unchanged. Under the
fuse setting (`fuse`: auto|on|off, default pipeline/fusion.fuse_mode(): auto where it can run) the
decode ops call `fused.FusedDecode` instead of the adapter's pieces: the same math with the
elementwise work fused (every placement runs the same code)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpipe.pipeline.lossy import PIPE_UNITS
from kvpipe.pipeline.stage import Phase, Stage

from kvpipe.executor.layers.attention import attend_decode
from kvpipe.executor.layers.fused import fuse_mode, make_fused, warm_or_fall_back
from kvpipe.executor.replay.window_step import WindowIndex, gathered
from kvpipe.executor.engine.decoding import argmax_rows
from kvpipe.executor.engine.interpreter import Interpreter, _Step


@dataclass(frozen=True)
class DeviceStep:
    """Static device buffers one decode step reads and writes (replay overwrites their contents).
    ids [B, 1] long: the token embedded, then the greedy next token; pos [1] long: its position
    (= keys cached before it); lens [1] int32: keys attended (pos + 1); logits [B, V] fp32;
    cu_q (0, 1), cu_k (0, capacity) int32; copy_len: tokens each prefix copy moves (host int,
    baked into a graph); windows: layer -> its window's rows and length (window_step.py), for
    layers whose window is shorter than the capacity; args, sp_lens, bucket, sp_width, sp_cu_k:
    a sparse step's (LOSSY)."""

    ids: torch.Tensor
    pos: torch.Tensor
    lens: torch.Tensor
    logits: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    copy_len: int = 0
    windows: dict[int, WindowIndex] = field(default_factory=dict)
    # LOSSY sparse steps (executor/replay/sparse_step.py): the step's counts (int64 [ARGS]), the keys its
    # offloaded heads attend (int32 [1]: the fetched ones and its own) and the graph's fixed shapes
    args: torch.Tensor | None = None
    sp_lens: torch.Tensor | None = None
    bucket: object | None = None
    sp_width: int = 0                     # W: the leading slot rows a bucket's steps can attend
    sp_cu_k: torch.Tensor | None = None   # (0, W) int32 on the device


class ReplayInterpreter(Interpreter):
    """The interpreter with decode ops that read their step from `dev` (a DeviceStep) instead of
    host integers; prefill (and decode while `dev` is None) runs the eager ops unchanged.
    `fuse`: the fuse setting (auto|on|off; None: pipeline/fusion.fuse_mode()); where it fuses, decode
    ops go through FusedDecode and the residual stream carries the last MLP's output in `_pending`
    until the next norm adds it. `fuse_note` says why a fusing setting runs unfused (else None)."""

    dev: DeviceStep | None = None

    def __init__(self, *args, fuse: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fuse = fuse_mode(fuse)
        self.fused, self.fuse_note = make_fused(self.adapter, self.fuse)
        self._pending: torch.Tensor | None = None   # [B, 1, hidden] MLP output not yet added
        self.probe_ref: tuple | None = None   # LOSSY sparse: (layer, queries, selection) of a step's first scored layer
        self._side: torch.cuda.Stream | None = None   # LOSSY sparse: see `side`
        self._sel_events: dict[tuple, list[torch.cuda.Event]] = {}   # (step, layer) -> per unit (_score)
        # stage id -> the event its consumers on other lanes wait for instead of the stage's end
        # (DecodeReplay._issue takes it): a consumer that waits finer-grained on its own
        self.early_end: dict[int, torch.cuda.Event] = {}

    def warm_fused(self, positions: torch.Tensor) -> float:
        """Compile and warm the fused pieces before any capture -> seconds; a compile that fails
        under `auto` leaves the decode unfused (`fused` None, `fuse_note` says why)."""
        if self.fused is None:
            return 0.0
        seconds, note = warm_or_fall_back(self.fused, self.fuse, positions)
        if note is not None:
            self.fused, self.fuse_note = None, note
        return seconds

    def side(self) -> torch.cuda.Stream:
        """LOSSY sparse steps: the stream the sketch's and the quantisation's per-step upkeep of the
        filling chunk (block) runs on, beside the step's chain of score, gather, dequantise and
        attention, which never reads what it writes within the step (SparseHomes.append_static,
        QuantHomes.encode_static); `_head` joins it, so it belongs to a captured step's graph.
        Made on first use, which is the step issued before any capture."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.store.device)
        return self._side

    def _device_step(self, s: Stage) -> bool:
        return s.phase is Phase.DECODE and self.dev is not None

    def _embed(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._embed(s)
        hidden, rope = self.adapter.embed(self.dev.ids, 0, positions=self.dev.pos.view(1, 1))
        self._cur = _Step(s.phase, s.step, s.tokens[0], hidden, rope)
        self._pending = None
        for win in {id(w): w for w in self.dev.windows.values()}.values():   # one per kind
            win.refresh(self.dev.pos)

    def _qkv(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._qkv(s)
        cur, lo = self._step(s), self.store.layout
        if self.fused is None:
            q, kv = self.adapter.qkv(s.layer, cur.hidden, cur.rope)  # [1, Hq, 1, D], [1, H, 1, 2, D]
        else:
            cur.hidden, q, kv = self.fused.qkv(s.layer, cur.hidden, self._pending, cur.rope)
            self._pending = None
        n, win = lo.resident[s.layer], self.dev.windows.get(s.layer)
        if n:   # at the device-held row: the position, or in a ring its row (past the window's keys)
            self.store.gpu[s.layer].index_copy_(2, self.dev.pos if win is None else win.write, kv[:, :n])
        if self.sp is not None:           # LOSSY: the sketch's unsealed chunk (replay/sparse_step.py)
            self.sp.append_static(s.layer, kv, self.dev.args, self.side())
        B, Hq, T, D = q.shape
        cur.q, cur.out = q, None if self.fused is not None else q.new_empty(B, T, Hq, D)
        self._kv[(s.phase, s.step, s.layer)] = [kv, 1 + (n < lo.kv_heads)]

    def _attn(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._attn(s)
        cur = self._step(s)
        h0, G, r = s.heads[0], len(s.heads), self.adapter.r
        new = self._kv[(s.phase, s.step, s.layer)][0][:, h0:h0 + G]   # [1, G, 1, 2, D]
        if s.slot is not None and self.sp is not None:   # LOSSY sparse
            return self._attn_sparse_static(s, cur, new)
        win = self.dev.windows.get(s.layer)
        lens, cu_k = (self.dev.lens, self.dev.cu_k) if win is None else (win.lens, win.cu_k)
        if s.slot is not None:   # offloaded heads were fetched into the slot; add the rest and the new token
            self.store.fill_resident(s.layer, s.heads, s.slot, self._copy_rows(s.layer))
            buf = self.store.slots[s.slot][:, :G]                      # [1, G, S, 2, D]
            buf.index_copy_(2, self.dev.pos if win is None else win.write, new)
        else:                    # resident: the new token was written home by qkv
            buf = self.store.gpu[s.layer][:, h0:h0 + G]                # [1, G, S, 2, D]
        if win is not None:      # the window's keys in position order, the own token at lens - 1
            buf = gathered(self.store.scratch, buf, win)               # [1, G, W, 2, D]
        qs = slice(h0 * r, (h0 + G) * r)
        scale = self.adapter.body.layers[s.layer].self_attn.scaling
        o = attend_decode(cur.q[:, qs], buf, lens, self.dev.cu_q, cu_k, scale)  # [1, 1, G*r, D]
        if cur.out is None and G == self.store.layout.kv_heads:   # fused: one group holds every head
            cur.out = o
            return
        if cur.out is None:
            cur.out = o.new_empty(1, 1, cur.q.shape[1], o.shape[-1])    # [B, T, Hq, D]
        cur.out[:, :, qs] = o

    def _copy_rows(self, layer: int) -> int:
        """Rows a step's copy into a slot moves for `layer`: a ring's every row (a fixed size, wherever
        the window lies in it), else the bucket's prefix."""
        return self.store.layout.ring(layer) or self.dev.copy_len

    def _write_ring(self, s: Stage) -> None:
        if not self._device_step(s):   # a device step's qkv wrote its ring row already
            super()._write_ring(s)

    # ---- LOSSY sparse steps (executor/replay/sparse_step.py) -----------------------------------
    def _attn_sparse_static(self, s: Stage, cur, new: torch.Tensor) -> None:
        """The group's offloaded heads attend the fetched rows of the slot and their own token
        (written after them, lengths from the device row); its resident heads, if any, their whole
        prefix at home (the new token written there by qkv), apart, as the eager `_attn_sparse`."""
        from kvpipe.executor.replay.sparse_step import ATTENDED
        h0, G, r = s.heads[0], len(s.heads), self.adapter.r
        k = max(0, min(G, self.store.layout.resident[s.layer] - h0))     # resident heads lead the group
        scale = self.adapter.body.layers[s.layer].self_attn.scaling
        if cur.out is None:
            cur.out = cur.q.new_empty(1, 1, cur.q.shape[1], cur.q.shape[-1])   # [B, T, Hq, D]
        if k:
            qs = slice(h0 * r, (h0 + k) * r)
            cur.out[:, :, qs] = attend_decode(cur.q[:, qs], self.store.gpu[s.layer][:, h0:h0 + k], self.dev.lens,
                                              self.dev.cu_q, self.dev.cu_k, scale)
        buf = self.store.slots[s.slot][:, k:G]                            # [1, G - k, S, 2, D]
        buf.index_copy_(2, self.dev.args[ATTENDED:ATTENDED + 1], new[:, k:])
        qs = slice((h0 + k) * r, (h0 + G) * r)
        # only the rows the bucket's steps can attend: FA2 sizes its key splits by the keys it is
        # given, and over the whole slot most splits would lie past the step's ~F x prefix rows
        rows = buf[:, :, :self.dev.sp_width]
        cur.out[:, :, qs] = attend_decode(cur.q[:, qs], rows, self.dev.sp_lens, self.dev.cu_q, self.dev.sp_cu_k, scale)

    def _quant(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._quant(s)
        self.q.encode_static(s.layer, self._kv[(s.phase, s.step, s.layer)][0], self.dev.args, self.side())

    def _score(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._score(s)
        cur = self._step(s)
        n = self.store.layout.resident[s.layer]
        q_off = cur.q[:, n * self.adapter.r:]
        # where the graph pipelines the stage (Stage.pieces: int4/int8 blocks), its units PIPE_UNITS
        # at a time, an event each: the layer's gathers start on the first piece's (the stage's
        # end as its consumers see it, `early_end`) and each head waits for its own piece's
        events = [torch.cuda.Event() for _ in range(s.pieces)] if s.pieces > 1 else None
        sel = self.sp.select_static(s.layer, q_off, self.dev.args, self.dev.bucket, events)
        if self.sparse_probe_due and self.probe_ref is None:   # kept for the probe after the first step
            self.probe_ref = (s.layer, q_off, sel)
        self._sel[(s.step, s.layer)] = sel
        if events is not None:   # each offloaded unit's piece's event, for its head's gather
            self._sel_events[(s.step, s.layer)] = [events[u // PIPE_UNITS] for u in range(len(s.heads))]
            self.early_end[s.id] = events[0]

    def _dequant(self, s: Stage) -> None:
        if not self._device_step(s) or self.sp is None:
            return super()._dequant(s)
        self.q.decode_static(s.layer, s.heads, s.group * self.group[s.phase], s.slot, self.dev.args)

    def _mlp(self, s: Stage) -> None:
        self._sel_events.pop((s.step, s.layer), None)
        if not self._device_step(s) or self.fused is None:
            return super()._mlp(s)
        self._sel.pop((s.step, s.layer), None)
        cur = self._step(s)
        cur.hidden, self._pending = self.fused.mlp(s.layer, cur.hidden, cur.out)
        cur.q = cur.out = None
        self._release((s.phase, s.step, s.layer))

    def _head(self, s: Stage) -> None:
        if not self._device_step(s):
            return super()._head(s)
        cur = self._step(s)
        if self.fused is None:
            logits = self.adapter.head(cur.hidden)                      # [B, V] fp32
        else:
            logits = self.fused.head(cur.hidden, self._pending)
            self._pending = None
        self.dev.logits.copy_(logits)
        if self.decoding is None:
            self.dev.ids.copy_(argmax_rows(logits)[:, None])       # greedy, the next step's input
        else:                                                           # token i = pos - context + 1
            self.dev.ids.copy_(self.decoding.pick(logits, self.dev.pos - (self.context - 1)).view(-1, 1))
        if self._side is not None:       # LOSSY sparse: the upkeep stream joins before the step ends
            torch.cuda.current_stream(self.store.device).wait_stream(self._side)
        self.last_logits = self.dev.logits
        self._cur = None

    def _fetch(self, s: Stage) -> None:
        if self._device_step(s) and self.sp is not None:   # LOSSY sparse: the eager gather of the selection
            base = s.group * self.group[s.phase]           # (n_max rows), each head after its unit's select
            key = (s.step, s.layer)
            self.moved[s.id] = self.sp.gather(s.layer, s.heads, base, s.slot, self._sel[key], self._sel_events.get(key))
            return
        if not self._device_step(s):
            return super()._fetch(s)
        base = s.group * self.group[s.phase]
        self.moved[s.id] = self.store.fetch(s.layer, s.heads, base, s.slot, self._copy_rows(s.layer))
