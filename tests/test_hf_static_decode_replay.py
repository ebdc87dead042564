"""The captured static decode step of HeadwiseCache (executor/hf/static.py) replayed across its prefix
buckets and across generate() calls on one cache, as benchmarks and servers run it: a warm-up, a
bucket captured, a later bucket captured, the first bucket replayed again by the next call. On CPU
the capture is tests/graph_tape.py (CUDA graphs' meaning: ops re-issued on the captured tensors, no
Python run on replay); on CUDA, real graphs at Llama-3-8B's head layout. References: the same step
issued without a graph (bitwise), HF's own generate() with its DynamicCache (tokens), and the
every-head-resident plan (bitwise)."""
import pytest
import torch
from transformers import LogitsProcessorList

import kvpipe
from graph_tape import StreamLog, TapeGraphs
from test_hf_static_decode import Record  # noqa: E402  (keeps each step's scores)

pytestmark = [pytest.mark.usefixtures("single_thread")]

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)


def calls(model, cache, ids: torch.Tensor, new: int, warm: int) -> list:
    """The benchmark's calls on one cache: a short warm-up prompt, two tokens, then the whole
    decode twice -> [(tokens, scores)] of each call."""
    out = []
    for prompt, n in ((ids[:, :warm], 3), (ids, 2), (ids, new), (ids, new)):
        cache.reset()
        rec = Record()
        toks = model.generate(prompt, cache=cache, max_new_tokens=n, logits_processor=LogitsProcessorList([rec]),
                              **GREEDY)
        out.append((toks, torch.stack(rec.scores)))
    return out


def test_tape_has_graph_meaning():
    """Faults caught in the CPU stand-in for CUDA graphs: a replay that runs the captured Python
    again (it would read the host int as it is now, not as captured), that returns new tensors
    instead of writing the captured ones, or that lets a host sync through."""
    x, state = torch.ones(3), {"n": 2}
    graphs = TapeGraphs()
    graph, out = graphs.capture(lambda: x * state["n"] + 1)
    x.fill_(5)
    state["n"] = 7
    before = out
    graph.replay()
    assert out is before and torch.equal(out, torch.full((3,), 11.0))   # 5 * 2 + 1: the int baked
    with pytest.raises(RuntimeError, match="host sync"):
        graphs.capture(lambda: x.sum().item())


@pytest.mark.parametrize("resident,group", [("none", 4), ("none", 1), (6, 2)])
def test_replayed_buckets_across_calls_equal_issued_step(tiny_model, resident, group):
    """Fault caught (found on the H200 at 8B shapes, streamed: two right tokens, then zeros): a
    bucket's captured write-back rebound by a later bucket's capture, so that replaying the first
    bucket again (the next generate() on the cache) copies the other bucket's K/V tensors (stale,
    or overwritten in the shared graph pool) into the host homes. Also any host value a step reads
    per token (baked into the capture). One group per layer (group = KV heads), four groups per
    layer over fewer slots, and a mixed plan; the prompt ends on a bucket's edge (128)."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    ids = torch.randint(0, 127, (1, 128), generator=torch.Generator().manual_seed(11))
    new = 10
    ref = model.generate(ids, max_new_tokens=new, **GREEDY)
    runs = {}
    for tape in (False, True):
        with kvpipe.HeadwiseCache(model, max_length=128 + new, resident=resident, group=group, chunk=64,
                                  decode="static") as cache:
            if tape:
                cache.step_recorder = TapeGraphs()
            runs[tape] = calls(model, cache, ids, new, warm=65)
            assert cache.replays == (2 + 1 + 2 * (new - 1) if tape else 0), cache.replays
            if tape:
                assert len(cache.static.graphs) == 2   # buckets 128 and the capacity (138)
    for (t_issued, s_issued), (t_tape, s_tape) in zip(runs[False], runs[True]):
        assert torch.equal(s_tape, s_issued), (s_tape - s_issued).abs().amax(dim=-1).flatten()
        assert torch.equal(t_tape, t_issued)
    assert torch.equal(runs[True][-1][0], ref), (runs[True][-1][0], ref)


@pytest.mark.parametrize("tape", [False, True])
def test_write_back_ordered_before_the_next_fetch(tiny_model, tape):
    """Faults caught (CPU runs every copy in issue order; a GPU runs streams concurrently): the next
    step (its fetch of a host home, or a replay overwriting the K/V being copied) not waiting for
    the write-back on the d2h stream; the write-back reading the step's K/V before the step made
    them; the next prefill writing homes before the last write-backs landed (hand_back); a stream
    switch, event or wait inside the captured step. `graph_tape.StreamLog` logs each op with its
    stream and the events and waits between streams, and lists the unordered conflicting pairs."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    ids = torch.randint(0, 127, (1, 128), generator=torch.Generator().manual_seed(13))
    new, log = 6, StreamLog()
    ref = model.generate(ids, max_new_tokens=new, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=128 + new, resident="none", group=2, chunk=64,
                              decode="static") as cache:
        cache.step_lanes = log
        if tape:
            cache.step_recorder = TapeGraphs()
        with log:
            runs = calls(model, cache, ids, new, warm=65)
        assert (cache.replays > 0) == tape
    steps = 2 + 1 + 2 * (new - 1)
    assert sum(op[0] == "d2h" and op[5] == "copy_" for op in log.ops) == steps * 3 * 4   # every write-back on d2h
    assert log.hazards() == []
    assert torch.equal(runs[-1][0], ref)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [8, 4])
