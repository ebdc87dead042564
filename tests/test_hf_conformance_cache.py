"""HeadwiseCache as a transformers `Cache` object: what HF code and users read and call on a cache
(layers[i].keys / .values, get_seq_length, get_mask_sizes, crop, reorder_cache,
batch_repeat_interleave, batch_select_indices, copy.deepcopy) behaves as on HF's DynamicCache,
the independent reference, with units in both tiers; and the cache's lifetime on its model."""
import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

import kvpipe
from kvpipe.executor.hf.attention import IMPLEMENTATION
from kvpipe.executor.hf.generate import cache_argument, live

pytestmark = [pytest.mark.usefixtures("single_thread")]

CTX, NEW = 17, 6
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)


def prompt(seed: int, batch: int = 3, ctx: int = CTX) -> torch.Tensor:
    return torch.randint(0, 127, (batch, ctx), generator=torch.Generator().manual_seed(seed))


def forward(model, ids, cache):
    with torch.inference_mode():
        return model(ids, **{cache_argument(model): cache}, use_cache=True).logits


def same_kv(cache, ref) -> None:
    """Every layer's keys and values equal (to float rounding of the two attention paths)."""
    assert cache.get_seq_length() == ref.get_seq_length()
    for mine, theirs in zip(cache.layers, ref.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=3)


def test_keys_values_and_sizes_read_like_dynamic_cache(model):
    """Faults caught: layers[i].keys / .values None or assembled wrongly from the tiers (a head
    from the wrong home, resident and host heads swapped), or the read a view that a write through
    it corrupts; get_seq_length / get_mask_sizes off. Put in: materialise with the tiers reversed."""
    ids = prompt(1)
    ref = DynamicCache(config=model.config)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=3, group=1, batch=3) as cache:
        assert cache.layers[0].keys is None and cache.get_seq_length() == 0
        forward(model, ids, cache), forward(model, ids, ref)
        forward(model, ids[:, :2], cache), forward(model, ids[:, :2], ref)
        assert cache.layout.resident == (1, 1, 1)   # each layer: a resident head, a host head
        same_kv(cache, ref)
        assert cache.layers[1].keys.shape == (3, 2, CTX + 2, 16)
        assert cache.get_mask_sizes(4, 0) == ref.get_mask_sizes(4, 0) == (CTX + 6, 0)
        cache.layers[1].keys.zero_()   # a copy: the homes are untouched
        same_kv(cache, ref)
        with pytest.raises(ValueError, match="read-only copy"):
            cache.layers[0].keys = torch.zeros(1)


@pytest.mark.parametrize("op,arg", [("crop", -5), ("reorder_cache", [2, 0, 0]),
                                    ("batch_select_indices", [2, 0]), ("batch_repeat_interleave", 2)])
def test_cache_operations_match_dynamic_cache_across_tiers(model, op, arg):
    """Faults caught: an operation applied to one tier's homes only (the host heads keep the old
    order or length), or refused; the continuation then attends to the wrong K/V. Put in: regather
    skipping host homes; crop a no-op."""
    ids, nxt = prompt(2), prompt(3, ctx=2)
    rows = {"batch_select_indices": 2, "batch_repeat_interleave": 6}.get(op, 3)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=3, group=1, batch=6) as cache:
        ref = DynamicCache(config=model.config)
        forward(model, ids, cache), forward(model, ids, ref)
        a = torch.tensor(arg) if isinstance(arg, list) else arg
        getattr(cache, op)(a), getattr(ref, op)(a)
        same_kv(cache, ref)
        nxt = nxt.repeat_interleave(2, dim=0)[:rows]
        torch.testing.assert_close(forward(model, nxt, cache), forward(model, nxt, ref), rtol=1e-5, atol=1e-5)
        same_kv(cache, ref)


