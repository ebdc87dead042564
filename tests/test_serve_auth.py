"""`kvpipe serve --api-key` as a real process on loopback (a tiny random Llama with SmolLM2's
tokenizer): the key guards the `/v1` routes and nothing else, so a load balancer's `/health`
probe and a Prometheus scraper need no bearer token."""
from __future__ import annotations

import json

import httpx
import pytest

from kvpipe.cli import main
from serve_helpers import ServerProcess, metric, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
C, P = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("serve-auth")
    d = tiny_dir(root, smollm2[2])
    s = ServerProcess(["--model", str(d), "--random-weights", "--device", "cpu", "--max-context", "1024",
                       "--gpu-mem", "400MB", "--cache-mem", "0", "--api-key", KEY])
    yield s
    s.stop()


def test_health_and_metrics_are_open_and_v1_needs_the_key(server):
    """Fault caught: /metrics behind --api-key (401 to a Prometheus scraper, which carries no
    bearer token), or the key no longer guarding /v1 once /health and /metrics are open."""
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and metric(r.text, "kvpipe_queue_depth") == 0, r.text[:200]
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30)
    assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert r.json()["data"][0]["created"] > 1.7e9   # the server's start (Unix seconds), not 0


@pytest.mark.parametrize("headers, path, status", [
    ({}, C, 401), ({"Authorization": "Bearer wrong"}, C, 401), ({"Authorization": KEY}, P, 401),
    ({}, "/v1/models/tiny", 401), ({}, "/v1/models", 401), (AUTH, C, 200),
])
def test_api_key_is_required(server, headers, path, status):
    """Fault caught: a /v1 route reachable without the key, or a key accepted without "Bearer"."""
    r = httpx.request("GET" if not path.startswith("/v1/c") else "POST", server.url + path,
                      content=json.dumps(CHAT), headers={"content-type": "application/json", **headers}, timeout=60)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"


def test_help_says_what_the_key_guards(capsys):
    """Fault caught: `kvpipe serve --help` silent on which routes --api-key guards."""
    assert main(["serve", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "/health and /metrics stay open" in text and "/v1" in text, text


def test_an_unknown_v1_path_without_the_key_is_401_not_404(server):
    """Fault caught: a /v1 path no route serves answered 404 to a client without the key (the
    router's key check runs only for matched routes), telling anyone which paths exist; vLLM
    answers 401. With the key: 404, and 405 for a known path asked with another method."""
    r = httpx.get(server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "GET /v1/nothing: Not Found", r.text
    r = httpx.get(server.url + C, headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
