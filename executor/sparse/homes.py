"""LOSSY, opt-in (`--sparse F`): sparse decode of the offloaded units in the executor.

Per offloaded (layer, KV head) unit the GPU keeps the selection's summaries, counted in the plan's
GPU budget (LossySpec.gpu_summary_bytes): per sealed 64-token chunk the keys' per-channel min and
max, per sealed token a `bits`-bit sketch of its key within them (executor/sparse/sketch.py), and
the K of the chunk still filling (exact; it is sealed when full, so a key is sketched once).
`append` keeps them on the compute lane as K/V are made (prefill and decode). A decode step's
`score` stage (compute lane, one per layer) scores every sealed token of the layer's offloaded
units for the step's queries and selects, per unit, the sink, the recent window, the unsealed
tail and the best tokens: `idx` [B, n_off, N] on the GPU, N the same for every unit. Each group's
`kv_fetch` (h2d lane) then gathers exactly those tokens' K/V into its transfer slot, rows 0..N-1
in token order (executor/sparse/gather.py), and the attention reads them as the group's prefix.
Resident units stay exact and whole (a mixed group attends its resident heads over their whole
prefix, apart). With F = 1 every token is selected in order: the slot holds the exact prefix and
the step is the exact one.

The `score` stage runs on CUDA as Triton kernels (executor/sparse/rank_triton.py: the ranking reads
the packed codes once per token tile; the selection's compaction is two kernels after a
torch.topk), and as torch ops elsewhere or where Triton cannot run or fails (`score_path`,
`score_note`); both select the same tokens for the same ranking (sketch.select's rule).
With --lossy int8/int4 too (LOSSY twice) a step selects whole quantised blocks, since a record
holds a block of `group` tokens (executor/quant/store.py; `group` must divide the sketch's chunk):
each block ranks by its tokens' ranks (sketch.block_share, LossySpec's BLOCK_RANK), the selection
runs sketch.select's rule over blocks (LossySpec.block_args: the budget less the exact tail, the
blocks holding sink or recent tokens and the blocks not yet sketched forced), `gather` moves the
selected blocks' records (rows of `record` bytes) from the pinned record home into the byte slot
by the same gather modes, and the `dequant` stage decodes only those records
(QuantHomes.decode_selected) into slot rows in token order, the exact tail after them.
Refused: disk units (their rows are read whole) and an h2d codec (compressed homes).
Replayed decode (CUDA graphs, executor/replay/sparse_step.py) runs the `*_static` methods: the same
selection with the step's counts read on the device, a fixed-width gather."""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from kvpipe.pipeline.lossy import BLOCK_RANK, PIPE_UNITS, LossySpec

from kvpipe.executor.sparse import rank_triton, sketch
from kvpipe.executor.sparse.gather import RowGather

SCORE_ENV = "KVPIPE_SPARSE_SCORE"   # auto (default) | triton | torch: which path ranks the tokens


def score_path(device: torch.device, head_dim: int, bits: int) -> tuple[str, str | None]:
    """("triton" | "torch", why not triton or None): the Triton ranking on CUDA where it can run,
    unless KVPIPE_SPARSE_SCORE=torch asks for the torch path (=triton: a ValueError where it cannot)."""
    want = os.environ.get(SCORE_ENV, "auto")
    if want not in ("auto", "triton", "torch"):
        raise ValueError(f"{SCORE_ENV}: must be auto, triton or torch, got {want!r}")
    if want == "torch":
        return "torch", f"{SCORE_ENV}=torch"
    why = rank_triton.unavailable(device, head_dim, bits)
    if why is not None and want == "triton":
        raise ValueError(f"{SCORE_ENV}: triton cannot run here: {why}")
    return ("torch", why) if why else ("triton", None)


