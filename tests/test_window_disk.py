"""Window layers' disk units keep a ring too (pipeline/disk_rows.py, executor/disk/tier.py ring
rows): a ring row read from a block boundary against the bytes appended to it; tokens equal to HF's
greedy and offloaded == resident bit for bit with window units on disk (windows smaller than a
chunk, equal, larger than the run, decode far past the window; tokens that straddle blocks); the
file's bytes on disk ring-sized and equal to the memory model's; the estimate's disk lane still a
lower bound; a kept conversation on disk stepping back within what its rings hold."""
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvpipe.executor.disk.tier import DiskFile
from kvpipe.executor.engine.live import LiveSession
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.loader import random_model
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.disk_rows import ring_block_bytes, row_file_bytes
from kvpipe.pipeline.memory import breakdown, kv_by_kind
from kvpipe.pipeline.windows import disk_block
from kvpipe.pipeline.workload import Workload

from test_end_to_end import headwise, hf_greedy
from test_window import check_plans

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
CONTEXT, DECODE, CHUNK = 30, 34, 6   # positions to 64: a 512-byte token (head_dim 64, fp32) wraps 2-slot rings often


def _model(cfg, seed=3):
    return random_model(dict(BASE, **cfg), "cpu", torch.float32, seed=seed)


@settings(max_examples=25, deadline=None)
@given(tb=st.sampled_from([512, 384, 1024]), ring=st.integers(2, 30), writes=st.lists(st.integers(1, 20), min_size=1, max_size=14),
       back=st.lists(st.integers(0, 3), min_size=14, max_size=14))
