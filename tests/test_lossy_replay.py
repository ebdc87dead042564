"""LOSSY sparse decode replayed as CUDA graphs (executor/replay/sparse_step.py): a step's counts come from
a device row, the selection has a fixed width, the sketch chunk and the quantisation block are
rebuilt at device-held places. CPU: the rows against hand-computed figures, the buckets, the plan's
replay rule. CUDA: the device-row selection against the test's own stable top-k, and whole runs:
replayed == the same step code issued without a graph, bit for bit; replayed vs eager within bf16
rounding with the same first-step selection error; steps that rank nothing fall back (auto) or are refused (on)."""
import math

import pytest
import torch

from kvpipe.executor.replay import sparse_step as lr
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.replay import Replay

SPARSE = LossySpec(sparse=0.2)                                   # chunk 64, sink 64, recent 256
SPARSE_INT4 = LossySpec("int4", group=32, vgroup=64, sparse=0.2)


def test_step_rows_match_hand_computed_counts():
    """Fault caught: a row field out of place or computed from the wrong prefix (the kernels would
    rank the wrong range, keep the wrong count, or the attention read too few rows)."""
    # 4000 tokens: sealed 3968 (62 chunks); budget ceil(0.2 * 4000) = 800; forced: sink [0, 64) and
    # the recent window [3744, 4000) (it starts before the unsealed tail 3968): 320; room 480
    r = lr.step_args(SPARSE, 4000)
    assert r[lr.TOTAL:lr.N + 1] == [4000, 64, 3744, 480, 800]
    assert (r[lr.ATTENDED], r[lr.TAIL_AT], r[lr.IN_CHUNK], r[lr.CHUNK], r[lr.IN_BLOCK]) == (800, 800, 32, 62, 0)
    # int4 blocks of 32 at 4001 tokens: 125 full blocks, 124 sketched (3968 / 32), 1 exact tail
    # token; budget ceil((ceil(800.2) - 1) / 32) = 25 blocks; sink 2 blocks, recent: 125 - 3745 // 32
    # = 8 blocks from block 117; forced 10, room 15; attended 25 * 32 + 1
    r = lr.step_args(SPARSE_INT4, 4001)
    assert r[lr.TOTAL:lr.N + 1] == [125, 2, 117, 15, 25]
    assert (r[lr.ATTENDED], r[lr.TAIL_AT], r[lr.IN_CHUNK], r[lr.CHUNK], r[lr.IN_BLOCK]) == (801, 800, 33, 62, 1)


def test_a_bucket_is_one_sealed_chunk_and_takes_its_widest_step():
    """Fault caught: a graph shared by steps that rank different token counts (stale shapes), or
    a bucket narrower than one of its steps (a step's kept tokens cut off)."""
    prefixes = list(range(4000, 4200))
    keys = [lr.ranked(SPARSE, p) for p in prefixes]
    assert sorted(set(keys)) == [3968, 4032, 4096, 4160]
    for key in set(keys):
        ps = [p for p, k in zip(prefixes, keys) if k == key]
        assert max(ps) - min(ps) < 64
        rows = [lr.step_args(SPARSE, p) for p in ps]
        b = lr.bucket_of(SPARSE, rows, ps)
        assert b.sealed == key and b.n_max == max(math.ceil(0.2 * p) for p in ps)
        assert all(b.h0_min <= r[lr.H0] and r[lr.H1] <= b.h1_max and r[lr.TOTAL] <= b.total_max for r in rows)


def test_the_blocker_names_steps_whose_forced_tokens_fill_the_budget():
    """Fault caught: a replay of a step that ranks nothing (the radix select sought rank 0 and the
    graph kept garbage), or a refusal where every step ranks."""
    assert lr.blocker(SPARSE, [4000, 4001], 8192, 0) is None
    why = lr.blocker(SPARSE, [1000], 8192, 0)
    assert why is not None and "prefix 1000" in why
    assert lr.blocker(SPARSE_INT4, [4000], 8192, 10) is not None and "window" in lr.blocker(SPARSE_INT4, [4000], 8192, 10)


