"""`kvpipe serve` as a real process on loopback with a tiny random Llama (SmolLM2's tokenizer and
chat template, random weights, KV on host RAM and disk): the SSE framing through `curl -N`, bad
requests and their error JSON, the planner's admission, the bounded queue under 50 concurrent
clients, a client that disconnects mid-stream, and SIGTERM. The engine runs with --resident none
--disk 2, so its one live conversation has a disk-tier file in the test's --kv-dir."""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from serve_helpers import ServerProcess, metric, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 65536
MAX_QUEUE = 2
NAME = "tiny"


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("serve")
    kv = root / "kv"
    kv.mkdir()
    d = tiny_dir(root, smollm2[2])
    s = ServerProcess(["--model", str(d), "--random-weights", "--device", "cpu", "--resident", "none",
                       "--disk", "2", "--kv-dir", str(kv), "--max-context", "8192", "--gpu-mem", "400MB", "--host-mem", "4MB",
                       "--disk-mem", "4MB", "--max-queue", str(MAX_QUEUE), "--max-body", str(MAX_BODY),
                       "--cache-mem", "0"],   # the live conversation alone (the cache: test_serve_cache.py)
                      env={"KVPIPE_API_KEY": KEY})
    s.kv = kv
    yield s
    s.stop()


def post(server, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"content-type": "application/json", **headers},
                      timeout=60, **kw)


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMP = {"model": NAME, "prompt": "hello there", "max_tokens": 3}
C, P = "/v1/chat/completions", "/v1/completions"
# (path, body, status, error.param): each a kind of bad request
BAD = [
    (C, b"{not json", 400, None), (C, b"[1, 2]", 400, None), (C, {"messages": CHAT["messages"]}, 400, "model"),
    (C, {**CHAT, "model": 123}, 400, "model"), (C, {**CHAT, "model": "gpt-4o"}, 404, "model"),
    (C, {"model": NAME}, 400, "messages"), (C, {**CHAT, "messages": []}, 400, "messages"),
    (C, {**CHAT, "messages": "hi"}, 400, "messages"), (C, {**CHAT, "messages": ["hi"]}, 400, "messages[0]"),
    (C, {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    (C, {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (C, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    (C, {**CHAT, "messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages[0].name"),
    (C, {**CHAT, "messages": [{"role": "user", "content": "   "}]}, 400, "messages"),
    (C, {**CHAT, "n": 2}, 400, "n"), (C, {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**CHAT, "max_tokens": "ten"}, 400, "max_tokens"), (C, {**CHAT, "max_completion_tokens": -1}, 400,
                                                             "max_completion_tokens"),
    (C, {**CHAT, "temperature": 3}, 400, "temperature"), (C, {**CHAT, "temperature": "hot"}, 400, "temperature"),
    (C, {**CHAT, "top_p": 0}, 400, "top_p"), (C, {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {**CHAT, "stop": 12}, 400, "stop"), (C, {**CHAT, "stream": "yes"}, 400, "stream"),
    (C, {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {**CHAT, "logprobs": True}, 400, "logprobs"), (C, {**CHAT, "tools": []}, 400, "tools"),
    (C, {**CHAT, "presence_penalty": 0.5}, 400, "presence_penalty"), (C, {**CHAT, "seed": "x"}, 400, "seed"),
    (P, {"model": NAME}, 400, "prompt"), (P, {**COMP, "prompt": ["a", "b"]}, 400, "prompt"),
    (P, {**COMP, "prompt": [1, 49152]}, 400, "prompt"), (P, {**COMP, "echo": True}, 400, "echo"),
    (P, {**COMP, "best_of": 3}, 400, "best_of"), (P, {**COMP, "messages": CHAT["messages"]}, 400, "messages"),
    (P, {**COMP, "max_tokens": 2_000_000}, 400, "max_tokens"),      # past the model's positions too
    (P, {**COMP, "max_tokens": 100_000}, 400, "max_tokens"),        # past the server's context
    (C, {**CHAT, "user": 5}, 400, "user"), (P, {**COMP, "user": ["abc"]}, 400, "user"),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_its_status_and_error_json(server, path, body, status, param):
    # Fault caught: a bad field accepted, ignored silently or answered with a traceback, a dropped
    # connection or the wrong status; the error JSON without message/type/param.
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text


def test_budget_refusal_says_the_numbers(tmp_path_factory):
    # Fault caught: admission that queues a request no plan fits (it would fail in the run), or a
    # refusal without the budgets and the largest context that fits. In process: a server's
    # --max-context is planned within the budgets, so over loopback its context refuses first.
    from conftest import write_config
    from kvpipe.serve.admission import Admission, Budgets, Refused
    b = Budgets.of(write_config(tmp_path_factory, max_position_embeddings=1 << 20),
                   {"device": "cpu", "resident": "none", "disk": 2, "gpu_mem": "400MB", "host_mem": "4MB",
                    "disk_mem": "4MB", "random_weights": True})
    with pytest.raises(Refused) as e:
        Admission(b).check(2, 100_000)
    msg = str(e.value)
    assert "do not fit the budgets" in msg and "host 3.8 MiB" in msg and "largest prompt that fits" in msg


@pytest.mark.parametrize("max_tokens", [9_000, 2_000_000])
def test_context_refusal_names_the_binding_limit(server, max_tokens):
    # Fault caught: a max_tokens past both the model's positions (1M) and --max-context 8192 told
    # "exceed the model's context of 1048576 tokens" (the positions checked first), where the
    # server's smaller context is the limit the client must meet.
    err = post(server, P, {**COMP, "max_tokens": max_tokens}).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"plus max_tokens {max_tokens} exceed the server's context of 8192 tokens" in err["message"], err
    assert "model's" not in err["message"]


@pytest.mark.parametrize("path, body, user", [(C, CHAT, "abc"), (P, COMP, "abc"), (C, CHAT, None)])
def test_user_field_is_accepted_and_ignored(server, path, body, user):
    # Fault caught: `user` (the openai client's user=, LangChain's default) refused as 400
    # "user: is not supported", where OpenAI and vLLM take it; or the answer changed by it.
    plain = post(server, path, {**body, "seed": 5, "max_tokens": 4})
    tagged = post(server, path, {**body, "seed": 5, "max_tokens": 4, "user": user})
    assert plain.status_code == tagged.status_code == 200, tagged.text
    pick = (lambda js: js["choices"][0]["message"]["content"]) if path == C else (lambda js: js["choices"][0]["text"])
    assert pick(plain.json()) == pick(tagged.json())



@pytest.mark.parametrize("path, body, status, param, code", [
    (C, {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    (C, b"{not json", 400, None, "invalid_json"),
    (C, {"model": NAME}, 400, "messages", "missing_field"),
    (C, {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (C, {**CHAT, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    (C, {**CHAT, "messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages", "context_length_exceeded"),
    (P, {**COMP, "prompt": "hi " * 9000}, 400, "prompt", "context_length_exceeded"),
    (P, {**COMP, "max_tokens": 100_000}, 400, "max_tokens", "context_length_exceeded"),
    (C, {**CHAT, "user": 5}, 400, "user", "invalid_type"),
])
def test_error_body_is_openai_shaped_with_openai_status(server, path, body, status, param, code):
    # Fault caught: an unknown model answered 400 (OpenAI and vLLM: 404), a wrong JSON type 422
    # (FastAPI's habit; the openai client raises UnprocessableEntityError, not BadRequestError), a
    # prompt too long by itself blamed on max_tokens, or a body not {"error": {message, type, param, code}}.
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error") and err["message"]


def test_the_openai_client_gets_its_own_exceptions_and_the_model(server):
    # Fault caught: GET /v1/models/{id} missing (openai's models.retrieve a 404 for the served
    # model), an unknown model not openai.NotFoundError, a wrong type not openai.BadRequestError,
    # the client's user= refused.
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert c.models.retrieve(NAME).id == NAME and [m.id for m in c.models.list()] == [NAME]
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=CHAT["messages"], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=CHAT["messages"], max_tokens="ten")
    assert e.value.body["param"] == "max_tokens"
    assert c.completions.create(model=NAME, prompt="hi", max_tokens=2, user="abc").usage.completion_tokens == 2


def test_oversized_body_unknown_route_and_method(server):
    # Fault caught: a body past --max-body read whole (413 missing), routes answered without JSON.
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    r = post(server, C, big)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body exceeds")
    assert httpx.get(server.url + "/v1/nothing", timeout=10).json()["error"]["message"]
    r = httpx.get(server.url + C, headers=AUTH, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


def test_metrics_label_requests_by_route_not_by_the_raw_path(server):
    """Fault caught: kvpipe_requests_total labelled by the path as sent, so every 404 probe
    (`/v1/x1`, `/v1/x2`, ...) and model id asked (`/v1/models/a`) made a new series for good, and a
    `"` in a path broke the exposition's label syntax."""
    import re
    for path in ("/v1/x1", "/v1/x2", '/v1/a"b', "/v1/models/a", "/v1/models/b"):
        httpx.get(server.url + path, headers=AUTH, timeout=10)
    m = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    labels = set(re.findall(r'^kvpipe_requests_total\{endpoint="([^"]*)",status="\d+"\} \d+$', m, re.M))
    rows = [ln for ln in m.splitlines() if ln.startswith("kvpipe_requests_total")]
    assert len(rows) == len(re.findall(r"^kvpipe_requests_total\{", m, re.M)) and rows
    assert all(re.fullmatch(r'kvpipe_requests_total\{endpoint="[^"]*",status="\d+"\} \d+', r) for r in rows), rows
    assert "unmatched" in labels and "/v1/models/{model:path}" in labels, labels
    assert not labels & {"/v1/x1", "/v1/x2", "/v1/models/a", "/v1/models/b"}, labels


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_sse_framing_through_curl(server):
    # Fault caught: events not framed as `data: ...` + blank line, no `data: [DONE]`, the usage
    # chunk missing with include_usage, or the streamed text not the whole answer's.
    body = {**CHAT, "max_tokens": 5, "seed": 3, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}
    out = subprocess.run(["curl", "-sN", server.url + C, "-H", f"Authorization: Bearer {KEY}",
                          "-H", "content-type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60).stdout
    blocks = out.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]" and all(b.startswith("data: ") for b in blocks[:-1])
    chunks = [json.loads(b[6:]) for b in blocks[:-2]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    whole = post(server, C, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}).json()
    assert text == whole["choices"][0]["message"]["content"]
    first, again = chunks[-1]["usage"], whole["usage"]
    # the same prompt again: its KV is home, all but the last token (whose logits start decode) reused
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
    assert {**again, "prompt_tokens_details": None} == {**first, "prompt_tokens_details": None}


def test_a_sampled_request_without_a_seed_varies_and_with_one_repeats(server):
    """Fault caught: a sampled request without `seed` keyed to seed 0, so every "regenerate" of a
    chat UI gave the same text (OpenAI and vLLM draw afresh); or a given seed not repeating."""
    body = {**CHAT, "max_tokens": 12, "temperature": 1.0}
    free = {post(server, C, body).json()["choices"][0]["message"]["content"] for _ in range(3)}
    seeded = {post(server, C, {**body, "seed": 11}).json()["choices"][0]["message"]["content"] for _ in range(2)}
    assert len(free) > 1 and len(seeded) == 1, (free, seeded)


def test_fifty_concurrent_clients_are_answered_or_refused(server):
    # Fault caught: a request that hangs, is lost or dropped under load, a full queue answered
    # other than 429 with Retry-After, a Retry-After past the whole burst (the work ahead of a
    # refused request ended within it), or memory that stays up after the burst.
    post(server, P, COMP).raise_for_status()   # warm: the idle level after one generation
    idle = server.rss_bytes()

    async def one(client, i):
        try:
            r = await client.post(P, json={**COMP, "max_tokens": 2, "seed": i}, headers=AUTH, timeout=90)
        except httpx.HTTPError as e:
            return ("error", repr(e))
        return (r.status_code, r.headers.get("retry-after"), r.json())

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, limits=httpx.Limits(max_connections=60)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))
    t0 = time.monotonic()
    got = asyncio.run(burst())
    took_s = time.monotonic() - t0
    assert took_s < 90
    codes = [g[0] for g in got]
    assert len(got) == 50 and set(codes) <= {200, 429, 503}, codes
    assert codes.count(200) >= MAX_QUEUE and codes.count(429) >= 1
    for code, retry, js in got:
        if code == 200:
            assert js["usage"]["completion_tokens"] == 2 and js["choices"][0]["finish_reason"] == "length"
        else:
            assert 1 <= int(retry) <= math.ceil(took_s) and js["error"]["type"] == "rate_limit_error", retry
    m = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    assert metric(m, "kvpipe_queue_depth") == 0 and metric(m, "kvpipe_running") == 0
    assert server.rss_bytes() < idle * 1.25 + (64 << 20), (idle, server.rss_bytes())
    assert len(list(server.kv.iterdir())) == 1     # the one live conversation's disk tier, none per request


def test_disconnect_mid_stream_stops_and_keeps_nothing_of_it(server):
    # Fault caught: a generation that runs on after its client left (the cancel not reaching the
    # decode loop), the conversation keeping the cancelled request's tokens (its KV still home and
    # counted in /metrics), or the live session unusable afterwards.
    metrics = lambda: httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text   # noqa: E731
    first = post(server, P, {**COMP, "max_tokens": 5}).json()["choices"][0]["text"]
    m = metrics()
    before, done = metric(m, "kvpipe_cancelled_total"), metric(m, "kvpipe_completion_tokens_total")
    kept, disk = metric(m, "kvpipe_kept_tokens"), metric(m, 'kvpipe_kv_bytes{tier="disk"}')
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + C, json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        m = metrics()
        assert metric(m, "kvpipe_running") == 1 and metric(m, 'kvpipe_kv_bytes{tier="disk"}') > disk, seen
        next(lines)
    deadline = time.monotonic() + 30
    while metric(metrics(), "kvpipe_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    m = metrics()
    assert metric(m, "kvpipe_cancelled_total") == before + 1 and metric(m, "kvpipe_running") == 0
    assert metric(m, "kvpipe_kept_tokens") <= kept and metric(m, 'kvpipe_kv_bytes{tier="disk"}') <= disk
    assert metric(m, "kvpipe_completion_tokens_total") - done < 4000
    again = post(server, P, {**COMP, "max_tokens": 5})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == first
    assert len(list(server.kv.iterdir())) == 1


def test_sigterm_cancels_the_stream_removes_the_kv_and_exits(server):
    # Fault caught: SIGTERM that waits for a long generation to finish, leaves its disk file, or
    # exits with a traceback; the cut stream ended as a finished one (a finish_reason, [DONE])
    # instead of the 503 error event. (Last in the module: it stops the server.)
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + C, json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert list(server.kv.iterdir())
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert server.proc.wait(60) in (-15, 143) and time.monotonic() - t0 < 30   # SIGTERM's code, as kvpipe run's
    assert "data: [DONE]" not in rest, rest[-3:]   # [DONE] says the answer is whole
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: ")]
    assert events[-1]["error"]["code"] == "shutting_down", rest[-3:]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert not list(server.kv.iterdir()) and "Traceback" not in server.stderr()
