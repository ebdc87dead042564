"""The executor: lane actors issue in order and after their dependencies; runs refuse what they
cannot run exactly; and where a byte lives changes no bit (offloaded == resident, bitwise), on
CPU always and on CUDA in bf16 with a randomized stress test of deep prefetch."""

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.engine.lanes import Lanes, cross_lane_waits
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Lane
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = ModelSpec("tiny", "llama", layers=3, hidden=64, q_heads=8, kv_heads=4, head_dim=16,
                 intermediate=96, vocab=128, dtype="fp32")


def headwise(group, chunk, depth, resident, decode_group=None, decode_depth=None, disk=0):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth),
                PhasePlan(decode_group or group, 1, decode_depth or depth), resident, disk)


# ---- lanes -----------------------------------------------------------------------------------
def test_cross_lane_waits_keep_the_latest_dep_per_other_lane():
    """Fault caught: a cross-lane wait missing, or not the latest dependency on its lane."""
    g = build(SPEC, Workload(12, 3), headwise(1, 4, 2, 2))
    waits = cross_lane_waits(g)
    for s in g.stages:
        other = [d for d in s.deps if g.stages[d].lane is not s.lane]
        lanes = {g.stages[d].lane for d in other}
        assert len(waits[s.id]) == len(lanes)
        for lane in lanes:
            assert max(d for d in other if g.stages[d].lane is lane) in waits[s.id]


def test_actors_issue_each_lane_in_order_after_its_dependencies():
    """Fault caught: an actor issuing out of lane order or before a dependency was enqueued."""
    g = build(SPEC, Workload(12, 4, 2), headwise(2, 5, 3, 1, decode_group=1))
    issued = []
    with Lanes(torch.device("cpu")) as lanes:
        spans = lanes.run(g, lambda s: issued.append(s.id))
    assert sorted(issued) == list(range(len(g.stages)))
    pos = {sid: i for i, sid in enumerate(issued)}
    for lane, order in g.lane_order().items():
        assert [pos[s.id] for s in order] == sorted(pos[s.id] for s in order), lane
    for s in g.stages:
        assert all(pos[d] < pos[s.id] for d in s.deps), s.name
    assert [sp.stage for sp in spans] == list(range(len(g.stages)))
    assert {s.lane for s in g.stages} == {Lane.GPU, Lane.H2D, Lane.D2H}


def test_stage_hook_sees_every_stage_once_before_it_runs(tiny_model):
    """Fault caught: the stage hook skipped or called twice (progress bars, stream stalls)."""
    model = tiny_model("qwen2", kv_heads=2, q_heads=4, head_dim=16)
    g = build(HFAdapter(model).spec(), Workload(9, 3), headwise(1, 4, 2, 1))
    seen = []
    res = execute(g, model, torch.zeros(1, 9, dtype=torch.long), stage_hook=lambda s: seen.append(s.id))
    assert sorted(seen) == list(range(len(g.stages))) and res.tokens.shape == (1, 4)


def test_an_error_in_a_stage_ends_the_run():
    """Fault caught: an exception in one lane swallowed while the other lanes wait forever."""
    g = build(SPEC, Workload(12, 2), headwise(1, 4, 2, 0))

    def issue(s):
        if s.tag == "kv_fetch":
            raise RuntimeError("copy failed")

    with Lanes(torch.device("cpu")) as lanes, pytest.raises(RuntimeError, match="copy failed"):
        lanes.run(g, issue)


# ---- refusals --------------------------------------------------------------------------------
def test_refuses_what_it_cannot_run_exactly(tiny_model):
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    spec = HFAdapter(model).spec()
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (3, 4, 16)
    ids = torch.zeros(1, 12, dtype=torch.long)
    w = Workload(12, 2)
    with pytest.raises(ValueError, match="prompt_ids"):
        execute(build(spec, w, headwise(1, 4, 2, 0)), model, ids[:, :11])
    with pytest.raises(ValueError, match="model.kv_heads"):
        execute(build(replace(SPEC, kv_heads=2), w, headwise(1, 4, 2, 0)), model, ids)
    with pytest.raises(ValueError, match="prefill"):
        execute(build(spec, w, headwise(1, 4, 2, 0), prefill=False), model, ids)
    with pytest.raises(ValueError, match="decode steps"):
        execute(build(spec, w, headwise(1, 4, 2, 0), decode=range(1, 2)), model, ids)
    with pytest.raises(ValueError, match="device"):
        execute(build(spec, w, headwise(1, 4, 2, 0)), model, ids, "meta")
    windowed = tiny_model("mistral", kv_heads=4, q_heads=8, head_dim=16, layers=3, sliding_window=8)
    with pytest.raises(ValueError, match="windows"):   # a graph built without the model's windows
        execute(build(spec, w, headwise(1, 4, 2, 0)), windowed, ids)


