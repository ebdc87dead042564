"""Lossy options, opt-in and labelled: group-wise int8/int4 quantisation of offloaded KV and sparse
decode (each step fetches a fraction of the offloaded tokens, chosen by a low-bit key sketch on
the GPU). This module holds the spec and the byte-size formulas the builder and the simulator use;
the tensor code is in executor/quant/quantize.py and executor/sparse/sketch.py; `kvpipe run`
executes quantisation (executor/quant/store.py: whole `group`-token blocks are stored quantised, the
block still filling stays exact on the GPU), sparse decode by the token sketch
(executor/sparse/homes.py), and both at once: then a step selects whole quantised blocks (a record
holds a block of `group` tokens), ranked by their tokens' sketch shares (`block_args`). Torch-free."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .lossy_select import selection

QUANT_BITS = {"int8": 8, "int4": 4}
# Default values per scale/zero-point. int4: group 32, the largest group within 1e-1 mean
# attention-output error on the needle set (figures: docs/PERFORMANCE.md).
DEFAULT_GROUP = {"int8": 64, "int4": 32}
# Channels per V group (V is grouped along its channels, per token; K along the block's tokens, per
# channel). int4: 64, where V's scale bytes halve (152 bytes a token and head against 160) and the
# needle-set error stays within 1e-1. Elsewhere the group.
DEFAULT_VGROUP = {"int4": 64}
META_BYTES = 2     # scale and zero-point (the group minimum) are float16 each
SKETCH_BITS = (2, 4, 8)   # bits per key channel of the GPU token sketch (executor/sparse/sketch.py)
# The score stage with the sketch on CUDA: the three Triton calls of executor/sparse/rank_triton.rank,
# then rank_triton.select: the threshold by a radix select (2 zeroed buffers and a fill, then 4
# passes of 2 kernels) and two compaction kernels (count per tile, write in token order). Bytes a
# sealed token, per unit: the radix passes read its float32 rank 4 times, the two compaction
# kernels twice more, and at most one int64 index is written. Counted from the code, not fitted.
SCORE_CALLS = 3
SELECT_KERNELS = 3 + 4 * 2 + 2
SELECT_BYTES_PER_TOKEN = 4 * 4 + 2 * 4 + 8
# Kernels the executor's `quant` stage issues per layer (executor/quant/store.py QuantHomes.encode): the
# new K/V joins the exact tail (a cat and a copy), and where a block fills, BlockCodec.encode
# quantises it (small kernels counted by executor/calibrate/op_inventory.py's recorder on CPU).
QUANT_TAIL_OPS = 2
QUANT_ENCODE_OPS = 68
# Sparse with quantisation: a block's rank from its tokens' log shares, "sum" (logsumexp: the block's
# estimated share of the group's attention) or "max" (its best token); "sum" has the lower
# needle-set error (pipeline/lossy_measured.py SPARSE_QUANT_MEASURED).
BLOCK_RANKS = ("sum", "max")
BLOCK_RANK = "sum"
# A replayed sparse step ranks and selects a layer's offloaded units PIPE_UNITS at a time, so the
# gathers of the first units start while the next are ranked (executor/replay/device_step.py `_score`,
# pipeline/cost.unit_pipelined): one unit at a time, the selection (mostly kernel latencies) is
# slower than the gather it feeds; a pair's stays under its two gathers. Only where a step selects
# quantised blocks (the builder's Stage.pieces): sparse alone, over tokens, is no faster pipelined
# (its pieces' score kernels run beside a longer gather).
PIPE_UNITS = 2
BLOCK_RANK_OPS = 1          # the block ranking's calls: one logsumexp (or amax) over a free reshape
                            # (executor/sparse/sketch.block_share; op_inventory counts 1)


@dataclass(frozen=True)
class LossySpec:
    """`quant`: None, "int8" or "int4" (asymmetric min-max, one scale and zero-point per `group`
    elements). `sparse`: None or the fraction of each decode step's offloaded tokens fetched, in
    (0, 1], `sink` first tokens and the `recent` last tokens always included. `sketch`: bits per
    key channel of a token-level key sketch kept on the GPU within the per-channel min/max of
    `chunk`-token chunks (executor/sparse/sketch.py); each step scores every token from it and
    fetches the best tokens, so nothing of the selection crosses the link. `error` is a measured
    error to report (e.g. {"attn_rel_err": ...}), or None where nothing was measured."""

    quant: str | None = None
    group: int | None = None
    vgroup: int | None = None    # channels per V group (of the head dim: gcd(vgroup, head_dim)); None: the default
    sparse: float | None = None
    chunk: int = 64
    sink: int = 64
    recent: int = 256
    sketch: int = 2
    error: tuple[tuple[str, float], ...] | None = None
    basis: str | None = None     # why the planner picked it (--max-error: the budget, the measured
                                 # error and its source); None when the user opted in (--lossy)

    def __post_init__(self) -> None:
        if self.quant is not None and self.quant not in QUANT_BITS:
            raise ValueError(f"lossy: unknown quantisation {self.quant!r} (known: {', '.join(QUANT_BITS)})")
        if self.sparse is not None and not (isinstance(self.sparse, (int, float)) and 0 < self.sparse <= 1):
            raise ValueError(f"sparse: must be a fraction in (0, 1], got {self.sparse!r}")
        if self.group is None:
            object.__setattr__(self, "group", DEFAULT_GROUP.get(self.quant, 64))
        if self.vgroup is None:
            object.__setattr__(self, "vgroup", DEFAULT_VGROUP.get(self.quant, self.group))
        for f in ("group", "vgroup", "chunk"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0 or v % 2:
                raise ValueError(f"{f}: must be a positive even integer, got {v!r}")
        if self.sketch not in SKETCH_BITS:
            raise ValueError(f"sketch: bits must be one of {SKETCH_BITS}, got {self.sketch!r}")
        for f in ("sink", "recent"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{f}: must be >= 0 tokens, got {v!r}")
        if self.quant is None and self.sparse is None:
            raise ValueError("lossy: a lossy spec needs quant or sparse (exact runs have no spec)")
        if self.basis is not None and not isinstance(self.basis, str):
            raise ValueError(f"basis: must be a sentence or None, got {self.basis!r}")

    @property
    def bits(self) -> int | None:
        return QUANT_BITS.get(self.quant) if self.quant else None

    def stored_bytes(self, elements: int, dtype_bytes: int, group: int | None = None) -> int:
        """Bytes that `elements` KV values occupy once stored: codes plus per-group metadata, in
        groups of `group` values (None: the spec's `group`)."""
        if self.quant is None:
            return elements * dtype_bytes
        groups = math.ceil(elements / (group or self.group))
        return math.ceil(elements * self.bits / 8) + 2 * META_BYTES * groups

    def ratio(self, dtype_bytes: int, head_dim: int = 128) -> float:
        """Stored K/V bytes per exact byte (1 without quantisation); int4 (group 32, V groups of 64
        channels), bf16, head_dim 128: 152 / 512 = 0.297."""
        return self.unit_bytes(self.group, head_dim, dtype_bytes) / (self.group * 2 * head_dim * dtype_bytes)

    def v_channels(self, head_dim: int) -> int:
        """Channels per V group for this head dim (the executor's BlockCodec)."""
        return math.gcd(self.vgroup, head_dim)

    @property
    def blocks(self) -> bool:
        """Whether a sparse step selects whole quantised blocks (sparse with quant)."""
        return self.sparse is not None and self.quant is not None

    def block_args(self, prefix: int) -> tuple[int, int, int, int, int]:
        """Sparse with quantisation: the selection over `group`-token blocks of a `prefix`-token
        cache as (blocks, sealed, budget, sink, recent), all in blocks, for sketch.select's
        rule: the full blocks (stored as records; the tokens past them are the exact tail, on the
        GPU, always attended), those whose tokens are all sketched (the rest are forced), the
        budget (the token budget ceil(sparse * prefix) less the tail, in blocks, rounded up), and
        the blocks holding a sink token or a recent-window token."""
        g = self.group
        nb = prefix // g
        sealed = prefix // self.chunk * self.chunk // g
        budget = max(0, -(-(math.ceil(self.sparse * prefix) - (prefix - nb * g)) // g))
        recent = nb - min(nb, max(0, prefix - self.recent) // g)
        return nb, sealed, budget, -(-self.sink // g), recent

    def fetched_blocks(self, prefix: int) -> int:
        """Sparse with quantisation: the blocks (records) one step fetches, sketch.count's
        rule over `block_args`: the budget, or the forced blocks where they alone are more."""
        nb, sealed, budget, sink, recent = self.block_args(prefix)
        head, tail = min(sink, nb), min(max(0, nb - recent), sealed)
        return min(nb, max(budget, head + nb - max(head, tail)))

    def max_fetched_blocks(self, capacity: int) -> int:
        """An upper bound of `fetched_blocks` over every prefix up to `capacity` (the executor's
        fixed-size dequantise of the selected records): the budget at the capacity plus one, or
        every block that can be forced (sink, recent window, an unsketched chunk) plus one."""
        g = self.group
        cap = capacity // g
        return min(cap, max(-(-math.ceil(self.sparse * capacity) // g) + 1,
                            -(-self.sink // g) + -(-self.recent // g) + self.chunk // g + 1))

    def max_fetched_tokens(self, capacity: int) -> int:
        """An upper bound of `fetched_tokens` over every prefix up to `capacity` (a fixed-size
        gather buffer): the budget at the capacity, or every token a step can force (sink, recent
        window, the unsealed tail chunk); fetched_tokens is not monotone where recent < chunk."""
        if self.sparse is None:
            return capacity
        if self.blocks:
            return min(capacity, self.max_fetched_blocks(capacity) * self.group + self.group - 1)
        return min(capacity, max(math.ceil(self.sparse * capacity), self.sink + self.recent + self.chunk))

    def fetched_tokens(self, prefix: int) -> int:
        """Tokens of a `prefix`-token cache one sparse decode step fetches (all without `sparse`):
        the budget ceil(sparse * prefix), never below the tokens every step fetches (the sink, the
        recent window and the unsealed tail chunk, as executor/sparse/sketch.py forces them),
        never above the prefix. With quantisation (`blocks`): the tokens the step attends, its
        fetched blocks' and the exact tail's."""
        if self.sparse is None:
            return prefix
        if self.blocks:
            return self.fetched_blocks(prefix) * self.group + prefix % self.group
        # the unsealed tail chunk has no sketch: fetched too
        head, tail = min(self.sink, prefix), min(max(0, prefix - self.recent), prefix // self.chunk * self.chunk)
        floor = head + prefix - max(head, tail)
        return min(prefix, max(math.ceil(self.sparse * prefix), floor))

    def unit_bytes(self, tokens: int, head_dim: int, dtype_bytes: int) -> int:
        """K and V of `tokens` tokens of one (layer, KV head) unit as stored (quantised or not): K
        in groups of `group` tokens per channel, V in groups of `v_channels` channels per token."""
        if self.quant is None:
            return tokens * 2 * head_dim * dtype_bytes
        n = tokens * head_dim
        return self.stored_bytes(n, dtype_bytes) + self.stored_bytes(n, dtype_bytes, self.v_channels(head_dim))

    def summary_chunks(self, prefix: int) -> int:
        """Chunks summarised per unit for a `prefix`-token capacity: the whole ones and one past
        them, which the executor holds even where `prefix` is whole chunks (executor/sparse/homes.py:
        a replayed step summarises the filling chunk at a device-held index)."""
        return prefix // self.chunk + 1

    def coarse_summary_bytes(self, prefix: int, head_dim: int, dtype_bytes: int) -> int:
        """Per-channel key min and max of every `chunk`-token chunk of one unit (kept on the GPU)."""
        return 0 if self.sparse is None else self.summary_chunks(prefix) * 2 * head_dim * dtype_bytes

    def sketch_bytes(self, prefix: int, head_dim: int, dtype_bytes: int) -> int:
        """The token sketch of one unit's summarised chunks (`sketch` bits a channel) plus the K of
        its unsealed tail chunk, exact (kept on the GPU); 0 without sparse decode."""
        if self.sparse is None:
            return 0
        tokens = self.summary_chunks(prefix) * self.chunk
        return math.ceil(tokens * head_dim * self.sketch / 8) + self.chunk * head_dim * dtype_bytes

    def gpu_summary_bytes(self, prefix: int, head_dim: int, dtype_bytes: int) -> int:
        """Everything the selection keeps on the GPU for one unit: chunk summaries and the sketch."""
        return self.coarse_summary_bytes(prefix, head_dim, dtype_bytes) + self.sketch_bytes(prefix, head_dim, dtype_bytes)

    def fetch_bytes(self, prefix: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes one decode step moves for one unit with a `prefix`-token cache: the selected tokens
        (quantised or not); nothing of the selection crosses the link."""
        if self.blocks:   # the selected blocks' records; the exact tail stays on the GPU
            return self.unit_bytes(self.fetched_blocks(prefix) * self.group, head_dim, dtype_bytes)
        return self.unit_bytes(self.fetched_tokens(prefix), head_dim, dtype_bytes)

    def score_cost(self, prefix: int, q_heads: int, head_dim: int, dtype_bytes: int, units: int = 1) -> dict:
        """Cost inputs of one decode step's `score` stage over `units` (sequence, offloaded unit)
        pairs with `prefix`-token caches and `q_heads` query heads per unit: the stage's own
        `flops`, `mem_bytes`, `ops` (issued calls), `kv_bytes` (the sketch's
        packed codes, streamed like a decode attention's K/V: pipeline/cost.py charges them at
        the profile's decode-attention rate plus its per-call term) and the selection's
        `small_ops`/`small_bytes` (pipeline/cost.small_seconds).
        The score (executor/sparse/rank_triton.py, then sketch.select): its kernel reads every
        sealed token's codes once and its chunk's min/max, rebuilds k_hat (2 FLOPs a channel) and
        dots it with each query head (2 a channel and head), writing float32 scores that the share
        kernel reads back and turns into a float32 rank; the selection then makes
        SELECT_KERNELS passes over the rank, SELECT_BYTES_PER_TOKEN bytes a token (its topk and
        prefix sums; see the constants). Nothing when the step ranks nothing (no sparse decode,
        F = 1, or the forced tokens fill the count)."""
        nothing = {"flops": 0, "mem_bytes": 0, "ops": 0}
        if self.sparse is None:
            return nothing
        sealed = prefix // self.chunk * self.chunk
        if self.blocks:   # the selection runs over blocks: after the ranking, a block rank
            nb, sb, _, sink, recent = self.block_args(prefix)
            n, head = self.fetched_blocks(prefix), min(sink, nb)
            total, floor = nb, head + nb - max(head, min(max(0, nb - recent), sb))
            extra_ops, extra_bytes, ranked = BLOCK_RANK_OPS, units * (sealed * 4 + 2 * sb * 4), sb
        else:
            n, total, ranked, extra_ops, extra_bytes = self.fetched_tokens(prefix), prefix, sealed, 0, 0
            floor = min(self.sink, prefix) + prefix - max(min(self.sink, prefix),
                                                           min(max(0, prefix - self.recent), sealed))
        if n >= total or n <= floor:
            return nothing
        codes = math.ceil(sealed * head_dim * self.sketch / 8)
        return {"flops": units * (2 + 2 * q_heads) * head_dim * sealed,
                "mem_bytes": units * (codes + sealed // self.chunk * 2 * head_dim * dtype_bytes
                                      + sealed * (2 * 4 * q_heads + 4)),
                "kv_bytes": units * codes, "ops": SCORE_CALLS + extra_ops,
                "small_ops": SELECT_KERNELS + extra_ops,
                "small_bytes": units * ranked * SELECT_BYTES_PER_TOKEN + extra_bytes}

    def describe(self, context: int | None = None) -> str:
        """The options; with `context`, what a sparse step there selects (`selection`)."""
        parts = []
        if self.quant:
            parts.append(f"{self.quant} KV (group {self.group}" + (f", V groups of {self.vgroup} channels"
                                                                  if self.vgroup != self.group else "") + ")")
        if self.sparse is not None:
            parts.append(f"sparse decode {self.sparse:.0%} of tokens (chunks {self.chunk}"
                         + (f", whole {self.group}-token blocks by {BLOCK_RANK} of token shares" if self.blocks else "")
                         + f", {self.sketch}-bit token sketch"
                         + f", sink {self.sink}, recent {self.recent})")
            sel = selection(self, context) if context else None
            if sel and sel["effective_fraction"] is not None:
                parts.append(f"at {context} tokens {sel['selected_tokens']} of {sel['eligible_tokens']} eligible "
                             f"tokens selected by score (effective {sel['effective_fraction']:.1%}), "
                             f"{sel['forced_tokens']} forced ({sel['forced_fraction']:.0%})")
        if self.basis:
            parts.append(self.basis)
        return ", ".join(parts)

    def to_json(self, context: int | None = None) -> dict:
        """The spec; with `context`, a sparse spec's `selection` there (effective and forced part)."""
        sel = selection(self, context) if context and self.sparse is not None else None
        return {**({"selection": sel} if sel else {}), "quant": self.quant, "group": self.group if self.quant else None,
                "vgroup": self.vgroup if self.quant else None, "sparse": self.sparse,
                "chunk": self.chunk if self.sparse is not None else None,
                "sink": self.sink if self.sparse is not None else None,
                "recent": self.recent if self.sparse is not None else None,
                "sketch": self.sketch if self.sparse is not None else None,
                "measured_error": dict(self.error) if self.error else None,
                **({"basis": self.basis} if self.basis else {})}

    @classmethod
    def from_json(cls, obj: dict | None) -> "LossySpec | None":
        if obj is None:
            return None
        keep = {k: obj[k] for k in ("quant", "group", "vgroup", "sparse", "chunk", "sink", "recent", "sketch", "basis")
                # a null sketch on a sparse plan is passed on, so the spec refuses it by name
                if k in obj and (obj[k] is not None or (k == "sketch" and obj.get("sparse") is not None))}
        err = obj.get("measured_error")
        return cls(**keep, error=tuple(sorted(err.items())) if err else None)
