"""pipeline/memory.breakdown for sparse decode (LOSSY) against the bytes the executor allocates:
the GPU summaries of every offloaded unit (chunk min/max, token sketch, unsealed tail) are sized
by the KV capacity (context + decode tokens), since decode tokens are summarised too. Checked over
random lossy plans whose context and capacity end in different sketch chunks, against the
tensors a KVStore opens (executor/kv/store.py, executor/sparse/homes.py), not the spec's formula."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

SPEC = ModelSpec("tiny", "llama", layers=2, hidden=128, q_heads=8, kv_heads=4, head_dim=16,
                 intermediate=64, vocab=64, dtype="fp32")
UNIT_TOKEN = 2 * 16 * 4          # K and V of one token of one unit, fp32


def _check(context: int, decode: int, batch: int, resident: int, lossy: LossySpec) -> None:
    work = Workload(context, decode, batch)
    plan = Plan(Method.HEADWISE, PhasePlan(2, min(128, context), 2), PhasePlan(2, 1, 2), resident, lossy=lossy)
    graph = build(SPEC, work, plan)
    mem = breakdown(SPEC, work, plan)
    with torch.inference_mode(), KVStore(KVLayout.of(graph), torch.device("cpu"), torch.float32) as store:
        summaries = store.sparse.gpu_bytes
        homes_and_slots = store.gpu_bytes - summaries
    assert mem.gpu_kv - resident * batch * work.kv_capacity * UNIT_TOKEN == summaries
    if lossy.quant is None:      # exact homes and slots: the whole GPU KV figure is what was allocated
        assert mem.gpu_kv + mem.gpu_buffers == homes_and_slots + summaries


@settings(max_examples=20)
@given(context=st.integers(64, 700), decode=st.integers(1, 200), batch=st.integers(1, 2),
       resident=st.integers(0, 7), quant=st.sampled_from([None, "int8", "int4"]), frac=st.floats(0.05, 1.0))
def test_sparse_gpu_summaries_are_what_the_executor_allocates(context, decode, batch, resident, quant, frac):
    """Fault caught: the GPU summaries sized by the context instead of context + decode tokens:
    wherever the capacity ends in a later sketch chunk than the context, the run allocates more
    than the plan counted."""
    _check(context, decode, batch, resident, LossySpec(quant, sparse=frac))


def test_context_and_capacity_in_different_chunks():
    """The case the law's examples must not miss, fixed: 1000 tokens end in chunk 15 of 64 tokens,
    1000 + 100 in chunk 17; the summaries hold 18 chunks (the whole ones and one past them)."""
    lossy = LossySpec(sparse=0.2)
    assert 1000 // lossy.chunk == 15 and 1100 // lossy.chunk == 17
    _check(1000, 100, 1, 0, lossy)
    # by hand: per unit 18 chunks x (min, max) x 16 channels x 4 bytes, 18 x 64 tokens of 2-bit
    # sketch over 16 channels, and the unsealed chunk's 64 exact keys: 8 offloaded units
    per_unit = 18 * 2 * 16 * 4 + 18 * 64 * 16 * 2 // 8 + 64 * 16 * 4
    assert breakdown(SPEC, Workload(1000, 100), Plan(Method.HEADWISE, PhasePlan(2, 128, 2), PhasePlan(2, 1, 2), 0,
                                                     lossy=lossy)).gpu_kv == 8 * per_unit
