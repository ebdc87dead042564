"""HeadwiseCache's static-shape decode step (executor/hf/static.py) and the decode loop it hands to
HF's generate() (executor/hf/loop.py). On CPU the static step runs without a graph
(`decode="static"`); on CUDA (bf16) it is captured and replayed. References are independent: HF's
own generate() with its DynamicCache and SDPA attention, and the cache's eager path."""
import warnings

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import kvpipe
from kvpipe.executor.hf import loop

pytestmark = [pytest.mark.usefixtures("single_thread")]

CTX, NEW = 23, 8
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)


def prompt(seed: int, ctx: int = CTX) -> torch.Tensor:
    return torch.randint(0, 127, (1, ctx), generator=torch.Generator().manual_seed(seed))


class Record(LogitsProcessor):
    """Keeps each step's scores (a device copy: no host sync)."""

    def __init__(self) -> None:
        self.scores: list = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def test_static_greedy_equals_dynamic_cache(tiny_model):
    """Faults caught: the new K/V written at the wrong device-held position, the length mask off
    by one (a key too many or too few attended), the cache's length after generate() not HF's."""
    model = tiny_model("qwen2", kv_heads=2, q_heads=4, head_dim=32, layers=3)
    ids = prompt(1)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    for chunk in (None, 6):
        with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", group=1, decode="static") as cache:
            out = model.generate(ids, cache=cache, max_new_tokens=NEW, prefill_chunk_size=chunk, **GREEDY)
            assert cache.decode_path == "static" and cache.decode_note is None
            assert cache.get_seq_length() == CTX + NEW - 1
        assert torch.equal(out, ref), (out, ref)


def test_static_stops_at_eos_like_hf(tiny_model):
    """Fault caught: the lagged stop check keeping the steps issued past the end of sequence
    (tokens after EOS returned, or the cache left longer than HF's)."""
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16)
    ids = prompt(2)
    free = model.generate(ids, max_new_tokens=NEW, **GREEDY)[0, CTX:].tolist()
    eos = free[4]   # the first time it appears is where HF stops
    stop = dict(do_sample=False, eos_token_id=eos, pad_token_id=127)
    dyn = DynamicCache(config=model.config)
    ref = model.generate(ids, cache=dyn, max_new_tokens=NEW, **stop)
    assert ref.shape[1] < CTX + NEW
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", decode="static") as cache:
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, **stop)
        assert cache.get_seq_length() == dyn.get_seq_length()
    assert torch.equal(out, ref), (out, ref)


def test_static_seeded_sampling_equals_hf(tiny_model):
    """Fault caught: the loop choosing tokens other than HF's way (processors skipped, a draw
    from another generator state): float64 so that the SDPA reference agrees to ~1e-15."""
    model = tiny_model("mistral", kv_heads=4, q_heads=8, head_dim=16, dtype=torch.float64)
    ids = prompt(3)
    sample = dict(do_sample=True, top_k=20, temperature=0.9, repetition_penalty=1.1, eos_token_id=None,
                  pad_token_id=127)
    torch.manual_seed(77)
    ref = model.generate(ids, max_new_tokens=NEW, **sample)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", decode="static") as cache:
        torch.manual_seed(77)
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, **sample)
    assert torch.equal(out, ref), (out, ref)


@pytest.mark.parametrize("resident,group", [("none", 1), (5, 2), ("all", 4)])
def test_static_offloaded_equals_resident_bitwise(tiny_model, resident, group):
    """Faults caught: an offloaded group's prefix fetched short (the bucket), its new token not in
    the slot, a mixed group's resident heads missing, the new K/V of offloaded heads not written
    back to host RAM (the next step reads a stale row): logits then differ from the all-resident
    static step's, and tokens from HF's DynamicCache."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    ids = prompt(8, ctx=140)   # a prefix past one bucket of prefix tokens (128)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    scores = {}
    for res, g in ((resident, group), ("all", 4)):
        rec = Record()
        with kvpipe.HeadwiseCache(model, max_length=140 + NEW, resident=res, group=g, decode="static") as cache:
            out = model.generate(ids, cache=cache, max_new_tokens=NEW, prefill_chunk_size=64,
                                 logits_processor=LogitsProcessorList([rec]), **GREEDY)
            assert cache.decode_path == "static"
        assert torch.equal(out, ref), (res, out, ref)
        scores[res] = torch.stack(rec.scores)
    assert torch.equal(scores[resident], scores["all"])


def test_static_equals_offloaded_eager_and_reuses_the_cache(tiny_model):
    """Faults caught: the static step reading other K/V than the streamed eager path (tokens of
    an offloaded plan differ), a reset cache's second generate() attending the first prompt's
    keys, and the streamer missing tokens of the static loop."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    ids, other = prompt(4), prompt(5)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="none", group=2) as cache:
        eager = model.generate(ids, cache=cache, max_new_tokens=NEW, **GREEDY)
        assert cache.decode_path == "eager"

    class Tokens(BaseStreamer):
        got: list = []

        def put(self, value) -> None:
            self.got.append(value.reshape(-1).tolist())

        def end(self) -> None:
            self.got.append("end")

    streamer = Tokens()
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", decode="static") as cache:
        first = model.generate(ids, cache=cache, max_new_tokens=NEW, streamer=streamer, **GREEDY)
        cache.reset()
        second = model.generate(other, cache=cache, max_new_tokens=NEW, **GREEDY)
    assert torch.equal(first, eager)
    assert torch.equal(second, model.generate(other, max_new_tokens=NEW, **GREEDY))
    assert streamer.got[1:] == [[t] for t in first[0, CTX:].tolist()] + ["end"]


