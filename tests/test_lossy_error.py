"""The synthetic needle set and its error measures (analysis/needles.py), checked against float64
attention written here."""
import math

import pytest
import torch

from kvpipe.analysis.needles import NeedleSpec, concentration, errors, exact, make_case

SPEC = NeedleSpec(context=2048, cases=1, steps=4)


@pytest.fixture(scope="module")
def case():
    return make_case(SPEC, 0)


def _softmax_attention(q, k, v, keep=None):
    # independent reference: explicit exp / sum in float64
    s = (q.double() @ k.double().T) / math.sqrt(k.shape[-1])          # [G, S]
    if keep is not None:
        s[:, ~keep] = -math.inf
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    w = e / e.sum(-1, keepdim=True)
    return w, w @ v.double()


def test_exact_matches_an_independent_softmax(case):
    # Fault caught: the reference scaled by the wrong factor, or attending in the cache dtype.
    w, out = exact(case)
    for t in range(SPEC.steps):
        rw, ro = _softmax_attention(case.q[t], case.k, case.v)
        assert torch.allclose(w[t], rw, rtol=1e-10, atol=1e-14) and torch.allclose(out[t], ro, rtol=1e-10, atol=1e-12)


def test_needles_are_planted_where_the_queries_look(case):
    # Fault caught: needles planted off the query direction (the set would test nothing).
    w, _ = exact(case)
    for t, (a, b) in enumerate(case.needles):
        per_tok = w[t, :, a:b].mean()                          # mean weight on a needle token (group)
        assert per_tok > 10 * w[t].mean()                      # off-direction needles get ~1x


def test_same_seed_same_set_other_seed_other_set():
    # Fault caught: a generator that ignores the seed, or global RNG state leaking in.
    small = NeedleSpec(context=1536, cases=1, steps=4)
    a, b = make_case(small, 0), make_case(small, 0)
    c = make_case(NeedleSpec(context=1536, cases=1, steps=4, seed=1), 0)
    assert torch.equal(a.k, b.k) and torch.equal(a.q, b.q) and not torch.equal(a.k, c.k)


def test_keys_have_outlier_channels_and_heavy_tails(case):
    # Fault caught: a plain Gaussian background (quantisation and summaries would look too easy).
    k = case.k.double()
    mag = k.abs().mean(0)
    assert mag.max() > 4 * mag.median()                              # outlier channels
    z = (k - k.mean(0)) / k.std(0)
    assert ((z ** 4).mean(0).median() > 3.0)                          # kurtosis above Gaussian


def test_errors_of_the_exact_method_and_of_a_method_missing_the_needle(case):
    # Fault caught: recall/needle hit computed from the method's own weights, or error not relative.
    w, out = exact(case)
    e = errors(case, w, out, w, out)
    assert torch.all(e.recall > 1 - 1e-12) and torch.all(e.rel_err == 0) and e.needle_hit.all()
    keep = torch.ones(SPEC.context, dtype=torch.bool)
    a, b = case.needles[0]
    keep[a:b] = False
    mw, mo = _softmax_attention(case.q[0], case.k, case.v, keep)
    w2, o2 = w.clone(), out.clone()
    w2[0], o2[0] = mw, mo
    e2 = errors(case, w, out, w2, o2)
    assert not e2.needle_hit[0].any() and e2.needle_hit[1:].all()
    assert torch.allclose(e2.recall[0], 1 - w[0, :, a:b].sum(-1))
    assert (e2.rel_err[0] > 0).all()


def test_concentration_is_the_top_fraction_mass():
    # Fault caught: taking the bottom or a random fraction.
    w = torch.tensor([[[0.5, 0.1, 0.3, 0.1, 0.0]]], dtype=torch.float64)
    assert concentration(w, 0.4).item() == pytest.approx(0.8)