class SparseHomes:
    """The selection state of a KVStore's offloaded units (`store`, opened) under `spec`."""

    def __init__(self, store, spec: LossySpec) -> None:
        lo = store.layout
        if spec.sparse is None:
            raise ValueError("sparse: SparseHomes needs a spec with sparse decode")
        if lo.quant_bits and spec.chunk % lo.quant_group:
            raise ValueError(f"sparse: with --lossy the quantisation group ({lo.quant_group} tokens) must divide "
                             f"the sketch's chunk ({spec.chunk} tokens)")
        if lo.h2d_codec != "none":
            raise ValueError("sparse: kvpipe run cannot combine --sparse with an h2d codec (compressed homes)")
        if any(lo.disk):
            raise ValueError("sparse: kvpipe run's sparse decode needs every offloaded unit in host RAM "
                             "(no disk units); use --disk 0")
        self.s, self.spec = store, spec
        self.chunk, self.bits = spec.chunk, spec.sketch
        B, H, D, cap = lo.batch, lo.kv_heads, lo.head_dim, lo.capacity
        C = spec.summary_chunks(cap)      # one chunk past the capacity's whole ones: a replayed step summarises
        gpu = dict(device=store.device)   # the chunk filling at a device-held index (append_static), even a last part one
        off = [H - n for n in lo.resident]
        self.lo = [torch.empty(B, o, C, D, dtype=store.dtype, **gpu) if o else None for o in off]
        self.hi = [torch.empty(B, o, C, D, dtype=store.dtype, **gpu) if o else None for o in off]
        self.codes = [torch.empty(B, o, C * self.chunk, D * self.bits // 8, dtype=torch.uint8, **gpu) if o else None
                      for o in off]
        self.tail = [torch.empty(B, o, self.chunk, D, dtype=store.dtype, **gpu) if o else None for o in off]
        self.score_path, self.score_note = score_path(store.device, D, self.bits)
        self.radix = True   # the selection's threshold by the Triton radix select (else torch.topk)
        # the rows a gather moves: tokens [2, D] of the exact homes, or (quantised) records of a block,
        # read as 8-byte words (a record is a multiple of 16 bytes): a gather thread loads 8 bytes
        q = store.q if lo.quant_bits else None
        self.block = q.g if q is not None else 1
        if q is not None:
            words = lambda t, heads: t.view(torch.int64).view(B, heads, q.blocks, q.rec // 8)
            self.rows = RowGather(store, [None if h is None else words(h, h.shape[1]) for h in q.host],
                                  [words(t, lo.slot_heads) for t in q.qslots], q.rec, spec.max_fetched_blocks(cap))
        else:
            self.rows = RowGather(store, list(store.host), list(store.slots), store.token_bytes,
                                  spec.max_fetched_tokens(cap))

    @property
    def gather_mode(self) -> str:
        """How `gather` moves the selected rows: uva | staged | cpu (executor/sparse/gather.py)."""
        return self.rows.mode

    def paths(self) -> dict:
        """Which paths this run's sparse decode took (reported in `run --json` decode_issue.sparse):
        the gather (uva | staged | cpu), the ranking (triton | torch), the threshold (radix select
        or torch.topk), and why a faster path was left, if one was."""
        return {"gather": self.gather_mode, "score": self.score_path,
                "threshold": "radix" if self.radix else "topk", "note": self.score_note}

    @property
    def gpu_bytes(self) -> int:
        bufs = [t for ts in (self.lo, self.hi, self.codes, self.tail) for t in ts if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs)

    # ---- compute lane ------------------------------------------------------------------------
    def append(self, layer: int, kv: torch.Tensor, start: int) -> None:
        """The step's new K/V kv [B, H, T, 2, D]: the offloaded heads' keys join their unit's tail;
        the chunks that fill are summarised and sketched."""
        n, c = self.s.layout.resident[layer], self.chunk
        if self.tail[layer] is None:
            return
        had = start % c
        seq = torch.cat([self.tail[layer][:, :, :had], kv[:, n:, :, 0]], 2)       # [B, n_off, had+T, D]
        nb = seq.shape[2] // c
        if nb:
            full = seq[:, :, :nb * c]                                            # [B, n_off, nb*c, D]
            blocks = full.reshape(*full.shape[:2], nb, c, full.shape[-1])
            lo, hi = blocks.amin(3), blocks.amax(3)                              # [B, n_off, nb, D]
            c0 = start // c
            self.lo[layer][:, :, c0:c0 + nb] = lo
            self.hi[layer][:, :, c0:c0 + nb] = hi
            self.codes[layer][:, :, c0 * c:(c0 + nb) * c] = sketch.encode(full, lo, hi, self.bits)
        left = seq.shape[2] - nb * c
        self.tail[layer][:, :, :left] = seq[:, :, nb * c:]

    def attended(self, sel: torch.Tensor, prefix: int) -> int:
        """Tokens the offloaded heads attend for the selection `sel` over a `prefix`-token cache
        (besides the step's own): the selected tokens, or the selected blocks' and the exact tail."""
        if self.block == 1:
            return sel.shape[-1]
        return sel.shape[-1] * self.block + prefix % self.block

    def tokens(self, sel: torch.Tensor, prefix: int) -> torch.Tensor:
        """The token indices [B, n_off, attended] the selection `sel` stands for, ascending: itself,
        or every token of the selected blocks and the exact tail."""
        g = self.block
        if g == 1:
            return sel
        toks = (sel[..., None] * g + torch.arange(g, device=sel.device)).flatten(-2)
        tail = torch.arange(prefix // g * g, prefix, device=sel.device).expand(*sel.shape[:-1], -1)
        return torch.cat([toks, tail], -1)

    def select(self, layer: int, q: torch.Tensor, prefix: int) -> torch.Tensor:
        """Tokens each offloaded unit of `layer` fetches this step, for the queries q [B, n_off * r,
        1, D] of its heads over a `prefix`-token cache: idx [B, n_off, N] int64, ascending (with
        quantisation: blocks of `block` tokens, the selection over LossySpec.block_args)."""
        B, n_off = self.lo[layer].shape[:2]
        D = q.shape[-1]
        qg = q.reshape(B, n_off, -1, D)                                          # [B, n_off, r, D]
        C = prefix // self.chunk
        sealed = C * self.chunk
        sp, g = self.spec, self.block
        if g > 1:   # whole blocks: (blocks, sealed blocks, budget, sink, recent), all in blocks
            total, ranked, budget, sink, recent = sp.block_args(prefix)
        else:
            total, ranked, budget, sink, recent = prefix, sealed, sp.fetched_tokens(prefix), sp.sink, sp.recent
        if not sketch.ranks(total, ranked, budget, sink, recent):   # forced tokens / F = 1
            return sketch.select(torch.empty(B, n_off, ranked, device=q.device), total, budget, sink, recent)
        lo, hi, codes = self.lo[layer][:, :, :C], self.hi[layer][:, :, :C], self.codes[layer][:, :, :sealed]
        while self.score_path == "triton":
            try:
                share = rank_triton.rank(qg, lo, hi, codes, self.bits, blocks=g, how=BLOCK_RANK)   # [B, n_off, ranked]
                return rank_triton.select(share, total, budget, sink, recent, self.radix)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:   # Triton: compiler missing, codegen or compile errors
                first = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
                if self.radix:       # first the radix select alone gives way to torch.topk
                    self.radix, self.score_note = False, f"sparse: the Triton radix select failed ({first}); torch.topk"
                else:
                    self.score_path, self.score_note = "torch", f"sparse: the Triton ranking failed ({first}); torch path"
                logging.getLogger("kvpipe").warning(self.score_note)   # once each: the store keeps the slower path
        share = sketch.group_share(sketch.scores(qg, lo, hi, codes, self.bits))
        if g > 1:
            share = sketch.block_share(share, g, BLOCK_RANK)
        return sketch.select(share, total, budget, sink, recent)

    # ---- replayed steps (executor/replay/sparse_step.py: a step's counts in the device row `a`) ------
    def replay_blocker(self) -> str | None:
        """Why this store's sparse steps cannot be captured in a CUDA graph, or None."""
        if self.gather_mode != "uva":
            return f"sparse replay needs the zero-copy gather (this run's is {self.gather_mode})"
        if self.score_path != "triton" or not self.radix:
            return f"sparse replay needs the Triton ranking and radix select ({self.score_note})"
        q = self.s.q if self.s.layout.quant_bits else None
        if q is not None and not q.fused:
            return f"sparse replay needs the compiled dequantise window ({q.unfused})"
        return None

    def append_static(self, layer: int, kv: torch.Tensor, a: torch.Tensor,
                      side: torch.cuda.Stream | None = None) -> None:
        """`append` of one new token at a device-held place (a[IN_CHUNK] of chunk a[CHUNK]): its key
        joins the unsealed chunk, whose summary and sketch are recomputed whole (stale keys past it
        included: the chunk is ranked only once full, then from the eager path's values). `side`: a
        stream the summary and sketch (~15 kernels) run on, off the step's critical path: the key
        is written into the tail on the current stream first; the side stream then reads only the
        tail and writes chunk a[CHUNK]'s summary and codes, past the sealed chunks this step's
        `select_static` ranks (the bucket's), so nothing reads them before the caller joins it."""
        from kvpipe.executor.replay.sparse_step import CHUNK, IN_CHUNK
        t = self.tail[layer]
        if t is None:
            return
        n, c = self.s.layout.resident[layer], self.chunk
        t.index_copy_(2, a[IN_CHUNK:IN_CHUNK + 1], kv[:, n:, :, 0])               # [B, n_off, c, D]
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            lo, hi = t.amin(2, keepdim=True), t.amax(2, keepdim=True)             # [B, n_off, 1, D]
            at = a[CHUNK:CHUNK + 1]
            self.lo[layer].index_copy_(2, at, lo)
            self.hi[layer].index_copy_(2, at, hi)
            rows = at * c + torch.arange(c, device=t.device)
            self.codes[layer].index_copy_(2, rows, sketch.encode(t, lo, hi, self.bits))

    def select_static(self, layer: int, q: torch.Tensor, a: torch.Tensor, bucket,
                      events: list[torch.cuda.Event] | None = None) -> torch.Tensor:
        """`select` with the step's counts on the device (a[TOTAL:N + 1]) and the shapes of
        `bucket` (sparse_step.Bucket): idx [B, n_off, bucket.n_max], the step's a[N] tokens
        (blocks) ascending, then zeros. `events` (one per piece of PIPE_UNITS units, CUDA; given
        where the graph pipelines the stage, Stage.pieces: quantised blocks): the units are ranked
        and selected a piece at a time, each piece's event recorded once its rows are written
        (rank_triton.rank_select_static), so that their gathers (`gather`'s `ready`) start
        while the next pieces are still ranked."""
        B, n_off = self.lo[layer].shape[:2]
        D, g = q.shape[-1], self.block
        sealed = bucket.sealed * g                                 # tokens sketched and ranked
        C = sealed // self.chunk
        assert B == 1, B                                           # replay runs batch 1
        sel = rank_triton.rank_select_static(
            q.reshape(n_off, -1, D), self.lo[layer][0, :, :C], self.hi[layer][0, :, :C],
            self.codes[layer][0, :, :sealed], self.bits, a, bucket.total_max, bucket.h0_min, bucket.h1_max,
            bucket.n_max, blocks=g, how=BLOCK_RANK, piece=PIPE_UNITS if events is not None else 0, events=events)
        return sel[None]

    # ---- h2d lane ----------------------------------------------------------------------------
    def gather(self, layer: int, heads: tuple[int, ...], base: int, slot: int, idx: torch.Tensor,
               ready: list[torch.cuda.Event] | None = None) -> int:
        """The selected rows idx [B, n_off, N] of offloaded `heads` into the transfer slot
        (RowGather.gather); returns bytes moved."""
        return self.rows.gather(layer, heads, base, slot, idx, ready)
