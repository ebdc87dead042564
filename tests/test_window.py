"""Window layers that keep only what their window still sees (pipeline/windows.py,
executor/kv/ring.py): the ring's reads and writes against a plain list of positions; the store's
buffers at W - 1 + 4 rows and equal to the memory model; decode far past the window (tokens
really dropped) equal to HF's greedy tokens and offloaded == resident bit for bit in every tier;
the graph's fetches of a window's tokens only; `kvpipe plan` for Gemma 3 at about a sixth of
full attention's KV and a longer --max-context; a kept conversation stepping back past what a
ring holds; --save-kv refused on one line."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

from kvpipe.executor.engine.live import LiveSession
from kvpipe.executor.kv import ring
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.saved import refuse_rings
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.loader import random_model
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.workload import Workload

from test_end_to_end import TOL, headwise, hf_greedy, run_kvpipe

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
            rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
CONTEXT, DECODE, CHUNK = 20, 28, 6   # positions to 48: many windows past each small one
PLANS = [headwise(2, CHUNK, 2, 4),                                   # all resident
         headwise(1, CHUNK, 2, 1, decode_group=2),                   # one resident unit, mixed groups
         headwise(2, CHUNK, 3, 0, decode_group=1, decode_depth=1),   # all on the host
         replace(headwise(1, CHUNK, 2, 1), disk=3)]                  # host and disk units (gemma3: on both kinds)


@given(st.integers(1, 9), st.lists(st.integers(1, 12), min_size=1, max_size=12))
def test_ring_reads_what_was_written_last(R, writes):
    """Fault (each seen failing): a wrapped piece running one row past the ring's end, or rows
    that drift after the first wrap (p mod R miscounted), so a read returns stale positions."""
    home = torch.zeros(R, 2, 1)
    pos = 0
    for T in writes:
        src = torch.arange(pos, pos + T, dtype=torch.float32).view(T, 1, 1).expand(T, 2, 1).contiguous()
        ring.write(home, src, pos, R)
        pos += T
        a = max(0, pos - R)   # the last R positions are home
        out = torch.empty(pos - a, 2, 1)
        ring.read(home, a, pos, R, out)
        assert out[:, 0, 0].tolist() == list(map(float, range(a, pos)))


def _model(cfg, seed=3):
    return random_model(dict(BASE, **cfg), "cpu", torch.float32, seed=seed)


WINDOWS = [dict(model_type="mistral", sliding_window=3),              # < chunk
           dict(model_type="mistral", sliding_window=CHUNK),          # = chunk
           dict(model_type="mistral", sliding_window=11),             # between chunk and context
           dict(model_type="mistral", sliding_window=64),             # > context + decode: no ring
           dict(model_type="gemma3_text", sliding_window=4, query_pre_attn_scalar=12, num_hidden_layers=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
           dict(model_type="gemma2", sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
                final_logit_softcapping=3.0, num_hidden_layers=2)]


@pytest.mark.parametrize("cfg", WINDOWS, ids=["w3", "w6", "w11", "w64", "gemma3", "gemma2"])
def test_decode_past_the_window_matches_hf_and_placement(cfg):
    """Fault (each seen failing): a ring of W - 1 rows (the rewind slack dropped is fine, one row
    short is not: the oldest visible key overwritten), the resident ring written before
    attention read it, a host store not waiting for the step's fetches, a fetch starting at 0
    in a ring layer, or a placement-dependent bit (offloaded logits differ from resident)."""
    check_plans(_model(cfg), CONTEXT, DECODE, PLANS)


def check_plans(model, context: int, decode: int, plans) -> None:
    """Every plan's greedy tokens equal HF's (logits within fp32 rounding), and every plan's logits
    equal the first's bit for bit (placement never changes a bit)."""
    ids = torch.randint(2, 128, (1, context), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_tokens = hf_greedy(model, ids, decode)
    runs = [run_kvpipe(model, ids, decode, plan) for plan in plans]
    for plan, res in zip(plans, runs):
        torch.testing.assert_close(res.step_logits, ref_logits, **TOL[torch.float32])
        assert torch.equal(res.tokens, ref_tokens), plan.describe()
    for res in runs[1:]:
        assert torch.equal(res.step_logits, runs[0].step_logits)


def test_ring_store_waits_for_the_steps_fetches():
    """Fault: a host ring's store not ordered after the step's fetches of that layer (on a GPU
    the d2h copy would overwrite rows an h2d fetch has still to read); a full layer's store
    made to wait as well (needless)."""
    spec = HFAdapter(_model(WINDOWS[4])).spec()
    graph = build(spec, Workload(CONTEXT, 3), headwise(1, CHUNK, 1, 0))
    fetches: dict = {}
    for s in graph.stages:
        if s.tag == "kv_fetch":
            fetches.setdefault((s.phase, s.step, s.layer), set()).add(s.id)
    for s in graph.stages:
        if s.tag == "kv_store" and (s.phase, s.step, s.layer) in fetches:
            mine = fetches[(s.phase, s.step, s.layer)]
            assert (mine <= set(s.deps)) == (s.layer != 1), (s.name, s.deps)


def test_store_keeps_the_ring_and_equals_the_memory_model():
    """Fault: the executor allocating window units at full length (or the memory model counting
    them so, window units' disk rows too), or slots longer than the
    longest window a step fetches."""
    model = _model(WINDOWS[4])
    spec = HFAdapter(model).spec()
    work = Workload(CONTEXT, DECODE)
    for plan in PLANS:
        graph = build(spec, work, plan)
        mem, lo = breakdown(spec, work, plan), KVLayout.of(graph)
        assert lo.rings == (4 - 1 + 4, 0, 7)
        with KVStore(lo, torch.device("cpu"), torch.float32) as store:
            assert store.gpu_bytes == mem.gpu_kv + mem.gpu_buffers, plan.describe()
            if not plan.disk:   # disk runs add the file's block tails, not in the model
                assert store.host_bytes == mem.host_kv + mem.host_buffers, plan.describe()
            if plan.disk:   # 2 full units (48 tokens: a 4096-byte block on file, 2048 as its tail), a 1-block ring row
                assert (mem.disk_kv, store.disk_bytes) == (2 * 48 * 128 + 4096, 2 * 4096 + 4096), plan.describe()
            for i, t in enumerate(store.gpu + store.host):
                if t is not None:
                    assert t.shape[2] == (7 if i % 3 != 1 else CONTEXT + DECODE)
    # by hand, all on the host: 2 window layers x 2 heads x 7 tokens, 1 full layer x 2 x 48; 128 B a token
    host = breakdown(spec, work, PLANS[2]).host_kv
    assert host == (2 * 2 * 7 + 2 * 48) * 2 * 16 * 4


def test_fetches_move_the_window_only():
    """Fault: a window layer's decode step fetching its whole prefix (the simulator's bytes per
    step and the decode floor would count every token), or a store moving more than the ring."""
    spec = HFAdapter(_model(WINDOWS[4])).spec()
    graph = build(spec, Workload(CONTEXT, 2), PLANS[2])
    fetched = {s.layer: s.bytes for s in graph.stages if s.tag == "kv_fetch" and s.phase.value == "decode"
               and s.step == 1 and s.group == 0}
    tok = 2 * 16 * 4   # one unit's token, K and V, fp32
    assert fetched == {0: 3 * tok, 1: 21 * tok, 2: 3 * tok}   # W - 1 = 3 keys; the full layer's 21
    stores = {s.layer: s.bytes for s in graph.stages if s.tag == "kv_store" and s.tokens == (0, CHUNK)}
    assert stores == {0: 2 * CHUNK * tok, 1: 2 * CHUNK * tok, 2: 2 * CHUNK * tok}   # the ring takes 6 of 7


def _plan_json(*args):
    out = subprocess.run([sys.executable, "-m", "kvpipe", "plan", *args, "--json"], capture_output=True, text=True)
    assert out.returncode in (0, 3), out.stderr
    return json.loads(out.stdout)


def test_gemma3_plan_keeps_about_a_sixth_and_a_longer_max_context():
    """Fault: local layers counted at the full context in the plan's JSON (kv_vs_full_attention
    near 1), the global layers shrunk, or --max-context answering as for full attention."""
    d = _plan_json("--model", "gemma-3-12b", "--context", "128K")
    rows = {r["kind"]: r for r in d["kv_per_layer_kind"]}
    per_layer = 8 * 2 * 256 * 2
    assert rows["full"]["kv_bytes"] == 8 * per_layer * (131072 + 32)
    assert rows["sliding 1024"]["kv_bytes"] == 40 * per_layer * 1027
    assert 0.16 < d["kv_vs_full_attention"] < 0.18
    # 8.9 GB of homes in power-of-two pinned blocks (decode replays: pipeline/memory.pinned_homes_bytes);
    # full attention's would be 51 GB
    assert d["predicted"]["peak_bytes"]["host"] + d["predicted"]["peak_bytes"]["disk"] < 12 * 2**30
    from kvpipe.sim.decide import Request, max_context
    spec = PRESETS["gemma-3-12b"]
    budgets = {"gpu": 40 * 10**9, "host": 64 * 2**30, "disk": 0}
    hybrid = max_context(spec, Workload(1, 32), budgets, Request())
    full = max_context(replace(spec, windows=()), Workload(1, 32), budgets, Request())
    assert hybrid > 5 * full, (hybrid, full)


def test_kept_conversation_steps_back_past_the_ring_exactly():
    """Fault: a rewind past what a ring still holds kept (the next tokens attend overwritten
    keys and differ from HF's), or a one-token step back within the slack re-prefilling all."""
    model = _model(WINDOWS[0])
    spec = HFAdapter(model).spec()
    ids = torch.randint(2, 128, (1, 30), generator=torch.Generator().manual_seed(9)).tolist()[0]
    with LiveSession(spec, headwise(1, CHUNK, 2, 1), model, torch.device("cpu"), 64) as live:
        live.extend(ids[:26], decode_tokens=8)      # 34 tokens home, positions 28..33 in the ring
        live.rewind(31)
        assert live.length == 31                      # position 31 sees 29, 30: still home
        live.rewind(29)
        assert live.length == 0                       # position 29 sees 27: overwritten by 33
        res = live.extend(ids, decode_tokens=6)
    _, ref = hf_greedy(model, torch.tensor([ids]), 6)
    assert res.tokens[0, :7].tolist() == ref[0].tolist()


def test_save_kv_refused_for_ring_models(tmp_path):
    """Fault: a KV directory written for a model whose window layers keep a ring (a load would
    continue from keys that are not there), or the refusal not naming --save-kv."""
    spec = HFAdapter(_model(WINDOWS[0])).spec()
    lo = KVLayout.of(build(spec, Workload(40, 1), headwise(1, CHUNK, 2, 1)))
    with pytest.raises(ValueError, match=r"^save-kv: .*sliding-window layers keep only their last 6 tokens"):
        refuse_rings(lo, "save-kv")
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(dict(BASE, model_type="mistral", sliding_window=3)))
    out = subprocess.run([sys.executable, "-m", "kvpipe", "generate", "--model", str(cfg), "--random-weights",
                          "--prompt", " ".join(["5"] * 30), "--prompt-format", "ids", "--max-new-tokens", "3",
                          "--save-kv", str(tmp_path / "kv")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "save-kv" in out.stderr, out.stderr
    assert not (tmp_path / "kv").exists() and out.stdout == ""   # refused before any token
