"""HeadwiseCache inside transformers' own generate(), across its decoding modes: every mode gives
the tokens HF gives with its DynamicCache (the independent reference), on tiny random Llama
(multi-head and GQA), Mistral (sliding window covering the cache) and Qwen2, with units spread
over both tiers (`resident` a mix: some layers resident, others offloaded, a mixed group)."""
import pytest
import torch

import kvpipe
from kvpipe.executor.hf.generate import cache_argument

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("error::FutureWarning")]

MODELS = {  # name -> tiny_model arguments
    "llama": dict(family="llama", kv_heads=4, q_heads=4, head_dim=16),
    "llama-gqa": dict(family="llama", kv_heads=2, q_heads=8, head_dim=16),
    "mistral": dict(family="mistral", kv_heads=2, q_heads=4, head_dim=16, sliding_window=64),
    "qwen2": dict(family="qwen2", kv_heads=2, q_heads=4, head_dim=32),
}
CTX, NEW = 19, 7
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)
SAMPLE = dict(do_sample=True, top_k=30, temperature=0.8, eos_token_id=None, pad_token_id=127)


def prompt(seed: int, batch: int = 2, ctx: int = CTX) -> torch.Tensor:
    return torch.randint(0, 127, (batch, ctx), generator=torch.Generator().manual_seed(seed))


def left_padded(ids: torch.Tensor) -> torch.Tensor:
    """An attention mask with zeros on the left: 5 pad tokens on row 0, 2 on row 1."""
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :2] = 0
    return mask


def run(model, ids, seed=None, resident=3, batch=2, length=CTX + NEW, **kw) -> torch.Tensor:
    """generate() with a HeadwiseCache on the tiers mix, passed under the version's argument name."""
    with kvpipe.HeadwiseCache(model, max_length=length, resident=resident, group=1, batch=batch) as cache:
        if seed is not None:
            torch.manual_seed(seed)
        return model.generate(ids, **{cache_argument(model): cache}, **kw)


def hf(model, ids, seed=None, **kw) -> torch.Tensor:
    if seed is not None:
        torch.manual_seed(seed)
    return model.generate(ids, **kw)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_sampled_and_left_padded_equal_hf(tiny_model, name):
    """Faults caught: padded keys attended (a left-padded row's tokens differ from HF's), padding
    refused, a sliding window that covers the cache refused (Mistral), or sampling seeing other
    logits through the cache. Put in: headwise_mask returning None for padded masks."""
    model = tiny_model(**MODELS[name])
    ids = prompt(len(name))
    mask = left_padded(ids)
    for kw in (GREEDY, dict(SAMPLE, top_p=0.9)):
        seed = 7 if kw["do_sample"] else None
        for m in (None, mask):
            ref = hf(model, ids, seed, attention_mask=m, max_new_tokens=NEW, **kw)
            out = run(model, ids, seed, attention_mask=m, max_new_tokens=NEW, **kw)
            assert torch.equal(out, ref), (name, kw["do_sample"], m is not None)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_beam_search_equals_hf(tiny_model, name):
    """Fault caught: reorder_cache moving only some homes (the resident ones, or one tier) or not
    at all: the beams then continue from another beam's KV. Put in: regather skipping host homes."""
    model = tiny_model(**MODELS[name])
    ids = prompt(3)
    kw = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=2, **GREEDY)
    ref = hf(model, ids, **kw)
    assert torch.equal(run(model, ids, batch=6, **kw), ref)
    mask = left_padded(ids)
    assert torch.equal(run(model, ids, batch=6, attention_mask=mask, **kw), hf(model, ids, attention_mask=mask, **kw))


def test_num_return_sequences_sampled_and_the_batch_it_needs(tiny_model):
    """Faults caught: num_return_sequences > 1 giving other tokens than HF, or, with a cache built
    for fewer sequences, failing with a shape error deep in the model instead of saying what to
    pass. Put in: prepare_generate's batch check removed (the first forward then refuses)."""
    model = tiny_model(**MODELS["llama-gqa"])
    ids = prompt(5, batch=1)
    kw = dict(max_new_tokens=NEW, num_return_sequences=3, **SAMPLE)
    assert torch.equal(run(model, ids, 11, batch=3, **kw), hf(model, ids, 11, **kw))
    with pytest.raises(ValueError, match=r"^batch: generate\(\) runs 3 sequences .* build it with batch=3$"):
        run(model, ids, 11, batch=1, **kw)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_prompt_lookup_and_assisted_decoding_equal_hf(tiny_model, name):
    """Fault caught: crop() not truncating every layer (rejected candidate tokens stay attended),
    or crop refused. Put in: HeadwiseLayer.crop a no-op."""
    model = tiny_model(**MODELS[name])
    ids = prompt(9, batch=1).repeat(1, 2)[:, :CTX]   # repeats: prompt lookup finds candidates
    kw = dict(max_new_tokens=NEW, **GREEDY)
    assert torch.equal(run(model, ids, batch=1, length=CTX + NEW + 2, prompt_lookup_num_tokens=3, **kw),
                       hf(model, ids, prompt_lookup_num_tokens=3, **kw))
    draft = tiny_model(**MODELS[name], layers=1)
    assert torch.equal(run(model, ids, batch=1, assistant_model=draft, **kw),
                       hf(model, ids, assistant_model=draft, **kw))


