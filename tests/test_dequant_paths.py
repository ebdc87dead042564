"""The dequantise's paths (executor/quant/store.py, LOSSY `--lossy int4|int8`, with `--sparse F` too):
which calls ran compiled (over the whole byte slot, or over the sparse window of selected records)
and which eagerly, and why (`QuantHomes.paths`, `run --json` decode_issue.dequant); and that the
compiled decode moves only the records it decodes and the slot rows they fill. Tiny random models
built here (no task accuracy); two GPU tests."""
from __future__ import annotations

import pytest
import torch

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.quant.blocks import BlockCodec, fused_decode
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload
from sparse_runs import CUDA_TINY, plan_of

G = 16   # int4 group of these tests: divides the sketch chunk 64
SPARSE_INT4 = LossySpec("int4", group=G, sparse=0.2, sink=4, recent=32)


def _expected(graph, spec: LossySpec) -> dict:
    """Dequantise calls per kind that `graph` makes: prefill fetches decode every full block of
    their prefix (`full`), sparse decode steps the selected blocks (`window`); none without a block."""
    got = {"full": 0, "window": 0, "empty": 0}
    for s in graph.stages:
        if s.tag != "dequant":
            continue
        P = s.tokens[1]
        sparse = s.phase is Phase.DECODE and spec.sparse is not None
        blocks = spec.fetched_blocks(P) if sparse else P // spec.group
        got["empty" if blocks == 0 else "window" if sparse else "full"] += 1
    return got


def _run(model, spec, decode=3, device="cpu"):
    mspec = HFAdapter(model).spec()
    graph = build(mspec, Workload(300, decode), plan_of(spec))
    ids = torch.randint(0, mspec.vocab, (1, 300), generator=torch.Generator().manual_seed(0))
    return graph, execute(graph, model, ids.to(device)).dequant_paths


def test_a_cpu_sparse_int4_run_counts_every_dequantise_eager_because_not_cuda(tiny_model):
    """Faults: a dequantise call left uncounted or counted twice (the counts must equal the graph's
    dequant stages), a CPU call reported as compiled, an eager call without its reason (here "not
    CUDA"), and the window size or the largest selection misreported against the plan's
    (LossySpec.max_fetched_blocks, fetched_blocks)."""
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    graph, paths = _run(model, SPARSE_INT4)
    want = _expected(graph, SPARSE_INT4)
    calls = want["full"] + want["window"]
    assert calls and want["window"]
    assert {k: paths[k] for k in ("full", "window", "eager", "empty")} == \
        {"full": 0, "window": 0, "eager": calls, "empty": want["empty"]}
    assert paths["eager_why"] == {"not CUDA": calls}
    cap = graph.workload.kv_capacity
    assert paths["window_blocks"] == min(cap // G, SPARSE_INT4.max_fetched_blocks(cap))
    steps = [s.tokens[1] for s in graph.stages if s.tag == "dequant" and s.phase is Phase.DECODE]
    assert paths["max_selected_blocks"] == max(SPARSE_INT4.fetched_blocks(P) for P in steps)
    assert paths["stage_compiles"] == paths["stage_compile_failures"] == paths["open_compiles"] == 0


def _store(spec: LossySpec, tiny_model, context: int = 2000):
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    graph = build(HFAdapter(model).spec(), Workload(context, 1), plan_of(spec))
    return KVStore(KVLayout.of(graph), "cpu", torch.float32)


def test_more_selected_blocks_than_the_window_are_counted_eager_with_that_reason(tiny_model):
    """Faults: a sparse dequantise of more records than the compiled window (the bound
    LossySpec.max_fetched_blocks broken) passing unseen, or reported under another reason (it
    must name the window, ahead of "not CUDA"), and the eager decode past the window decoding other
    bits than the codec's own decode of those records."""
    with _store(SPARSE_INT4, tiny_model) as store:
        q = store.q
        n = q.sel_blocks + 1
        assert n <= q.blocks
        gen = torch.Generator().manual_seed(5)
        kv = torch.randn(q.s.layout.slot_heads * n, G, 2, 16, generator=gen)
        q.qslots[0][0, :, :n * q.rec] = q.codec.encode(kv).view(q.s.layout.slot_heads, n * q.rec)
        q.decode_selected(0, (0, 1), 0, 0, n, n * G)
        q.decode_selected(0, (0, 1), 0, 0, q.sel_blocks, q.sel_blocks * G)
        paths = q.paths()
        ref = torch.empty(2, n, G, 2, 16)
        q.codec.decode(q.qslots[0][0, :, :n * q.rec].reshape(2, n, q.rec), ref)
        got = store.slots[0][0, :, :n * G].reshape(ref.shape)
    assert paths["eager"] == 2 and paths["window"] == 0
    assert paths["eager_why"] == {f"more selected blocks than the window ({n - 1})": 1, "not CUDA": 1}
    assert paths["max_selected_blocks"] == n
    assert torch.equal(got, ref)


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
def test_a_cuda_sparse_int4_run_dequantises_every_decode_step_by_the_window(tiny_model):
    """Faults, on a GPU: a sparse decode's dequantise falling to the eager passes (the window test
    failing, the window's kernel, Triton's or the compiled one, off for bf16 on CUDA), the
    prefill's not taking the compiled full slot, and a compile (or a failed one, then eager)
    inside a timed dequant stage instead of in the store's open."""
    model = tiny_model("llama", **CUDA_TINY)
    graph, paths = _run(model, SPARSE_INT4, decode=4, device="cuda")
    want = _expected(graph, SPARSE_INT4)
    assert want["window"] and want["full"]
    assert {k: paths[k] for k in ("full", "window", "eager", "empty")} == {**want, "eager": 0}
    assert paths["eager_why"] == {} and paths["max_selected_blocks"] <= paths["window_blocks"]
    assert paths["stage_compiles"] == paths["stage_compile_failures"] == 0


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