def test_cuda_graph_offloaded_8b_heads_equal_resident_across_calls(tiny_model, group):
    """Fault caught on the GPU: the captured step of streamed heads at Llama-3-8B's head layout
    (8 KV heads, 32 query heads, head dim 128, bf16) giving other tokens than the step issued
    without a graph or than every head resident, once a bucket is replayed by a later generate()
    on the same cache (a prefix of a few K crossing buckets; group 8: one group per layer)."""
    model = tiny_model("llama", kv_heads=8, q_heads=32, head_dim=128, layers=4, hidden_size=256,
                       intermediate_size=512, max_position_embeddings=4096, dtype=torch.bfloat16, device="cuda")
    ctx, new = 3072, 24
    ids = torch.randint(0, 127, (1, ctx), generator=torch.Generator().manual_seed(12)).cuda()
    runs = {}
    for resident, decode in (("none", "graph"), ("none", "static"), ("all", "graph"), ("none", "eager")):
        with kvpipe.HeadwiseCache(model, max_length=ctx + new, resident=resident, group=group, chunk=1024,
                                  decode=decode) as cache:
            runs[resident, decode] = calls(model, cache, ids, new, warm=1025)
            assert cache.decode_path == decode, (cache.decode_path, cache.decode_note)
            assert (cache.replays > 0) == (decode == "graph")
    graph = runs["none", "graph"]
    for other in (("none", "static"), ("all", "graph")):
        for (t, s), (t_o, s_o) in zip(graph, runs[other]):
            assert torch.equal(s, s_o) and torch.equal(t, t_o), (other, t[0, -new:], t_o[0, -new:])
    assert torch.equal(graph[-1][0], runs["none", "eager"][-1][0])   # HF's own loop over the same cache


@pytest.mark.gpu
def test_cuda_graph_offloaded_32_layers_long_prefix_equal_resident(tiny_model):
    """Fault caught on the GPU, where streams run concurrently (CPU tests see issue order only): a
    step's write-back of its new K/V of offloaded heads (d2h stream) racing the next step's fetch
    of those host rows, or the next replay overwriting the K/V being copied, at the sizes that give
    a race room: Llama-3-8B's head layout with its 32 layers, a 16K prefix, group 8 (one group per
    layer, every layer's fetch into one slot), 16 steps over two buckets. The logits of every call
    of the captured and the issued step with every head in host RAM equal, bit for bit, those of
    every head resident (no host copy at all). HF's own loop is not the reference here: its
    attention rounds otherwise (prefix, own keys, merge), and bf16 tokens may part after a few."""
    model = tiny_model("llama", kv_heads=8, q_heads=32, head_dim=128, layers=32, hidden_size=256,
                       intermediate_size=512, max_position_embeddings=16512, dtype=torch.bfloat16, device="cuda")
    ctx, new = 16000, 16
    ids = torch.randint(0, 127, (1, ctx), generator=torch.Generator().manual_seed(14)).cuda()
    runs = {}
    for resident, decode in (("none", "graph"), ("none", "static"), ("all", "graph")):
        with kvpipe.HeadwiseCache(model, max_length=ctx + new, resident=resident, group=8, chunk=4096,
                                  decode=decode) as cache:
            runs[resident, decode] = calls(model, cache, ids, new, warm=4097)
            assert cache.decode_path == decode, (cache.decode_path, cache.decode_note)
    for other in (("none", "static"), ("all", "graph")):
        for k, ((t, s), (t_o, s_o)) in enumerate(zip(runs["none", "graph"], runs[other])):
            first = next((i for i in range(len(s)) if not torch.equal(s[i], s_o[i])), None)
            assert first is None and torch.equal(t, t_o), (other, k, "first step differing", first)
