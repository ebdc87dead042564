"""executor/kv/pinned.py: torch-pinned KV homes (decode replay) carved out of power-of-two blocks,
so that torch's rounding of each pinned allocation to a power of two costs a few percent of the
host tier, not up to twice it."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.kv.pinned import ALIGN, HostArena, carve, pow2_ceil, release_cached_pinned
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import preset
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.workload import Workload

GiB = 2**30


def _headwise(resident: int, group: int = 4, chunk: int = 16384) -> Plan:
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0)


@given(st.lists(st.integers(1, 3 * 2**20), min_size=1, max_size=40))
def test_carve_places_every_buffer_inside_one_block_without_overlap(sizes):
    """Law of the packing: blocks are powers of two (torch does not round them), every buffer
    lies ALIGN-aligned inside its block, no two overlap, and each block's unused tail is smaller
    than the largest buffer (so the carving never costs one rounded block per buffer)."""
    c = carve(sizes)
    padded = [-(-s // ALIGN) * ALIGN for s in sizes]     # a buffer's span: its pages
    assert all(b == pow2_ceil(b) for b in c.blocks)
    spans: dict[int, list[tuple[int, int]]] = {}
    for size, (b, at) in zip(padded, c.places):
        assert at % ALIGN == 0 and at + size <= c.blocks[b]
        spans.setdefault(b, []).append((at, at + size))
    for b, block in enumerate(c.blocks):
        ivs = sorted(spans[b])                      # every block holds at least one buffer
        assert all(e <= s for (_, e), (s, _) in zip(ivs, ivs[1:]))
        assert block - ivs[-1][1] < max(padded)
    assert sum(padded) <= c.total_bytes < sum(padded) + len(c.blocks) * max(padded)


def test_exact_512k_homes_pin_68_gib_where_one_torch_block_per_layer_pinned_128():
    """Fault caught (the exact 512K Llama-3-8B run killed by the OOM killer on a 125 GiB H200
    machine while the planner counted 64 GiB): replayed runs took one torch-pinned block per layer
    home, and torch rounds each up to a power of two: a home of 2 GiB + 16 KiB (524288 + 4 tokens)
    pinned 4 GiB, 128 GiB for the 32 layers. Carved, the homes take 68 GiB (a 64 GiB block holds
    31 layers, a 4 GiB block the last), within 7% of the exact homes; the memory model counts them."""
    spec = preset("llama-3-8b")
    work = Workload(524288, 4, 1)
    graph = build(spec, work, _headwise(0))
    lo = KVLayout.of(graph)
    home = lo.batch * lo.kv_heads * lo.capacity * 2 * lo.head_dim * spec.dtype_bytes
    assert home == 2 * GiB + 16 * 2**10
    exact = breakdown(spec, work, graph.plan.with_(replay=Replay.OFF)).host   # eager: registered homes
    assert exact == lo.layers * home == 64 * GiB + 512 * 2**10
    assert lo.layers * pow2_ceil(home) == 128 * GiB            # what the per-layer blocks pinned
    carved = carve([home] * lo.layers)
    assert carved.blocks == (64 * GiB, 4 * GiB)
    assert carved.total_bytes <= 1.07 * exact
    assert breakdown(spec, work, graph.plan).host == carved.total_bytes   # replayed: what torch pins


def test_replayed_store_carves_its_homes_and_they_hold_their_own_bytes():
    """Fault caught: the store allocating its torch-pinned homes one by one (each rounded by torch)
    instead of carving them together, or carving views that alias each other. On the CPU the arena
    carves plain memory the same way (CUDA pins it): every home lies in one of the arena's blocks,
    the blocks are exactly `carve`'s, and a value written to one home is read back from it alone."""
    layout = KVLayout(batch=1, kv_heads=4, head_dim=16, capacity=1030, resident=(0, 1, 4, 2), slots=2,
                      slot_heads=2)
    with KVStore(layout, torch.device("cpu"), torch.float32, replay=True) as store:
        homes = [h for h in store.host if h is not None]
        sizes = [h.numel() * h.element_size() for h in homes]
        assert [tuple(h.shape) for h in homes] == [(1, 4, 1030, 2, 16), (1, 3, 1030, 2, 16), (1, 2, 1030, 2, 16)]
        assert store.host[2] is None and store.host_bytes == sum(sizes)
        assert store.host_reserved_bytes == carve(sizes).total_bytes == sum(b.numel() for b in store.arena.blocks)
        assert len(store.arena.blocks) < len(homes)              # shared blocks, not one per home
        for i, h in enumerate(homes):
            h.fill_(float(i + 1))
        for i, h in enumerate(homes):
            base = next(b for b in store.arena.blocks
                        if b.data_ptr() <= h.data_ptr() < b.data_ptr() + b.numel())
            assert h.data_ptr() + sizes[i] <= base.data_ptr() + base.numel()
            assert bool((h == float(i + 1)).all())
    assert store.arena.blocks == [] and store.host_reserved_bytes == 0


def test_unreplayed_cpu_arena_makes_plain_buffers():
    """The CPU path without replay is unchanged: plain allocations, nothing reserved or carved."""
    with HostArena(pin=False) as arena:
        a, b = arena.empties([(3, 5), (0, 2)], torch.float16)
        assert a.shape == (3, 5) and b.numel() == 0 and arena.reserved_bytes == 0 and arena.blocks == []


@pytest.mark.gpu
def test_torch_pinned_homes_cost_torch_exactly_the_carved_blocks():
    """On CUDA: the carved homes are pinned by torch (decode replay captures copies from them),
    torch's pinned allocator grows by exactly the carving's blocks (no rounding on top: 384 MiB
    for four homes of 64 MiB + 16 KiB, which took 512 MiB as one torch block each), and a copy
    from the GPU lands in each home alone."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this torch has no pinned-allocator statistics")
    home = (1, 8, 16384 + 4, 2, 128)                             # bf16: 64 MiB + 16 KiB
    torch.zeros(1, device="cuda")   # torch 2.11 counts pinned blocks only once CUDA is initialised
    release_cached_pinned()
    # "active_bytes": torch 2.11 adds the "allocated_bytes" keys only once a block has been freed
    before = stats().get("active_bytes.current", 0)
    with HostArena(pin=True, torch_pinned=True) as arena:
        homes = arena.empties([home] * 4, torch.bfloat16)
        nbytes = homes[0].numel() * 2
        assert carve([nbytes] * 4).total_bytes == 384 * 2**20
        assert stats()["active_bytes.current"] - before == 384 * 2**20 == arena.reserved_bytes
        assert all(h.is_pinned() for h in homes)
        for i, h in enumerate(homes):
            h.copy_(torch.full(home, i + 1, dtype=torch.bfloat16, device="cuda"), non_blocking=True)
        torch.cuda.synchronize()
        assert all(bool((h == i + 1).all()) for i, h in enumerate(homes))
        del homes, h
    release_cached_pinned()
