"""What sliding-window layers keep: a window layer's units hold a ring of the last
W - 1 + REWIND_TOKENS tokens (layer_kinds.ring_tokens) in every tier (on disk a ring of blocks,
disk_rows.py); the tokens a step fetches (the window's), the transfer slot's length, and the
bytes of each tier when units differ in size by layer. The memory model, the graph builder, the
planner's search and the executor's store all read them here."""
from __future__ import annotations

from .disk_rows import block_bytes, ring_block_bytes, row_file_bytes
from .layer_kinds import first_visible, ring_tokens
from .model import ModelSpec
from .plan import Plan
from .workload import Workload


def rings(m: ModelSpec, work: Workload, plan: Plan) -> tuple[int, ...]:
    """Per layer, the tokens a GPU or host unit of it keeps in a ring (layer_kinds.ring_tokens;
    the executor's store holds position p at row p mod R), 0 where it keeps the whole length;
    () when no layer has a ring. Window layers of exact plans without an h2d codec only (LOSSY and
    compressed homes keep every token); their disk units too where `disk_rings` says so."""
    if not m.windows or not _plain_homes(plan):
        return ()
    out = tuple(ring_tokens(w, work.kv_capacity) for w in m.windows)
    return out if any(out) else ()


def _plain_homes(plan: Plan) -> bool:
    """Whether the plan's homes hold K/V as computed (exact, no h2d codec): rings and replay need it."""
    return plan.lossy is None and "none" == plan.decode.codec("h2d") == plan.prefill.codec("h2d")


def disk_rings(plan: Plan, ring: tuple[int, ...]) -> tuple[int, ...]:
    """The rings of the disk rows (`ring`, as the GPU and host units keep them), () where the disk
    link has a codec: its frames are written as blocks fill and read from the row's start."""
    codecs = {plan.prefill.codec("disk"), plan.decode.codec("disk")}
    return ring if codecs == {"none"} else ()


def disk_block(m: ModelSpec, work: Workload, plan: Plan) -> int:
    """The disk file's block for full rows: a unit's share of one prefill chunk's write."""
    return block_bytes(min(plan.prefill.chunk, work.context) * m.kv_unit_bytes_per_token)


def disk_unit_bytes(m: ModelSpec, work: Workload, plan: Plan, ring_tokens_: int) -> int:
    """Bytes one disk unit of a layer takes in the file, all sequences: a ring row's slots where
    the layer's disk rows keep a ring of `ring_tokens_` tokens (0: a full row, counted at the
    whole length, its partial tail block in RAM)."""
    tok = m.kv_unit_bytes_per_token
    if not ring_tokens_:
        return work.batch * work.kv_capacity * tok
    return work.batch * row_file_bytes(work.kv_capacity * tok, disk_block(m, work, plan), ring_tokens_ * tok)


def staging_row_bytes(m: ModelSpec, work: Workload, plan: Plan, ring: tuple[int, ...]) -> int:
    """Bytes of one disk unit's read staging row (one sequence), the longest read of a layer with
    disk units: a full row's whole length, a ring row's W - 1 keys from the start of the block
    holding the first (up to a block before it)."""
    tok, on = m.kv_unit_bytes_per_token, disk_rings(plan, ring)
    block = disk_block(m, work, plan)
    disk = [c[2] for c in tier_counts(m, plan)]
    return max([(m.windows[i] - 1) * tok + ring_block_bytes(on[i] * tok, block) if on and on[i]
                else work.kv_capacity * tok for i in range(m.layers) if disk[i]], default=0)


def fetch_from(m: ModelSpec, ring: tuple[int, ...], layer: int, start: int) -> int:
    """The first token of `layer`'s prefix that a step at `start` fetches: the first its window
    sees where the layer keeps a ring (`rings`), else 0 (the whole prefix)."""
    return first_visible(start, m.windows[layer]) if ring and ring[layer] else 0


def slot_tokens(m: ModelSpec, work: Workload, ring: tuple[int, ...]) -> int:
    """Tokens a transfer slot holds: the longest prefix any layer fetches, a ring layer's whole
    ring (R rows: a replayed step copies it all, a fixed size; an eager one its W - 1 keys)."""
    if not ring:
        return work.kv_capacity
    return max(r or work.kv_capacity for r in ring)


def tier_counts(m: ModelSpec, plan: Plan) -> list[tuple[int, int, int]]:
    """(GPU, host, disk) units of every layer, as `placement` splits them (without building it):
    resident spread evenly, lowest heads first; disk from the highest offloaded head down, full
    layers before window layers or, with plan.disk_windows_first, after them."""
    L, H = m.layers, m.kv_heads
    res = [min(H, plan.resident // L + (layer < plan.resident % L)) for layer in range(L)]
    disk, left = [0] * L, plan.disk
    kinds = [[i for i in range(L) if not (m.windows and m.windows[i])], [i for i in range(L) if m.windows and m.windows[i]]]
    for layers in kinds[::-1] if plan.disk_windows_first else kinds:
        for h in range(H - 1, -1, -1):
            for layer in layers:
                if left and h >= res[layer]:
                    disk[layer] += 1
                    left -= 1
    return [(r, H - r - d, d) for r, d in zip(res, disk)]


def windowed_offloaded(m: ModelSpec, resident: int) -> int:
    """Offloaded units of window layers with `resident` units spread as `placement` spreads them."""
    L, H = m.layers, m.kv_heads
    return sum(H - min(H, resident // L + (i < resident % L)) for i in range(L) if m.windows and m.windows[i])


def window_homes(m: ModelSpec, work: Workload, plan: Plan, ring: tuple[int, ...]) -> tuple[int, int, int]:
    """(GPU, host, disk) KV bytes of a plan whose window layers keep rings (`rings`): a GPU or
    host unit holds its ring's tokens (or the whole length), a disk unit its row in the file
    (`disk_unit_bytes`: a ring of blocks where `disk_rings` keeps one, else the whole length)."""
    per_tok = work.batch * m.kv_unit_bytes_per_token
    on_disk = disk_rings(plan, ring)
    pools = [0, 0, 0]
    for layer, (gpu, host, disk) in enumerate(tier_counts(m, plan)):
        held = ring[layer] or work.kv_capacity
        pools[0] += gpu * held * per_tok
        pools[1] += host * held * per_tok
        if disk:
            pools[2] += disk * disk_unit_bytes(m, work, plan, on_disk[layer] if on_disk else 0)
    return pools[0], pools[1], pools[2]


def scratch_tokens(m: ModelSpec, work: Workload, plan: Plan) -> int:
    """Tokens of the GPU buffer a window layer's keys are copied into in position order, one group
    at a time on the compute stream: the longest window shorter than the capacity (a replayed
    step gathers its W keys there, its own included; an eager step a ring layer's resident W - 1);
    0 without such windows or where the homes are not plain (lossy, an h2d codec: no replay, no ring)."""
    if not m.windows or not _plain_homes(plan):
        return 0
    return max([w for w in m.windows if 0 < w < work.kv_capacity], default=0)


def window_scratch_bytes(m: ModelSpec, work: Workload, plan: Plan) -> int:
    """GPU bytes of that buffer: a group of the largest phase group's heads."""
    group = max(plan.prefill.group, plan.decode.group)
    return work.batch * group * scratch_tokens(m, work, plan) * m.kv_unit_bytes_per_token


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