def test_deepcopy_shares_the_model_and_continues_like_a_fresh_run(model):
    """Faults caught: deepcopy copying the model (HF's prefix-caching recipe copies the cache per
    prompt: memory then grows by the model each time), or a copy sharing KV buffers with the
    original (the two continuations overwrite each other). Put in: no __deepcopy__ (the default
    copies the model), and duplicate() returning the same stream."""
    prefix, ids = prompt(4, batch=1), prompt(5, batch=1, ctx=4)
    full = torch.cat([prefix, ids], dim=1)
    ref = model.generate(full, max_new_tokens=NEW, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=CTX + 4 + NEW, resident=3, group=1) as base:
        forward(model, prefix, base)
        outs = []
        for _ in range(2):
            c = copy.deepcopy(base)
            assert c.model is model and c.stream.store.host[1] is not base.stream.store.host[1]
            outs.append(model.generate(full, **{cache_argument(model): c}, max_new_tokens=NEW, **GREEDY))
            c.close()
        assert base.get_seq_length() == CTX
        assert model.config._attn_implementation == IMPLEMENTATION   # base is still live
    assert all(torch.equal(o, ref) for o in outs)
    assert model.config._attn_implementation == "sdpa" and "generate" not in model.__dict__


def test_closing_one_cache_leaves_the_other_live(model):
    """Fault caught: the first close() switching the model back to SDPA while another
    HeadwiseCache is live (its next generate() then fails). Put in: detach restoring at once."""
    ids = prompt(6, batch=1)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    a = kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="none", group=1)
    b = kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="none", group=1)
    assert live(model) == 2
    a.close()
    a.close()   # twice: still counted once
    assert live(model) == 1 and model.config._attn_implementation == IMPLEMENTATION
    assert torch.equal(model.generate(ids, **{cache_argument(model): b}, max_new_tokens=NEW, **GREEDY), ref)
    b.close()
    assert live(model) == 0 and model.config._attn_implementation == "sdpa"


def test_budget_strings_and_the_cache_argument_name(model):
    """Faults caught: gpu_mem="24GB" refused although the CLI takes that form; generate() warning
    that `past_key_values` is deprecated when handed the cache under the older name. Put in:
    budget_bytes without the string case; the wrapper not renaming the argument."""
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, gpu_mem="24GB", host_mem="1GiB") as a:
        with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, gpu_mem=24 * 10**9, host_mem=2**30) as b:
            assert a.plan == b.plan
    with pytest.raises(ValueError, match="^gpu_mem: cannot read"):
        kvpipe.HeadwiseCache(model, max_length=CTX + NEW, gpu_mem="lots")
    ids = prompt(7, batch=1)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW) as cache, warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(ids, past_key_values=cache, max_new_tokens=2, **GREEDY)
        cache.reset()
        model.generate(ids, cache=cache, max_new_tokens=2, **GREEDY)


def test_generate_prefills_in_the_plans_chunks(model):
    """Fault caught: generate() prefilling the whole prompt in one forward when the caller passes
    no prefill_chunk_size (the plan's chunk ignored: its peak memory and its overlap lost), or
    overriding a chunk the caller chose. Put in: prepare_generate not setting prefill_chunk_size."""
    ids = prompt(8, batch=1)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        for given, want in ((None, [5, 5, 5, 2]), (8, [8, 8, 1])):
            lengths.clear()
            with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=3, group=1, chunk=5) as cache:
                out = model.generate(ids, **{cache_argument(model): cache}, max_new_tokens=NEW,
                                     prefill_chunk_size=given, **GREEDY)
            assert torch.equal(out, ref)
            assert lengths == want + [1] * (NEW - 1), (given, lengths)
    finally:
        hook.remove()


def test_the_readme_snippet_runs_as_written(capsys):
    """Fault caught: the README's HeadwiseCache snippet depending on names it does not define
    (`model`, `ids`, `prompt_len`) or on a download, or failing as written. Put in: the snippet's
    model line removed."""
    from pathlib import Path
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## Hugging Face generate()"):]
    start = section.index("```python\n") + 10
    code = section[start:section.index("\n```", start)]
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("[") and len(eval(printed)) == 16


def test_an_unpadded_mask_is_read_once_per_call_not_per_step(model, monkeypatch):
    """Fault caught: every decode step reading the attention mask back to the host to look for
    padding (a device sync per token). Put in: the wrapper not setting UNPADDED (seen failing
    with transformers 5.17; 5.24's generate() drops an all-ones mask itself, so there it passes)."""
    import kvpipe.executor.hf.masked as masked
    calls = []
    real = masked.padding_mask
    monkeypatch.setattr(masked, "padding_mask", lambda *a: calls.append(1) or real(*a))
    ids = prompt(9, batch=1)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_argument(model): cache},
                             max_new_tokens=NEW, **GREEDY)
    assert torch.equal(out, ref) and calls == []
