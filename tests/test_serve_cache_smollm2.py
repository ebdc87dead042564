"""`kvpipe serve`'s prefix cache with the real SmolLM2-135M-Instruct behind the official `openai`
client: two different documents, each asked a question in turn (A, B, A, B); the second round
continues from the kept documents (cached_tokens covers each document) and its answers are the
text a cold `kvpipe.generate` gives for the same prompt."""
from __future__ import annotations

import httpx
import pytest

import kvpipe
from serve_helpers import ServerProcess, metric
from test_generate_smollm2 import smollm2  # noqa: F401  (the fixture)

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("single_thread")
NAME, CONTEXT, NEW = "smollm2", 1024, 8
DOCS = {"A": ("The Rhine rises in the Swiss Alps, flows north along the border of Germany and France, "
              "passes Cologne and Duesseldorf, and reaches the North Sea in the Netherlands near Rotterdam. ") * 3,
        "B": ("Mount Fuji is an active volcano on the island of Honshu, the highest peak in Japan at 3776 "
              "metres; it last erupted in 1707, and pilgrims and hikers climb it every summer. ") * 3}
QUESTIONS = ("What is the text about?", "Name one place it mentions.")


def _ask(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{DOCS[doc]}\n\nQuestion: {question}"}]


def test_two_documents_alternating_hit_and_answer_as_a_cold_generate(smollm2):  # noqa: F811
    # Fault caught: the other document's KV dropped when the live conversation moves on (round
    # two prefilled whole), or an entry continued from the wrong KV (text unlike a cold generate).
    s = ServerProcess(["--model", str(smollm2[0]), "--served-model-name", NAME, "--device", "cpu",
                       "--max-context", str(CONTEXT), "--cache-mem", "64MB"],
                      env={"KVPIPE_CACHE_DIR": str(smollm2[1])})
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = {(d, q): client.chat.completions.create(model=NAME, messages=_ask(d, q), max_tokens=NEW)
               for q in QUESTIONS for d in "AB"}
        m = httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        assert s.stop() in (-15, 143)
    assert metric(m, "kvpipe_prefix_cache_hits_total") == 2 and metric(m, "kvpipe_prefix_cache_evictions_total") == 0
    for d in "AB":
        assert got[d, QUESTIONS[0]].usage.prompt_tokens_details.cached_tokens < 40     # the template's start only
        assert got[d, QUESTIONS[1]].usage.prompt_tokens_details.cached_tokens > 100
        ref = kvpipe.generate(str(smollm2[2]), DOCS[d] + "\n\nQuestion: " + QUESTIONS[1], device="cpu",
                              max_new_tokens=NEW)
        assert got[d, QUESTIONS[1]].choices[0].message.content == ref.text
