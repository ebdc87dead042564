"""LOSSY (`--lossy int8|int4`): the fetched records of a GPU byte slot dequantised into the exact
transfer slot, and the exact tail of the prefix copied after them. How is decided once, in the
store's open, and compiled there on the slots' real shapes, so that no compile lands inside a
timed stage: on CUDA with float16 metadata one compiled call over the whole byte slot (FULL,
quant/blocks.py `fused_decode`) and, with sparse decode, a call over the sparse window of
selected records (WINDOW) by the hand-written Triton kernel of quant/dequant_triton.py where it
runs, else by the compiled call; elsewhere eager passes of DECODE_VALUES (EAGER). `paths()`
counts the calls by path and the compiles (reported in `run --json` decode_issue.dequant)."""
from __future__ import annotations

import logging
from collections import Counter

import torch

from kvpipe.executor.quant import dequant_triton
from kvpipe.executor.quant.blocks import dynamo_frames, fused_decode

DECODE_VALUES = 1 << 25   # eager decode: values dequantised per pass, bounding the float32
                          # temporaries (128 MiB each) under the exact-size output the plan books
# the dequantise's paths (SlotDequant.paths): the compiled call over the whole byte slot, over the
# sparse window, eager passes, and calls with no full block to decode
FULL, WINDOW, EAGER, EMPTY = "full", "window", "eager", "empty"


