"""`kvpipe serve`'s request defaults as OpenAI and vLLM apply them, as a real process on loopback
(a tiny random Llama with SmolLM2's tokenizer, a 256-token context): a request without
max_tokens generates at most the room its prompt leaves, where a given max_tokens is checked."""
from __future__ import annotations

import httpx
import pytest

from serve_helpers import ServerProcess, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

CONTEXT = 256
P = "/v1/completions"
LONG = {"model": "tiny", "prompt": "hi " * 240, "ignore_eos": True}   # fits, with less than 256 new tokens' room


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):  # noqa: F811
    d = tiny_dir(tmp_path_factory.mktemp("serve-defaults"), smollm2[2])
    s = ServerProcess(["--model", str(d), "--random-weights", "--device", "cpu", "--max-context", str(CONTEXT),
                       "--gpu-mem", "400MB", "--cache-mem", "0"])
    yield s
    s.stop()


def test_no_max_tokens_fills_the_room_the_prompt_leaves(server):
    """Fault caught: a prompt that fits the context refused with 400 context_length_exceeded
    "plus max_tokens 256" when the client gave no max_tokens (the default counted as asked for),
    where vLLM and OpenAI generate up to the room left."""
    r = httpx.post(server.url + P, json=LONG, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, usage


@pytest.mark.parametrize("path, body, field", [
    (P, LONG, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG["prompt"]}]},
     "max_completion_tokens")])
def test_a_given_max_tokens_past_the_room_is_still_refused(server, path, body, field):
    """Fault caught: the default's cut applied to a max_tokens the client gave, silently
    shortening an answer the client asked to be longer (OpenAI and vLLM answer 400)."""
    r = httpx.post(server.url + path, json={**body, field: 100}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
