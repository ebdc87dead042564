"""LossySpec.max_fetched_tokens: the size of a sparse step's fixed gather buffer (the staged
gather on CUDA) must hold the tokens of EVERY step up to the capacity, not only the last one's."""
from __future__ import annotations

from hypothesis import given, strategies as st

from kvpipe.pipeline.lossy import LossySpec


def test_a_step_before_the_capacity_can_fetch_more_than_the_last_one():
    # Fault caught: the buffer sized by fetched_tokens(capacity): step 319 of this spec fetches 67
    # tokens where fetched_tokens(320) is 64 (the unsealed tail chunk outgrows a short window).
    spec = LossySpec(sparse=0.2, sink=4, recent=32)
    assert spec.fetched_tokens(320) < spec.fetched_tokens(319)
    assert spec.max_fetched_tokens(320) >= max(spec.fetched_tokens(p) for p in range(1, 321))


@given(sparse=st.sampled_from([0.05, 0.1, 0.2, 0.3, 0.5]), sink=st.integers(0, 80), recent=st.integers(0, 300),
       quant=st.sampled_from([None, "int4", "int8"]), capacity=st.integers(1, 1500))
def test_the_bound_holds_every_prefix_up_to_the_capacity(sparse, sink, recent, quant, capacity):
    # Fault caught: a bound below some earlier step's fetch (a shape error in the staged copy).
    spec = LossySpec(quant, sparse=sparse, sink=sink, recent=recent)
    bound = spec.max_fetched_tokens(capacity)
    assert bound <= capacity
    assert all(spec.fetched_tokens(p) <= bound for p in range(1, capacity + 1))