def test_decode_setting_is_checked_and_recorded(tiny_model):
    """Faults caught: a static step run where it cannot be (several sequences,
    padding HF infers from pad tokens) instead of refused or left to HF's loop, and `decode_note` not saying why."""
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16)
    ids = prompt(6)
    with pytest.raises(ValueError, match="^decode: expected"):
        kvpipe.HeadwiseCache(model, max_length=CTX + NEW, decode="fast")
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all") as cache:
        with pytest.raises(ValueError, match="^decode: 'graph' cannot run: graph replay needs a CUDA device"):
            cache.decode = "graph"
            model.generate(ids, cache=cache, max_new_tokens=NEW, **GREEDY)
        cache.decode = "auto"
        model.generate(ids, cache=cache, max_new_tokens=NEW, **GREEDY)
        assert cache.decode_path == "eager" and "needs a CUDA device" in cache.decode_note
    padded = ids.clone()
    padded[0, :3] = 127   # HF infers left padding from the pad id when no attention_mask is given
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", decode="static") as cache:
        with pytest.raises(ValueError, match="padded attention_mask"):
            model.generate(padded, cache=cache, max_new_tokens=NEW, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="all", batch=2, decode="static") as cache:
        with pytest.raises(ValueError, match="batch 1"):
            model.generate(ids.repeat(2, 1), cache=cache, max_new_tokens=NEW, **GREEDY)


def _cuda_run(model, ids, decode: str, cache=None, new: int = NEW, resident="all"):
    rec = Record()
    own = cache is None
    cache = cache or kvpipe.HeadwiseCache(model, max_length=ids.shape[1] + 32, resident=resident, group=2,
                                          decode=decode)
    out = model.generate(ids, cache=cache, max_new_tokens=new, logits_processor=LogitsProcessorList([rec]), **GREEDY)
    path, replays = cache.decode_path, cache.replays
    if own:
        cache.close()
    return out, torch.stack(rec.scores), path, replays


@pytest.mark.gpu
@pytest.mark.parametrize("resident", ["all", "none", 5])
def test_cuda_graph_replays_equal_static_issue_bitwise(tiny_model, resident):
    """Faults caught: a replay reading a stale input buffer (the token or position of the captured
    step), a write outside the captured pool, a bucket's graph replayed past its prefix (the decode
    crosses 256 tokens), a write-back racing the next step's fetch, the graph not engaging (replays
    not counted): the logits of every step equal the same step issued without a graph, the tokens
    the eager path's, and (offloaded) the all-resident graph's."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=32, layers=4, dtype=torch.bfloat16, device="cuda")
    ids = prompt(9, ctx=250).cuda()
    if resident != "all" and not loop.OFFLOADED_AUTO:   # auto leaves offloaded heads on CUDA to HF's loop
        _, _, path, _ = _cuda_run(model, ids, "auto", resident=resident)
        assert path == "eager"
        return
    g_out, g_scores, path, replays = _cuda_run(model, ids, "auto", resident=resident)
    assert path == "graph" and replays == NEW - 1, (path, replays)
    s_out, s_scores, path, replays = _cuda_run(model, ids, "static", resident=resident)
    assert path == "static" and replays == 0
    assert torch.equal(g_scores, s_scores) and torch.equal(g_out, s_out)
    e_out, _, path, _ = _cuda_run(model, ids, "eager", resident=resident)
    assert path == "eager" and torch.equal(e_out, g_out), (e_out, g_out)
    if resident != "all":
        a_out, a_scores, _, _ = _cuda_run(model, ids, "auto", resident="all")
        assert torch.equal(a_scores, g_scores) and torch.equal(a_out, g_out)


@pytest.mark.gpu
def test_cuda_graph_decode_has_no_per_token_sync(tiny_model):
    """Fault caught: a host sync per decode token (a .item(), a blocking copy, a stop check on the
    step just issued): the synchronizing calls seen by torch's sync debug mode grow with the
    number of tokens. The graph is captured by a first call; the cache keeps it."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=32, layers=4, dtype=torch.bfloat16, device="cuda")
    ids = prompt(10, ctx=200).cuda()
    counts = {}
    with kvpipe.HeadwiseCache(model, max_length=200 + 32, resident="all") as cache:
        _cuda_run(model, ids, "auto", cache, new=4)     # captures the step
        for new in (4, 24):
            cache.reset()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _cuda_run(model, ids, "auto", cache, new=new)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts[new] = sum("synchroniz" in str(w.message) for w in seen)
        assert cache.decode_path == "graph" and cache.replays == 3 + 3 + 23
    assert counts[24] <= counts[4], counts   # a sync per token would add 20
