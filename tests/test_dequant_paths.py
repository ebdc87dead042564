"""The compiled dequantise of executor/qstore.py (LOSSY `--lossy int4|int8`, with `--sparse F`
too) moves only the records it decodes and the slot rows they fill. One GPU test."""
from __future__ import annotations

import pytest
import torch

from kvpipe.executor.qstore import BlockCodec, fused_decode

G = 16   # int4 group of these tests: divides the sketch chunk 64


def test_the_compiled_decode_reads_and_writes_only_the_window_not_the_whole_slot():
    """Fault: the compiled dequantise taking the whole exact slot [B, heads, S_cap, 2, D] as an
    input it writes through a slice (AOTAutograd then scatters into a copy of the whole slot and
    copies it back: every call streams all S_cap tokens whatever it decodes; on the H200 the 820
    selected records of a 128K step took 1.24 ms, as long as the full slot). No tensor of the
    compiled graph may be larger than the rows decoded; the rows decoded equal the eager decode bit
    for bit, and the slot's other tokens and heads are left as they were."""
    seen = []

    def record(graph):   # inductor's post-grad hook: every tensor the compiled graph makes or takes
        seen.extend(n.meta["val"].numel() for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))

    B, H, D, blocks, sel, j0, j1 = 1, 4, 64, 24, 5, 1, 3    # shapes no other test compiles
    codec = BlockCodec(4, G, D, torch.bfloat16, 32)
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(B * H * blocks, G, 2, D, generator=gen).to(torch.bfloat16)
    qslot = codec.encode(kv).view(B, H, blocks * codec.record)
    slot = torch.full((B, H, blocks * G + 5, 2, D), float("nan"), dtype=torch.bfloat16)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        fused_decode()(codec, qslot[:, :, :sel * codec.record], slot, j0, j1)
    window = B * (j1 - j0) * sel * G * 2 * D
    assert seen, "the compiled decode was not compiled here (cached?): nothing to inspect"
    assert max(seen) == window < slot.numel() // 4
    ref = torch.empty(B, j1 - j0, sel, G, 2, D, dtype=torch.bfloat16)
    codec.decode(qslot[:, j0:j1, :sel * codec.record].reshape(B, j1 - j0, sel, codec.record), ref)
    assert torch.equal(slot[:, j0:j1, :sel * G].reshape(ref.shape).view(torch.int16), ref.view(torch.int16))
    assert bool(slot[:, j0:j1, sel * G:].isnan().all()) and bool(slot[:, :j0].isnan().all()) \
        and bool(slot[:, j1:].isnan().all())


@pytest.mark.gpu
def test_the_compiled_window_decode_allocates_no_slot_sized_temporary_on_cuda():
    """Fault, on a GPU: the compiled dequantise of a sparse window writing the whole exact slot
    through a slot-sized temporary (the H200's 1.24 ms a layer for 820 of 4096 blocks): the peak
    memory of a window call must stay well under the slot's size. The compile caches are reset
    first (torch.compiler.reset) so that an earlier test's compiles cannot have used up dynamo's
    recompile limit (past it, calls run eagerly, with float32 temporaries)."""
    torch.compiler.reset()
    dev = torch.device("cuda")
    B, H, D, blocks = 1, 8, 128, 1024
    sel = blocks // 5 + 1
    codec = BlockCodec(4, 32, D, torch.bfloat16, 64)
    kv = torch.randn(B * H * blocks, 32, 2, D, device=dev).to(torch.bfloat16)
    qslot = codec.encode(kv).view(B, H, blocks * codec.record)
    slot = torch.zeros(B, H, blocks * 32 + 4, 2, D, dtype=torch.bfloat16, device=dev)
    win = qslot[:, :, :sel * codec.record]
    fused_decode()(codec, win, slot, 0, H)          # compiled here, outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_decode()(codec, win, slot, 0, H)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    slot_bytes = slot.numel() * slot.element_size()
    assert extra < slot_bytes // 2, (extra, slot_bytes)
    ref = torch.empty(B, H, sel, 32, 2, D, dtype=torch.bfloat16, device=dev)
    codec.decode(win.reshape(B, H, sel, codec.record), ref)
    assert torch.equal(slot[:, :, :sel * 32].reshape(ref.shape).view(torch.int16), ref.view(torch.int16))
