"""kvpipe.Conversation (kvpipe/conversation.py): the plan a conversation decides once for its
capacity, against the plan `kvpipe generate` decides for one prompt of the same size."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpipe
from kvpipe.conversation import Conversation, common_prefix, planned_workload
from kvpipe.pipeline.workload import Workload

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 4096, "torch_dtype": "float32", "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d / "config.json")


def test_conversation_decides_the_plan_generate_decides_for_its_prompt(tiny_config):
    """Fault caught: a conversation of capacity C for n new tokens planned for n decode steps (the
    first token comes from the prefill, so generate plans n - 1): `generate --save-kv`, chat and the
    server then decide their plan for another workload than `kvpipe generate` over the same prompt,
    and may run another plan (the 128K server measured slower than generate on its own plan)."""
    prompt, n = 700, 9
    assert planned_workload(prompt + n, n) == Workload(prompt, n - 1, 1)
    ref = kvpipe.generate(tiny_config, " ".join(["5"] * prompt), prompt_format="ids", random_weights=True,
                          device="cpu", max_new_tokens=n, ignore_eos=True)
    with Conversation(tiny_config, random_weights=True, device="cpu", max_context=prompt + n, chat=False,
                      max_new_tokens=n) as c:
        assert c.engine.base.workload == ref.run.workload
        assert c.engine.plan == ref.plan


def test_a_question_of_the_same_shape_reuses_the_graph_and_answers_as_a_fresh_one(tiny_config):
    """Fault caught: every question building its stage graph again (0.3 s of host time at 128K,
    spent as its run goes), or a kept graph reused for another shape (a question prefilling the
    document again, or attending with the previous question's chunk starts); the kept stages,
    revealed step by step, answer as a fresh graph does."""
    from unittest import mock

    from kvpipe.executor.engine import live
    doc, qs, n = [7] * 90, [[1 + i, 2, 3 + i, 4, 5] for i in range(3)], 6
    opts = dict(random_weights=True, device="cpu", max_context=100 + n, chat=False, max_new_tokens=n, chunk=32)
    gen = dict(max_new_tokens=n, ignore_eos=True, reuse=True)
    with Conversation(tiny_config, **opts) as c, mock.patch.object(live, "build_lazily", wraps=live.build_lazily) as spy:
        got = [c.append(doc + q, **gen) for q in qs]
    assert spy.call_count == 2                                     # q1 from token 0; q2 and q3 alike
    assert [r.timings["prefill_tokens"] for r in got] == [95, 5, 5]
    with Conversation(tiny_config, **opts) as c:
        c.append(doc + qs[0], **gen)                               # q3's graph built afresh
        ref = c.append(doc + qs[2], **gen)
    assert (got[2].tokens, got[2].output_digest) == (ref.tokens, ref.output_digest)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_no_decode_step_is_built_before_the_first_token(tiny_config, device):
    """Fault caught: a question's decode steps' stages all built (or, for a repeated shape, the
    kept ones all handed to the run) before its prefill runs: 0.3 s of host time before the first
    token for a 128K prompt and 64 new tokens, the server's second question over its 5% TTFT
    target. At the first token the run's graph holds at most the decode steps its compute lane
    issues ahead of that token (engine/decoding.LAG), whatever the number of new tokens (the
    repeated shape answering as a fresh graph does: the test above). On CUDA (fp32: eager decode)
    the host issues ahead of the GPU, as on the server's GPU."""
    from unittest import mock

    from kvpipe.executor.engine import live
    from kvpipe.executor.engine.decoding import LAG
    from kvpipe.pipeline.stage import Phase
    graphs, at_first, execute = [], [], live.execute

    def spied(graph, *args, **kw):
        graphs.append(graph)
        return execute(graph, *args, **kw)

    def on_token() -> bool:   # asked after each token: the first call follows the first token
        if len(at_first) < len(graphs):
            at_first.append(sum(s.phase is Phase.DECODE and s.tag == "embed" for s in graphs[-1].stages))
        return False

    doc, n = [7] * 60, 12
    opts = dict(random_weights=True, device=device, max_context=70 + n, chat=False, max_new_tokens=n, chunk=32)
    with Conversation(tiny_config, **opts) as c, mock.patch.object(live, "execute", spied):
        got = [c.append(doc + q, max_new_tokens=n, ignore_eos=True, reuse=True, cancel=on_token)
               for q in ([1, 2, 3], [4, 5, 6], [8, 9, 10])]   # a cold prompt, a new shape, a repeated one
    assert len(at_first) == 3 and max(at_first) <= LAG + 1 < n - 1, at_first
    assert [r.timings["prefill_tokens"] for r in got] == [63, 3, 3]


@settings(max_examples=200, deadline=None)
@given(a=st.lists(st.integers(0, 3), max_size=40), b=st.lists(st.integers(0, 3), max_size=40),
       block=st.integers(1, 9), as_tuple=st.booleans())
def test_common_prefix_is_the_first_difference(a, b, block, as_tuple):
    """Fault caught: a blockwise comparison that stops at the last whole block (the ids after it
    not counted) or steps past a block that differs; tuples (a server's kept entries) against
    lists too. Reference: the first index where the ids differ."""
    ref = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix(tuple(a) if as_tuple else a, b, block) == ref
    assert common_prefix(a + a, a + b, block) == len(a) + ref
