"""Sparse decode in the executor (LOSSY, `--sparse F`; executor/sparse/homes.py, sparse_sketch.py):
the step's offloaded heads attend exactly the tokens the selection named, resident heads their
whole prefix; F = 1 is the exact run. CPU, tiny random models built here (no task accuracy)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, strategies as st

from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.engine.interpreter import Interpreter
from kvpipe.executor.kv.layout import KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.executor.engine.lanes import Lanes
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.lossy import LossySpec
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload
from sparse_runs import CUDA_TINY, check_fraction_one, plan_of

SPARSE = LossySpec(sparse=0.2, sink=4, recent=32)


_plan = plan_of


def _run_capturing(model, graph, ids, device="cpu"):
    """Run `graph` with the executor's own Interpreter; after every decode `attn` stage record
    what the step attended with: (stage, q, out, selection or None, the step's own K/V). Returns
    (records, store contents needed by the reference: GPU and host homes, cloned at the end)."""
    adapter = HFAdapter(model)
    w = graph.workload
    dev = torch.device(device)
    tokens = torch.zeros(w.batch, w.decode_tokens + 1, dtype=torch.long, device=dev)
    recs = []
    with torch.inference_mode(), KVStore(KVLayout.of(graph), dev, adapter.dtype) as store, Lanes(dev) as lanes:
        interp = Interpreter(graph, adapter, store, lanes, ids.to(dev), tokens, None)
        mode = store.sparse.gather_mode

        def issue(s):
            interp(s)
            if s.tag == "attn" and s.phase is Phase.DECODE:
                cur = interp._cur
                new = interp._kv[(s.phase, s.step, s.layer)][0]
                sel = interp._sel.get((s.step, s.layer))
                recs.append((s, cur.q.clone(), cur.out.clone(), None if sel is None else sel.clone(), new.clone()))
        lanes.run(graph, issue)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        homes = ([None if t is None else t.cpu().clone() for t in store.gpu],
                 [None if t is None else t.cpu().clone() for t in store.host])
    recs = [(s, q.cpu(), out.cpu(), None if sel is None else sel.cpu(), new.cpu()) for s, q, out, sel, new in recs]
    return recs, homes, adapter, mode


def _reference(q, k, v, scale):
    """Float64 softmax attention of q [r, D] over k, v [S, D]: [r, D] (written here, independent
    of the executor's kernels)."""
    s = (q.double() @ k.double().T) * scale
    return torch.softmax(s, -1) @ v.double()


def _check_selected(model, device, tol):
    spec = HFAdapter(model).spec()
    w = Workload(300, 2)
    graph = build(spec, w, _plan(SPARSE, resident=1, group=2))
    ids = torch.randint(0, spec.vocab, (1, 300), generator=torch.Generator().manual_seed(0))
    recs, (gpu, host), adapter, mode = _run_capturing(model, graph, ids, device)
    lo = KVLayout.of(graph)
    r, seen_sparse, seen_mixed, differs = adapter.r, 0, 0, False
    for s, q, out, sel, new in recs:
        P, n = s.tokens[0], lo.resident[s.layer]
        scale = model.model.layers[s.layer].self_attn.scaling
        if any(h < n for h in s.heads) and any(h >= n for h in s.heads):
            seen_mixed += 1
        for h in s.heads:
            if h < n:                                              # resident: the whole prefix
                kv = torch.cat([gpu[s.layer][0, h, :P], new[0, h]], 0)
            else:                                                  # offloaded: the named tokens only
                assert sel is not None, s.name
                idx = sel[0, h - n]
                assert idx.numel() == SPARSE.fetched_tokens(P) < P and bool((idx[1:] > idx[:-1]).all())
                seen_sparse += 1
                kv = torch.cat([host[s.layer][0, h - n, idx], new[0, h]], 0)
                full = torch.cat([host[s.layer][0, h - n, :P], new[0, h]], 0)
                f = _reference(q[0, h * r:(h + 1) * r, 0], full[:, 0], full[:, 1], scale)
                differs |= not torch.allclose(out[0, 0, h * r:(h + 1) * r].double(), f, atol=10 * tol)
            ref = _reference(q[0, h * r:(h + 1) * r, 0], kv[:, 0], kv[:, 1], scale)
            torch.testing.assert_close(out[0, 0, h * r:(h + 1) * r].double(), ref, atol=tol, rtol=tol)
    assert seen_sparse and seen_mixed and differs
    return mode


def test_sparse_step_attends_exactly_the_selected_tokens(tiny_model):
    # Faults caught: the gather fetching other tokens than the selection named (wrong head row,
    # wrong order, stale slot rows), the attention reading the whole slot prefix instead of the N
    # selected rows, the step's own token dropped, resident heads of a mixed group made sparse (they
    # must attend their whole prefix), and a selection that is no selection (N == P: the test then
    # asserts it saw a real sparse step whose output differs from full attention).
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    assert _check_selected(model, "cpu", 2e-5) == "cpu"


@pytest.mark.gpu
def test_sparse_step_attends_exactly_the_selected_tokens_cuda_bf16_by_uva_gather(tiny_model):
    # Faults caught, on the H200: the zero-copy gather (a CUDA tensor over the pinned host home)
    # reading other bytes than the home holds, the gather racing the score on another stream, and
    # the probe falling back to the staged gather where UVA works (the mode must be `uva`).
    assert _check_selected(tiny_model("llama", **CUDA_TINY), "cuda", 2e-2) == "uva"


def test_fraction_one_is_the_exact_run_and_lower_fractions_are_deterministic(tiny_model):
    # Faults caught: the sparse path changing bits when it selects everything (gather order, a
    # split attention, the sketch hooks touching the exact path), a nondeterministic selection (two
    # runs differ), and a sparse run that is in fact exact (F = 0.2 equal to exact).
    check_fraction_one(tiny_model, None, LossySpec(sparse=1.0, sink=4, recent=32), SPARSE, 2)


def test_run_json_labels_the_sparse_run(tmp_path, capsys):
    # Faults caught: a sparse run without its `lossy` object (or with one saying exact), or its
    # table not saying LOSSY in the first line.
    from kvpipe.cli import main
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = ["run", "--model", str(tmp_path / "config.json"), "--random-weights", "--context", "1700", "--chunk", "128",
            "--decode-tokens", "2", "--device", "cpu", "--no-progress", "--resident", "none", "--sparse", "0.2"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lossy = out["lossy"]
    assert lossy["sparse"] == 0.2 and lossy["quant"] is None and lossy["sketch"] == 2
    # and which paths it took (a slow fallback, e.g. a staged gather, must be visible in the JSON)
    assert out["decode_issue"]["sparse"] == {"gather": "cpu", "score": "torch", "threshold": "radix",
                                             "note": "the Triton ranking runs on CUDA only (CPU keeps the torch path)"}
    err = lossy["measured_error"]          # the run's own probe: 340 of 1700 (sink 64 + recent 256 + 20 by score)
    assert err["fetched_tokens"] == 340 and err["probe_tokens"] == 1700
    assert lossy["selection"]["selected_tokens"] == 20 and lossy["selection"]["forced_tokens"] == 320
    assert 0 < err["sparse_recall_mean"] < 1 and err["sparse_attn_rel_err"] > 0
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("kvpipe run: LOSSY")


@given(S=st.integers(1, 6).map(lambda c: 64 * c), D=st.sampled_from([4, 8, 16]), bits=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 10_000), scale=st.floats(1e-2, 1e3))
def test_sketch_cells_enclose_their_keys_and_scores_are_of_the_rebuilt_keys(S, D, bits, seed, scale):
    # Faults caught: codes packed into the wrong bits or channels, cells off by one (a key outside
    # its cell), the wrong chunk's range used, and scores not of the rebuilt key (lo + (cell + 1/2)
    # step) or not scaled by 1/sqrt(D). Reference: the cell recomputed here from the unpacked code
    # by shifts written in the test, and the float64 dot product.
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(S, D, generator=g, dtype=torch.float64) * scale).to(torch.bfloat16)
    blocks = k.float().reshape(S // 64, 64, D)
    lo, hi = blocks.amin(1).to(torch.bfloat16), blocks.amax(1).to(torch.bfloat16)
    codes = sparse_sketch.encode(k, lo, hi, bits)
    assert codes.shape == (S, D * bits // 8) and codes.dtype == torch.uint8
    per, L = 8 // bits, 1 << bits
    cells = torch.stack([(codes.long() >> (bits * j)) & (L - 1) for j in range(per)], -1).reshape(S, D)
    lod, step = lo.double().repeat_interleave(64, 0), ((hi.double() - lo.double()) / L).repeat_interleave(64, 0)
    kd = k.double()
    inside = (kd >= lod + cells * step - 1e-6 * scale) & ((kd <= lod + (cells + 1) * step + 1e-6 * scale) | (cells == L - 1))
    assert bool(inside.all())
    q = torch.randn(3, D, generator=g, dtype=torch.float64)
    got = sparse_sketch.scores(q.float(), lo, hi, codes, bits).double()
    ref = q @ (lod + (cells + 0.5) * step).T / math.sqrt(D)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * scale * math.sqrt(D))


@given(P=st.integers(1, 500), frac=st.floats(0.01, 1.0), sink=st.integers(0, 20), recent=st.integers(0, 80),
       seed=st.integers(0, 10_000))
def test_selection_takes_forced_then_the_best_ranked_tokens(P, frac, sink, recent, seed):
    # Faults caught: the sink, the recent window or the unsketched tail left out; a count other
    # than the budget (or the forced tokens when they are more); duplicates or unsorted indices; a
    # token taken while a better-ranked one is left.
    sealed = P // 64 * 64
    share = torch.randn(2, sealed, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    budget = min(P, max(math.ceil(frac * P), 1))
    idx = sparse_sketch.select(share, P, budget, sink, recent)
    must = set(range(min(sink, P))) | set(range(max(0, P - recent), P)) | set(range(sealed, P))
    for row in range(2):
        got = idx[row].tolist()
        assert got == sorted(set(got)) and must <= set(got)
        assert len(got) == min(P, max(budget, len(must)))
        extra = [t for t in got if t not in must]
        left = [t for t in range(sealed) if t not in must and t not in got]
        if extra and left:
            assert min(float(share[row, t]) for t in extra) >= max(float(share[row, t]) for t in left)


def test_sparse_with_disk_units_is_refused_naming_the_field(tiny_model):
    # Fault caught: a combination the executor does not run (disk rows are read whole, with or
    # without int4) silently running as something else.
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    spec = HFAdapter(model).spec()
    w = Workload(300, 1)
    ids = torch.zeros(1, 300, dtype=torch.long)
    for plan in (_plan(LossySpec("int4", sparse=0.2)).with_(disk=2), _plan(SPARSE).with_(disk=2)):
        with pytest.raises(ValueError, match="sparse"):
            execute(build(spec, w, plan), model, ids)


@given(P=st.integers(1, 5000), frac=st.floats(0.001, 1.0), sink=st.integers(0, 100), recent=st.integers(0, 400),
       chunk=st.sampled_from([16, 64]))
def test_the_plan_counts_the_tokens_the_executor_fetches(P, frac, sink, recent, chunk):
    # Fault caught: the builder and simulator (LossySpec.fetched_tokens) charging another number
    # of tokens than the executor's selection fetches (e.g. the unsealed tail chunk forgotten when
    # the recent window is shorter than a chunk), so predicted bytes would not be the moved ones.
    spec = LossySpec(sparse=frac, sink=sink, recent=recent, chunk=chunk)
    sealed = P // chunk * chunk
    n = spec.fetched_tokens(P)
    assert sparse_sketch.count(P, sealed, n, sink, recent) == n
    share = torch.zeros(1, sealed)
    assert sparse_sketch.select(share, P, n, sink, recent).shape[-1] == n


@pytest.mark.parametrize("context", [300, 316])   # capacities of 304 (part chunks) and 320 (whole ones)
def test_the_plan_counts_the_gpu_bytes_the_selection_holds(tiny_model, context):
    # Fault caught: the memory model (LossySpec.gpu_summary_bytes, which the planner's GPU budget
    # adds per offloaded unit) counting fewer bytes than the selection's GPU tensors take: the
    # chunk past a capacity of whole chunks, which a replayed step summarises, left out (it was,
    # ~0.6 MB at 128K for Llama-3-8B), or the tail chunk's K. The reference is the tensors' own
    # sizes in an opened store, not the spec's arithmetic.
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    spec = HFAdapter(model).spec()
    w = Workload(context, 4)
    graph = build(spec, w, plan_of(SPARSE))
    layout = KVLayout.of(graph)
    with torch.inference_mode(), KVStore(layout, torch.device("cpu"), HFAdapter(model).dtype) as store:
        sp = store.sparse
        held = sum(t.numel() * t.element_size() for ts in (sp.lo, sp.hi, sp.codes, sp.tail) for t in ts if t is not None)
    offloaded = sum(layout.kv_heads - n for n in layout.resident)
    assert offloaded > 0
    assert held == offloaded * w.batch * SPARSE.gpu_summary_bytes(w.kv_capacity, spec.head_dim, spec.dtype_bytes)
