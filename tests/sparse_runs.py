"""Shared by the sparse-decode tests (tests/test_sparse_run.py, tests/test_sparse_int4.py): the
tiny models they build, their plan, and the check that F = 1 is the base run bit for bit."""
import torch

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

# a bf16 CUDA model wide enough for the Triton ranking and the UVA gather (head_dim 64)
CUDA_TINY = dict(kv_heads=2, q_heads=8, head_dim=64, layers=2, dtype=torch.bfloat16, device="cuda",
                 hidden_size=256, intermediate_size=512, vocab_size=1024)


def plan_of(lossy, resident=0, group=2):
    return Plan(Method.HEADWISE, PhasePlan(group, 128), PhasePlan(group, 1), resident, lossy=lossy)


def check_fraction_one(tiny_model, base, one, sparse, decode: int) -> None:
    """On a tiny CPU model over 300 tokens: the run with `one` (the sparse spec at F = 1) equals the
    run with `base` (None: exact, or the same quantisation without sparse) bit for bit; two runs of
    `sparse` agree; they differ from `base` in the decode steps and not in prefill."""
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    spec = HFAdapter(model).spec()
    w = Workload(300, decode)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    run = lambda lossy: execute(build(spec, w, plan_of(lossy)), model, ids, keep_logits=True)   # noqa: E731
    ref, full = run(base), run(one)
    assert torch.equal(ref.tokens, full.tokens) and torch.equal(ref.step_logits, full.step_logits)
    a, b = run(sparse), run(sparse)
    assert torch.equal(a.step_logits, b.step_logits)
    assert not torch.equal(a.step_logits[1:], ref.step_logits[1:])
    assert torch.equal(a.step_logits[0], ref.step_logits[0])       # prefill is never sparse