def test_the_plan_replays_sparse_decode_and_not_quantised_decode_alone():
    """Fault caught: the simulator predicting an eager sparse decode that the executor replays
    (or a replay of quantised decode, which no graph holds)."""
    plan = lambda lossy: Plan(Method.HEADWISE, PhasePlan(8, 4096), PhasePlan(8, 1), 0, lossy=lossy)  # noqa: E731
    assert plan(SPARSE).replay_blocker is None and plan(SPARSE_INT4).replay_blocker is None
    assert "without --sparse" in plan(LossySpec("int4")).replay_blocker


# ---- CUDA ----------------------------------------------------------------------------------------
def _top(rank: torch.Tensor, prefix: int, h0: int, h1: int, room: int) -> torch.Tensor:
    """The test's own selection: forced tokens [0, h0) and [h1, prefix), and the `room` best of
    [h0, h1) by (rank descending, index ascending), in token order."""
    mid = rank[h0:h1].double().cpu()
    order = sorted(range(h1 - h0), key=lambda i: (-mid[i].item(), i))[:room]
    keep = sorted([*range(h0), *(h0 + i for i in order), *range(h1, prefix)])
    return torch.tensor(keep, dtype=torch.long)


@pytest.mark.gpu
def test_device_row_selection_takes_exactly_the_top_tokens_for_every_step_of_a_bucket():
    """Fault caught: a kernel reading a stale host count (the capture's) instead of the row's, the
    output's row stride taken from n, or ties not broken to the lower index."""
    from kvpipe.executor.sparse import rank_triton as sparse_triton
    spec = LossySpec(sparse=0.2, sink=16, recent=64)
    g = torch.Generator().manual_seed(0)
    for units in (1, 3):
        prefixes = list(range(2560, 2624))                 # one sealed chunk: 2560
        rows = [lr.step_args(spec, p) for p in prefixes]
        b = lr.bucket_of(spec, rows, prefixes)
        rank = torch.randint(0, 40, (units, b.sealed), generator=g).float().cuda()   # many ties
        for p, r in zip(prefixes, rows):
            prm = torch.tensor(r, dtype=torch.long, device="cuda")
            got = sparse_triton.select_static(rank, prm, b.total_max, b.h0_min, b.h1_max, b.n_max)
            assert got.shape == (units, b.n_max)
            n = r[lr.N]
            for u in range(units):
                want = _top(rank[u], p, r[lr.H0], r[lr.H1], r[lr.ROOM])
                assert torch.equal(got[u, :n].cpu(), want), (p, u)
                assert not got[u, n:].any()               # zeros past n: rows a gather may read


def _run(tiny_model, lossy, replay, resident=0, decode=140, layers=2):
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.workload import Workload
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=64, layers=layers, dtype=torch.bfloat16, device="cuda",
                       hidden_size=256, intermediate_size=512, vocab_size=1024, max_position_embeddings=2048)
    spec = HFAdapter(model).spec()
    w = Workload(640, decode)
    plan = Plan(Method.HEADWISE, PhasePlan(2, 128), PhasePlan(2, 1), resident, lossy=lossy)
    ids = torch.randint(0, spec.vocab, (1, w.context), generator=torch.Generator().manual_seed(3))
    return execute(build(spec, w, plan), model, ids, "cuda", keep_logits=True, replay=replay, fuse="off")


CASES = [LossySpec(sparse=0.2, sink=4, recent=32), LossySpec("int4", group=32, sparse=0.2, sink=4, recent=32)]


@pytest.mark.gpu
@pytest.mark.parametrize("lossy", CASES, ids=["sparse", "sparse-int4"])
def test_sparse_replay_equals_the_same_steps_issued_without_a_graph(tiny_model, lossy):
    """Fault caught: a graph that bakes in its capture step's counts (every later step would
    select, fetch or attend as the capture did), a record or sketch chunk rebuilt at the wrong
    place, a filled block's record not sent home: any of them changes later steps' logits."""
    a = _run(tiny_model, lossy, "on")
    b = _run(tiny_model, lossy, "issue")
    assert a.decode_issue == "graph" and b.decode_issue == "issue"
    assert a.graphs == 3          # prefixes 640..779: sealed chunks 10, 11 and 12
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.step_logits, b.step_logits)
    assert a.lossy_error["sparse_recall_mean"] == b.lossy_error["sparse_recall_mean"]


