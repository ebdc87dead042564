"""Laws of the torch-pinned KV homes (executor/kv/pinned.py HostArena, pipeline/pinned_blocks.carve)
that hold across calls and orders: buffers of every `empties()` call are disjoint from every other
buffer of the arena, and the carving fills its blocks largest buffer first (first-fit decreasing),
checked against expectations worked out here, not against `carve()` itself."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.kv.pinned import ALIGN, HostArena
from kvpipe.pipeline.pinned_blocks import carve

shapes = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 700)), min_size=1, max_size=6)


@settings(max_examples=20)
@given(calls=st.lists(shapes, min_size=2, max_size=4), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_every_buffer_of_every_empties_call_is_disjoint_from_every_other(calls, dtype):
    """Fault caught: a second `empties()` call that forgets where its blocks start among the
    arena's (indexing the first call's blocks), so its buffers alias the first call's and a write
    to one layer's home lands in another's. The arena carves plain memory on the CPU as CUDA pins
    it (torch_pinned without pin); every non-empty buffer of every call must own its bytes: no two
    byte ranges overlap, and a value written into each is read back from it alone."""
    with HostArena(pin=False, torch_pinned=True) as arena:
        bufs = [t for shapes_ in calls for t in arena.empties(list(shapes_), dtype)]
        live = [t for t in bufs if t.numel()]
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in live)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:])), spans
        for i, t in enumerate(live):
            t.fill_(i + 1)
        assert all(bool((t == i + 1).all()) for i, t in enumerate(live))
        assert [tuple(t.shape) for t in bufs] == [s for shapes_ in calls for s in shapes_]


def _first_fit_decreasing_holds(sizes, c):
    """The carve docstring's rule, checked from the outside: within a block, buffers lie in
    decreasing padded size (ties by index) at increasing offsets, packed from 0; and a buffer in a
    later block did not fit the room an earlier block had left when it came up in that order."""
    padded = [-(-s // ALIGN) * ALIGN for s in sizes]
    order = sorted(range(len(sizes)), key=lambda j: (-padded[j], j))
    rank = {j: k for k, j in enumerate(order)}
    by_block: dict[int, list[int]] = {}
    for j, (b, _) in enumerate(c.places):
        by_block.setdefault(b, []).append(j)
    for b, members in by_block.items():
        members.sort(key=lambda j: c.places[j][1])
        assert [rank[j] for j in members] == sorted(rank[j] for j in members), (b, members)
        at = 0
        for j in members:
            assert c.places[j][1] == at
            at += padded[j]
    for j, (b, _) in enumerate(c.places):
        for earlier in range(b):
            used = sum(padded[i] for i in by_block[earlier] if rank[i] < rank[j])
            assert used + padded[j] > c.blocks[earlier], (j, b, earlier)


@given(st.lists(st.integers(1, 3 * 2**20), min_size=1, max_size=30))
def test_carving_fills_largest_first(sizes):
    """Fault caught: the blocks filled smallest buffer first (the unused-tail law of test_pinned.py
    still holds then, and the store test compares against carve() itself): every placement must
    follow first-fit in decreasing size."""
    _first_fit_decreasing_holds(sizes, carve(sizes))


def test_largest_first_pins_fewer_bytes_than_smallest_first_by_hand():
    """Fault caught: smallest-first carving, which costs pinned bytes. Buffers of 3, 1, 1 and 1
    pages (P = 4096 bytes), 6 pages in all: the first block is the largest power of two not above
    6 P, 4 P. Largest first: the 3-page buffer at 0, one 1-page buffer at 3 P; the two left take
    a 2 P block: 6 P pinned. Smallest first would put the three 1-page buffers in the 4 P block,
    leaving the 3-page one a 4 P block of its own: 8 P."""
    P = ALIGN
    c = carve([3 * P, P, P, P])
    assert c.blocks == (4 * P, 2 * P) and c.total_bytes == 6 * P
    assert c.places == ((0, 0), (0, 3 * P), (1, 0), (1, P))
    # and sizes that are not whole pages take their pages: 2.5 pages is 3
    assert carve([int(2.5 * P), P, P, P]).blocks == (4 * P, 2 * P)