def test_sliding_window_smaller_than_the_cache_is_refused_up_front(tiny_model):
    """Fault caught: a window smaller than the cache accepted (attention would then see keys the
    model must not) or refused only mid-run. Put in: the window check in adapter.check skipped."""
    model = tiny_model(**MODELS["mistral"])
    with pytest.raises(ValueError, match=r"^sliding_window: .*64.*not supported"):
        kvpipe.HeadwiseCache(model, max_length=65)
    assert model.config._attn_implementation == "sdpa"
    run(model, prompt(1), length=64, max_new_tokens=NEW, **GREEDY)   # a window of exactly the cache runs
    big = tiny_model(**dict(MODELS["mistral"], sliding_window=4096), max_position_embeddings=8192)
    kvpipe.HeadwiseCache(big, max_length=4096).close()   # Mistral-7B-v0.1's window, contexts up to it
    with pytest.raises(ValueError, match="^sliding_window: "):
        kvpipe.HeadwiseCache(big, max_length=4097)


def test_continuation_embeddings_and_processors_equal_hf(tiny_model):
    """Faults caught: a second generate() over a returned cache re-prefilling or mis-placing the
    cached prefix; inputs_embeds prompts or logits processors (repetition penalty, n-gram ban,
    min_new_tokens) seeing other logits; output_attentions failing with an IndexError deep in
    generate() instead of one line. Put in: the output_attentions check removed."""
    model = tiny_model(**MODELS["qwen2"])
    ids = prompt(12)
    first = hf(model, ids, max_new_tokens=4, **GREEDY)
    ref = hf(model, first, max_new_tokens=4, **GREEDY)   # HF: a fresh run over the longer prompt
    with kvpipe.HeadwiseCache(model, max_length=CTX + 8, resident=3, group=1, batch=2) as cache:
        arg = {cache_argument(model): cache}
        out = model.generate(ids, **arg, max_new_tokens=4, return_dict_in_generate=True, **GREEDY)
        assert out[cache_argument(model)] is cache and cache.get_seq_length() == CTX + 3
        assert torch.equal(model.generate(out.sequences, **arg, max_new_tokens=4, **GREEDY), ref)
        with pytest.raises(ValueError, match="^output_attentions: not supported"):
            model.generate(ids, **arg, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True,
                           **GREEDY)
    emb = model.get_input_embeddings()(ids)
    assert torch.equal(run(model, None, inputs_embeds=emb, max_new_tokens=NEW, **GREEDY),
                       hf(model, None, inputs_embeds=emb, max_new_tokens=NEW, **GREEDY))
    kw = dict(max_new_tokens=NEW, min_new_tokens=3, repetition_penalty=1.3, no_repeat_ngram_size=2, **GREEDY)
    assert torch.equal(run(model, ids, **kw), hf(model, ids, **kw))


@pytest.mark.gpu
def test_cuda_beams_over_padded_prompts_equal_all_resident(tiny_model):
    """Faults caught, on CUDA: a reorder (beam search) racing the d2h stores or h2d prefetches of
    offloaded heads (regather before the copies in flight landed), or padded attention differing
    between tiers: the sequences then differ from the all-resident run's, bit for bit."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=32, layers=3, dtype=torch.bfloat16, device="cuda")
    ids = prompt(4, ctx=200).cuda()
    mask = left_padded(ids)
    kw = dict(attention_mask=mask, max_new_tokens=12, num_beams=3, prefill_chunk_size=64,
              output_scores=True, return_dict_in_generate=True, **GREEDY)
    outs = {res: run(model, ids, resident=res, batch=6, length=212, **kw) for res in ("all", "none", 5)}
    for res in ("none", 5):
        assert torch.equal(outs[res].sequences, outs["all"].sequences), res
        assert torch.equal(torch.stack(outs[res].scores), torch.stack(outs["all"].scores)), res