def test_ring_row_reads_the_streams_end(tmp_path_factory, tb, ring, writes, back):
    """Fault (each seen failing): a ring row one slot short (ring_blocks rounding down: the oldest
    kept token overwritten), a read request running across the ring's wrap (slot k+1 read past
    the row's last slot), an append skipping a block it still needed, or a truncate inside a
    written block not bringing it back to the tail."""
    d = tmp_path_factory.mktemp("ring")
    cap = sum(writes) + 4
    with DiskFile(str(d), 1, cap * tb, 4096, 1, False, io="posix", rings=(ring * tb,)) as f:
        stream, top = bytearray(), 0
        for T, k in zip(writes, back):
            data = bytes((len(stream) + i) * 7 % 251 for i in range(T * tb))
            f.append([(0, memoryview(data))])
            stream += data
            top = max(top, len(stream) // tb)
            cut = max(len(stream) // tb - k, top - ring + 1, 0)   # a rewind the ring still holds
            f.truncate(0, cut * tb)
            del stream[cut * tb:]
            B = f.block[0]
            a = max(0, cut - (ring - 1), top - ring) * tb // B * B   # the block of the first token it holds
            buf = torch.empty(len(stream) - a + 8192, dtype=torch.uint8)
            off = (-buf.data_ptr()) % 4096
            dst = memoryview(buf[off:off + len(stream) - a].numpy())
            f.read([(0, dst, a)])
            assert bytes(dst) == bytes(stream[a:]), (len(stream), a)
        assert f.file_bytes == row_file_bytes(cap * tb, 4096, ring * tb) == os.fstat(f.fd).st_size


WINDOWS = [dict(model_type="mistral", sliding_window=3),                 # < chunk, a one-slot ring
           dict(model_type="mistral", sliding_window=CHUNK),             # = chunk
           dict(model_type="mistral", sliding_window=11, head_dim=48),   # > chunk; 384-byte tokens straddle blocks
           dict(model_type="mistral", sliding_window=80),                # > context + decode: full rows
           dict(model_type="gemma3_text", sliding_window=9, query_pre_attn_scalar=12, num_hidden_layers=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
           dict(model_type="gemma2", sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0, num_hidden_layers=2)]


def _plans(units):
    return [headwise(2, CHUNK, 2, units),                                           # all resident
            replace(headwise(2, CHUNK, 3, 0, decode_group=1, decode_depth=1), disk=units),   # all on disk
            replace(headwise(1, CHUNK, 2, 1, decode_group=2), disk=units - 2),        # one host unit, mixed groups
            replace(headwise(1, CHUNK, 2, 0), disk=units // 2)]                       # half on disk


@pytest.mark.parametrize("cfg", WINDOWS, ids=["w3", "w6", "w11-d48", "w80", "gemma3", "gemma2"])
def test_window_units_on_disk_match_hf_and_resident(cfg):
    """Fault (each seen failing): a ring row's read staged from the window's first token instead
    of its block's start (the fetch takes shifted keys), a read from position 0 in a ring row
    (the ring no longer holds it), or window units on disk keeping every token (disk_rings off)."""
    model = _model(cfg)
    spec = HFAdapter(model).spec()
    plans = _plans(spec.units)
    check_plans(model, CONTEXT, DECODE, plans)
    lo = KVLayout.of(build(spec, Workload(CONTEXT, DECODE), plans[1]))
    assert any(lo.disk_rings) == (cfg["sliding_window"] < 60), lo.disk_rings   # ring rows where a ring fits


def _disk_store(spec, context, plan):
    work = Workload(context, 4)
    lo = KVLayout.of(build(spec, work, plan, prefill=range(1), decode=range(0)))
    return work, lo, KVStore(lo, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("context", [60, 600])
def test_disk_file_is_ring_sized_and_equals_the_memory_model(context):
    """Fault (each seen failing): a window unit's disk row allocated at the whole length (its file
    bytes grow with the context), the memory model counting it so, the per-kind disk bytes of
    kv_by_kind off the file's, or a ring row's blocks as large as a full row's (3 MiB on disk for
    Gemma 3's 1 MiB ring)."""
    spec = HFAdapter(_model(WINDOWS[4])).spec()   # layers: sliding 9, full, sliding 9
    plan = replace(headwise(1, CHUNK, 2, 0), disk=spec.units)
    work, lo, store = _disk_store(spec, context, plan)
    tb = 2 * 64 * 4
    with store:
        assert os.fstat(store.disk.fd).st_size == store.disk_bytes   # pre-allocated: bytes on disk
        per_layer = store.disk_bytes_by_layer()
        block = disk_block(spec, work, plan)
        ring_row = row_file_bytes(work.kv_capacity * tb, block, 12 * tb)
        assert ring_row == -(-12 * tb // ring_block_bytes(12 * tb, block)) * ring_block_bytes(12 * tb, block)
        assert per_layer[0] == per_layer[2] == 2 * ring_row   # two heads a layer, whatever the context
        full_rows = 2 * (work.kv_capacity * tb // block * block)
        assert per_layer[1] == full_rows
        mem = breakdown(spec, work, plan)
        tails = 2 * (work.kv_capacity * tb - work.kv_capacity * tb // block * block)   # a full row's tail in RAM
        assert mem.disk_kv == store.disk_bytes + tails
        kinds = {r["kind"]: r["disk_bytes"] for r in kv_by_kind(spec, work, plan)}
        assert kinds == {"sliding 9": per_layer[0] + per_layer[2], "full": per_layer[1] + tails}
    if context == 600:
        assert per_layer[0] < per_layer[1] / 10
    ring = 1027 * 1024   # Gemma 3's ring: W - 1 + 4 tokens of 1 KiB, beside full rows of 1 MiB blocks
    assert ring < row_file_bytes(131072 * 1024, 1 << 20, ring) <= ring * 5 // 4   # blocks of <= 1/8 of it


def test_estimate_disk_lane_stays_a_lower_bound():
    """Fault: the estimate's disk lane costing a window layer's disk reads at the whole prefix (or
    its writes at the whole chunk) while the graph moves the window's: its lower bound exceeds
    the disk lane's busy in the graph, so pruning could drop the best plan."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.cost import stage_seconds
    from kvpipe.pipeline.model import PRESETS
    from kvpipe.sim.planner import _Search
    spec, hw = PRESETS["gemma-3-4b"], load_profile("h200")
    work = Workload(65536, 2)
    plan = replace(headwise(4, 8192, 2, 0), disk=spec.units)   # every unit on disk: window units too
    s = _Search(spec, work, hw, {"gpu": 2**50, "host": 2**50, "disk": 2**50})
    est = s.estimate(plan)
    graph = build(spec, work, plan)
    busy = {phase: sum(stage_seconds(st_, hw, spec.dtype) for st_ in graph.stages
                       if st_.lane.value == "disk" and st_.phase.value == phase) for phase in ("prefill", "decode")}
    assert 0 < est.prefill_busy["disk"] <= busy["prefill"] * (1 + 1e-9), (est.prefill_busy["disk"], busy)
    assert 0 < est.decode_busy["disk"] <= busy["decode"] * (1 + 1e-9), (est.decode_busy["disk"], busy)


def test_kept_conversation_on_disk_steps_back_within_the_ring():
    """Fault (seen failing): a disk ring row's truncate inside a written block not reading it back
    into the row's tail (the next read takes stale bytes for the kept tokens), or a rewind past
    the ring's end kept, so the next tokens attend overwritten keys."""
    model = _model(dict(WINDOWS[0], head_dim=256))   # window 3, 2048-byte tokens: 2 to a block
    spec = HFAdapter(model).spec()
    ids = torch.randint(2, 128, (1, 42), generator=torch.Generator().manual_seed(9)).tolist()[0]
    plan = replace(headwise(1, CHUNK, 2, 0), disk=spec.units)
    with LiveSession(spec, plan, model, torch.device("cpu"), 80) as live:
        live.extend(ids, decode_tokens=8)            # 50 tokens home; the tail holds 48, 49
        kept = live.tokens[:47]
        live.rewind(47)
        assert live.length == 47                      # position 47 sees 45, 46: block 23 (46, 47) read back
        res = live.extend(kept + [7], decode_tokens=5)
        _, ref = hf_greedy(model, torch.tensor([kept + [7]]), 5)
        assert res.tokens[0, :6].tolist() == ref[0].tolist()
        live.rewind(20)
        assert live.length == 0                       # position 20 sees 18: long overwritten


def test_planner_puts_window_units_on_disk_first_where_host_ram_is_short_by_little():
    """Fault (each seen failing): window units never offered to disk first (a host 20 MiB short
    moves whole 64 MiB full units and their full-length staging), the order not kept in the
    plan's JSON, or the memory model placing them apart from `placement`."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import PRESETS
    from kvpipe.pipeline.plan import Plan, Tier, placement
    from kvpipe.pipeline.replay import Replay
    from kvpipe.pipeline.rules import HOST_KV_FRACTION
    from kvpipe.pipeline.windows import tier_counts
    from kvpipe.sim.planner import _Search
    from kvpipe.sim.simulate import simulate
    spec, hw = PRESETS["gemma-3-4b"], load_profile("h200")
    work = Workload(65536, 8)
    base = headwise(4, 16384, 2, 0)
    need = breakdown(spec, work, base.with_(replay=Replay.OFF)).host   # the homes, without a replay's pinned slack
    for short, windows_first in ((20 << 20, True), (400 << 20, False)):
        budgets = {"gpu": 2**50, "host": int((need - short) / HOST_KV_FRACTION), "disk": 2**50}
        s = _Search(spec, work, hw, budgets)
        plans = s.placements(base, 0, True, True)
        assert [p.disk_windows_first for p in plans] == [False, True][:len(plans)] and plans, plans
        totals = [simulate(spec, work, p, hw).report.timing.total_s for p in plans]
        assert plans[totals.index(min(totals))].disk_windows_first == windows_first, (short, totals)
        for p in plans:
            tiers = placement(spec, p)
            by_layer = [tuple(sum(tiers[(i, h)] is t for h in range(spec.kv_heads)) for t in (Tier.GPU, Tier.HOST, Tier.DISK))
                        for i in range(spec.layers)]
            assert by_layer == tier_counts(spec, p)
            assert Plan.from_json(p.to_json(spec), spec) == p


def test_a_stopped_run_past_the_ring_leaves_the_conversation_usable():
    """Fault (seen failing): a run stopped after its ring rows moved past the conversation's
    length cutting them back to it (the ring no longer holds it: a ValueError in place of the
    run's own error, the session unusable); the next turn must prefill from 0 and equal HF's."""
    model = _model(WINDOWS[0])
    spec = HFAdapter(model).spec()
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(4)).tolist()[0]
    plan = replace(headwise(1, CHUNK, 2, 0), disk=spec.units)

    def stop(s):   # the last prefill chunk's first disk write: 30 tokens past the 6 home
        if s.tag == "kv_write" and s.tokens[0] >= 36:
            raise RuntimeError("stopped")   # as a Ctrl-C would (extend's handler takes any exception)
    with LiveSession(spec, plan, model, torch.device("cpu"), 80) as live:
        live.extend(ids[:6])
        with pytest.raises(RuntimeError, match="stopped"):
            live.extend(ids, decode_tokens=2, stage_hook=stop)
        assert live.length == 6                       # what was home before the stopped run
        res = live.extend(ids, decode_tokens=3)
    _, ref = hf_greedy(model, torch.tensor([ids]), 3)
    assert res.tokens[0, :4].tolist() == ref[0].tolist()
