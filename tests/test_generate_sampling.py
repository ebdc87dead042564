"""pipeline/sampling.py and the device-side sampler of executor/engine/decoding.py."""
from __future__ import annotations

import math

import pytest

from kvpipe.pipeline.sampling import Sampling

torch = pytest.importorskip("torch")
from kvpipe.executor.engine.decoding import Sampler  # noqa: E402

PROBS = [0.5, 0.3, 0.15, 0.05]


def sampler(rows=1, vocab=4, n=8, prompt=None, **kw):
    prompt = torch.tensor([[0]] * rows) if prompt is None else prompt
    return Sampler(Sampling(**kw), prompt, vocab, n)


def logits(rows=1):
    return torch.tensor([math.log(p) for p in PROBS]).repeat(rows, 1)


@pytest.mark.parametrize("kw, flag", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top-k"), (dict(top_p=0.0), "top-p"),
    (dict(top_p=1.5), "top-p"), (dict(min_p=1.0), "min-p"), (dict(repetition_penalty=0), "repetition-penalty"),
    (dict(seed="x"), "seed"), (dict(top_k=2.5), "top-k"), (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_names_the_flag(kw, flag):
    # Fault caught: a bad sampling value accepted (or a TypeError) instead of a line naming it.
    with pytest.raises(ValueError, match=f"^{flag}: "):
        Sampling(**kw)


def test_generation_config_decides_only_what_is_not_given():
    # Fault caught: a sampling generation_config ignored (HF samples there), a greedy one made
    # to sample, or a given flag overridden by the config.
    cfg = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    assert Sampling.choose({}, cfg) == Sampling(temperature=0.6, top_p=0.9)
    assert Sampling.choose({"temperature": 0}, cfg).greedy
    assert Sampling.choose({}, {"temperature": 0.6}).greedy          # do_sample absent: greedy
    assert Sampling.choose({"seed": 3, "temperature": 0.7}, {}) == Sampling(temperature=0.7, seed=3)


@pytest.mark.parametrize("given", [{"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_a_filter_without_a_temperature_samples_at_temperature_1(given):
    # Fault caught: `--top-p 0.9` (or top_k, min_p; a request's `top_p`) without a temperature
    # dropped in silence: greedy text where the user asked to sample (OpenAI and vLLM sample at
    # temperature 1 by default). An explicit temperature 0 stays greedy.
    assert Sampling.choose({**given, "seed": 3}, {}) == Sampling(temperature=1.0, seed=3, **given)
    assert Sampling.choose({**given, "temperature": 0}, {}).greedy
    assert Sampling.choose({**given}, {"do_sample": True, "temperature": 0.6}).temperature == 0.6


def test_greedy_is_argmax_and_the_replay_index_form_agrees():
    # Fault caught: the sampler's greedy path differing from argmax (kvpipe run's choice), or the
    # device-tensor token index of a replayed step giving another token than the host int.
    x = torch.randn(3, 50)
    s = sampler(rows=3, vocab=50)
    assert torch.equal(s(x, 2), x.argmax(-1))
    t = sampler(rows=3, vocab=50, temperature=0.9, seed=4)
    assert torch.equal(t(x, 5), t(x, torch.tensor([5])))


def test_the_two_pass_argmax_is_argmax_with_ties_nan_and_any_vocabulary():
    # Faults caught: the two-pass argmax (a vocabulary's pieces, then their maxima) giving another
    # index than torch.argmax: the piece's offset wrong, the last (padded) piece's pad taken as a
    # value, a tie resolved to a later piece or a later index within the piece, a NaN row not
    # resolving to the NaN as argmax does, or all -inf rows giving an index past the vocabulary.
    from kvpipe.executor.engine.decoding import ARGMAX_SPLIT_AT, argmax_rows
    gen = torch.Generator().manual_seed(0)
    for V in (ARGMAX_SPLIT_AT, 128256, 151936, 50257, 262144, ARGMAX_SPLIT_AT - 1, 32000):
        x = torch.randn(6, V, generator=gen).round(decimals=1)      # coarse values: many ties
        x[1, :] = 0.0                                               # every entry a tie
        x[2, V // 3] = x[2, V - 1] = 99.0                           # a tie in two pieces
        x[3, V // 2] = float("nan")
        x[4, :] = float("-inf")
        x[5, -1] = 50.0                                             # the last entry, beside the pad
        assert torch.equal(argmax_rows(x), x.argmax(-1)), V


def test_seeded_draws_repeat_differ_by_seed_and_step_and_follow_the_softmax():
    # Fault caught: a seed that does not repeat the draw, noise that ignores the seed or the token
    # index (every step the same choice), or a biased sampler (not softmax(logits / T)).
    rows = 20000
    a, b = sampler(rows, temperature=1.0, seed=1), sampler(rows, temperature=1.0, seed=2)
    x = logits(rows)
    draw = a(x, 0)
    assert torch.equal(draw, sampler(rows, temperature=1.0, seed=1)(x, 0))
    assert not torch.equal(draw, b(x, 0)) and not torch.equal(draw, a(x, 1))
    freq = torch.bincount(draw, minlength=4).double() / rows
    assert torch.allclose(freq, torch.tensor(PROBS, dtype=torch.double), atol=0.015), freq
    hot = sampler(rows, temperature=0.5, seed=1)(x, 0)     # T = 0.5: probabilities squared, renormalised
    want = torch.tensor([p * p for p in PROBS], dtype=torch.double)
    assert torch.allclose(torch.bincount(hot, minlength=4).double() / rows, want / want.sum(), atol=0.015)


@pytest.mark.parametrize("kw, allowed", [
    (dict(top_k=2), {0, 1}), (dict(top_p=0.8), {0, 1}), (dict(top_p=0.81), {0, 1, 2}),
    (dict(min_p=0.4), {0, 1}), (dict(top_k=1), {0}),
])
def test_filters_keep_exactly_their_tokens(kw, allowed):
    # Fault caught: top-k/top-p/min-p keeping a token they exclude (or dropping one they keep:
    # top-p keeps the smallest set whose probability reaches p).
    rows = 4000
    got = set(sampler(rows, temperature=1.0, seed=9, **kw)(logits(rows), 0).tolist())
    assert got == allowed


def test_repetition_penalty_covers_prompt_and_output():
    # Fault caught: the penalty not applied to prompt tokens, to tokens generated so far, or
    # applied in the wrong direction to negative logits (HF multiplies those).
    s = sampler(vocab=4, prompt=torch.tensor([[0]]), repetition_penalty=3.0)
    x = torch.tensor([[2.0, 1.0, 0.9, -5.0]])
    assert s(x, 0).item() == 1                   # 2.0 / 3 < 1.0
    assert s(x, 1).item() == 2                   # token 1 now generated: 1.0 / 3 < 0.9
    neg = sampler(vocab=2, prompt=torch.tensor([[0]]), repetition_penalty=2.0)
    assert neg(torch.tensor([[-1.0, -1.5]]), 0).item() == 1      # -1 * 2 < -1.5


def test_logit_checksum_sees_one_bit():
    # Fault caught: an output digest blind to a change of the logits (it hashes only tokens).
    x = torch.randn(1, 300)
    y = x.clone()
    y.view(torch.int32)[0, 17] ^= 1
    s = sampler(vocab=300)
    s(x, 0)
    s(y, 1)
    assert x.argmax() == y.argmax() and not torch.equal(s.sums[0], s.sums[1])
