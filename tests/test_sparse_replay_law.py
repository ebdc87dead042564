"""The slot geometry of a replayed sparse decode step (executor/replay/sparse_step.py): once a step
ranks (its forced tokens do not fill its count and not every token is kept), its fetch, its exact
quantisation tail and its own new token always fit in the transfer slot of `capacity` rows, and so
does the widest fetch of its graph's bucket. Worked out from the step rows over random specs and
every decode step of random workloads; the expectation is token arithmetic, not the blocker."""
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.replay.sparse_step import ATTENDED, H0, H1, N, ROOM, TAIL_AT, TOTAL, blocker, ranked, step_args
from kvpipe.pipeline.lossy import LossySpec


@st.composite
def specs(draw) -> LossySpec:
    quant = draw(st.sampled_from([None, "int8", "int4"]))
    chunk = draw(st.sampled_from([64, 128]))
    group = draw(st.sampled_from([g for g in (8, 16, 32, 64) if chunk % g == 0]))
    return LossySpec(quant, group=group, sparse=draw(st.floats(0.01, 1.0)), chunk=chunk,
                     sink=draw(st.integers(0, 300)), recent=draw(st.integers(0, 600)))


@settings(max_examples=60)
@given(spec=specs(), context=st.integers(1, 20000), decode=st.integers(1, 300))
def test_a_ranking_step_always_fits_its_slot(spec, context, decode):
    """Fault caught: a step whose fetch, exact tail and own token overrun the slot of `capacity`
    rows (a write past the slot in a captured graph). The law also shows that the blocker's
    slot-room refusal can never fire after its rank check: a ranking step keeps N < TOTAL blocks
    (tokens), so (N + 1) x group + 1 <= TOTAL x group + 1 <= prefix + 1 <= capacity."""
    capacity = context + decode
    g = spec.group if spec.blocks else 1
    buckets: dict[int, int] = {}
    for prefix in range(context, capacity):                    # decode step k: prefix context + k
        r = step_args(spec, prefix)
        if r[ROOM] <= 0 or r[N] >= r[TOTAL]:
            continue                                          # refused by the rank check
        assert r[TOTAL] == (prefix // g if spec.blocks else prefix)
        assert 0 <= r[H0] <= r[H1] <= r[TOTAL] and r[ROOM] <= r[H1] - r[H0]
        assert r[TAIL_AT] == r[N] * g and r[ATTENDED] == r[N] * g + prefix % g
        assert r[ATTENDED] + 1 <= prefix + 1 <= capacity       # fetch, tail and own token
        assert (r[N] + 1) * g + 1 <= capacity                  # the blocker's slot check, never true
        buckets[ranked(spec, prefix)] = max(buckets.get(ranked(spec, prefix), 0), r[N])
        why = blocker(spec, [prefix], capacity, window_blocks=10**9)
        assert why is None or "leaves no room" not in why
    for widest in buckets.values():                            # a bucket's fixed-width gather
        assert widest * g <= capacity
