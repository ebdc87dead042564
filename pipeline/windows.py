"""What sliding-window layers keep: a window layer's GPU and host units hold a ring of the last
W - 1 + REWIND_TOKENS tokens (layer_kinds.ring_tokens), their disk units every token; the
tokens a step fetches (the window's), the transfer slot's length, and the bytes of each tier
when units differ in size by layer. The memory model, the graph builder, the planner's search
and the executor's store all read them here."""
from __future__ import annotations

from .layer_kinds import first_visible, ring_tokens
from .model import ModelSpec
from .plan import Plan
from .workload import Workload


def rings(m: ModelSpec, work: Workload, plan: Plan) -> tuple[int, ...]:
    """Per layer, the tokens a GPU or host unit of it keeps in a ring (layer_kinds.ring_tokens;
    the executor's store holds position p at row p mod R), 0 where it keeps the whole length;
    () when no layer has a ring. Window layers of exact plans without an h2d codec only (LOSSY and
    compressed homes keep every token); disk units keep every token (their rows are append-only)."""
    if not m.windows or plan.lossy is not None or "none" != plan.decode.codec("h2d") or \
            "none" != plan.prefill.codec("h2d"):
        return ()
    out = tuple(ring_tokens(w, work.kv_capacity) for w in m.windows)
    return out if any(out) else ()


def fetch_from(m: ModelSpec, ring: tuple[int, ...], layer: int, start: int) -> int:
    """The first token of `layer`'s prefix that a step at `start` fetches: the first its window
    sees where the layer keeps a ring (`rings`), else 0 (the whole prefix)."""
    return first_visible(start, m.windows[layer]) if ring and ring[layer] else 0


def slot_tokens(m: ModelSpec, work: Workload, ring: tuple[int, ...]) -> int:
    """Tokens a transfer slot holds: the longest prefix any layer fetches (W - 1 for a ring layer)."""
    if not ring:
        return work.kv_capacity
    return max(m.windows[i] - 1 if r else work.kv_capacity for i, r in enumerate(ring))


def tier_counts(m: ModelSpec, plan: Plan) -> list[tuple[int, int, int]]:
    """(GPU, host, disk) units of every layer, as `placement` splits them (without building it):
    resident spread evenly, lowest heads first; disk from the highest offloaded head down, full
    layers before window layers."""
    L, H = m.layers, m.kv_heads
    res = [min(H, plan.resident // L + (layer < plan.resident % L)) for layer in range(L)]
    disk, left = [0] * L, plan.disk
    kinds = [[i for i in range(L) if not (m.windows and m.windows[i])], [i for i in range(L) if m.windows and m.windows[i]]]
    for layers in kinds:   # full layers' units first: a window layer's disk unit keeps every token
        for h in range(H - 1, -1, -1):
            for layer in layers:
                if left and h >= res[layer]:
                    disk[layer] += 1
                    left -= 1
    return [(r, H - r - d, d) for r, d in zip(res, disk)]


def window_homes(m: ModelSpec, work: Workload, plan: Plan, ring: tuple[int, ...]) -> tuple[int, int, int]:
    """(GPU, host, disk) KV bytes of a plan whose window layers keep rings (`rings`): a GPU or
    host unit holds its ring's tokens (or the whole length), a disk unit the whole length."""
    per_tok = work.batch * m.kv_unit_bytes_per_token
    pools = [0, 0, 0]
    for layer, counts in enumerate(tier_counts(m, plan)):
        held = (ring[layer] or work.kv_capacity, ring[layer] or work.kv_capacity, work.kv_capacity)
        for i in range(3):
            pools[i] += counts[i] * held[i] * per_tok
    return pools[0], pools[1], pools[2]


def scratch_tokens(m: ModelSpec, plan: Plan, ring: tuple[int, ...]) -> int:
    """Tokens of the GPU buffer a ring layer's resident heads' window is copied into, in position
    order, for attention (one group at a time on the compute stream): the longest window less its
    own token; 0 without resident units in ring layers."""
    counts = tier_counts(m, plan) if ring else []
    return max([m.windows[i] - 1 for i, r in enumerate(ring) if r and counts[i][0]], default=0)


def window_scratch_bytes(m: ModelSpec, work: Workload, plan: Plan, ring: tuple[int, ...]) -> int:
    """GPU bytes of that buffer: a group of the largest phase group's heads."""
    group = max(plan.prefill.group, plan.decode.group)
    return work.batch * group * scratch_tokens(m, plan, ring) * m.kv_unit_bytes_per_token


def least_true(n: int, ok) -> int:
    """The least d in [0, n] with ok(d) (n when none before it is), for ok monotone (false, then true)."""
    lo, hi = -1, n   # ok(lo) taken false, ok(hi) taken true
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def most_true(n: int, ok, start: int = 0) -> int:
    """The largest r in [0, n) with ok(r) (0 when none is), for ok monotone (true, then false);
    `start`: a first guess tried as the lower end."""
    lo = start if start > 0 and ok(start) else 0
    hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
