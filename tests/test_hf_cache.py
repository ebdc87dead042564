"""HeadwiseCache: Hugging Face's own `generate()` with kvpipe's head-wise KV placement. References
are independent: HF's `DynamicCache` with the model's own (SDPA) attention, and `kvpipe run`'s
executor (`executor.engine.runner.execute`) on the same plan."""

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import kvpipe
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.hf.attention import IMPLEMENTATION
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.workload import Workload

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

FAMILIES = [  # family, kv heads, q heads, head_dim
    ("llama", 2, 8, 16),
    ("mistral", 4, 8, 16),
    ("qwen2", 2, 4, 32),
    ("qwen3", 4, 8, 16),
]
CTX, NEW, BATCH = 23, 8, 2
# No early stop on a random EOS; a pad id outside the prompts' ids (0..126), so HF infers no padding.
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)


def prompt(seed: int, batch: int = BATCH, ctx: int = CTX) -> torch.Tensor:
    return torch.randint(0, 127, (batch, ctx), generator=torch.Generator().manual_seed(seed))


def kvpipe_run_tokens(model, ids, new, plan) -> torch.Tensor:
    """Greedy tokens [B, new] from the executor `kvpipe run` uses, on `plan` (chunk 7)."""
    plan = plan.with_(prefill=replace(plan.prefill, chunk=7))
    graph = build(HFAdapter(model).spec(), Workload(ids.shape[1], new - 1, ids.shape[0]), plan)
    return execute(graph, model, ids).tokens


@pytest.mark.parametrize("family,kv,q,d", FAMILIES)
def test_greedy_equals_dynamic_cache_and_kvpipe_run(tiny_model, family, kv, q, d):
    # Faults caught: the wrong prefix fetched for an offloaded group, new K/V written to the wrong
    # tier or position, a mixed (resident + offloaded) group mis-assembled, a step's length off by
    # one, and HF's chunked prefill (prefill_chunk_size) attending without its prefix.
    model = tiny_model(family, kv_heads=kv, q_heads=q, head_dim=d)
    ids = prompt(kv * 7 + d)
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)[:, CTX:]     # DynamicCache, SDPA
    units = model.config.num_hidden_layers * kv
    mix = units // 2 + 1          # layers get different counts; with group 2 a group is mixed
    for resident, group in (("none", 1), ("all", kv), (mix, 2)):
        for hf_chunk in (None, 5):
            with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=resident, group=group,
                                      batch=BATCH) as cache:
                assert model.config._attn_implementation == IMPLEMENTATION
                out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW,
                                     prefill_chunk_size=hf_chunk, **GREEDY)[:, CTX:]
                plan = cache.plan
            assert torch.equal(out, ref), (resident, hf_chunk, out, ref)
        assert torch.equal(kvpipe_run_tokens(model, ids, NEW, plan), ref), resident
    assert model.config._attn_implementation == "sdpa"   # close() gave it back


def test_offloaded_logits_equal_resident_bitwise(tiny_model):
    # Fault caught: where a unit lives changing any bit of the output (a different kernel, shape or
    # reduction order for streamed groups than for resident ones), in prefill chunks and decode.
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    ids = prompt(3)
    scores = {}
    for resident in ("none", "all", 5):
        with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=resident, group=2, batch=BATCH) as cache:
            out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, prefill_chunk_size=6,
                                 output_logits=True, return_dict_in_generate=True, **GREEDY)
        scores[resident] = torch.stack(out.logits)                    # [NEW, B, V]
    assert torch.equal(scores["none"], scores["all"])
    assert torch.equal(scores[5], scores["all"])
    ref = model.generate(ids, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True, **GREEDY)
    torch.testing.assert_close(scores["none"], torch.stack(ref.logits), rtol=1e-4, atol=2e-5)


def test_offloaded_units_live_in_host_memory(tiny_model):
    # Fault caught: a plan knob ignored (everything kept on the device), or K/V stored at the
    # wrong head or position in the host tier. Reference: HF's DynamicCache keys and values.
    model = tiny_model("qwen2", kv_heads=2, q_heads=4, head_dim=32)
    ids = prompt(5)
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=ref, use_cache=True)
    with kvpipe.HeadwiseCache(model, max_length=CTX + 4, resident=1, group=1, batch=BATCH) as cache:
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
        store = cache.stream.store
        assert cache.layout.resident == (1, 0)
        assert store.gpu[1] is None and store.host[0].shape[1] == 1 and store.host[1].shape[1] == 2
        for layer, n in enumerate(cache.layout.resident):
            keys, values = ref.layers[layer].keys, ref.layers[layer].values          # [B, H, S, D]
            for h in range(2):
                buf = store.gpu[layer][:, h] if h < n else store.host[layer][:, h - n]  # [B, S_cap, 2, D]
                torch.testing.assert_close(buf[:, :CTX, 0], keys[:, h], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(buf[:, :CTX, 1], values[:, h], rtol=1e-6, atol=1e-6)
        assert cache.get_seq_length() == CTX


def test_sampling_with_a_seed(tiny_model):
    # Fault caught: sampling (logits processors, multinomial) seeing different logits through the
    # cache than through HF's own path; float64 so that the SDPA reference agrees to ~1e-15.
    model = tiny_model("mistral", kv_heads=4, q_heads=8, head_dim=16, dtype=torch.float64)
    ids = prompt(11)
    sample = dict(do_sample=True, top_k=20, temperature=0.9, eos_token_id=None, pad_token_id=127)
    torch.manual_seed(1234)
    ref = model.generate(ids, max_new_tokens=NEW, **sample)
    outs = []
    for resident in ("none", "all"):
        with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident=resident, group=1, batch=BATCH) as cache:
            torch.manual_seed(1234)
            outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=NEW, **sample))
    assert torch.equal(outs[0], ref) and torch.equal(outs[1], ref)
    assert len(set(ref[0, CTX:].tolist())) > 1   # it really sampled, not a constant


