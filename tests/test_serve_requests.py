"""One request to a real `kvpipe serve` (a tiny random Llama with SmolLM2's tokenizer, on CPU) as
its user sees it: its access line on stderr, the chunks of a streamed completion, the words of a
refusal."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from serve_helpers import ServerProcess, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

NAME = "tiny"
COMP = {"model": NAME, "prompt": "Hi", "max_tokens": 3}


def serve(smollm2, root, *flags: str) -> ServerProcess:  # noqa: F811
    d = tiny_dir(root, smollm2[2])
    return ServerProcess(["--model", str(d), "--random-weights", "--device", "cpu", "--max-context", "512",
                          "--cache-mem", "0", "--served-model-name", NAME, *flags])


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):  # noqa: F811
    s = serve(smollm2, tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


def access_lines(server, path: str, wait_s: float = 10) -> list[str]:
    """The access lines of `path` so far, waited for: the line comes once the answer has ended."""
    deadline = time.monotonic() + wait_s
    while True:
        got = [ln for ln in server.stderr().splitlines() if f' {path}" ' in ln]
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_each_request_logs_one_access_line(server):
    """Fault caught: `kvpipe serve` logged nothing per request (uvicorn's access log is off at
    its default level), so a user saw no method, path, status, tokens or TTFT."""
    r = httpx.post(server.url + "/v1/completions", json=COMP, timeout=60)
    assert r.status_code == 200, r.text
    with httpx.stream("POST", server.url + "/v1/completions", json={**COMP, "stream": True}, timeout=60) as s:
        s.read()
    assert httpx.get(server.url + "/v1/nothing", timeout=10).status_code == 404
    done = access_lines(server, "/v1/completions")
    pattern = r'kvpipe: 127\.0\.0\.1 "POST /v1/completions" 200 in [\d.]+ s: 1 prompt \+ 3 generated tokens, TTFT [\d.]+ s'
    assert len(done) == 2 and all(re.fullmatch(pattern, ln) for ln in done), done
    missing = access_lines(server, "/v1/nothing")
    assert len(missing) == 1 and re.fullmatch(r'kvpipe: 127\.0\.0\.1 "GET /v1/nothing" 404 in [\d.]+ s', missing[0]), missing


def test_streamed_completion_starts_with_text_not_an_empty_chunk(server):
    """Fault caught: a streamed /v1/completions began with a chunk of `"text": ""` (a chat's role
    chunk without the role), which OpenAI and vLLM do not send: every chunk carried text or the finish."""
    with httpx.stream("POST", server.url + "/v1/completions", json={**COMP, "stream": True}, timeout=60) as s:
        blocks = s.read().decode().split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""], blocks
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    choices = [c["choices"][0] for c in chunks]
    assert len(chunks) == 4 and all(c["object"] == "text_completion" for c in chunks), chunks
    assert all(ch["text"] and ch["finish_reason"] is None for ch in choices[:-1]), choices
    assert choices[-1]["finish_reason"] == "length", choices


def test_refusal_says_one_token_in_the_singular(server):
    """Fault caught: the refusal of a one-token prompt said "the prompt's 1 tokens"."""
    r = httpx.post(server.url + "/v1/completions", json={**COMP, "prompt": [5], "max_tokens": 600}, timeout=60)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("the prompt's 1 token plus max_tokens 600 exceed"), message


def test_no_access_log_flag_keeps_stderr_quiet(smollm2, tmp_path):  # noqa: F811
    """Fault caught: --no-access-log still logging a line per request."""
    s = serve(smollm2, tmp_path, "--no-access-log")
    try:
        assert httpx.post(s.url + "/v1/completions", json=COMP, timeout=60).status_code == 200
        time.sleep(0.5)
        assert '"POST /v1/completions"' not in s.stderr(), s.stderr()
    finally:
        s.stop()


def test_a_stream_whose_client_left_says_so_in_its_access_line(server):
    """Fault caught: a streamed request whose client went away mid-answer logged as a plain
    `200 in ... s` (its status went out at the start), like a finished answer: only /metrics'
    cancel count told; vLLM logs the abort."""
    body = {**COMP, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as s:
        lines = s.iter_lines()
        next(lines), next(lines)
    deadline, gone = time.monotonic() + 30, []
    while not gone and time.monotonic() < deadline:
        gone = [ln for ln in access_lines(server, "/v1/completions") if "(client gone, answer stopped)" in ln]
        time.sleep(0.1)
    assert len(gone) == 1 and re.match(r'kvpipe: 127\.0\.0\.1 "POST /v1/completions" 200 in [\d.]+ s '
                                       r'\(client gone, answer stopped\)', gone[0]), gone
