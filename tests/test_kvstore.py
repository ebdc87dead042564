"""The KV store: layout from the plan, one allocation per buffer for the whole run, copies that
move exactly the bytes the graph says (decode writes back only the new token), clean release."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore, k_of, v_of
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, Tier, placement
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = ModelSpec("tiny", "llama", layers=3, hidden=64, q_heads=8, kv_heads=4, head_dim=16,
                 intermediate=96, vocab=128, dtype="fp32")


def plan(resident, group=2, chunk=5, depth=2, decode_group=None, decode_depth=None, disk=0):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth),
                PhasePlan(decode_group or group, 1, decode_depth or depth), resident, disk)


@pytest.mark.parametrize("resident", [0, 1, 5, 12])
def test_layout_follows_placement(resident):
    g = build(SPEC, Workload(17, 4, 2), plan(resident, depth=3, decode_group=4, decode_depth=1))
    lo = KVLayout.of(g)
    tiers = placement(SPEC, g.plan)
    assert lo.resident == tuple(sum(tiers[(l, h)] is Tier.GPU for h in range(4)) for l in range(3))
    assert sum(lo.resident) == resident and lo.capacity == 21 and lo.batch == 2
    assert (lo.slots, lo.slot_heads) == ((3, 4) if resident < 12 else (0, 4))


def test_disk_units_are_each_layers_top_heads():
    """Catches a layout whose disk heads are not the ones placement() put on disk (the store
    would read another head's rows)."""
    g = build(SPEC, Workload(17, 4), plan(1, disk=5))
    lo, tiers = KVLayout.of(g), placement(SPEC, g.plan)
    assert lo.disk == tuple(sum(tiers[(l, h)] is Tier.DISK for h in range(4)) for l in range(3))
    assert sum(lo.disk) == 5 and lo.write_tokens == 5
    assert all(tiers[(l, h)] is Tier.DISK for l in range(3) for h in range(lo.first_disk(l), 4))


def test_buffers_are_allocated_at_open_and_released_at_close():
    lo = KVLayout(batch=2, kv_heads=4, head_dim=8, capacity=9, resident=(0, 3, 4), slots=2, slot_heads=2)
    store = KVStore(lo, "cpu", torch.float32)
    assert store.data_ptrs() == ()          # nothing before open()
    with store:
        assert [t is None for t in store.gpu] == [True, False, False]
        assert [t is None for t in store.host] == [False, False, True]
        assert store.host_bytes == (4 + 1) * 2 * 9 * 2 * 8 * 4
        assert store.gpu_bytes == (3 + 4 + 2 * 2) * 2 * 9 * 2 * 8 * 4
    assert store.data_ptrs() == () and store.host_bytes == 0
    with pytest.raises(KeyboardInterrupt):   # released on an interrupt too
        with store:
            assert store.host_bytes > 0
            raise KeyboardInterrupt
    assert store.data_ptrs() == ()


def test_store_then_fetch_round_trips_and_counts_bytes():
    lo = KVLayout(batch=2, kv_heads=4, head_dim=8, capacity=12, resident=(1,), slots=2, slot_heads=4)
    gen = torch.Generator().manual_seed(0)
    with KVStore(lo, "cpu", torch.float64) as store:
        ptrs = store.data_ptrs()
        kv = torch.randn(2, 4, 12, 2, 8, generator=gen, dtype=torch.float64)  # [B, H, S, 2, D]
        for start, n in ((0, 5), (5, 4), (9, 1), (10, 2)):  # a prefill in chunks, then decode
            chunk = kv[:, :, start:start + n].contiguous()
            store.write_resident(0, chunk, start)
            assert store.store(0, (1, 2, 3), chunk, start) == 2 * 3 * n * 2 * 8 * 8
        assert store.fetch(0, (2, 3), base=2, slot=1, length=11) == 2 * 2 * 11 * 2 * 8 * 8
        got = store.slot_prefix(1, 2, 11)                                   # [B, 2, 11, 2, D]
        assert torch.equal(got, kv[:, 2:4, :11])
        assert torch.equal(k_of(got), kv[:, 2:4, :11, 0]) and torch.equal(v_of(got), kv[:, 2:4, :11, 1])
        store.fetch(0, (1,), base=0, slot=0, length=7)                   # mixed group {0, 1}
        store.fill_resident(0, (0, 1), slot=0, length=7)
        assert torch.equal(store.slot_prefix(0, 2, 7), kv[:, 0:2, :7])
        assert torch.equal(store.resident_prefix(0, (0,), 12), kv[:, 0:1])
        assert store.data_ptrs() == ptrs


class _KVAllocations(TorchDispatchMode):
    """Records every tensor created with the KV layout's signature [.., S_cap, 2, D]."""

    def __init__(self, capacity, head_dim):
        super().__init__()
        self.capacity, self.head_dim, self.created = capacity, head_dim, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() == 5 and out.shape[2:] == (self.capacity, 2, self.head_dim):
            if out._base is None and "empty" in str(func):
                self.created.append(tuple(out.shape))
        return out


def test_run_allocates_each_kv_buffer_once(tiny_model):
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    w = Workload(19, 6, 2)   # S_cap = 25, no chunk of 25 tokens
    g = build(HFAdapter(model).spec(), w, plan(5, group=2, chunk=4, depth=3, decode_group=1))
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(1))
    with _KVAllocations(w.kv_capacity, 16) as rec:
        res = execute(g, model, ids)
    lo = KVLayout.of(g)
    expected = sorted([(2, n, 25, 2, 16) for n in lo.resident if n]
                      + [(2, 4 - n, 25, 2, 16) for n in lo.resident if n < 4] + [(2, 2, 25, 2, 16)] * 3)
    assert sorted(rec.created) == expected
    # Fault caught (fast twin of the CLI's predicted == measured host check): the planner's KV
    # homes sized by the context alone. 7 offloaded units x batch 2 x (19 + 6) tokens x 128 bytes.
    mem = breakdown(g.model, w, g.plan)
    assert res.host_pinned_bytes == mem.host_kv == 7 * 2 * 25 * 128
    assert mem.gpu_kv == 5 * 2 * 25 * 128 and mem.gpu_buffers == 3 * 2 * 2 * 25 * 128


