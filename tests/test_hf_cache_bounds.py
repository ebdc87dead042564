"""`HeadwiseCache`'s two limits at their edges: the GPU budget (the plan's peak must fit under the
budget less the caching allocator's allowance, as `kvpipe run` and the planner count it) and
`max_length` (a cache exactly as long as generate() fills is accepted; one token shorter is not)."""
import pytest
import torch
from transformers import DynamicCache

import kvpipe
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.workload import Workload

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

CTX, NEW = 23, 6
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=127)
FLOOR = 256 * 2**20      # the allocator's allowance below a 25.6 GiB budget: max(256 MiB, 1%)
KNOBS = dict(resident="all", group=2, chunk=16, depth=2)   # a plan that does not move with the budget


def _refusal(model, budget: int) -> str:
    """The ValueError's text of a cache refused at `gpu_mem=budget`, or "" (the cache closed
    again, so that an accepted one leaves the model's attention as it was)."""
    try:
        cache = kvpipe.HeadwiseCache(model, max_length=CTX + NEW, gpu_mem=budget, **KNOBS)
    except ValueError as e:
        return str(e)
    cache.close()
    return ""


def test_the_gpu_budget_keeps_the_allocators_allowance(tiny_model):
    """Fault caught: the GPU budget check without the allocator's allowance (a 1000-byte budget
    is refused either way): a budget that holds the plan's peak but not the allowance on top must
    be refused, one that holds both accepted."""
    model = tiny_model("llama", kv_heads=2)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, **KNOBS) as cache:
        plan = cache.plan
    need = breakdown(HFAdapter(model).spec(), Workload(CTX + NEW, 0, 1), plan).gpu
    assert 0 < need < FLOOR
    for budget in (need + 1, need + FLOOR // 2, need + FLOOR - 1):
        assert _refusal(model, budget).startswith("gpu_mem: "), budget
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW, gpu_mem=need + FLOOR, **KNOBS) as cache:
        assert cache.plan == plan
    assert model.config._attn_implementation == "sdpa"


def test_an_exactly_full_cache_is_accepted_and_one_token_less_refused(tiny_model):
    """Fault caught: `max_length` checked with >= (a cache filled exactly to its length refused),
    or checked only once exceeded, after the work. generate() with NEW new tokens writes the
    prompt and NEW - 1 of them (the last is sampled, never attended): a cache of CTX + NEW - 1
    tokens must give HF's own greedy tokens; one of CTX + NEW - 2 must be refused before any
    forward runs."""
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(0, 127, (1, CTX), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=NEW, **GREEDY)[:, CTX:]
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW - 1, resident="none", group=1) as cache:
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, **GREEDY)[:, CTX:]
        assert cache.get_seq_length() == CTX + NEW - 1 == cache.max_length
    assert torch.equal(out, ref)
    with kvpipe.HeadwiseCache(model, max_length=CTX + NEW - 2, resident="none", group=1) as cache:
        with pytest.raises(ValueError, match=f"^max_length: generate\\(\\) writes up to {CTX + NEW - 1} tokens"):
            model.generate(ids, past_key_values=cache, max_new_tokens=NEW, **GREEDY)
        assert cache.stream is None   # refused before the first forward allocated anything