# ---- bitwise: where a byte lives changes no bit ---------------------------------------------
@st.composite
def schedules(draw, max_context=40, max_decode=6, families=("llama", "mistral", "qwen2", "qwen3")):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    layers = draw(st.integers(1, 3))
    context = draw(st.integers(1, max_context))
    divisors = [d for d in (1, 2, 4, 8) if kv % d == 0]
    return dict(
        family=draw(st.sampled_from(families)), kv=kv, layers=layers,
        head_dim=draw(st.sampled_from([16, 32])), batch=draw(st.integers(1, 2)),
        context=context, decode=draw(st.integers(0, max_decode)),
        chunk=draw(st.one_of(st.integers(1, context), st.sampled_from([context, max(1, context // 2 | 1)]))),
        group=draw(st.sampled_from(divisors)), decode_group=draw(st.sampled_from(divisors)),
        depth=draw(st.integers(1, 4)), decode_depth=draw(st.integers(1, 4)),
        resident=draw(st.integers(0, layers * kv)), seed=draw(st.integers(0, 2**31 - 1)))


def check_bitwise(model, case, device="cpu", hook=None, turns=None):
    """The case's plan and the same plan with every unit resident give identical bits. `turns`
    (a seed) runs the offloaded plan with the lane actors' turn order shuffled (CPU): a missing
    dependency then shows as wrong bits under some interleaving, not only under the fixed one."""
    spec = HFAdapter(model).spec()
    w = Workload(case["context"], case["decode"], case["batch"])
    plan = headwise(case["group"], case["chunk"], case["depth"], case["resident"],
                    case["decode_group"], case["decode_depth"])
    gen = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, spec.vocab, (w.batch, w.context), generator=gen)
    off = execute(build(spec, w, plan), model, ids, device, keep_logits=True, stage_hook=hook,
                  turns=None if turns is None else random.Random(turns))
    ref = execute(build(spec, w, plan.with_(resident=spec.units)), model, ids, device, keep_logits=True)
    assert torch.equal(off.step_logits, ref.step_logits), case
    assert torch.equal(off.tokens, ref.tokens), case
    assert torch.equal(off.last_logits, ref.last_logits), case   # two runs: the digest's input agrees
    return off, ref


turn_seeds = st.one_of(st.none(), st.integers(0, 2**32 - 1))   # None: the fixed turn order


@settings(max_examples=20, deadline=None)
@given(case=schedules(), turns=turn_seeds)
def test_offloaded_equals_resident_bitwise(tiny_model, case, turns):
    """Faults caught: any dependency, slot reuse or placement bug that changes a bit of the output
    when K/V live in host RAM, under the fixed or a shuffled lane turn order."""
    model = tiny_model(case["family"], kv_heads=case["kv"], q_heads=8, head_dim=case["head_dim"],
                       layers=case["layers"], dtype=torch.float32)
    check_bitwise(model, case, turns=turns)


@settings(max_examples=6, deadline=None)
@given(case=schedules(max_context=24, max_decode=3, families=("llama", "qwen3")), turns=turn_seeds)
def test_offloaded_equals_resident_bitwise_float64(tiny_model, case, turns):
    """Fault caught: as the fp32 property, in float64 (no rounding to hide behind)."""
    model = tiny_model(case["family"], kv_heads=case["kv"], q_heads=8, head_dim=case["head_dim"],
                       layers=case["layers"], dtype=torch.float64)
    check_bitwise(model, case, turns=turns)


@settings(max_examples=12, deadline=None)
@given(case=schedules(max_context=30, max_decode=4, families=("llama",)), turns=st.integers(0, 2**32 - 1))
def test_offloaded_equals_resident_bitwise_shuffled_turns(tiny_model, case, turns):
    """The property again, every example under a shuffled turn order (seeded by hypothesis)."""
    model = tiny_model("llama", kv_heads=case["kv"], q_heads=8, head_dim=case["head_dim"],
                       layers=case["layers"], dtype=torch.float32)
    check_bitwise(model, case, turns=turns)


# ---- CUDA ------------------------------------------------------------------------------------
def cuda_model(tiny_model, family="llama", kv=8, layers=3, hidden=512):
    return tiny_model(family, kv_heads=kv, q_heads=16, head_dim=64, layers=layers, dtype=torch.bfloat16,
                      device="cuda", hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=1024)


@pytest.mark.gpu
@settings(max_examples=15, deadline=None)
@given(case=schedules(max_context=300, max_decode=8), turns=turn_seeds)
def test_offloaded_equals_resident_bitwise_cuda_bf16(tiny_model, case, turns):
    """On CUDA the host's issue order is shuffled too (the streams' own timing adds the rest)."""
    model = cuda_model(tiny_model, case["family"], case["kv"], case["layers"], hidden=256)
    check_bitwise(model, case, "cuda", turns=turns)


def random_schedule(rng: random.Random, kv: int, layers: int) -> dict:
    context = rng.choice([rng.randint(1, 64), rng.randint(64, 1024), rng.randint(1024, 4096)])
    chunk = max(1, context // rng.randint(1, 10) + rng.randint(-3, 3))
    divisors = [d for d in (1, 2, 4, 8) if kv % d == 0]
    units = layers * kv
    return dict(context=context, decode=rng.randint(1, 10), batch=rng.randint(1, 2),
                chunk=min(chunk, context), group=rng.choice(divisors), decode_group=rng.choice(divisors),
                depth=rng.randint(1, 4), decode_depth=rng.randint(1, 4),
                resident=rng.choice([0, rng.randint(0, units), rng.randint(0, units // 2)]),
                seed=rng.randint(0, 2**31 - 1))


def jitter(rng: random.Random):
    """Stall stages' streams after their dependency waits: a quarter by up to ~0.5 ms, one in
    fifty by up to ~5 ms. The host then falls behind or runs ahead of the GPU and the lanes drift
    against each other, so a missing dependency (a fetch read before it landed, a slot
    overwritten while read) or a missing record_stream (new K/V reused before its write-back)
    shows as wrong bits. Without stalls the host is the bottleneck and such races never show."""
    def hook(stage):
        x = rng.random()
        if x < 0.02:
            torch.cuda._sleep(rng.randint(1_000_000, 10_000_000))
        elif x < 0.25:
            torch.cuda._sleep(rng.randint(50_000, 1_000_000))
    return hook


@pytest.mark.gpu
def test_stress_random_schedules_cuda(tiny_model):
    """At least 50 randomized schedules: deep prefetch (depth up to 4), concurrent write-back,
    random groups, resident counts and chunks, random stream delays; each bitwise equal to the
    same schedule with every unit resident."""
    model = cuda_model(tiny_model, "llama", kv=8, layers=3, hidden=512)
    rng = random.Random(1234)
    for i in range(50):
        case = random_schedule(rng, kv=8, layers=3)
        check_bitwise(model, case, "cuda", hook=jitter(rng) if i % 5 else None)


def test_warm_up_runs_one_chunk_and_leaves_the_run_unchanged(tiny_model):
    """`kvpipe run`'s warm-up: the plan's first prefill chunk (plus a short second one where the
    run attends to a prefix with cuDNN) and one decode step (a `standard` plan's whole-prompt
    chunk capped), with no effect on the bits of the run that follows."""
    from kvpipe.executor.engine.session import WARMUP_MAX_TOKENS, warm_up
    model = tiny_model("llama", kv_heads=2, layers=2, max_position_embeddings=16384)
    spec = HFAdapter(model).spec()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(2))
    graph = build(spec, Workload(200, 3, 1), headwise(1, 48, 2, 1))
    cold = execute(graph, model, ids, keep_logits=True)
    assert warm_up(graph, model, ids, torch.device("cpu")) == 48
    warm = execute(graph, model, ids, keep_logits=True)
    assert torch.equal(cold.step_logits, warm.step_logits) and torch.equal(cold.tokens, warm.tokens)
    long_ids = torch.randint(0, 128, (1, WARMUP_MAX_TOKENS + 5), generator=torch.Generator().manual_seed(3))
    whole = build(spec, Workload(WARMUP_MAX_TOKENS + 5, 1, 1), headwise(2, WARMUP_MAX_TOKENS + 5, 2, 4))
    assert warm_up(whole, model, long_ids, torch.device("cpu")) == WARMUP_MAX_TOKENS
    # Fault caught: a warm-up that never attends to a prefix with cuDNN (chunks >= CUDNN_MIN_ROWS),
    # leaving the first prefix attention's one-time ~0.8 s to the timed run: a second chunk of
    # CUDNN_MIN_ROWS tokens follows the first; none where the run's prefix chunks are too short.
    from kvpipe.executor.layers.attention import CUDNN_MIN_ROWS
    chunked = build(spec, Workload(1024, 1, 1), headwise(1, 512, 2, 1))
    assert warm_up(chunked, model, long_ids[:, :1024], torch.device("cpu")) == 512 + CUDNN_MIN_ROWS
    short_tail = build(spec, Workload(512 + CUDNN_MIN_ROWS - 1, 1, 1), headwise(1, 512, 2, 1))
    assert warm_up(short_tail, model, long_ids[:, :512 + CUDNN_MIN_ROWS - 1], torch.device("cpu")) == 512


def test_warm_up_collects_its_garbage_before_the_timed_run(tiny_model):
    """Fault caught: the warm-up's garbage (torch.compile's graphs on CUDA) left for a full
    collection that would fall inside the timed run. A reference cycle made before the warm-up,
    with the collector's automatic runs off, must be gone when it returns."""
    import gc
    import weakref

    from kvpipe.executor.engine.session import warm_up

    class Node:
        pass

    model = tiny_model("llama", kv_heads=2, layers=2)
    graph = build(HFAdapter(model).spec(), Workload(64, 1, 1), headwise(1, 32, 2, 1))
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(4))
    was = gc.isenabled()
    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None          # only a collection frees a cycle
        warm_up(graph, model, ids, torch.device("cpu"))
        assert gone() is None
    finally:
        if was:
            gc.enable()


@pytest.mark.gpu
def test_cuda_run_overlaps_copies_with_compute_and_reports_memory(tiny_model):
    """A model with Llama-3-8B-shaped layers: the h2d lane works while the compute lane does.
    Enough work per stage (32K prefix, 4096-token chunks) that the GPU, not the host's ~0.3 ms
    issue per stage, sets the pace; after a warm-up run, so cuDNN plan builds do not stall it."""
    model = tiny_model("llama", kv_heads=8, q_heads=32, head_dim=128, layers=2, dtype=torch.bfloat16,
                       device="cuda", hidden_size=4096, intermediate_size=14336, vocab_size=1024,
                       max_position_embeddings=65536)
    spec = HFAdapter(model).spec()
    w = Workload(32768, 8, 1)
    ids = torch.randint(0, 1024, (1, 32768), generator=torch.Generator().manual_seed(0))
    graph = build(spec, w, headwise(1, 4096, 2, 0))
    execute(graph, model, ids)
    res = execute(graph, model, ids)
    tr = res.trace
    spans = {lane: [sp for sp in tr.spans if tr.graph.stages[sp.stage].lane is lane] for lane in Lane}
    overlap = sum(max(0.0, min(a.end_s, b.end_s) - max(a.start_s, b.start_s))
                  for a in spans[Lane.H2D] for b in spans[Lane.GPU])
    assert overlap > 0.1 * sum(sp.end_s - sp.start_s for sp in spans[Lane.H2D]), overlap
    for s in tr.graph.stages:  # CUDA events: a stage starts after its dependencies ended
        assert all(tr.spans[d].end_s <= tr.spans[s.id].start_s + 1e-6 for d in s.deps), s.name
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert res.peak_gpu_bytes > weights
    assert res.host_pinned_bytes == spec.units * w.kv_capacity * spec.kv_unit_bytes_per_token
