"""Lossy options in the vocabulary, graph, simulator and `kvpipe plan` (pipeline/lossy.py and its
small hooks in plan, builder, memory and the CLI). Expected figures are worked out by hand here."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvpipe.cli import main
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.lossy import SELECT_BYTES_PER_TOKEN, SELECT_KERNELS, LossySpec
from kvpipe.pipeline.memory import breakdown
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.simulate import simulate

M = PRESETS["llama-3-8b"]


def _plan(lossy=None, resident=0, group=8, chunk=2048):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk), PhasePlan(group, 1), resident, lossy=lossy)


@pytest.mark.parametrize("kw,field", [({"quant": "int3"}, "lossy"), ({"sparse": 0.0}, "sparse"),
                                      ({"sparse": 1.5}, "sparse"), ({"quant": "int8", "group": 3}, "group"),
                                      ({}, "lossy"),
                                      ({"sparse": 0.2, "sink": -1}, "sink"),
                                      ({"sparse": 0.2, "sketch": None}, "sketch")])
def test_bad_specs_raise_naming_the_field(kw, field):
    # Fault caught: a spec that silently accepts nonsense (int3, fractions outside (0, 1], a sparse
    # selection without the sketch the executor runs) or
    # an empty "lossy" spec that is in fact exact.
    with pytest.raises(ValueError, match=field):
        LossySpec(**kw)


def test_a_plan_file_with_a_null_sketch_is_refused_and_a_non_sparse_one_reads_back():
    # Fault caught: from_json dropping a sparse plan's null sketch (a file that asked for a
    # selection the executor cannot run would silently run the sketch), or refusing the null
    # sketch that every non-sparse spec writes.
    with pytest.raises(ValueError, match="sketch"):
        LossySpec.from_json({"quant": None, "sparse": 0.2, "sketch": None})
    spec = LossySpec("int4")
    assert LossySpec.from_json(json.loads(json.dumps(spec.to_json()))).to_json() == spec.to_json()


def test_byte_formulas_by_hand():
    # Fault caught: metadata left out of the quantised size (the simulator would overstate the gain),
    # or int4 counted as one byte per value, or V's groups taken as K's. bf16, head_dim 128, per
    # token and head (K and V, 512 exact bytes): int8 group 64: codes 256 + K's scale and zero per
    # channel every 64 tokens 2*2*128/64 + V's per 64 channels 2*2*2 = 272; int4 group 32 with V
    # groups of 64 channels: 128 + 2*2*128/32 + 2*2*2 = 152; with V groups of 32: 160.
    assert LossySpec("int8").ratio(2) == 272 / 512
    assert LossySpec("int4").ratio(2) == 152 / 512
    assert LossySpec("int4", vgroup=32).ratio(2) == 160 / 512
    assert LossySpec("int4").unit_bytes(32, 16, 2) == 32 * 16 // 2 * 2 + 2 * 2 * 16 + 2 * 2 * 32   # D 16: V groups of 16
    from kvpipe.executor.quant.blocks import BlockCodec                 # the executor's record, the same bytes
    import torch
    assert BlockCodec(4, 32, 128, torch.bfloat16, 64).record == 152 * 32
    assert BlockCodec(4, 32, 128, torch.bfloat16, 32).record == 160 * 32
    s = LossySpec(sparse=0.2)
    assert s.fetched_tokens(100_000) == 20_000 and s.fetched_tokens(1000) == 64 + 256
    assert s.fetched_tokens(100) == 100
    # default (2-bit token sketch on the GPU): 20% of 128K tokens of one unit (4 * 128 bytes a
    # token) and nothing else crosses the link; the GPU holds the sketch (128 channels x 2 bits =
    # 32 bytes a token), the 64-token chunks' min and max (2 * 128 * 2 bytes) and a tail chunk's K
    n = 131072
    assert s.fetch_bytes(n, 128, 2) == math.ceil(0.2 * n) * 512
    # (n // 64 + 1 chunks: one past the whole ones, as the executor holds; then a capacity of part chunks)
    assert s.gpu_summary_bytes(n, 128, 2) == (n + 64) * 32 + (n // 64 + 1) * 512 + 64 * 128 * 2
    assert s.gpu_summary_bytes(n + 10, 128, 2) == (n + 64) * 32 + (n // 64 + 1) * 512 + 64 * 128 * 2
    # scoring 4 query heads of 3 units (executor/sparse/rank_triton.py): every token's key rebuilt (2
    # FLOPs a channel) and dotted with each head (2 a channel); it reads the 32 code bytes of a
    # token once (kv_bytes: charged as decode attention's K/V) and the chunks' min/max, writes and
    # reads back 4 float32 scores and writes one float32 rank; the selection's passes are small ops
    cost = s.score_cost(n, 4, 128, 2, units=3)
    assert cost["flops"] == 3 * (2 + 2 * 4) * 128 * n
    assert cost["kv_bytes"] == 3 * n * 32
    assert cost["mem_bytes"] == 3 * (n * 32 + (n // 64) * 512 + n * (2 * 4 * 4 + 4))
    assert cost["small_bytes"] == 3 * n * SELECT_BYTES_PER_TOKEN and cost["small_ops"] == SELECT_KERNELS
    # F = 1 ranks nothing (every token is fetched in order): no cost
    assert LossySpec(sparse=1.0).score_cost(n, 4, 128, 2)["mem_bytes"] == 0


def test_exact_plans_have_no_lossy_stages_and_lossy_ones_label_themselves():
    # Fault caught: lossy stages leaking into exact plans (the bitwise contract), or a lossy plan
    # that does not say so in its description and JSON.
    w = Workload(8192, 2, 1)
    g = build(M, w, _plan())
    assert not {s.tag for s in g.stages} & {"quant", "dequant", "score"}
    p = _plan(LossySpec("int4", sparse=0.2))
    assert "LOSSY" in p.describe() and Plan.from_json(json.loads(json.dumps(p.to_json()))).lossy == p.lossy
    assert "lossy" not in _plan().to_json()


def test_quantised_graph_moves_the_quantised_bytes_and_dequantises_before_attention():
    # Fault caught: fetch/store bytes not scaled, dequant missing or not between fetch and attention.
    w = Workload(8192, 2, 1)
    exact, lossy = build(M, w, _plan()), build(M, w, _plan(LossySpec("int4")))
    spec = LossySpec("int4")
    for kind in (Kind.H2D, Kind.D2H):
        a = [s for s in exact.stages if s.kind is kind]
        b = [s for s in lossy.stages if s.kind is kind]
        assert len(a) == len(b)
        for x, y in zip(a, b):
            tokens = x.tokens[1] - x.tokens[0]
            assert y.bytes == len(y.heads) * spec.unit_bytes(tokens, M.head_dim, 2)
    st = lossy.stages
    for s in st:
        if s.tag == "attn" and s.tokens[0] > 0:
            (deq,) = [st[d] for d in s.deps if st[d].tag == "dequant"]
            assert any(st[d].kind is Kind.H2D for d in deq.deps)
        if s.kind is Kind.D2H:
            assert any(st[d].tag == "quant" for d in s.deps)


def test_sparse_scores_each_layer_before_its_fetches_and_only_in_decode():
    # Fault caught: fetches that start before the step's queries exist (selection needs them), or
    # sparse applied to prefill (which attends everything).
    w = Workload(16384, 2, 1)
    spec = LossySpec(sparse=0.2)
    g = build(M, w, _plan(spec))
    st = g.stages
    for s in st:
        if s.kind is Kind.H2D:
            scored = [st[d] for d in s.deps if st[d].tag == "score"]
            if s.phase is Phase.DECODE:
                assert len(scored) == 1 and scored[0].layer == s.layer and scored[0].step == s.step
                assert s.bytes == len(s.heads) * spec.fetch_bytes(s.tokens[1], M.head_dim, 2)
            else:
                assert not scored and s.bytes == len(s.heads) * s.tokens[1] * M.kv_unit_bytes_per_token


def test_memory_counts_quantised_homes_and_summaries():
    # Fault caught: host RAM sized for exact KV under quantisation, or summaries not counted.
    w = Workload(65536, 4, 1)
    e, q = breakdown(M, w, _plan()), breakdown(M, w, _plan(LossySpec("int4", sparse=0.2)))
    cap, units = w.kv_capacity, M.units
    spec = LossySpec("int4", sparse=0.2)
    # default 2-bit sketch: host homes hold only the quantised KV; the GPU holds per unit the
    # sketch (32 bytes a token of the 1025 chunks held: 1024 whole ones and the one filling), the
    # chunks' min/max and a 64-token tail chunk's K
    assert q.host_kv == units * spec.unit_bytes(cap, 128, 2)
    assert q.gpu_kv - e.gpu_kv == units * (1025 * 64 * 32 + 1025 * 2 * 128 * 2 + 64 * 128 * 2)


def test_simulated_decode_gets_faster_with_fewer_bytes_on_a_pcie_bound_plan():
    # Fault caught: the simulator ignoring the smaller fetches (no gain) or the new stages' cost
    # (gain equal to the byte ratio even when scoring and dequant take time).
    # 128K with decode replayed as CUDA graphs (what `kvpipe plan` assumes, as `run --replay auto`):
    # issued eagerly, sparse + int4's ~8 stages per layer bind the host (~129 ms a step, above
    # int4's 99 ms), and at 32K the scoring every fetch waits for costs more than the bytes saved.
    hw = load_profile("h200")
    w = Workload(131072, 2, 1)
    t = {name: simulate(M, w, _plan(l, chunk=16384), hw, replay=True).report.timing.decode_s_per_token
         for name, l in [("exact", None), ("int8", LossySpec("int8")), ("int4", LossySpec("int4")),
                         ("sparse", LossySpec(sparse=0.2)), ("both", LossySpec("int4", sparse=0.2))]}
    assert t["exact"] > t["int8"] > t["int4"] > t["both"] and t["exact"] > t["sparse"] > t["both"]
    assert t["exact"] / t["int8"] <= 1 / LossySpec("int8").ratio(2)        # never beyond the byte ratio
    assert t["exact"] / t["int4"] <= 1 / LossySpec("int4").ratio(2)


def test_cli_plan_labels_lossy_runs_and_json_says_null_for_exact(capsys):
    # Fault caught: a lossy prediction indistinguishable from an exact one, or `lossy` missing from
    # exact JSON (the issue asks for an explicit null).
    args = ["plan", "--hw", "h200", "--context", "32K", "--decode-tokens", "2", "--gpu-mem", "24GB"]
    assert main(args + ["--lossy", "int4", "--sparse", "0.2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("kvpipe plan: LOSSY") and "int4" in first and "20%" in first
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lossy"] is None
    assert main(args + ["--json", "--lossy", "int8"]) == 0
    lossy = json.loads(capsys.readouterr().out)["lossy"]
    assert lossy["quant"] == "int8" and lossy["sparse"] is None and lossy["measured_error"] is None


@pytest.mark.parametrize("extra,field", [(["--sparse", "0"], "sparse"), (["--sparse", "x"], "sparse"),
                                         (["--lossy", "int2"], "lossy")])
def test_cli_bad_lossy_input_is_one_line_exit_2(extra, field):
    # Fault caught: a traceback or a silent default on a bad opt-in value.
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--context", "8K", *extra],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and field in r.stderr


def test_run_refuses_a_sparse_int4_plan_file_with_disk_units(tmp_path, capsys):
    # Fault caught: `kvpipe run` executing a sparse + int4 plan over disk units as something else
    # (sparse + int4 over host-RAM units runs: tests/test_sparse_int4.py; disk rows are read whole).
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan(LossySpec("int4", sparse=0.2), chunk=32).with_(disk=2).to_json()))
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["run", "--model", str(tmp_path / "config.json"), "--random-weights", "--context", "64",
               "--decode-tokens", "1", "--device", "cpu", "--plan", str(path)])
    assert rc == 2 and "sparse" in capsys.readouterr().err


def test_dequant_stage_is_one_fused_call_over_the_whole_byte_slot():
    # Fault caught: the simulator costing the dequantise as the eager per-head ops (16 host issues
    # a fetch at 62 us each: int4 at 128K predicted 116 ms) while the executor runs one compiled
    # call (executor/quant/store.py fused_decode) that streams every block of the slot's capacity.
    w = Workload(8192, 3, 1)
    spec = LossySpec("int4")
    g = build(M, w, _plan(spec))
    deqs = [s for s in g.stages if s.tag == "dequant"]
    assert deqs
    blocks_tokens = w.kv_capacity // 32 * 32
    for s in deqs:
        n = len(s.heads)
        assert (s.ops, s.small_ops, s.mem_bytes) == (1, 2, 0)
        assert s.small_bytes == n * (spec.unit_bytes(blocks_tokens, 128, 2) + blocks_tokens * 2 * 128 * 2)