class StopAfter(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_stopping_criteria_and_streamer(tiny_model):
    # Fault caught: the cache breaking generate()'s per-step hooks: a stopping criterion that
    # ends early, and a streamer that must receive the prompt and then each token as produced.
    model = tiny_model("qwen3", kv_heads=4, q_heads=8, head_dim=16)
    ids = prompt(2, batch=1)
    streamer = Collect()
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="none", group=2) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, streamer=streamer,
                             stopping_criteria=StoppingCriteriaList([StopAfter(CTX + 3)]), **GREEDY)
    ref = model.generate(ids, max_new_tokens=3, **GREEDY)
    assert out.shape == (1, CTX + 3) and torch.equal(out, ref)
    assert torch.equal(streamer.chunks[0], ids) and streamer.ended
    assert torch.cat([c.reshape(-1) for c in streamer.chunks[1:]]).tolist() == out[0, CTX:].tolist()


def test_bad_input_is_refused_with_the_field_named(tiny_model):
    # Fault caught: bad knobs or inputs running silently (wrong answers) or failing with a traceback
    # from deep inside transformers instead of a ValueError naming the field.
    model = tiny_model("llama", kv_heads=2)
    ids = prompt(1, batch=1)
    for kw, field in ((dict(resident="some"), "resident"), (dict(resident=99), "resident"),
                      (dict(group=3), "group"), (dict(max_length=0), "max_length"),
                      (dict(gpu_mem=-1), "gpu_mem"), (dict(host_mem=1, resident="none"), "host_mem"),
                      (dict(gpu_mem=1000, resident="all"), "gpu_mem"),
                      (dict(plan="x", resident="none"), "plan")):
        args = dict(max_length=CTX + NEW) | kw
        with pytest.raises(ValueError, match=field):
            kvpipe.HeadwiseCache(model, **args)
    assert model.config._attn_implementation == "sdpa"   # a refused cache changes nothing
    with kvpipe.HeadwiseCache(model, max_length=CTX + 2, resident="none", group=1) as cache:
        with pytest.raises(ValueError, match="max_length"):
            model.generate(ids, past_key_values=cache, max_new_tokens=NEW, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, batch=1) as cache:
        with pytest.raises(ValueError, match="^batch: generate"):
            model.generate(prompt(1, batch=2), past_key_values=cache, max_new_tokens=2, **GREEDY)


def test_other_caches_while_switched(tiny_model):
    # Fault caught: the kvpipe_headwise implementation giving wrong answers when the model runs
    # with HF's own cache (it falls back to exact attention over plain tensors), padded or not.
    model = tiny_model("qwen2", kv_heads=2, q_heads=4, head_dim=32)
    ids = prompt(4)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ref = model.generate(ids, max_new_tokens=NEW, **GREEDY)
    ref_pad = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, resident="none", group=1, batch=2 * BATCH):
        assert torch.equal(model.generate(ids, max_new_tokens=NEW, **GREEDY), ref)   # DynamicCache
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, **GREEDY), ref_pad)


def test_import_kvpipe_stays_torch_free():
    # Fault caught: `import kvpipe` pulling torch/transformers in (HeadwiseCache imported eagerly).
    import subprocess
    import sys
    code = "import sys, kvpipe; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    from kvpipe.hf_cache import HeadwiseCache
    assert kvpipe.HeadwiseCache is HeadwiseCache


@pytest.mark.gpu
@pytest.mark.parametrize("resident", ["none", 5])
def test_cuda_streams_bitwise_equal_resident(tiny_model, resident):
    # Fault caught: a race between the h2d prefetch, the d2h store and the compute stream (a slot
    # refilled before its reader ran, a prefix fetched before its store landed): logits then
    # differ from the all-resident run, which copies nothing.
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=32, layers=4, dtype=torch.bfloat16,
                       device="cuda")
    ids = prompt(9, ctx=300).cuda()
    logits = {}
    for res in ("all", resident):
        with kvpipe.HeadwiseCache(model, max_length=300 + 16, resident=res, group=1, batch=BATCH) as cache:
            out = model.generate(ids, past_key_values=cache, max_new_tokens=16, prefill_chunk_size=64,
                                 output_logits=True, return_dict_in_generate=True, **GREEDY)
        logits[res] = torch.stack(out.logits)
    assert torch.equal(logits[resident], logits["all"])
