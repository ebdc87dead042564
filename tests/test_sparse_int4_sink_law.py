"""Sparse decode over int4 blocks (executor/sparse/homes.py over pipeline/lossy.LossySpec.block_args):
whatever the ranking, a step attends every sink token and every recent-window token, also where
the sink or the window is not a multiple of the quantisation group (a block holding only some of
the sink tokens is forced whole). Keys are planted so that the sink's blocks rank last; the
tokens attended are read from the store's own selection, the expectation is token arithmetic."""
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

H, R, D = 2, 2, 16     # KV heads, query heads per KV head, head dim
SPEC = ModelSpec("tiny", "llama", layers=1, hidden=H * R * D, q_heads=H * R, kv_heads=H, head_dim=D,
                 intermediate=64, vocab=64, dtype="fp32")


def _attended(lossy: LossySpec, prefix: int, seed: int) -> list[set[int]]:
    """Tokens each offloaded unit of a one-layer store attend at a decode step over `prefix` tokens,
    where the first tokens (past the sink) hold keys opposite the query (ranked last)."""
    plan = Plan(Method.HEADWISE, PhasePlan(2, 64), PhasePlan(2, 1), 0, lossy=lossy)
    layout = KVLayout.of(build(SPEC, Workload(prefix, 1), plan))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(D, generator=gen)
    q = q / q.norm()
    kv = torch.randn(1, H, prefix, 2, D, generator=gen)                     # [B, H, S, 2, D]
    low = min(prefix, -(-lossy.sink // lossy.group) * lossy.group + lossy.group)
    kv[:, :, :low, 0] = -8.0 * q + 0.01 * torch.randn(low, D, generator=gen)
    with torch.inference_mode(), KVStore(layout, torch.device("cpu"), torch.float32) as store:
        store.sparse.append(0, kv, 0)
        queries = (4.0 * q).expand(1, H * R, 1, D).contiguous()            # [B, n_off * r, 1, D]
        sel = store.sparse.select(0, queries, prefix)
        toks = store.sparse.tokens(sel, prefix)                              # [B, n_off, attended]
    return [set(toks[0, u].tolist()) for u in range(H)]


@settings(max_examples=20)
@given(group=st.sampled_from([8, 16, 32]), sink_blocks=st.integers(0, 3), sink_part=st.integers(1, 31),
       recent=st.integers(0, 200), prefix=st.integers(300, 1200), frac=st.floats(0.05, 0.4),
       seed=st.integers(0, 1000))
def test_a_step_attends_every_sink_and_recent_token_whatever_the_ranking(group, sink_blocks, sink_part,
                                                                      recent, prefix, frac, seed):
    """Fault caught: the sink's blocks rounded down (sink // group) in the block selection, so the
    block holding the last sink tokens is not forced and, ranked last, is left out. Here the sink
    is never a multiple of the group, and the tokens attended come from the store's selection."""
    sink = sink_blocks * group + 1 + sink_part % (group - 1)     # never a multiple of the group
    lossy = LossySpec("int4", group=group, sparse=frac, sink=sink, recent=recent)
    assume(sparse_sketch.ranks(*lossy.block_args(prefix)))    # a step that ranks (else all forced)
    for got in _attended(lossy, prefix, seed):
        assert set(range(min(sink, prefix))) <= got, sorted(set(range(sink)) - got)
        assert set(range(max(0, prefix - recent), prefix)) <= got
        assert len(got) < prefix                               # a sparse step: some tokens left out
