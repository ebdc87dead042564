"""`kvpipe serve` stopped (SIGINT, SIGTERM) while a request generates, a real process on loopback
with the tiny random Llama (SmolLM2's tokenizer): the cut answer must reach the client as an error,
never as a finished one. A stream ends with the OpenAI-shaped error event (no finish_reason, no
`[DONE]`), so the `openai` client raises; a whole answer is 503. The server still exits with the
signal's code, its KV file removed. One server per test: each test stops its own."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from serve_helpers import ServerProcess, metric, tiny_dir
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture: SmolLM2's tokenizer)

NAME = "tiny"
ASK = [{"role": "user", "content": "tell me a long story"}]
LONG = 4000   # tokens asked with ignore_eos: far more than the tiny model decodes before the signal


@pytest.fixture
def server(smollm2, tmp_path):  # noqa: F811
    kv = tmp_path / "kv"
    kv.mkdir()
    s = ServerProcess(["--model", str(tiny_dir(tmp_path, smollm2[2])), "--random-weights", "--device", "cpu",
                       "--resident", "none", "--disk", "2", "--kv-dir", str(kv), "--max-context", "8192",
                       "--gpu-mem", "400MB", "--host-mem", "4MB", "--disk-mem", "4MB", "--cache-mem", "0"])
    s.kv = kv
    yield s
    s.stop()


def _exited_cleanly(server, sig: int, t0: float) -> None:
    assert server.proc.wait(60) in (-sig, 128 + sig) and time.monotonic() - t0 < 30
    assert not list(server.kv.iterdir()) and "Traceback" not in server.stderr(), server.stderr()[-2000:]


def test_sigint_mid_stream_raises_in_the_openai_client(server):
    """Fault caught: a stream cut by SIGINT ended as a finished answer (finish_reason "stop", the
    usage chunk, `data: [DONE]`), so the openai client iterated to the end with no error and the
    truncated text looked whole; or the server not exiting after it."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = c.chat.completions.create(model=NAME, messages=ASK, max_tokens=LONG, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    got, t0 = [], None
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                t0 = time.monotonic()
                server.proc.send_signal(signal.SIGINT)
    assert e.value.code == "shutting_down" and "shutting down" in e.value.message, e.value
    assert t0 is not None and all(ch.choices[0].finish_reason is None for ch in got if ch.choices)
    assert all(ch.usage is None for ch in got)
    _exited_cleanly(server, signal.SIGINT, t0)


def test_sigterm_mid_whole_request_is_503(server):
    """Fault caught: a non-streamed request cut by SIGTERM answered 200 with finish_reason "stop"
    and the tokens so far (a truncated answer passed off as whole), instead of 503 with OpenAI
    error JSON; or the server not exiting after it."""
    body = {"model": NAME, "messages": ASK, "max_tokens": LONG, "ignore_eos": True}
    out = {}
    ask = threading.Thread(target=lambda: out.update(r=httpx.post(server.url + "/v1/chat/completions",
                                                                  json=body, timeout=60)))
    ask.start()
    deadline = time.monotonic() + 30
    while metric(httpx.get(server.url + "/metrics", timeout=10).text, "kvpipe_running") != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.3)   # a few tokens in
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    ask.join(60)
    r = out["r"]
    assert r.status_code == 503, r.text[:300]
    err = json.loads(r.text)["error"]
    assert (err["type"], err["code"]) == ("service_unavailable_error", "shutting_down") and "cut after" in err["message"]
    _exited_cleanly(server, signal.SIGTERM, t0)


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, KeyboardInterrupt)])
def test_a_signal_uvicorn_returns_from_still_stops_with_its_code(monkeypatch, sig, raised):
    """Fault caught: `kvpipe serve` stopped by SIGINT exiting 0 when uvicorn's re-raised signal
    only cancelled asyncio's main task after it had already ended (seen in CI: exit 0, not 130):
    the signal's own exit must not rest on that race."""
    from types import SimpleNamespace

    import uvicorn

    from kvpipe.executor.engine.interrupts import Terminated
    from kvpipe.serve import cli as serve_cli

    def run(self, *a, **k):   # uvicorn handling the signal, then returning as in the race
        self.handle_exit(sig, None)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    cancelled = []
    engine = SimpleNamespace(cancel_all=lambda: cancelled.append(1),
                             conv=SimpleNamespace(engine=SimpleNamespace(plan=SimpleNamespace(describe=lambda: "p"))))
    args = SimpleNamespace(host="127.0.0.1", port=0, log_level="warning")
    with pytest.raises(raised) as e:
        serve_cli._serve(args, object(), SimpleNamespace(name="m", api_key=None, engine=engine))
    assert cancelled == [1]
    assert isinstance(e.value, Terminated) == (sig == signal.SIGTERM)
