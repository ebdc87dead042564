"""Chunk key summaries and sparse selection (executor/sparse/chunks.py): the summary bound is proved
against exact rational arithmetic, the selection against the budget, sink and recent window."""
from fractions import Fraction

import pytest
import torch
from hypothesis import given, strategies as st

from kvpipe.analysis.needles import NeedleSpec, exact, make_case
from kvpipe.executor.sparse.chunks import (chunk_scores, even_bounds, pack_fine, select, select_refined,
                                    shrunk_score, summarise, unpack_fine, upper_bound)


@st.composite
def _keys_and_partition(draw):
    S, D, G = draw(st.integers(1, 40)), draw(st.integers(1, 12)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    seed, scale = draw(st.integers(0, 2**16)), draw(st.floats(1e-3, 1e4))
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(S, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    q = (torch.randn(G, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    cuts = sorted(draw(st.sets(st.integers(1, S - 1), max_size=S - 1))) if S > 1 else []
    return k, q, torch.tensor([0, *cuts, S])


@given(_keys_and_partition())
def test_bound_is_at_least_every_true_score_of_its_chunk(data):
    # Faults caught: a bound that takes q*hi only (wrong for negative q), summaries over the wrong
    # tokens (off-by-one chunk edges), or rounding that lets the bound dip below a true score. The
    # true scores are exact rationals (Fraction), so the check is exact, not within a tolerance.
    k, q, bounds = data
    lo, hi = summarise(k, bounds)
    ub = upper_bound(q, lo, hi)                                        # [G, C]
    kq = [[Fraction(float(x)) for x in row] for row in k.tolist()]
    for h, qrow in enumerate(q.tolist()):
        qf = [Fraction(float(x)) for x in qrow]
        for c in range(bounds.numel() - 1):
            a, b = int(bounds[c]), int(bounds[c + 1])
            best = max(sum(x * y for x, y in zip(qf, kq[j])) for j in range(a, b))
            assert Fraction(float(ub[h, c])) >= best


def test_single_token_chunks_bound_their_score_tightly():
    # Fault caught: a bound so loose it cannot rank (e.g. summing |q| * max|k|).
    g = torch.Generator().manual_seed(0)
    k, q = torch.randn(16, 8, generator=g), torch.randn(2, 8, generator=g)
    lo, hi = summarise(k, even_bounds(16, 1))
    assert torch.allclose(upper_bound(q, lo, hi), q.double() @ k.double().T, rtol=1e-12, atol=1e-12)


@given(S=st.integers(1, 3000), chunk=st.sampled_from([8, 64]), frac=st.floats(0.01, 1.0),
       sink=st.integers(0, 100), recent=st.integers(0, 400), seed=st.integers(0, 1000))
def test_selection_keeps_sink_and_recent_and_whole_chunks_within_budget(S, chunk, frac, sink, recent, seed):
    # Faults caught: the sink or the recent window dropped, a budget overrun, chunks fetched in part,
    # a lower-scoring chunk taken while a higher-scoring one that fits is skipped.
    bounds = even_bounds(S, chunk)
    scores = torch.randn(bounds.numel() - 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    budget = max(int(frac * S), min(S, sink + recent))
    keep = select(scores, bounds, budget, sink, recent)
    assert keep[:sink].all() and keep[max(0, S - recent):].all()
    assert int(keep.sum()) <= budget
    base = torch.zeros(S, dtype=torch.bool)
    base[:sink] = True
    base[max(0, S - recent):] = True
    chosen = []
    for c in range(bounds.numel() - 1):
        a, b = int(bounds[c]), int(bounds[c + 1])
        extra = keep[a:b] & ~base[a:b]
        if extra.any():
            assert (keep[a:b]).all()                                   # whole chunk
            chosen.append(c)
    if chosen:                                                         # greedy by score: any chunk
        worst = min(float(scores[c]) for c in chosen)                  # scoring above the worst taken
        for c in range(bounds.numel() - 1):                            # one is taken too
            if float(scores[c]) > worst:
                a, b = int(bounds[c]), int(bounds[c + 1])
                assert keep[a:b].all()


def test_group_score_takes_the_best_head():
    # Fault caught: averaging the group's heads, so a chunk one head needs is ranked low.
    k = torch.zeros(4, 2)
    k[2] = torch.tensor([10.0, 0.0])                                  # chunk 1 (tokens 2-3) wins for head 0
    k[0] = torch.tensor([0.0, 1.0])                                   # chunk 0 wins mildly for head 1
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    lo, hi = summarise(k, even_bounds(4, 2))
    s = chunk_scores(q, lo, hi)
    assert s[0] == 0 and s[1] == 0                                    # both chunks are some head's best


@given(_keys_and_partition(), st.floats(0.0, 1.0))
def test_shrunk_score_is_the_bound_blended_with_the_midpoint_score(data, alpha):
    # Faults caught: the range term not shrunk (or shrunk twice), |q| dropped so negative query
    # channels lower the score, the midpoint taken as lo or hi. Reference, in float64 here: the
    # channel-wise bound max(q lo, q hi) blended with the midpoint score, alpha * bound + (1 - alpha)
    # * q . (lo + hi) / 2 (the same quantity by a different route).
    k, q, bounds = data
    lo, hi = summarise(k, bounds)
    got = shrunk_score(q, lo, hi, alpha).double()                      # [G, C]
    qd, lod, hid = q.double(), lo.double(), hi.double()
    for h in range(q.shape[0]):
        for c in range(lo.shape[0]):
            bound = sum(max(qd[h, i] * lod[c, i], qd[h, i] * hid[c, i]) for i in range(q.shape[1]))
            mid = sum(qd[h, i] * (lod[c, i] + hid[c, i]) / 2 for i in range(q.shape[1]))
            ref = alpha * bound + (1 - alpha) * mid
            tol = 1e-5 * float((qd[h].abs() * torch.maximum(lod[c].abs(), hid[c].abs())).sum()) + 1e-300
            assert abs(float(got[h, c]) - float(ref)) <= tol
            if alpha == 1:                                             # alpha 1 is the proved bound
                assert float(got[h, c]) == float(upper_bound(q, lo, hi)[h, c])


def test_group_share_is_the_mean_of_the_heads_softmax_shares():
    # Faults caught: softmax over heads instead of over chunks, shares averaged in log space (a
    # chunk only one head wants would vanish), or scores left unscaled by sqrt(D). Reference here:
    # explicit exp / sum in float64 per head, then the sum over heads, then the log.
    g = torch.Generator().manual_seed(3)
    k = torch.randn(48, 16, generator=g, dtype=torch.float64) * 3
    q = torch.randn(4, 16, generator=g, dtype=torch.float64) * 3
    lo, hi = summarise(k, even_bounds(48, 8))
    got = chunk_scores(q, lo, hi, 0.5, share=True)
    qd = q.double()
    s = (qd @ ((lo + hi) / 2).T + 0.5 * qd.abs() @ ((hi - lo) / 2).T) / 4.0           # sqrt(16) = 4
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    ref = torch.log((e / e.sum(-1, keepdim=True)).sum(0))
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_shrunk_score_is_not_a_bound_and_is_labelled_so():
    # Fault caught (honesty): calling the alpha < 1 score a bound. Keys 0 and 2 in one chunk, q = 1:
    # the best score is 2, the shrunk score at alpha 1/2 is 1 + 1/2 = 1.5 < 2; at alpha 1 it is 2.
    k = torch.tensor([[0.0], [2.0]], dtype=torch.float64)
    lo, hi = summarise(k, even_bounds(2, 2))
    q = torch.tensor([[1.0]], dtype=torch.float64)
    assert float(shrunk_score(q, lo, hi, 0.5)) == 1.5 < 2.0 <= float(shrunk_score(q, lo, hi, 1.0))
    assert "HEURISTIC" in shrunk_score.__doc__ and "not a bound" in shrunk_score.__doc__
    assert "HEURISTIC" in chunk_scores.__doc__
    with pytest.raises(ValueError, match="alpha"):
        chunk_scores(q, lo, hi, 1.5)


@given(S=st.integers(8, 400), frac=st.floats(0.05, 1.0), seed=st.integers(0, 1000),
       alpha=st.sampled_from([0.5, 1.0]), share=st.booleans())
def test_refinement_with_every_chunk_hot_is_the_flat_fine_selection(S, frac, seed, alpha, share):
    # Faults caught: refinement that scores fine chunks outside their coarse chunk, loses hot chunks,
    # or breaks the budget. With hot large enough that every coarse chunk is hot, the two-level
    # selection must equal selecting among all fine chunks directly.
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    q = torch.randn(3, 8, generator=g, dtype=torch.float64).to(torch.bfloat16)
    cb, fb = even_bounds(S, 64), even_bounds(S, 8)
    coarse, fine = (cb, *summarise(k, cb)), (fb, *summarise(k, fb))
    budget = max(int(frac * S), 16)
    keep, scored = select_refined(q, coarse, fine, budget, 4, 12, hot=S / budget + 1, alpha=alpha, share=share)
    flat = select(chunk_scores(q, fine[1], fine[2], alpha, share).double(), fb, budget, 4, 12)
    assert torch.equal(keep, flat) and scored == (cb.numel() - 1) + (fb.numel() - 1)
    assert int(keep.sum()) <= max(budget, 16)


def _recall_and_hits(mode: str):
    spec = NeedleSpec(context=4096, cases=1, steps=8)
    recall, hits = [], []
    for i in range(spec.cases):
        case = make_case(spec, i)
        ref_w, _ = exact(case)
        S, budget = 4096, int(0.2 * 4096)
        cb = even_bounds(S, 64)
        clo, chi = summarise(case.k, cb)
        fb = even_bounds(S, 8)
        fine = (fb, *summarise(case.k, fb))
        for t, (a, b) in enumerate(case.needles):
            if mode == "refined":        # the default: hot 5 x budget, range x 1/2, group share (heuristic)
                keep, _ = select_refined(case.q[t], (cb, clo, chi), fine, budget, 64, 256)
            elif mode == "refined-bound":   # the 2026-11-29 rule: by the bound, hot 2 x budget
                keep, _ = select_refined(case.q[t], (cb, clo, chi), fine, budget, 64, 256, hot=2, alpha=1.0,
                                         share=False)
            else:
                keep = select(chunk_scores(case.q[t], clo, chi), cb, budget, 64, 256)
            recall.append((ref_w[t] * keep).sum(-1).mean().item())
            hits.append(bool(keep[a:b].all()))
    return sum(recall) / len(recall), sum(hits) / len(hits)


def test_refined_selection_beats_fixed_chunks_on_the_needle_set():
    # Faults caught: refinement that does not refine (or refines the wrong chunks), a selection no
    # better than chance (at 20% of tokens, a random pick recalls about 0.2 of the mass), and a
    # default rule that lost ground to the earlier one (bound ranking, hot 2 x budget).
    fixed, bound, refined = _recall_and_hits("fixed"), _recall_and_hits("refined-bound"), _recall_and_hits("refined")
    assert fixed[0] > 0.5 and bound[0] > fixed[0] and bound[1] >= fixed[1]
    assert refined[0] >= bound[0] and refined[1] >= bound[1]


@given(S=st.integers(1, 300), D=st.integers(1, 16), scale=st.floats(1e-3, 1e4),
       offset=st.floats(-1e4, 1e4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_packed_fine_summaries_still_enclose_every_key(S, D, scale, offset, seed, dtype):
    # Fault caught: codes rounded to nearest (the minimum could land above a key, breaking the
    # bound), decode rounding not widened, or codes taken from the wrong coarse chunk.
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(S, D, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    cb, fb = even_bounds(S, 64), even_bounds(S, 8)
    coarse, fine = (cb, *summarise(k, cb)), (fb, *summarise(k, fb))
    codes = pack_fine(coarse, fine)
    assert codes[0].dtype == torch.uint8 and codes[0].shape == fine[1].shape
    lo, hi = unpack_fine(coarse, fb, codes)
    assert torch.all(lo.double() <= fine[1].double()) and torch.all(hi.double() >= fine[2].double())
    # and not uselessly loose: within 2/255 of the coarse range (+ float32 slack)
    width = (coarse[2].double() - coarse[1].double()).max()
    assert torch.all(fine[1].double() - lo.double() <= 2 * width / 255 + 1e-5 * (abs(offset) + scale * 10))
