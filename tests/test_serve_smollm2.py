"""`kvpipe serve` with the real SmolLM2-135M-Instruct (its GGUF file, converted once into the
test's cache) behind the official `openai` client: chat and completions, streamed and whole,
greedy and seeded sampling, each text equal to `kvpipe.generate`'s for the same prompt and
settings (the reference is generate in this process: the server must add nothing and lose
nothing between the HTTP fields and the engine); a question after the same document reuses the
document's KV and still answers as a cold generate does."""
from __future__ import annotations

import pytest

import kvpipe
from serve_helpers import ServerProcess
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("single_thread")
NAME = "smollm2"
Q = "What is the capital of France?"
CONTEXT = 1024
DOC = ("The Rhine rises in the Swiss Alps, flows north along the border of Germany and France, "
       "passes Cologne and Duesseldorf, and reaches the North Sea in the Netherlands near Rotterdam. "
       "Barges carry coal, grain and containers on it; castles stand on the rocks of its middle valley. ") * 3
QUESTIONS = ("Where does the Rhine rise?", "Which city near its mouth is named?")


@pytest.fixture(scope="module")
def client(smollm2):  # noqa: F811
    s = ServerProcess(["--model", str(smollm2[0]), "--served-model-name", NAME, "--device", "cpu",
                       "--max-context", str(CONTEXT)],
                      env={"KVPIPE_CACHE_DIR": str(smollm2[1])})
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert s.stop() in (-15, 143)   # SIGTERM's own code once shut down, as kvpipe run's


def reference(smollm2, prompt, **kw):  # noqa: F811
    return kvpipe.generate(str(smollm2[2]), prompt, device="cpu", **kw)


def test_chat_whole_greedy_is_generates_text(client, smollm2):  # noqa: F811
    # Fault caught: the chat template not applied to messages as generate applies it, max_tokens
    # or EOS handled differently, usage counted wrong, or the response shape off the spec.
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": Q}], max_tokens=12)
    ref = reference(smollm2, Q, max_new_tokens=12)
    assert r.choices[0].message.content == ref.text == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.model == NAME and r.created > 0


def test_chat_streamed_sampled_with_system_is_generates_text(client, smollm2):  # noqa: F811
    # Fault caught: temperature/top_p/seed or the system turn not reaching the engine, deltas
    # lost or duplicated between the worker thread and the event loop, usage missing at the end.
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    msgs = [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Describe the sea."}]
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    ref = reference(smollm2, "Describe the sea.", system="You are a poet.", max_new_tokens=16, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text and len(text) > 20
    assert chunks[-1].usage.completion_tokens == len(ref.tokens) and chunks[-1].choices == []
    other = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, **dict(kw, seed=8))
    assert other.choices[0].message.content != text


def test_completion_whole_and_streamed_with_stop_are_generates_text(client, smollm2):  # noqa: F811
    # Fault caught: a completion prompt run through the chat template (it must be plain text, as
    # `generate --no-chat`), a stop string not cutting the text, streamed text differing from whole.
    p = "The three primary colors are"
    whole = client.completions.create(model=NAME, prompt=p, max_tokens=10)
    ref = reference(smollm2, p, chat=False, max_new_tokens=10)
    assert whole.choices[0].text == ref.text and whole.object == "text_completion"
    assert whole.choices[0].finish_reason == ref.finish_reason == "length"
    stream = client.completions.create(model=NAME, prompt=p, max_tokens=10, stop=[":"], stream=True)
    text = "".join(c.choices[0].text for c in stream)
    ref = reference(smollm2, p, chat=False, max_new_tokens=10, stop=[":"])
    assert text == ref.text and ":" not in text and ref.finish_reason == "stop"


def test_models_and_errors_through_the_client(client):
    # Fault caught: /v1/models not listing the served name, or an unknown model (404) / n > 1
    # (400) not raised by the client as what it is (a 200 or a dropped connection instead).
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.NotFoundError, match="model"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": Q}])
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": Q}], n=2)


def _ask(question: str) -> list[dict]:
    return [{"role": "user", "content": f"{DOC}\n\nQuestion: {question}"}]


def test_a_new_question_after_the_same_document_reuses_it_and_is_generates_text(client, smollm2):  # noqa: F811
    # Fault caught: the document prefilled again (cached_tokens 0), a reuse count past what the two
    # prompts share, or a continuation on the kept KV that answers other than a cold generate.
    r1 = client.chat.completions.create(model=NAME, messages=_ask(QUESTIONS[0]), max_tokens=12)
    r2 = client.chat.completions.create(model=NAME, messages=_ask(QUESTIONS[1]), max_tokens=12)
    tok = _tokenizer(smollm2)
    a, b = (tok.apply_chat_template(_ask(q), add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in QUESTIONS)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert r2.usage.prompt_tokens == len(b) and r2.usage.prompt_tokens_details.cached_tokens == shared > 100
    for r, q in zip((r1, r2), QUESTIONS):
        ref = reference(smollm2, f"{DOC}\n\nQuestion: {q}", max_new_tokens=12)
        assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.tokens)


def _tokenizer(smollm2):  # noqa: F811
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2[2])


def test_reused_turn_equals_a_cold_run_and_extending_the_kept_prompt_is_bit_for_bit(smollm2):  # noqa: F811
    # Fault caught: kept KV that is not the prefix's (a rewind that keeps a stale token, rows of
    # the previous answer left), shown by tokens differing from a cold generate, or an
    # output_digest (tokens and every step's logits) differing from a fresh run whose prefill
    # chunks break at the reused token.
    tok = _tokenizer(smollm2)
    a, b = ([int(i) for i in tok.apply_chat_template(_ask(q), add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)] for q in QUESTIONS)
    doc = [int(i) for i in tok(DOC)["input_ids"]]
    more = doc + [int(i) for i in tok(" Question: " + QUESTIONS[0], add_special_tokens=False)["input_ids"]]
    kw = dict(device="cpu", max_context=CONTEXT, chat=False)
    with kvpipe.Conversation(str(smollm2[2]), **kw) as conv:
        conv.append(a, reuse=True, max_new_tokens=12)
        res = conv.append(b, reuse=True, max_new_tokens=12)     # shares the document, inside a's chunk
        conv.reset()
        conv.append(doc, reuse=True, max_new_tokens=4)
        ext = conv.append(more, reuse=True, max_new_tokens=12)  # extends the kept prompt
    n = res.timings["reused_tokens"]
    assert 100 < n < len(b) and res.timings["prefill_tokens"] == len(b) - n
    cold = kvpipe.generate(str(smollm2[2]), " ".join(map(str, b)), prompt_format="ids", device="cpu",
                           max_new_tokens=12)
    assert res.tokens == cold.tokens and res.text == cold.text
    assert ext.timings["reused_tokens"] == len(doc)
    with kvpipe.Conversation(str(smollm2[2]), **kw) as fresh:
        broken = fresh.append(more, breaks=(len(doc),), max_new_tokens=12)
    assert ext.output_digest == broken.output_digest and ext.tokens == broken.tokens
