"""LOSSY, opt-in (`--sparse F`, with or without `--lossy int8|int4`): sparse decode steps as CUDA
graphs (executor/replay/capture.py). A graph bakes in its kernels' shapes and scalar arguments, and a
sparse step's counts change every step (the prefix, the token budget, the forced recent window,
the tokens fetched), so each step's counts live in a device row (`ARGS` fields, one int64 row a
step, `step_args` computes them on the host before the decode) that the host copies into the
graph's static buffer before each replay; the kernels read them there:

- the selection (rank_triton.select_static): the radix threshold and the compaction
  read (prefix, h0, h1, room, n) from the row; the output has a fixed width `n_max` (the most
  tokens, or blocks, a step of the graph's bucket fetches), zeros past n;
- the gather (SparseHomes.gather) moves `n_max` rows (the last n_max - n rows are token 0's,
  never attended: at most 1 + F x BUCKET_TOKENS extra rows a step);
- the sketch and the quantisation tail: a step's new key (K/V) is written at its device-held
  place in the unit's unsealed chunk (block), and that chunk's summary and sketch (block's
  record) are recomputed whole every step at the chunk's device-held index: the chunk is only
  ranked (the block only fetched) once it is full, by then from the same values the eager path
  uses, so the ranking and the records are the eager ones bit for bit; a filled block's record
  goes home by the eager write-back after the replay (the host knows which steps fill one);
- the attention reads the slot's first `attended` rows and the step's own K/V written after them,
  the length from the row (attention.attend_decode).

A graph serves the steps of one sealed-chunk bucket (the prefix's chunk index: the ranked tokens
are fixed within it), so a run captures ceil(steps / chunk) + 1 graphs at most. The eager sparse
step and the replayed one select the same tokens for the same queries; their attention rounds
differently (one varlen call against a merge of two), as on the exact path.
The host-side counts only; the device ops are SparseHomes' and QuantHomes' `*_static` methods."""
from __future__ import annotations

from dataclasses import dataclass

from kvpipe.pipeline.stage import Graph, Phase

# fields of a step's device row (int64): the selection's counts (sketch.split: total
# tokens or blocks, the unforced range [h0, h1), how many are ranked in, how many are kept), the
# rows the offloaded heads attend (besides their own token), where the exact quantisation tail
# lands in the slot, the new key's place in its sketch chunk and the chunk's index, the new K/V's
# place in its quantisation block
TOTAL, H0, H1, ROOM, N, ATTENDED, TAIL_AT, IN_CHUNK, CHUNK, IN_BLOCK = range(10)
ARGS = 10


@dataclass(frozen=True)
class Bucket:
    """Fixed shapes of one captured graph, the widest over its steps: `sealed` ranked tokens (the
    sketch's sealed prefix; with quantisation, blocks), `total_max` tokens (blocks) of the widest
    step, the unforced range [h0_min, h1_max) and `n_max` kept."""

    sealed: int
    total_max: int
    h0_min: int
    h1_max: int
    n_max: int


def step_args(spec, prefix: int) -> list[int]:
    """The ARGS row of a decode step over a `prefix`-token cache (its new token at position
    `prefix`) under LossySpec `spec` (sparse, with the sketch; blocks with quantisation)."""
    from kvpipe.executor.sparse import sketch
    c = spec.chunk
    if spec.blocks:
        total, ranked, budget, sink, recent = spec.block_args(prefix)
    else:
        total, ranked, budget, sink, recent = (prefix, prefix // c * c, spec.fetched_tokens(prefix),
                                               spec.sink, spec.recent)
    n, room, h0, h1 = sketch.split(total, ranked, budget, sink, recent)
    g = spec.group if spec.blocks else 1
    tail = prefix % g
    row = [0] * ARGS
    row[TOTAL], row[H0], row[H1], row[ROOM], row[N] = total, h0, h1, room, n
    row[ATTENDED] = n * g + tail
    row[TAIL_AT] = n * g
    row[IN_CHUNK], row[CHUNK] = prefix % c, prefix // c
    row[IN_BLOCK] = tail
    return row


def ranked(spec, prefix: int) -> int:
    """The ranked tokens (blocks) of a step over `prefix`: what fixes a graph's bucket."""
    c = spec.chunk
    return (prefix // c * c) // spec.group if spec.blocks else prefix // c * c


def bucket_of(spec, rows: list[list[int]], prefixes: list[int]) -> Bucket:
    """The shapes one graph needs for the steps with these rows (one sealed count)."""
    sealed = {ranked(spec, p) for p in prefixes}
    assert len(sealed) == 1, sealed
    return Bucket(sealed.pop(), max(r[TOTAL] for r in rows), min(r[H0] for r in rows),
                  max(r[H1] for r in rows), max(r[N] for r in rows))


def blocker(spec, prefixes: list[int], capacity: int, window_blocks: int) -> str | None:
    """Why these decode steps cannot be replayed under `spec`, or None: every step must rank (its
    forced tokens do not fill its count and not every token is kept: sketch.ranks' rule, read off
    the step's row, room > 0 and n < total), within the dequantise window; n < total also makes
    the slot hold a step's widest fetch, its exact tail and its own token."""
    g = spec.group if spec.blocks else 1
    for p in prefixes:
        r = step_args(spec, p)
        if r[ROOM] <= 0 or r[N] >= r[TOTAL]:
            return (f"sparse replay needs every decode step to rank tokens; at prefix {p} the forced "
                    f"ones (sink {spec.sink}, recent {spec.recent}) fill the step's {r[N]} (or F keeps all)")
        if spec.blocks and r[N] > window_blocks:
            return f"sparse replay: a step fetches {r[N]} blocks, past the dequantise window of {window_blocks}"
        # n < total bounds a fetch, its tail and its own token by prefix + 1 <= capacity
        assert (r[N] + 1) * g + 1 <= capacity, (p, r[N], g, capacity)
    return None


def lossy_blocker(graph: Graph, store) -> str | None:
    """Why this run's decode steps with lossy KV cannot be replayed (store: the opened KVStore),
    or None (also without lossy KV). Sparse steps replay (this module's counts) where the
    store's paths allow it and every step ranks; quantised KV without sparse decode is issued eagerly."""
    spec = graph.plan.lossy
    if spec is None:
        return None
    if store.sparse is None:
        return "decode replay runs lossy KV only with --sparse (quantised decode alone is issued eagerly)"
    why = store.sparse.replay_blocker()
    if why:
        return why
    lo = store.layout
    steps = sorted({s.step for s in graph.stages if s.phase is Phase.DECODE})
    window = store.q.sel_blocks if store.q is not None else 0
    return blocker(spec, [graph.workload.context + k for k in steps], lo.capacity, window)