@pytest.mark.parametrize("resident,batch", [(0, 1), (5, 2), (7, 1)])
def test_moved_bytes_match_the_graph_and_decode_writes_one_token(tiny_model, resident, batch):
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3)
    spec = HFAdapter(model).spec()
    g = build(spec, Workload(14, 5, batch), plan(resident, group=2, chunk=6, depth=2, decode_group=1))
    ids = torch.randint(0, 128, (batch, 14), generator=torch.Generator().manual_seed(2))
    res = execute(g, model, ids)
    lo = KVLayout.of(g)
    for s in g.stages:
        if s.kind is Kind.COMPUTE:
            assert res.moved_bytes[s.id] == 0
            continue
        assert res.moved_bytes[s.id] == s.bytes, s.name
        if s.kind is Kind.D2H and s.phase is Phase.DECODE:
            n_off = 4 - lo.resident[s.layer]
            assert res.moved_bytes[s.id] == batch * n_off * 2 * 16 * 4
    stores = [s for s in g.stages if s.kind is Kind.D2H and s.phase is Phase.DECODE and s.step == 0]
    assert len(stores) == sum(n < 4 for n in lo.resident)   # one write-back per offloaded layer


@pytest.mark.gpu
def test_host_tier_is_pinned_and_freed_on_cuda():
    lo = KVLayout(batch=1, kv_heads=4, head_dim=64, capacity=1024, resident=(2, 0), slots=2, slot_heads=2)
    from gpu_checks import is_registered
    # Fault caught: host homes left pageable. Replayed runs take torch-pinned homes (graph capture
    # refuses copies from memory torch did not pin); eager runs register exact-size buffers.
    with KVStore(lo, "cuda", torch.bfloat16, replay=True) as store:
        assert all(t.is_pinned() for t in store.host if t is not None)
    with KVStore(lo, "cuda", torch.bfloat16) as store:
        assert all(is_registered(t) for t in store.host if t is not None)
        assert all(t.is_cuda for t in store.gpu + store.slots if t is not None)
        kv = torch.randn(1, 4, 1024, 2, 64, device="cuda", dtype=torch.bfloat16)
        assert store.store(0, (2, 3), kv, 0) == 2 * 1024 * 2 * 64 * 2
        store.fetch(0, (2, 3), base=2, slot=1, length=1000)
        torch.cuda.synchronize()
        assert torch.equal(store.slot_prefix(1, 2, 1000), kv[:, 2:4, :1000])
    assert store.host_bytes == 0 and store.data_ptrs() == ()
