"""The server's engine routing a prompt through its prefix cache, in process (a tiny random Llama
with disk units, no HTTP): a hit continues from the entry's KV exactly as the existing rule for a
kept conversation says: its output_digest (tokens and every step's logits) equals a fresh run's
whose prefill chunks break at the reused token, and where that token is a multiple of the plan's
chunk, the plain run's."""
from __future__ import annotations

import json

import pytest

import kvpipe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")
CONTEXT = 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvpipe.serve.cache_store import DirStore
    from kvpipe.serve.engine import Engine
    from kvpipe.serve.metrics import Metrics
    from kvpipe.serve.prefix_cache import PrefixCache
    root = tmp_path_factory.mktemp("engine")
    cfg = root / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)))
    kw = dict(random_weights=True, device="cpu", max_context=CONTEXT, chat=False, resident="none", disk="2")
    conv = kvpipe.Conversation(str(cfg), kv_dir=str(root), **kw)
    cache = PrefixCache(DirStore({"host": str(root / "ram"), "disk": str(root / "disk")}), 10 << 20, 0)
    engine = Engine(conv, None, Metrics(), cache=cache)
    yield engine, cfg, kw
    engine.close()
    assert not list((root / "ram").iterdir())


def ask(engine, ids, **kw):
    engine.route(ids)
    return engine.conv.append(ids, reuse=True, max_new_tokens=6, ignore_eos=True, **kw)


@pytest.mark.parametrize("doc_len", [70, 128])
def test_a_hit_is_bit_for_bit_the_run_broken_at_the_reused_token(setup, doc_len):
    # Fault caught: an entry's KV loaded into the wrong units or positions, tokens past the reused
    # prefix (the entry's answer) left home, or a hit that prefills more or fewer tokens than the
    # prompt has past the entry: the output_digest then differs from the fresh run's.
    engine, cfg, kw = setup
    chunk = engine.conv.engine.plan.prefill.chunk
    assert chunk == 128        # doc_len 128 ends on a chunk boundary, 70 inside the first chunk
    a, b = [3 + (t + doc_len) % 90 for t in range(doc_len)], [100 + (t + doc_len) % 20 for t in range(90)]
    ask(engine, a)
    ask(engine, b)                                # a is kept as an entry, b is live
    more = a + [1, 2, 3]
    hit = ask(engine, more)
    assert hit.timings["reused_tokens"] == doc_len and engine.cache.hits >= 1
    with kvpipe.Conversation(str(cfg), **kw) as fresh:
        broken = fresh.append(more, breaks=(doc_len,), max_new_tokens=6, ignore_eos=True)
        fresh.reset()
        plain = fresh.append(more, max_new_tokens=6, ignore_eos=True)
    assert hit.output_digest == broken.output_digest and hit.tokens == broken.tokens
    if doc_len % chunk == 0:
        assert hit.output_digest == plain.output_digest
