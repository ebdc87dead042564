"""`kvpipe run --lossy int8|int4` executes (LOSSY, opt-in): offloaded units stored, moved and read
back quantised (executor/quant/store.py), resident units exact. CPU, tiny random models built here.
The figures checked are of tiny random models: never an accuracy on real tasks."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import write_config

COMMON = ("--random-weights", "--context", "200", "--decode-tokens", "6", "--chunk", "80", "--seed", "3",
          "--resident", "none", "--group", "1")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_config(tmp_path_factory, head_dim=32)   # the model these tests' bounds were set on


def cli(capsys, *args: str) -> tuple[int, str, str]:
    from kvpipe.cli import main
    rc = main(["run", "--device", "cpu", "--no-progress", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *args: str) -> dict:
    rc, out, err = cli(capsys, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_exact_run_is_unchanged_and_lossy_null(tiny_config, capsys):
    """Fault: the lossy hooks leak into the exact path (a changed bit, or a `lossy` object on an
    exact run). The offloaded exact run must equal the all-resident one bit for bit."""
    off = run_json(capsys, "--model", tiny_config, *COMMON)
    res = run_json(capsys, "--model", tiny_config, *COMMON[:-4], "--resident", "all", "--group", "1")
    assert off["output_digest"] == res["output_digest"]
    assert off["lossy"] is None and res["lossy"] is None


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_lossy_run_differs_within_bound_deterministically(tiny_config, capsys, bits):
    """Faults: the quantised path is a no-op (digest equal to exact), is nondeterministic (two
    runs differ), or loses the KV (the measured errors blow past the bounds that group-wise
    min-max quantisation of these activations gives: half a step per value, i.e. at most
    1/(2*levels) of a group's range; relative K/V error well under 1/levels * a few)."""
    exact = run_json(capsys, "--model", tiny_config, *COMMON)
    a = run_json(capsys, "--model", tiny_config, *COMMON, "--lossy", bits)
    b = run_json(capsys, "--model", tiny_config, *COMMON, "--lossy", bits)
    assert a["output_digest"] == b["output_digest"] and a["tokens"] == b["tokens"]
    assert a["output_digest"] != exact["output_digest"]
    lossy = a["lossy"]
    assert lossy["quant"] == bits and lossy["sparse"] is None
    err = lossy["measured_error"]
    bound = {"int8": 2e-2, "int4": 3e-1}[bits]          # relative error of K, V and attention
    for k in ("k_rel_err", "v_rel_err", "attn_rel_err"):
        assert 0 < err[k] < bound, (k, err[k])
    # the link moved fewer bytes than the exact run: fetches and stores are quantised
    assert a["measured"]["peak_bytes"]["host"] < exact["measured"]["peak_bytes"]["host"]


def test_lossy_table_says_LOSSY_first_and_trace_has_its_stages(tiny_config, capsys, tmp_path):
    """Faults: a lossy run whose table does not say so in its first line; quantise/dequantise
    work missing from the measured trace (or from the simulated one)."""
    trace = tmp_path / "t.json"
    rc, out, err = cli(capsys, "--model", tiny_config, *COMMON, "--lossy", "int8", "--trace", str(trace))
    assert rc == 0, err
    first = out.splitlines()[0]
    assert first.startswith("kvpipe run: LOSSY (int8 KV")
    assert "LOSSY error measured in this run" in out
    events = json.loads(trace.read_text())["traceEvents"]
    pid = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for proc in ("kvpipe sim", "kvpipe real"):
        names = {e["name"] for e in events if e.get("pid") == pid[proc] and e["ph"] == "X"}
        assert any(".quant" in n for n in names) and any(".dequant." in n for n in names), proc


def test_disk_and_int4(tiny_config, tmp_path, capsys):
    """Fault: quantised records written to or read from the disk tier wrongly (a run with every
    offloaded unit on disk must give the same bits as the same plan with them in host RAM: the
    bytes are the same records, only their home differs)."""
    host = run_json(capsys, "--model", tiny_config, *COMMON, "--lossy", "int4")
    disk = run_json(capsys, "--model", tiny_config, *COMMON, "--lossy", "int4", "--disk", "all",
                    "--kv-dir", str(tmp_path))
    assert disk["plan"]["disk"], disk["plan"]
    assert disk["disk"] is not None and disk["disk"]["read_bytes"] > 0 and disk["disk"]["write_bytes"] > 0, disk["disk"]
    assert disk["output_digest"] == host["output_digest"]


IDLE_QUANT = "nothing is quantised"
IDLE_SPARSE = "sparse decode selects only among offloaded units, so every token is attended"


@pytest.mark.parametrize("flags, idle", [(("--sparse", "0.2"), [IDLE_SPARSE]), (("--lossy", "int8"), [IDLE_QUANT]),
                                         (("--lossy", "int4", "--sparse", "0.2"), [IDLE_QUANT, IDLE_SPARSE])])
def test_every_unit_resident_warns_what_the_lossy_flags_leave_undone(tiny_config, capsys, flags, idle):
    """Fault caught: a sparse-only run (no --lossy) with every unit on the GPU warned "nothing is
    quantised", which says nothing of sparse: what is true is that sparse decode selects among
    offloaded units only, so every token is attended and the run is exact. A CPU run saying its KV
    is "resident on the GPU" fails too."""
    rc, out, err = cli(capsys, "--json", "--model", tiny_config, "--random-weights", "--context", "2048",
                       "--decode-tokens", "1", "--resident", "all", "--device", "cpu", *flags)
    assert rc == 0, err
    line = f"kvpipe: warning: lossy: every KV unit is resident on the CPU; {'; '.join(idle)} (the run is exact)"
    assert line in err.splitlines(), err


def test_sparse_with_int4_over_disk_units_is_refused_in_one_line(tiny_config, capsys, tmp_path):
    """Fault: --sparse --lossy int4 over disk units silently running one of the two (or crashing)
    in `run`, where sparse decode cannot read disk rows (over host-RAM units the combination runs:
    tests/test_sparse_int4.py)."""
    rc, out, err = cli(capsys, "--model", tiny_config, *COMMON, "--sparse", "0.2", "--lossy", "int4",
                       "--disk", "all", "--kv-dir", str(tmp_path), "--context", "2048")   # where 0.2 selects
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvpipe: error: --sparse:") and "disk" in err, err


def _greedy_kl(tiny_model, bits):
    """Executor run of a tiny random model, exact vs lossy, same graph otherwise."""
    from dataclasses import replace

    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.model import from_hf_config
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    hf = tiny_model("llama", kv_heads=2, q_heads=8, head_dim=32, layers=2)
    spec = from_hf_config(hf.config.to_dict(), "tiny")
    work = Workload(256, 16, 1)
    plan = Plan(Method.HEADWISE, PhasePlan(group=1, chunk=64, depth=2), PhasePlan(group=1, chunk=1, depth=2),
                resident=0)
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    g_ex, g_lo = build(spec, work, plan), build(spec, work, replace(plan, lossy=LossySpec(bits)))
    ex = execute(g_ex, hf, ids, keep_logits=True)
    lo = execute(g_lo, hf, ids, keep_logits=True)
    h2d = lambda r, g: sum(m for m, s in zip(r.moved_bytes, g.stages) if s.tag == "kv_fetch")
    # fp32 KV: codes of <= 8 bits plus per-group metadata are well under half the exact bytes
    assert 0 < h2d(lo, g_lo) < 0.5 * h2d(ex, g_ex), (h2d(lo, g_lo), h2d(ex, g_ex))
    p = torch.log_softmax(ex.step_logits.double(), -1)
    q = torch.log_softmax(lo.step_logits.double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    agree = float((ex.tokens == lo.tokens).double().mean())
    return kl, agree


@pytest.mark.parametrize("bits,kl_max,agree_min", [("int8", 1e-3, 0.9), ("int4", 5e-2, 0.5)])
def test_logits_kl_and_greedy_agreement_on_tiny_random_model(tiny_model, bits, kl_max, agree_min):
    """Fault: dequantised KV far from the exact KV (wrong scale/zero, codes swapped, tail lost):
    the mean KL of the per-step logits (exact || lossy, float64 log-softmax written here) and the
    greedy agreement over 17 tokens. Tiny random model: a sanity figure, not task accuracy.
    Also fault: the fetches still moving exact bytes (no saving on the link)."""
    kl, agree = _greedy_kl(tiny_model, bits)
    print(f"{bits}: KL {kl:.3g}, greedy agreement {agree:.3f}")
    assert 0 < kl < kl_max and agree >= agree_min, (kl, agree)


# ---- races: the lossy stages' dependencies (tail, records, byte slots, disk staging) ------------
def _lossy_run(model, device, bits, resident, disk, kv_dir, hook=None, turns=None, context=60, decode=12,
               group=8):
    import random
    from dataclasses import replace

    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.kv.layout import DiskOptions
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    spec = HFAdapter(model).spec()
    plan = Plan(Method.HEADWISE, PhasePlan(2, 48, 3), PhasePlan(2, 1, 2), resident, disk)
    ids = torch.randint(0, spec.vocab, (1, context), generator=torch.Generator().manual_seed(5))
    g = build(spec, Workload(context, decode, 1), replace(plan, lossy=LossySpec(bits, group=group)))
    return execute(g, model, ids, device, keep_logits=True, stage_hook=hook, disk=DiskOptions(str(kv_dir)),
                   turns=None if turns is None else random.Random(turns))


@pytest.mark.parametrize("turns", [1, 2])
def test_lossy_bits_do_not_depend_on_lane_interleaving(tiny_model, tmp_path, turns):
    """Fault: a missing dependency of a lossy stage (a fetch reading records before their store,
    the tail read after the next step changed it, a byte slot refilled while decoded, disk staging
    reused before its write): with the lane actors' turns shuffled, some interleaving then gives
    other bits. 12 decode steps cross block boundaries (group 8) of the quantised homes."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=32, layers=2)
    ref = _lossy_run(model, "cpu", "int4", 1, 3, tmp_path)
    mix = _lossy_run(model, "cpu", "int4", 1, 3, tmp_path, turns=turns)
    assert torch.equal(ref.step_logits, mix.step_logits) and torch.equal(ref.tokens, mix.tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_lossy_cuda_bits_survive_stream_stalls_and_tiers(tiny_model, tmp_path, bits):
    """Fault (CUDA streams): a lossy stage missing an event wait or a record_stream (records freed
    before the d2h store read them, a byte slot refilled while dequantised, the tail overwritten
    while copied): with random stream stalls the bits change. Also: the same records on disk give
    the same bits as in host RAM."""
    import random
    model = tiny_model("llama", kv_heads=8, q_heads=16, head_dim=64, layers=3, dtype=torch.bfloat16,
                       device="cuda", hidden_size=512, intermediate_size=1024, vocab_size=1024)
    ref = _lossy_run(model, "cuda", bits, 5, 0, tmp_path, context=300, decode=40, group=32)
    from test_executor import jitter   # the stall schedule of the exact path's stress test
    hook = jitter(random.Random(7))
    for disk in (0, 8):
        run = _lossy_run(model, "cuda", bits, 5, disk, tmp_path, hook=hook, context=300, decode=40, group=32)
        assert torch.equal(ref.step_logits, run.step_logits) and torch.equal(ref.tokens, run.tokens), disk
