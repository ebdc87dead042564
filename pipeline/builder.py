"""Builds the stage graph of a workload under a plan. One builder serves every method: the
baselines are plans too (standard = all resident, one chunk; layerwise = whole-layer groups).

Per step (a prefill chunk or a decode token) and layer the compute lane runs `qkv`, one `attn`
per head group, then `mlp`. A group with offloaded heads first has its prefix fetched into a
transfer slot (`kv_fetch` on h2d; `kv_read` on disk first for disk units); the chunk's new K/V
of the layer's offloaded heads go home with one `kv_store` on d2h (and `kv_write` to disk). With a
codec on the disk link, `kv_compress` runs before each write and `kv_decompress` after each read,
on the cpu lane. With a GPU codec on h2d (host units only), `gpu_compress` runs on the gpu lane
before each `kv_store` and `gpu_decompress` after each `kv_fetch`, and both copies move the stored
bytes (raw / ratio). Slots are reused round-robin, so a fetch
waits only for the attention that last read its slot: the h2d lane runs ahead across group and
layer boundaries by `depth` slots (ping-pong prefetch with cross-layer lookahead). With `fused`,
decode steps count the small kernels of the fused decode pieces (layer_ops' fused forms)."""
from __future__ import annotations

from collections.abc import Iterator

from . import layer_ops
from .codecs import h2d_codec
from .lossy import PIPE_UNITS, QUANT_ENCODE_OPS, QUANT_TAIL_OPS
from .memory import (attn_ws_bytes, breakdown, hidden_bytes, layer_act_bytes, logits_bytes,
                     mlp_act_bytes)
from .model import ModelSpec
from .plan import PhasePlan, Plan, Tier, placement
from .stage import Alloc, Graph, Kind, Phase, Pool, Stage
from .windows import disk_rings, fetch_from, rings
from .workload import Workload


