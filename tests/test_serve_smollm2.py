"""`kvpipe serve` with the real SmolLM2-135M-Instruct (its GGUF file, converted once into the
test's cache) behind the official `openai` client: chat and completions, streamed and whole,
greedy and seeded sampling, each text equal to `kvpipe.generate`'s for the same prompt and
settings (the reference is generate in this process: the server must add nothing and lose
nothing between the HTTP fields and the engine)."""
from __future__ import annotations

import pytest

import kvpipe
from serve_helpers import ServerProcess
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("single_thread")
NAME = "smollm2"
Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(smollm2):  # noqa: F811
    s = ServerProcess(["--model", str(smollm2[0]), "--served-model-name", NAME, "--device", "cpu"],
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
    # Fault caught: /v1/models not listing the served name, or an unknown model / n > 1 not
    # raised by the client as the 400 it is (a 200 or a dropped connection instead).
    assert [m.id for m in client.models.list().data] == [NAME]
    with pytest.raises(openai.BadRequestError, match="model"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": Q}])
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": Q}], n=2)
