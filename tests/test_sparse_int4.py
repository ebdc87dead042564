"""Sparse decode over int4 KV in the executor (LOSSY twice, `--sparse F --lossy int4`;
executor/sparse/homes.py, qstore.py): a step selects whole quantised blocks, gathers their records,
dequantises only those, and attends them with the exact tail. CPU, tiny random models built here
(no task accuracy); one GPU test of the zero-copy record gather."""
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
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload
from sparse_runs import CUDA_TINY, check_fraction_one, plan_of

G = 16   # int4 group (tokens a record holds) of these tests: divides the sketch chunk 64
SPARSE_INT4 = LossySpec("int4", group=G, sparse=0.2, sink=4, recent=32)


_plan = plan_of


def _dequant_ref(rec: torch.Tensor, bits: int, g: int, D: int, meta: torch.dtype, dtype: torch.dtype,
                 gv: int) -> torch.Tensor:
    """Records [n, record] -> K/V [n, g, 2, D], decoded here from the record layout (K scale, K
    zero, V scale, V zero, K codes, V codes; K groups along the block's tokens per channel, V groups
    of `gv` channels per token; int4 codes low nibble first) with the same float32 arithmetic
    the executor's dequantise promises (code * scale + zero, one rounding to the model dtype)."""
    n, ms = rec.shape[0], meta.itemsize
    nv = g * (D // gv)
    at = 0

    def take(nbytes):
        nonlocal at
        out = rec[:, at:at + nbytes]
        at += nbytes
        return out

    ks, kz = take(D * ms).contiguous().view(meta), take(D * ms).contiguous().view(meta)      # [n, D]
    vs, vz = take(nv * ms).contiguous().view(meta), take(nv * ms).contiguous().view(meta)    # [n, nv]
    kc, vc = take(D * g * bits // 8), take(g * D * bits // 8)

    def codes(c, count):
        if bits == 4:
            c = torch.stack([c & 0xF, c >> 4], -1).reshape(n, -1)
        return c[:, :count].float()
    k = codes(kc, D * g).view(n, D, g) * ks.float()[..., None] + kz.float()[..., None]       # [n, D, g]
    v = codes(vc, g * D).view(n, g, D // gv, gv) * vs.float().view(n, g, D // gv, 1) + vz.float().view(n, g, D // gv, 1)
    out = torch.empty(n, g, 2, D, dtype=dtype)
    out[:, :, 0] = k.to(dtype).transpose(1, 2)
    out[:, :, 1] = v.to(dtype).reshape(n, g, D)
    return out


def _run_capturing(model, graph, ids, device="cpu"):
    """Run `graph` with the executor's own Interpreter; after each decode `dequant` stage record
    the slot rows of its heads, and after each decode `attn` the step's queries, output, block
    selection and own K/V. Also the records (host homes) and exact GPU tails at the end."""
    adapter = HFAdapter(model)
    w = graph.workload
    dev = torch.device(device)
    tokens = torch.zeros(w.batch, w.decode_tokens + 1, dtype=torch.long, device=dev)
    deqs, attns, made = [], [], {}
    with torch.inference_mode(), KVStore(KVLayout.of(graph), dev, adapter.dtype) as store, Lanes(dev) as lanes:
        interp = Interpreter(graph, adapter, store, lanes, ids.to(dev), tokens, None)
        mode = store.sparse.gather_mode

        def issue(s):
            interp(s)
            if s.tag == "qkv":                 # every token's exact K/V, as the model made it
                made.setdefault(s.layer, []).append(interp._kv[(s.phase, s.step, s.layer)][0].clone())
            if s.phase is not Phase.DECODE:
                return
            sel = interp._sel.get((s.step, s.layer))
            if s.tag == "dequant":
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                deqs.append((s, sel.clone(), store.slots[s.slot].clone(), store.q.qslots[s.slot].clone()))
            if s.tag == "attn":
                cur = interp._cur
                new = interp._kv[(s.phase, s.step, s.layer)][0]
                attns.append((s, cur.q.clone(), cur.out.clone(), None if sel is None else sel.clone(), new.clone()))
        lanes.run(graph, issue)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        homes = [None if t is None else t.cpu().clone() for t in store.q.host]
        codec = store.q.codec
    cpu = lambda t: None if t is None else t.cpu()
    deqs = [(s, cpu(sel), cpu(slot), cpu(q)) for s, sel, slot, q in deqs]
    attns = [(s, cpu(q), cpu(o), cpu(sel), cpu(new)) for s, q, o, sel, new in attns]
    exact = {layer: torch.cat(kvs, 2)[0].cpu() for layer, kvs in made.items()}   # [H, S, 2, D]
    return deqs, attns, homes, exact, codec, adapter, mode


def _reference(q, k, v, scale):
    """Float64 softmax attention of q [r, D] over k, v [S, D] (written here)."""
    return torch.softmax((q.double() @ k.double().T) * scale, -1) @ v.double()


def _check(model, device, tol, resident=0):
    spec = HFAdapter(model).spec()
    w = Workload(300, 3)
    graph = build(spec, w, _plan(SPARSE_INT4, resident))
    ids = torch.randint(0, spec.vocab, (1, 300), generator=torch.Generator().manual_seed(0))
    deqs, attns, homes, exact, codec, adapter, mode = _run_capturing(model, graph, ids, device)
    lo = KVLayout.of(graph)
    D, dt = adapter.spec().head_dim, adapter.dtype
    seen = 0
    for s, sel, slot, qslot in deqs:
        P, n = s.tokens[1], lo.resident[s.layer]
        nb, sealed, budget, sink, recent = SPARSE_INT4.block_args(P)
        for h in s.heads:                                          # the offloaded heads: slot row j
            j = h - s.group * graph.plan.decode.group
            idx = sel[0, h - n]
            # the selection: ascending, forced blocks in, the count the plan charges
            assert bool((idx[1:] > idx[:-1]).all()) and idx.numel() == SPARSE_INT4.fetched_blocks(P) < nb
            got = set(idx.tolist())
            assert set(range(min(sink, nb))) <= got and set(range(max(0, nb - recent), nb)) <= got
            assert set(range(sealed, nb)) <= got                   # blocks not sketched yet: always
            rows = homes[s.layer][0, h - n].view(-1, codec.record)   # every record of the unit
            # the gathered records are the selected blocks' records, in order
            assert torch.equal(qslot[0, j, :idx.numel() * codec.record].view(-1, codec.record), rows[idx])
            # the dequantised rows equal an independent decode of those records, bit for bit
            ref = _dequant_ref(rows[idx], 4, G, D, codec.meta, dt, math.gcd(SPARSE_INT4.vgroup, D)).reshape(-1, 2, D)
            assert torch.equal(slot[0, j, :idx.numel() * G], ref)
            # ... and qstore's whole-prefix dequantise (BlockCodec.decode of every full block) on them
            whole = torch.empty(nb, G, 2, D, dtype=dt)
            codec.decode(rows[:nb], whole)
            assert torch.equal(slot[0, j, :idx.numel() * G], whole[idx].reshape(-1, 2, D))
            # then the exact tail (tokens past the full blocks), right after them
            a = idx.numel() * G
            assert torch.equal(slot[0, j, a:a + P % G], exact[s.layer][h, nb * G:P])
            seen += 1
    assert seen
    r, differs, mixed = adapter.r, False, 0
    for s, q, out, sel, new in attns:
        P, n = s.tokens[0], lo.resident[s.layer]
        scale = model.model.layers[s.layer].self_attn.scaling
        mixed += any(h < n for h in s.heads) and any(h >= n for h in s.heads)
        for h in s.heads:
            if h < n:                     # resident: its whole exact prefix
                kv = torch.cat([exact[s.layer][h, :P], new[0, h]], 0)
                ref = _reference(q[0, h * r:(h + 1) * r, 0], kv[:, 0], kv[:, 1], scale)
                torch.testing.assert_close(out[0, 0, h * r:(h + 1) * r].double(), ref, atol=tol, rtol=tol)
                continue
            rows = homes[s.layer][0, h - n].view(-1, codec.record)
            full = _dequant_ref(rows[:P // G], 4, G, D, codec.meta, dt, math.gcd(SPARSE_INT4.vgroup, D)).reshape(-1, 2, D)
            idx = sel[0, h - n]
            toks = full.view(-1, G, 2, D)[idx].reshape(-1, 2, D)
            t = exact[s.layer][h, P // G * G:P]                      # the exact tail
            kv = torch.cat([toks, t, new[0, h]], 0)
            ref = _reference(q[0, h * r:(h + 1) * r, 0], kv[:, 0], kv[:, 1], scale)
            torch.testing.assert_close(out[0, 0, h * r:(h + 1) * r].double(), ref, atol=tol, rtol=tol)
            whole = torch.cat([full, t, new[0, h]], 0)
            f = _reference(q[0, h * r:(h + 1) * r, 0], whole[:, 0], whole[:, 1], scale)
            differs |= not torch.allclose(out[0, 0, h * r:(h + 1) * r].double(), f, atol=10 * tol)
    assert differs and bool(mixed) == bool(resident)
    return mode


def test_sparse_int4_step_attends_the_selected_blocks_dequantised_bit_for_bit(tiny_model):
    # Faults caught: the gather moving other records than the selected blocks' (wrong row, order,
    # head), the dequantise of the selected records differing from a decode of the same records
    # (stale bytes, a shifted block, another arithmetic), the exact tail missing or misplaced, the
    # forced blocks (sink, recent, not yet sketched) left out, a count other than the plan's
    # (LossySpec.fetched_blocks), the attention reading other rows than the selected ones, and a
    # "sparse" step equal to the full one (the test asserts some output differs).
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    assert _check(model, "cpu", 2e-5) == "cpu"


def test_sparse_int4_mixed_group_keeps_resident_heads_whole_and_exact(tiny_model):
    # Faults caught: the resident head of a mixed group made sparse or quantised (it must attend
    # its whole exact prefix), and the offloaded head's records or slot row taken at the group's
    # position instead of the head's (row h - base, unit h - resident).
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    assert _check(model, "cpu", 2e-5, resident=1) == "cpu"


@pytest.mark.gpu
def test_sparse_int4_record_gather_by_uva_equals_the_cpu_gather_cuda_bf16(tiny_model):
    # Faults caught, on a GPU: the zero-copy gather over the pinned record home (a CUDA view of it)
    # reading other bytes than an index_select of the host records gives, the gather racing the
    # score, the compiled dequantise over the selected records differing from the independent
    # decode, and a fallback to the staged gather where UVA works (the mode must be `uva`).
    assert _check(tiny_model("llama", **CUDA_TINY), "cuda", 2e-2) == "uva"


def test_fraction_one_is_the_int4_run_bit_for_bit(tiny_model):
    # Faults caught: the combined path changing bits when every block is selected (gather order,
    # the selected-record dequantise, the tail's place, the split attention) against the int4 path,
    # a nondeterministic selection, and a combined run that is not sparse at F = 0.2.
    check_fraction_one(tiny_model, LossySpec("int4", group=G), LossySpec("int4", group=G, sparse=1.0, sink=4, recent=32),
                       SPARSE_INT4, 3)


@pytest.mark.parametrize("how", ["sum", "max"])
def test_a_planted_block_of_aligned_keys_is_selected(how):
    # Faults caught: block ranks taken from the wrong tokens (a reshape across blocks), the block
    # selection missing the block that holds the most attention by an exact float64 score, and the
    # budget exceeded. The reference scores are float64 q.k over the exact keys, written here.
    gen = torch.Generator().manual_seed(3)
    S, D, r, chunk = 2048, 32, 4, 64
    k = torch.randn(1, S, D, generator=gen) * torch.linspace(0.2, 3, D)      # outlier-ish channels
    q = torch.randn(1, r, D, generator=gen)
    spec = LossySpec("int4", group=G, sparse=0.1, sink=4, recent=32, chunk=chunk)
    nb, sealed, budget, sink, recent = spec.block_args(S)
    planted = 37                                                 # not a forced block
    assert sink <= planted < nb - recent
    k[0, planted * G:(planted + 1) * G] = 2.0 * q[0].mean(0) / q[0].mean(0).norm() * math.sqrt(D) \
        + 0.1 * torch.randn(G, D, generator=gen)
    exact = torch.softmax((q[0].double() @ k[0].double().T) / math.sqrt(D), -1).sum(0)   # [S]
    mass = exact.view(-1, G).sum(-1)
    assert int(mass.argmax()) == planted
    C = S // chunk
    blocks = k.view(1, C, chunk, D)
    lo, hi = blocks.amin(2), blocks.amax(2)
    codes = sparse_sketch.encode(k, lo, hi, 2)
    share = sparse_sketch.group_share(sparse_sketch.scores(q, lo, hi, codes, 2))
    ranked = sparse_sketch.block_share(share[..., :sealed * G], G, how)
    idx = sparse_sketch.select(ranked, nb, budget, sink, recent)[0]
    assert planted in idx.tolist()
    assert idx.numel() == spec.fetched_blocks(S) and idx.numel() * G <= max(math.ceil(0.1 * S) + G,
                                                                          (sink + recent + 1) * G)


@given(P=st.integers(1, 6000), frac=st.floats(0.001, 1.0), sink=st.integers(0, 100), recent=st.integers(0, 400),
       group=st.sampled_from([8, 16, 32, 64]))
def test_the_plan_counts_the_blocks_the_executor_fetches(P, frac, sink, recent, group):
    # Fault caught: the builder and simulator (LossySpec.fetched_blocks, fetched_tokens,
    # fetch_bytes) charging another count than the executor's selection (sparse_sketch.count over
    # LossySpec.block_args), or the fixed-size dequantise (max_fetched_blocks) being smaller than
    # a step's selection.
    spec = LossySpec("int4", group=group, sparse=frac, sink=sink, recent=recent)
    nb, sealed, budget, s, r = spec.block_args(P)
    n = sparse_sketch.count(nb, sealed, budget, s, r)
    assert spec.fetched_blocks(P) == n <= min(spec.max_fetched_blocks(P), spec.max_fetched_blocks(6000))
    assert spec.fetched_tokens(P) == n * group + P % group
    assert spec.fetch_bytes(P, 128, 2) == spec.unit_bytes(n * group, 128, 2)
    if frac == 1.0:
        assert n == nb


def test_group_not_dividing_the_sketch_chunk_is_refused(tiny_model):
    # Fault caught: a quantisation block straddling two sketch chunks silently ranked from the
    # wrong tokens (the executor needs whole blocks in a chunk).
    model = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=16, layers=2)
    spec = HFAdapter(model).spec()
    plan = _plan(LossySpec("int4", group=48, sparse=0.2, sink=4, recent=32))
    with pytest.raises(ValueError, match="sparse: .*group"):
        execute(build(spec, Workload(300, 1), plan), model, torch.zeros(1, 300, dtype=torch.long))


def _cfg(tmp_path):
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


def test_cli_run_and_plan_label_both_lossy_options(tmp_path, capsys):
    # Faults caught: a combined run or plan whose `lossy` object or first line names only one of the
    # two lossy options, a run that quietly fetches whole prefixes (its probe's fetched tokens must
    # be the plan's count), a plan that charges the fetch as exact or unselected bytes, and a run
    # whose JSON does not say which path its dequantise calls took (decode_issue.dequant: on the
    # CPU every call eager, "not CUDA"; tests/test_dequant_paths.py checks the counts).
    from kvpipe.cli import main
    model = _cfg(tmp_path)
    args = ["run", "--model", model, "--random-weights", "--context", "1700", "--chunk", "128",
            "--decode-tokens", "2", "--device", "cpu", "--no-progress", "--resident", "none",
            "--sparse", "0.2", "--lossy", "int4"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    deq = out["decode_issue"]["dequant"]
    assert deq["eager"] > 0 and deq["full"] == deq["window"] == 0 and deq["eager_why"] == {"not CUDA": deq["eager"]}
    assert 0 < deq["max_selected_blocks"] <= deq["window_blocks"]
    lossy = out["lossy"]
    assert lossy["sparse"] == 0.2 and lossy["quant"] == "int4" and lossy["group"] == 32 and lossy["sketch"] == 2
    err = lossy["measured_error"]
    spec = LossySpec("int4", sparse=0.2)
    assert err["fetched_tokens"] == spec.fetched_tokens(1700) < 1700 and err["sparse_probe_tokens"] == 1700
    assert 0 < err["sparse_recall_mean"] < 1 and err["attn_rel_err"] > 0 and "int4" not in err
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "LOSSY" in first and "int4" in first and "sparse" in first
    assert main(["plan", "--model", model, "--hw", "h200", "--context", "128K", "--resident", "none",
                 "--group", "2", "--decode-tokens", "2", "--sparse", "0.2", "--lossy", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lossy"]["sparse"] == 0.2 and out["lossy"]["quant"] == "int4"
    assert main(["plan", "--model", model, "--hw", "h200", "--context", "128K", "--resident", "none",
                 "--group", "2", "--decode-tokens", "2", "--sparse", "0.2", "--lossy", "int4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "LOSSY" in first and "int4" in first and "sparse" in first


def test_builder_fetches_the_selected_records_and_dequantises_them():
    # Faults caught: the graph's decode fetch charging the int4 bytes of every token (or exact
    # bytes) instead of the selected blocks' records, and no dequant stage after a sparse fetch.
    from kvpipe.pipeline.model import preset
    m = preset("llama-3-8b")
    w = Workload(131072, 2)
    spec = LossySpec("int4", sparse=0.2)
    g = build(m, w, Plan(Method.HEADWISE, PhasePlan(8, 16384), PhasePlan(8, 1), 0, lossy=spec), prefill=False)
    fetch = [s for s in g.stages if s.tag == "kv_fetch" and s.phase is Phase.DECODE]
    deq = [s for s in g.stages if s.tag == "dequant" and s.phase is Phase.DECODE]
    assert len(fetch) == len(deq) == 2 * m.layers
    P = fetch[0].tokens[1]
    record = (2 * 128 * 2 + 2 * 32 * 2 * 2 + 2 * 32 * 128 // 2)   # metadata (V: 2 groups of 64 channels
                                                                  # a token) + codes of a 32-token block, bf16
    assert fetch[0].bytes == 8 * spec.fetched_blocks(P) * record
    assert 0.19 < spec.fetched_blocks(P) * 32 / P < 0.21


def test_the_combined_error_table_equals_the_benchmark_json_and_the_block_rank_is_the_measured_best():
    # Faults caught: sparse + int4 figures typed in by hand or left behind when the benchmark re-ran
    # (pipeline/lossy_measured.py), a figure of another block size or rank, and LossySpec's
    # BLOCK_RANK not the rank with the smaller mean error on the needle set.
    from pathlib import Path

    from kvpipe.pipeline.lossy import BLOCK_RANK, BLOCK_RANKS
    from kvpipe.pipeline.lossy_measured import SPARSE_QUANT_MEASURED
    doc = json.loads((Path(__file__).parent / "fixtures" / "lossy-error.json").read_text())
    assert set(SPARSE_QUANT_MEASURED) == {(0.2, "int4")}
    for (f, quant), m in SPARSE_QUANT_MEASURED.items():
        assert m.row == f"sparse {f:.0%} + {quant}, 32-token blocks ({BLOCK_RANK})" and LossySpec(quant).group == 32
        row = doc["rows"][m.row]
        assert row["kind"] == "kvpipe" and row["tokens_fetched"] == pytest.approx(f, abs=0.01)
        assert m.needle == pytest.approx(row["rel_err_mean"], rel=1e-3)
        prow = doc["probe"]["rows"][m.probe_row]
        assert prow["fraction"] == f and m.probe == pytest.approx(prow["rel_err_mean"], rel=1e-3)
    errs = {how: doc["rows"][f"sparse 20% + int4, 32-token blocks ({how})"]["rel_err_mean"] for how in BLOCK_RANKS}
    assert min(errs, key=errs.get) == BLOCK_RANK


def test_the_planner_lists_the_combination_by_its_measured_error_and_runs_a_pick_as_both():
    # Faults caught: the combination picked under a budget its measured error (the probe's, above
    # 1) exceeds, though it is predicted fastest; its row missing from the choice's list; and a
    # pick of it that would run as only one of the two (its spec must carry quant and sparse).
    from kvpipe.pipeline.lossy_measured import SPARSE_QUANT_MEASURED
    from kvpipe.sim.lossy_choice import choose_lossy, options

    m = SPARSE_QUANT_MEASURED[(0.2, "int4")]
    opt = next(o for o in options() if o.name == "sparse 20% + int4")
    sp = opt.spec(0.99)
    assert sp.quant == "int4" and sp.sparse == 0.2 and sp.blocks and dict(sp.error)["attn_rel_err"] == m.worst

    class Pred:
        def __init__(self, plan):
            self.plan, self.problems = plan, ()
            lossy = plan.lossy
            t = 1.0 if lossy is None else 0.1 if lossy.blocks else 0.5
            self.report = type("R", (), {"timing": type("T", (), {"total_s": t, "ttft_s": t,
                                                                   "decode_s_per_token": t})()})()
    base = Plan(Method.HEADWISE, PhasePlan(8, 2048), PhasePlan(8, 1), 0)
    best, choice = choose_lossy(base, 0.99, "total", Pred)
    assert m.worst > 0.99 and not (best.plan.lossy is not None and best.plan.lossy.blocks)
    assert f"sparse 20% + int4 (error {m.worst:.2g}): above the budget" in choice.describe()