class _Builder:
    def __init__(self, model: ModelSpec, work: Workload, plan: Plan, fused: bool = False) -> None:
        self.m, self.w, self.plan, self.fused = model, work, plan, fused
        self.graph = Graph(model, work, plan)
        self.tiers = placement(model, plan)
        self.last_write: dict[tuple[int, int], int] = {}   # unit -> stage that last wrote it home
        self.slot_user: dict[int, int] = {}                # slot -> attn that last read it
        self.staging_user: dict[int, int] = {}             # host staging slot -> h2d that read it
        self.fetches = 0
        self.h2d = h2d_codec(plan)   # GPU codec of the h2d link ("none": raw copies)
        # layer -> (offloaded heads, of which on disk)
        self.offloaded = {
            layer: (tuple(h for h in range(model.kv_heads) if self.tiers[(layer, h)] is not Tier.GPU),
                    tuple(h for h in range(model.kv_heads) if self.tiers[(layer, h)] is Tier.DISK))
            for layer in range(model.layers)}
        self._members: dict[tuple[int, int, int], tuple[tuple[int, ...], ...]] = {}
        self._attn: dict[tuple[int, int, int, int], tuple] = {}   # attn_cost's memo
        # window layers' rings (memory.rings): their fetches start at the first visible token,
        # their stores write only what the ring keeps, after the step's fetches have read it
        self.ring = rings(model, work, plan)
        self.disk_ring = disk_rings(plan, self.ring)       # and their disk rows, where no codec frames them
        self.layer_fetches: list[int] = []                 # kv_fetch stages of the layer in flight

    def add(self, kind: Kind, tag: str, phase: Phase, step: int, layer, group, tokens,
            deps=(), **kw) -> int:
        sid = len(self.graph.stages)
        clean = tuple(dict.fromkeys(deps))   # first occurrences, in order
        if None in clean:
            clean = tuple(d for d in clean if d is not None)
        self.graph.stages.append(Stage(sid, kind, tag, phase, step, layer, group, tokens, clean, **kw))
        return sid

    def step(self, phase: Phase, idx: int, start: int, n: int, pp: PhasePlan,
             with_head: bool, after: int | None) -> int:
        """Stages of one step over tokens [start, start+n); returns its last compute stage."""
        m, B = self.m, self.w.batch
        b, unit_tok = m.dtype_bytes, m.kv_unit_bytes_per_token
        end, G = start + n, pp.group
        hid = hidden_bytes(m, B, n)
        fused = self.fused and phase is Phase.DECODE   # the fused pieces run in decode steps only
        qkv_ops = layer_ops.fused_qkv if fused else layer_ops.qkv
        mlp_ops = layer_ops.fused_mlp if fused else layer_ops.mlp
        head_ops = layer_ops.fused_head if fused else layer_ops.head
        prev = self.add(Kind.COMPUTE, "embed", phase, idx, None, None, (start, end), (after,),
                        mem_bytes=2 * hid, takes=((Pool.GPU, hid),), **_small(layer_ops.embed(m, B * n)))
        qkv_w = m.hidden * (m.q_heads + 2 * m.kv_heads) * m.head_dim * b
        mlp_w = m.layer_weight_bytes - qkv_w
        la, ma = layer_act_bytes(m, B, n), mlp_act_bytes(m, B, n)
        mlp_small = _small(mlp_ops(m, B * n))   # the step's small kernels: the same in every layer ...
        qkv_small: dict[int, dict] = {}         # ... and per count of resident heads
        for layer in range(m.layers):
            resident = m.kv_heads - len(self.offloaded[layer][0])
            if resident not in qkv_small:
                qkv_small[resident] = _small(qkv_ops(m, B * n, resident))
            q = self.add(Kind.COMPUTE, "qkv", phase, idx, layer, None, (start, end), (prev,),
                         flops=B * n * m.qkv_flops_per_token,
                         mem_bytes=qkv_w + la + B * n * resident * unit_tok, ops=6,
                         takes=((Pool.GPU, la),), **qkv_small[resident])
            scored = self.score(phase, idx, layer, start, q)
            self.layer_fetches = []
            attns = [self.group(phase, idx, layer, g, start, n, pp, scored) for g in range(m.kv_heads // G)]
            self.store(phase, idx, layer, start, n, q)
            last = layer == m.layers - 1 and not with_head
            prev = self.add(Kind.COMPUTE, "mlp", phase, idx, layer, None, (start, end), attns,
                            flops=B * n * m.mlp_flops_per_token, mem_bytes=mlp_w + ma + la, ops=8,
                            takes=((Pool.GPU, ma),), frees=((Pool.GPU, ma + la + (hid if last else 0)),),
                            **mlp_small)
        if with_head:
            lg = logits_bytes(m, B)
            prev = self.add(Kind.COMPUTE, "head", phase, idx, None, None, (end - 1, end), (prev,),
                            flops=B * m.head_flops_per_token, mem_bytes=m.head_weight_bytes + lg, ops=3,
                            takes=((Pool.GPU, lg),), frees=((Pool.GPU, lg + hid),), **_small(head_ops(m, B)))
        return prev

    def disk_codec(self, phase: Phase) -> str:
        return (self.plan.prefill if phase is Phase.PREFILL else self.plan.decode).codec("disk")

    def members(self, layer: int, g: int, size: int) -> tuple[tuple[int, ...], ...]:
        """Heads of group `g` in `layer`, those of them offloaded, and those on disk (memoised:
        the builder asks once per step for the same few groups)."""
        key = (layer, g, size)
        if key not in self._members:
            heads = tuple(range(g * size, (g + 1) * size))
            off, disk = self.offloaded[layer]
            self._members[key] = (heads, tuple(h for h in off if h in heads), tuple(h for h in disk if h in heads))
        return self._members[key]

    def attn_cost(self, layer: int, start: int, n: int, group: int) -> tuple:
        """(workspace bytes, query heads, FLOPs, keys read per head, small kernels) of one group's
        attention over the chunk [start, start+n), memoised: every group and every layer of the same
        window size has the same (the builder's hottest call; a 1M search asked it 200K times)."""
        m = self.m
        key = (m.windows[layer] if m.windows else 0, start, n, group)
        if key not in self._attn:
            q_heads = group * m.gqa_ratio
            flops, keys = m.attn_work(layer, start, n, q_heads)   # a window layer reads its visible keys only
            self._attn[key] = (attn_ws_bytes(m, self.w.batch, n, group), q_heads, flops, keys,
                               _small(layer_ops.attn(m, self.w.batch * n, group, start)))
        return self._attn[key]

    def score(self, phase: Phase, idx: int, layer: int, start: int, qkv: int) -> int:
        """LOSSY, sparse decode: one GPU stage scores the layer's offloaded heads' token sketches
        (or chunk summaries) for this step's queries and selects their tokens (cost inputs:
        LossySpec.score_cost), before any of their fetches (which it decides); returns it, or
        `qkv` when there is nothing to score."""
        lossy, off = self.plan.lossy, self.offloaded[layer][0]
        if lossy is None or lossy.sparse is None or phase is not Phase.DECODE or not off or start == 0:
            return qkv
        m, B = self.m, self.w.batch
        cost = lossy.score_cost(start, m.gqa_ratio, m.head_dim, m.dtype_bytes, B * len(off))
        # pipelined where the step selects int4/int8 blocks (PIPE_UNITS: measured faster on the
        # H200); a token selection stays whole (pipelined, sparse alone measured no faster)
        pieces = -(-len(off) // PIPE_UNITS) if lossy.blocks else 0
        return self.add(Kind.COMPUTE, "score", phase, idx, layer, None, (0, start), (qkv,), heads=off,
                        pieces=pieces, **cost)

    def store(self, phase: Phase, idx: int, layer: int, start: int, n: int, qkv: int) -> None:
        """Write the step's new K/V of the layer's offloaded heads home (d2h, then disk)."""
        off, disk = self.offloaded[layer]
        if not off:
            return
        nbytes = self.w.batch * n * self.m.kv_unit_bytes_per_token
        ring = self.ring[layer] if self.ring else 0
        after = self.layer_fetches if ring else []   # a ring row is overwritten once it has been read
        lossy = self.plan.lossy
        if lossy is not None and lossy.quant:   # LOSSY: quantised on the GPU, smaller bytes go home
            qbytes = self.w.batch * lossy.unit_bytes(n, self.m.head_dim, self.m.dtype_bytes)
            fills = (start + n) // lossy.group > start // lossy.group     # a block fills: it is quantised
            qkv = self.add(Kind.COMPUTE, "quant", phase, idx, layer, None, (start, start + n), (qkv,), heads=off,
                           mem_bytes=(nbytes + qbytes) * len(off), ops=QUANT_TAIL_OPS + QUANT_ENCODE_OPS * fills)
            nbytes = qbytes
        # Disk heads' new K/V pass through the layer's host write staging: the store waits until
        # the previous write of the layer has left it.
        staged = [self.last_write.get((layer, h)) for h in disk]
        if self.h2d != "none":   # encoded on the GPU (amortised: a block is encoded when it fills)
            qkv = self.add(Kind.GPU_COMPRESS, "gpu_compress", phase, idx, layer, None, (start, start + n), (qkv,),
                           heads=off, bytes=nbytes * len(off), mem_bytes=2 * nbytes * len(off), ops=4,
                           codec=self.h2d)   # planes split: raw bytes read and written
        kept = self.w.batch * min(n, ring) * self.m.kv_unit_bytes_per_token if ring else nbytes   # a ring: its last R
        store = self.add(Kind.D2H, "kv_store", phase, idx, layer, None, (start, start + n), [qkv] + staged + after,
                         heads=off, bytes=kept * (len(off) - len(disk)) + nbytes * len(disk),
                         ops=self.w.batch * len(off), codec=self.h2d)
        for h in off:
            self.last_write[(layer, h)] = store
        if disk:
            disk_kept = kept if self.disk_ring and self.disk_ring[layer] else nbytes   # a ring row: its last R
            codec, raw = self.disk_codec(phase), disk_kept * len(disk)
            src = store
            if codec != "none":   # compressed on the CPU pool, then written
                src = self.add(Kind.COMPRESS, "kv_compress", phase, idx, layer, None, (start, start + n),
                               (store,), heads=disk, bytes=raw, ops=self.w.batch * len(disk), codec=codec)
            write = self.add(Kind.DISK_WRITE, "kv_write", phase, idx, layer, None, (start, start + n),
                             (src,), heads=disk, bytes=raw, ops=self.w.batch * len(disk), codec=codec)
            for h in disk:
                self.last_write[(layer, h)] = write

    def dequant_work(self, lossy, sparse: bool, start: int, n_off: int, unit_fetch: int, deq: int) -> dict:
        """Cost inputs of one `dequant` stage. bf16/fp16 models on CUDA run it as ONE compiled call
        (executor/quant/store.py fused_decode: a K and a V kernel) over the whole byte slot, i.e. every
        full block of the KV capacity: an elementwise stream of its records read and its exact
        K/V written, costed at the profile's elementwise rate (small kernels); with sparse decode
        over the blocks (LossySpec.blocks), over the most selected records a step has
        (QuantHomes.decode_selected). Float32 models run
        the eager dequantise: a launch per op and head, at the HBM rate."""
        m, B = self.m, self.w.batch
        if m.dtype_bytes != 2 or sparse and not lossy.blocks:
            return {"mem_bytes": unit_fetch * n_off + deq, "ops": 2 * n_off}
        tokens = self.w.kv_capacity // lossy.group * lossy.group
        if sparse:   # sparse too: the compiled call over the most selected records a step can have
            tokens = min(tokens, lossy.max_fetched_blocks(self.w.kv_capacity) * lossy.group)
        read = B * n_off * lossy.unit_bytes(tokens, m.head_dim, m.dtype_bytes)
        return {"ops": 1, "small_ops": 2, "small_bytes": read + B * n_off * tokens * m.kv_unit_bytes_per_token}

    def group(self, phase: Phase, idx: int, layer: int, g: int, start: int, n: int,
              pp: PhasePlan, qkv: int) -> int:
        """Fetch (if needed), attention and write-back of one head group; returns the attn id."""
        m, B, unit_tok = self.m, self.w.batch, self.m.kv_unit_bytes_per_token
        heads, off, disk = self.members(layer, g, pp.group)
        fetch = slot = score = None
        deq, lossy = 0, self.plan.lossy
        sparse = lossy is not None and lossy.sparse is not None and phase is Phase.DECODE
        lo = fetch_from(m, self.ring, layer, start)   # a ring layer fetches what its window sees
        unit_fetch = (B * (lossy.fetch_bytes(start, m.head_dim, m.dtype_bytes) if sparse else   # one unit's prefix on the links
                           lossy.unit_bytes(start, m.head_dim, m.dtype_bytes))) if lossy else B * (start - lo) * unit_tok
        if off and start > 0:
            slot = self.fetches % pp.depth
            self.fetches += 1
            written = [self.last_write.get((layer, h)) for h in off]
            if sparse:   # LOSSY: `qkv` is the layer's `score` stage; nothing moves before it
                score = qkv
                written.append(score)
            read = None
            if disk:
                codec = self.disk_codec(phase)
                ringed_disk = bool(self.disk_ring and self.disk_ring[layer])   # a ring row: the window's keys
                raw = (B * start * unit_tok if lo and not ringed_disk else unit_fetch) * len(disk)
                read = self.add(Kind.DISK_READ, "kv_read", phase, idx, layer, g, (lo if ringed_disk else 0, start),
                                [self.last_write.get((layer, h)) for h in disk]
                                + [self.staging_user.get(slot), score], heads=disk, slot=slot,
                                bytes=raw, ops=B * len(disk), codec=codec)
                if codec != "none":   # decompressed into the host staging on the CPU pool
                    read = self.add(Kind.DECOMPRESS, "kv_decompress", phase, idx, layer, g, (0, start),
                                    (read,), heads=disk, slot=slot, bytes=raw, ops=B * len(disk), codec=codec)
            coded = self.h2d != "none"   # stored bytes cross, then are decoded on the GPU into the slot
            fetch = self.add(Kind.H2D, "kv_fetch", phase, idx, layer, g, (lo, start),
                             written + [self.slot_user.get(slot), read], heads=off, slot=slot,
                             bytes=unit_fetch * len(off), ops=B * len(off) * (1 + coded), codec=self.h2d,
                             gather=sparse)
            if disk:
                self.staging_user[slot] = fetch
            self.layer_fetches.append(fetch)
            if coded:
                fetch = self.add(Kind.GPU_DECOMPRESS, "gpu_decompress", phase, idx, layer, g, (0, start), (fetch,),
                                 heads=off, slot=slot, bytes=unit_fetch * len(off), mem_bytes=3 * unit_fetch * len(off),
                                 ops=4, codec=self.h2d)   # low plane set aside, then both planes interleaved
            if lossy is not None and lossy.quant:   # LOSSY: dequantised on the GPU after the fetch
                deq = B * (lossy.fetched_tokens(start) if sparse else start) * len(off) * unit_tok
                fetch = self.add(Kind.COMPUTE, "dequant", phase, idx, layer, g, (0, start), (fetch,), heads=off,
                                 slot=slot, takes=((Pool.GPU, deq),),   # freed by the attention that reads it
                                 **self.dequant_work(lossy, sparse, start, len(off), unit_fetch, deq))
        ws, q_heads, flops, keys, small = self.attn_cost(layer, start, n, pp.group)
        ringed = bool(self.ring and self.ring[layer])   # resident heads of a mixed group or a ring layer: copied out
        copy_in = 2 * B * (start - lo) * (len(heads) - len(off)) * unit_tok if off or ringed else 0
        attn = self.add(Kind.COMPUTE, "attn", phase, idx, layer, g, (start, start + n), (qkv, fetch),
                        heads=heads, slot=slot, flops=B * flops,
                        mem_bytes=B * keys * len(heads) * unit_tok
                        + 2 * B * n * q_heads * m.head_dim * m.dtype_bytes + 2 * ws + copy_in,
                        ops=5 if start else 2, takes=((Pool.GPU, ws),), frees=((Pool.GPU, ws + deq),),
                        kv_bytes=B * keys * len(heads) * unit_tok, **small)
        if fetch is not None:
            self.slot_user[slot] = attn
        return attn


def _small(ops: layer_ops.SmallOps) -> dict:
    return {"small_ops": ops.kernels, "small_bytes": ops.bytes}


def _begin(model: ModelSpec, work: Workload, plan: Plan, fused: bool) -> _Builder:
    plan.check(model, work)
    b = _Builder(model, work, plan, fused)
    mem = breakdown(model, work, plan)
    b.graph.static = [Alloc(Pool.GPU, "weights", mem.weights), Alloc(Pool.GPU, "kv", mem.gpu_kv),
                      Alloc(Pool.GPU, "buffers", mem.gpu_buffers), Alloc(Pool.HOST, "kv", mem.host_kv + mem.host_slack),
                      Alloc(Pool.HOST, "buffers", mem.host_buffers), Alloc(Pool.DISK, "kv", mem.disk_kv)]
    return b


def _starts(work: Workload, plan: Plan, starts: tuple[int, ...] | None) -> tuple[int, ...] | range:
    starts = range(0, work.context, plan.prefill.chunk) if starts is None else tuple(starts)
    assert all(0 <= a < c for a, c in zip(starts, tuple(starts[1:]) + (work.context,))), starts
    return starts


def _prefill(b: _Builder, chunks: range, starts: tuple[int, ...] | range) -> int | None:
    """The stages of prefill chunks `chunks`; returns the last one's last stage."""
    work, chunk, last = b.w, b.plan.prefill.chunk, None
    for i in chunks:
        start = starts[i]
        n = min(chunk, (starts[i + 1] if i + 1 < len(starts) else work.context) - start)
        last = b.step(Phase.PREFILL, i, start, n, b.plan.prefill, i == len(starts) - 1, None)
    return last


def build(model: ModelSpec, work: Workload, plan: Plan, *, prefill: bool | range = True,
          decode: range | None = None, fused: bool = False, starts: tuple[int, ...] | None = None) -> Graph:
    """The graph of the prefill (if `prefill`; a range: those prefill chunks only) and the decode
    steps in `decode` (default: all). A graph that starts past chunk 0 or with a decode window
    starts with the cache before it already home (used by the simulator's steady-state shortcuts).
    `fused`: decode steps run the fused decode pieces (replayed decode, pipeline/fusion.py); only
    their small-kernel counts differ, the stages are the same. `starts`: the prefill chunks' first
    tokens, ascending (default: every `chunk` tokens from 0); a first start past 0 continues a cache
    whose tokens before it are home (a conversation's next turn, executor/engine/live.py)."""
    b = _begin(model, work, plan, fused)
    last = None
    if prefill is not False:
        starts = _starts(work, plan, starts)
        last = _prefill(b, range(len(starts)) if prefill is True else prefill, starts)
    for k in (range(work.decode_tokens) if decode is None else decode):
        last = b.step(Phase.DECODE, k, work.context + k, 1, plan.decode, True, last)
    return b.graph


def step_count(work: Workload, plan: Plan, starts: tuple[int, ...] | None = None) -> int:
    """Steps of the whole run's graph: its prefill chunks, then its decode steps."""
    return len(_starts(work, plan, starts)) + work.decode_tokens


def build_lazily(model: ModelSpec, work: Workload, plan: Plan, *, fused: bool = False,
                 starts: tuple[int, ...] | None = None) -> tuple[Graph, Iterator[tuple[Phase, int]]]:
    """`build(...)`'s whole-run graph step by step: returned with its first prefill chunk's stages,
    and an iterator whose every `next()` appends the next step's (the other prefill chunks, then
    the decode steps; yielding its phase and index); once exhausted the graph equals `build`'s.
    The executor builds each step when its compute lane reaches it (runner.execute's `more`), so
    no token waits for the stages of the steps after it (a 128K prompt and 64 new tokens: 0.3 s of
    host time for the decode steps, 0.2 s for the prefill's 32 chunks)."""
    b = _begin(model, work, plan, fused)
    starts = _starts(work, plan, starts)
    last = _prefill(b, range(1), starts)

    def steps(last: int | None) -> Iterator[tuple[Phase, int]]:
        for i in range(1, len(starts)):
            last = _prefill(b, range(i, i + 1), starts)
            yield Phase.PREFILL, i
        for k in range(work.decode_tokens):
            last = b.step(Phase.DECODE, k, work.context + k, 1, plan.decode, True, last)
            yield Phase.DECODE, k
    return b.graph, steps(last)