@pytest.mark.gpu
@pytest.mark.parametrize("lossy", CASES, ids=["sparse", "sparse-int4"])
def test_sparse_replay_matches_the_eager_sparse_decode_within_bf16_rounding(tiny_model, lossy):
    """Fault caught: the replayed step selecting other tokens than the eager one (the first step's
    probe differs), attending a row too many or too few, or missing the exact tail: the logits
    then drift far past bf16 rounding. (Not bitwise: one varlen call against eager's merge.) One
    layer, so that the step's only selection is the probed one: with more, the first layer's
    rounding moves the next layer's queries, and a near-tie of 2-bit sketch ranks can then take
    another 32-token block (2 layers, int4: 0.17 relative, H200; the replay == issue test covers
    every layer bit for bit)."""
    rep = _run(tiny_model, lossy, "on", decode=20, layers=1)
    eager = _run(tiny_model, lossy, "off", decode=20, layers=1)
    assert eager.decode_issue == "eager" and rep.decode_issue == "graph"
    assert rep.lossy_error["sparse_recall_mean"] == pytest.approx(eager.lossy_error["sparse_recall_mean"], rel=1e-6)
    d = (rep.step_logits[1:2] - eager.step_logits[1:2]).abs().max() / eager.step_logits[1:2].abs().max()
    assert d < 2e-2, float(d)
    agree = (rep.tokens == eager.tokens).float().mean()
    assert agree > 0.5, float(agree)


@pytest.mark.gpu
def test_a_mixed_group_replays_as_its_steps_issued_without_a_graph(tiny_model):
    """Fault caught: a replayed group of resident and offloaded heads attending its resident heads
    over the fetched rows (or the offloaded ones over the whole home): logits differ from the same
    step code issued without a graph, or (the eager check) drift past bf16 rounding."""
    a = _run(tiny_model, CASES[0], "on", resident=2, decode=70)
    b = _run(tiny_model, CASES[0], "issue", resident=2, decode=70)
    assert a.decode_issue == "graph" and torch.equal(a.step_logits, b.step_logits)
    eager = _run(tiny_model, CASES[0], "off", resident=2, decode=70)
    d = (a.step_logits[1:2] - eager.step_logits[1:2]).abs().max() / eager.step_logits[1:2].abs().max()
    assert d < 2e-2, float(d)


@pytest.mark.gpu
def test_steps_that_rank_nothing_run_eagerly_under_auto_and_are_refused_under_on(tiny_model):
    """Fault caught: a graph over steps whose forced tokens fill the budget (the radix select
    would seek rank 0), silently or under `on`."""
    wide = LossySpec(sparse=0.2, sink=4, recent=400)          # 404 forced tokens > 0.2 x 640
    res = _run(tiny_model, wide, "auto", decode=4)
    assert res.decode_issue == "eager" and "rank" in res.replay_note
    with pytest.raises(ValueError, match="replay: sparse replay needs every decode step to rank"):
        _run(tiny_model, wide, "on", decode=4)


def test_a_sparse_plan_is_predicted_replayed_not_as_its_exact_plans_eager_choice():
    """Fault caught: the lossy plan inheriting the exact plan's replay choice (at 128K the planner
    picks eager for the exact plan, whose decode sits at the PCIe floor), so `plan` and `run`
    predicted and ran a host-bound eager sparse decode (88.6 ms measured eagerly on the H200,
    the same as the replayed 88.7 there only by luck of the host)."""
    import kvpipe
    kw = dict(context="128K", gpu_mem="24GB", group=8, resident="none", hw="h200-testbox", sparse=0.2, lossy="int4")
    auto, off = kvpipe.plan(**kw), kvpipe.plan(**kw, replay="off")
    assert auto.plan.replay is Replay.AUTO and off.plan.replay is Replay.OFF
    a = auto.to_json()["predicted"]["decode_s_per_token"]
    b = off.to_json()["predicted"]["decode_s_per_token"]
    assert a < 0.8 * b, (a, b)
