"""The generation-side pieces `kvpipe serve` relies on, without a server: `generate(cancel=...)`
stops after the token it is asked on, and the token hand-over (`Decoding`) stays in order when
the host lanes of a run with disk units ask from their own threads, as under a busy server."""
from __future__ import annotations

import threading
import time

import pytest

import kvpipe

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")


def test_lanes_asking_from_threads_hand_tokens_over_once_in_order():
    # Fault caught: two lane threads both handing over the same token (Output.take's order
    # assertion; seen in the server with disk units), or a token skipped.
    from kvpipe.executor.engine.decoding import Decoding
    from kvpipe.pipeline.sampling import Sampling
    taken = []

    def take(i, t):
        assert i == len(taken), (i, len(taken))
        time.sleep(0.001)     # widen the window a racing second thread would fall into
        taken.append(i)
        return False
    dec = Decoding(Sampling(), [1, 2], vocab=8, n_tokens=200, device="cpu", take=take)
    tokens = torch.zeros(1, 200, dtype=torch.long)
    dec.produced(tokens, 199)   # every token already on the host
    dec.made = 200
    threads = [threading.Thread(target=lambda: [dec.halted(s, False) for s in range(50)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dec.finish() == 200 and taken == list(range(200))


def test_cancel_stops_after_the_token_it_is_asked_on(tmp_path):
    # Fault caught: a cancel ignored by the decode loop (all max_new_tokens generated), reported
    # as another finish reason, or the run's disk-tier file left behind.
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)))
    kv = tmp_path / "kv"
    kv.mkdir()
    asked = []

    def cancel() -> bool:
        asked.append(1)
        return len(asked) >= 5
    kw = dict(prompt_format="ids", random_weights=True, device="cpu", max_new_tokens=40, ignore_eos=True,
              resident="none", disk="2", kv_dir=str(kv))
    res = kvpipe.generate(str(cfg), "1 2 3 4 5", cancel=cancel, **kw)
    assert res.finish_reason == "cancelled" and len(res.tokens) == 5 and not list(kv.iterdir())
    whole = kvpipe.generate(str(cfg), "1 2 3 4 5", **kw)
    assert whole.finish_reason == "length" and whole.tokens[:5] == res.tokens and len(whole.tokens) == 40


def test_cancelled_append_keeps_only_what_it_reused(tmp_path):
    # Fault caught: Conversation.append deaf to `cancel` (all max_new_tokens generated), or the
    # cancelled call's prompt and tokens left home (the next call reusing them).
    import json
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False)))
    asked = []
    with kvpipe.Conversation(str(cfg), random_weights=True, device="cpu", max_context=128, chat=False) as conv:
        first = conv.append([1, 2, 3], reuse=True, max_new_tokens=4, ignore_eos=True)
        res = conv.append([1, 2, 3, 9, 9, 9], reuse=True, max_new_tokens=40, ignore_eos=True,
                          cancel=lambda: asked.append(1) or len(asked) >= 3)
        assert res.finish_reason == "cancelled" and len(res.tokens) == 3
        assert conv.tokens == [1, 2, 3]
        again = conv.append([1, 2, 3], reuse=True, max_new_tokens=4, ignore_eos=True)
    assert again.tokens == first.tokens
