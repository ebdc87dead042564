"""A generation that ends early (Ctrl-C, EOS, a stop string, a client gone: all reach the engine as
`Decoding.take` returning True) builds no decode step past the end: with thousands of tokens of
room left, the steps past it cost host time the user waits through before the result (31 s at
32K on the H200 before this was fixed: docs/PERFORMANCE.md). Plain `generate` (api.run) and a
conversation's turn (LiveSession) are each checked; a replayed (CUDA-graph) decode still builds
its steps whole before it starts."""
from __future__ import annotations

import pytest

import kvpipe
from kvpipe.conversation import Conversation
from kvpipe.executor.engine.decoding import LAG

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "5 6 7 8"
LARGE = 3000          # room for far more tokens than the stop lets through
STOP_AFTER = 4        # tokens taken before `interrupt` says stop
PLANS = {"resident": {}, "streamed": dict(resident="none", group=1), "disk": dict(resident="none", group=1, disk=3)}


def _stopper():
    """interrupt(): True from the STOP_AFTER + 1-th question on (asked after each token)."""
    asked = [0]

    def interrupt() -> bool:
        asked[0] += 1
        return asked[0] > STOP_AFTER
    return interrupt


def _decode_steps(res) -> int:
    return len({s.step for s in res.run.real_trace.graph.stages if s.phase.value == "decode"})


@pytest.mark.parametrize("plan", PLANS)
def test_generate_builds_no_step_past_an_early_stop(tiny_config, tmp_path, plan):
    """Fault caught: an early stop still building (and walking) every decode step up to
    max_new_tokens: the graph built whole before the run (api.run without build_lazily), or
    grown past the end (runner._while_needed dropped). The tokens must still be an uninterrupted
    run's first ones."""
    common = dict(prompt_format="ids", ignore_eos=True, device="cpu", chunk=4, random_weights=True,
                  kv_dir=str(tmp_path), **PLANS[plan])
    res = kvpipe.generate(tiny_config, PROMPT, max_new_tokens=LARGE, interrupt=_stopper(), **common)
    n = len(res.tokens)
    assert res.finish_reason == "interrupted" and n == STOP_AFTER + 1, (res.finish_reason, n)
    assert _decode_steps(res) <= n + LAG, _decode_steps(res)
    ref = kvpipe.generate(tiny_config, PROMPT, max_new_tokens=n, **common)
    assert res.tokens == ref.tokens and res.output_digest == ref.output_digest


@pytest.mark.parametrize("plan", ["resident", "streamed"])
def test_a_turn_stopped_early_builds_no_step_past_it_nor_poisons_the_next(tiny_config, plan):
    """Fault caught: a conversation's turn stopped early growing its graph to max_new_tokens, or
    LiveSession keeping the cut graph as the whole graph of its shape (the next turn of the same
    shape, run to its end, then runs the cut graph's steps only: too few tokens, or wrong ones)."""
    ids, room = [5, 6, 7, 8], 64
    common = dict(device="cpu", chunk=4, random_weights=True, **PLANS[plan])
    with Conversation(tiny_config, max_context=len(ids) + room, **common) as c:
        cut = c.append(ids, max_new_tokens=room, ignore_eos=True, interrupt=_stopper())
        assert cut.finish_reason == "interrupted" and _decode_steps(cut) <= len(cut.tokens) + LAG
        c.reset()
        same_shape = c.append(ids, max_new_tokens=room, ignore_eos=True)
    with Conversation(tiny_config, max_context=len(ids) + room, **common) as fresh:
        ref = fresh.append(ids, max_new_tokens=room, ignore_eos=True)
    assert len(ref.tokens) == room and cut.tokens == ref.tokens[:STOP_AFTER + 1]
    assert same_shape.tokens == ref.tokens and same_shape.output_digest == ref.output_digest