class SlotDequant:
    """The dequantise side of QuantHomes (its base class): reads the homes' store `s`, `codec`,
    `g`, `rec`, `blocks`, `qslots` and `tail`; `_open_dequant` decides the paths and compiles."""

    def _open_dequant(self) -> None:
        """Decide how this store's records are dequantised, once, and compile those calls now."""
        store, lo, c = self.s, self.s.layout, self.codec
        # the fetch's dequantise as one compiled kernel (fused_decode) on CUDA where it is bit-exact
        self.fused = store.cuda and c.fusable
        # why this store's calls run eagerly (None: compiled), reported by `paths`
        self.unfused = (None if self.fused else "not CUDA" if not store.cuda
                        else "float32 metadata (not bit-exact fused)")
        # LOSSY sparse too (executor/sparse/homes.py): a decode step's records are the selected
        # blocks', at most `sel_blocks` of them, decoded by a second call over that many
        sparse = lo.sparse
        self.sel_blocks = min(self.blocks, sparse.max_fetched_blocks(lo.capacity)) if sparse is not None else 0
        # that window decoded by the Triton kernel (dequant_triton.decode_window) where it runs, else
        # by the compiled call
        self.triton_decode = self.fused and dequant_triton.unavailable(c, store.device) is None
        self.triton_note: str | None = None   # why the Triton kernel was given up, if it was (paths)
        # the dequantise calls by path (`paths`): FULL, WINDOW, EAGER (and why), EMPTY (no full block)
        self.calls: Counter[str] = Counter()
        self.eager_why: Counter[str] = Counter()
        self.max_selected = 0                  # the most records one sparse dequantise decoded
        # in a dequant stage (dynamo_frames, and the Triton kernel's variants: compiled_variants)
        self.stage_compiles = self.stage_compile_failures = 0
        self.open_compiles = 0
        if self.fused:
            self._compile_at_open()

    def _compile_at_open(self) -> None:
        """Every call this store makes, run once on slot 0 (a group of every slot row; stale bytes
        decode into unread rows), so that each is compiled here."""
        store, lo, c = self.s, self.s.layout, self.codec
        seen, seen_t = dynamo_frames(), dequant_triton.compiled_variants()
        fused_decode()(c, self.qslots[0], store.slots[0], 0, lo.slot_heads)
        window = self.qslots[0][:, :, :self.sel_blocks * c.record]
        if self.sel_blocks and self.triton_decode:
            # both variants, the replayed one with its count a step row's slice (the same
            # pointer alignment, so the same variant): no compile in a stage or a capture
            from kvpipe.executor.replay.sparse_step import ARGS, N
            count = torch.zeros(ARGS, dtype=torch.int64, device=store.device)[N:N + 1]
            try:
                dequant_triton.decode_window(c, window, store.slots[0], 0, lo.slot_heads)
                dequant_triton.decode_window(c, window, store.slots[0], 0, lo.slot_heads, count=count)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:   # Triton: compiler missing, codegen or compile errors
                self.triton_decode = False   # the compiled call instead, said once
                self.triton_note = f"the Triton dequantise failed ({type(e).__name__}: {str(e)[:200]}); compiled call"
                logging.getLogger("kvpipe").warning(self.triton_note)
        if self.sel_blocks and not self.triton_decode:
            fused_decode()(c, window, store.slots[0], 0, lo.slot_heads)
        self.open_compiles = dynamo_frames()[1] - seen[1] + dequant_triton.compiled_variants() - seen_t

    def decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, length: int) -> None:
        """Compute lane: the fetched records dequantised into the exact slot rows of `heads`, then
        the exact tail tokens [full blocks, length) copied from the GPU tail."""
        nb = length // self.g
        # one compiled call for the whole fetch: no float32 temporaries
        self._decode(layer, heads, base, slot, nb, length - nb * self.g,
                     self.qslots[slot] if self.fused else None, FULL, self.unfused)

    def decode_selected(self, layer: int, heads: tuple[int, ...], base: int, slot: int, blocks: int,
                        length: int) -> None:
        """Compute lane, LOSSY sparse decode over quantised blocks: the first `blocks` records of
        the byte slot (the selected blocks', gathered in token order by executor/sparse/homes.py)
        dequantised into slot tokens [0, blocks * group), then the exact tail of the `length`-token
        prefix (its tokens past the full blocks) right after them. Only the selected records are
        decoded: eagerly, or on CUDA by the compiled call over the first `sel_blocks` records (a
        fixed shape; rows past `blocks` hold stale bytes, decoded into slot rows the attention
        never reads, and the tail overwrites the first of them after). The arithmetic is
        `decode`'s, so a record decodes to the same bits wherever it lies."""
        fits = blocks <= self.sel_blocks
        self.max_selected = max(self.max_selected, blocks)
        window = (self.qslots[slot][:, :, :self.sel_blocks * self.rec]      # a fixed shape: compiled once
                  if self.fused and fits else None)
        # an overflow first: LossySpec.max_fetched_blocks promises none, on any device
        why = self.unfused if fits else f"more selected blocks than the window ({self.sel_blocks})"
        self._decode(layer, heads, base, slot, blocks, length % self.g, window, WINDOW, why)

    def decode_static(self, layer: int, heads: tuple[int, ...], base: int, slot: int, a: torch.Tensor) -> None:
        """`decode_selected` for a replayed step: the window's records dequantised (one call, a fixed
        shape: the Triton kernel, which decodes only the step's a[N] kept blocks, or the compiled
        call, all of the window's), then the whole exact tail block copied to slot rows a[TAIL_AT]
        onwards (its rows past the step's tail are not attended; the step's own token overwrites the
        first)."""
        from kvpipe.executor.replay.sparse_step import N, TAIL_AT
        n = self.s.layout.resident[layer]
        j0, j1 = heads[0] - base, heads[-1] - base + 1      # (not counted in `calls`: captured once, replayed)
        window = self.qslots[slot][:, :, :self.sel_blocks * self.rec]
        if self.triton_decode:
            dequant_triton.decode_window(self.codec, window, self.s.slots[slot], j0, j1, count=a[N:N + 1])
        else:
            fused_decode()(self.codec, window, self.s.slots[slot], j0, j1)
        rows = a[TAIL_AT:TAIL_AT + 1] + torch.arange(self.g, device=self.s.device)
        self.s.slots[slot][:, j0:j1].index_copy_(2, rows, self.tail[layer][:, heads[0] - n:heads[-1] - n + 1])

    def paths(self) -> dict:
        """Which path this store's dequantise calls took (reported in `run --json`
        decode_issue.dequant): counts of compiled calls over the whole byte slot (`full`: prefill,
        decode without sparse) and of calls over the sparse window of `window_blocks` records
        (`window`, by the `window_kernel`),
        eager calls with their reasons (`eager_why`), calls with no full block (`empty`); the most
        records one sparse call decoded; which kernel decodes the window (`window_kernel`:
        "triton", dequant_triton's; "compiled", fused_decode's; "eager" where the store is unfused,
        reason in `eager_why`); and the compiles (dynamo's, and the Triton kernel's variants) in the
        store's open and inside dequant stages (a compile in a timed stage, or one that failed and
        ran eagerly: see `dynamo_frames`; dynamo's silent eager runs past its recompile limit are
        not seen)."""
        kernel = "triton" if self.triton_decode else "compiled" if self.fused else "eager"
        return {**{k: self.calls[k] for k in (FULL, WINDOW, EAGER, EMPTY)}, "eager_why": dict(self.eager_why),
                "window_blocks": self.sel_blocks, "window_kernel": kernel, "window_note": self.triton_note,
                "max_selected_blocks": self.max_selected,
                "open_compiles": self.open_compiles, "stage_compiles": self.stage_compiles,
                "stage_compile_failures": self.stage_compile_failures}

    def _decode(self, layer: int, heads: tuple[int, ...], base: int, slot: int, nb: int, tail: int,
                window: torch.Tensor | None, path: str, why: str | None) -> None:
        """The first `nb` records of the byte slot rows of `heads` dequantised into slot tokens
        [0, nb * group): by one call over `window` (the byte slot's leading records, a fixed shape)
        where given, counted as `path` (the sparse WINDOW by the Triton kernel where it runs, else,
        and the FULL slot always, compiled), else eagerly in passes of DECODE_VALUES,
        counted with the reason `why`; then `tail` exact tokens from the GPU tail right after them."""
        lo, g = self.s.layout, self.g
        n = lo.resident[layer]
        j0, j1 = heads[0] - base, heads[-1] - base + 1
        B, J = lo.batch, j1 - j0
        dst = self.s.slots[slot][:, j0:j1]                              # [B, J, S_cap, 2, D]
        if not nb:
            self.calls[EMPTY] += 1
        elif window is not None:
            self.calls[path] += 1
            seen, seen_t = dynamo_frames(), dequant_triton.compiled_variants()
            if self.triton_decode and path == WINDOW:
                dequant_triton.decode_window(self.codec, window, self.s.slots[slot], j0, j1)
            else:
                fused_decode()(self.codec, window, self.s.slots[slot], j0, j1)
            got = dynamo_frames()
            self.stage_compiles += got[1] - seen[1] + dequant_triton.compiled_variants() - seen_t
            self.stage_compile_failures += (got[0] - seen[0]) - (got[1] - seen[1])
        else:
            assert why is not None, (path, nb)       # eager only where unfused or past the window
            self.calls[EAGER] += 1
            self.eager_why[why] += 1
            rec = self.qslots[slot][:, j0:j1, :nb * self.rec].view(B, J, nb, self.rec)
            out = dst[:, :, :nb * g].view(B, J, nb, g, 2, lo.head_dim)
            step = max(1, DECODE_VALUES // (B * J * g * 2 * lo.head_dim))   # blocks per pass
            for c in range(0, nb, step):
                self.codec.decode(rec[:, :, c:c + step], out[:, :, c:c + step])
        if tail:
            dst[:, :, nb * g:nb * g + tail].copy_(self.tail[layer][:, heads[0] - n:heads[-1] - n + 1, :tail])
