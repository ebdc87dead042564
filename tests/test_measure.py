"""benchmarks/measure.py (the one row-measuring helper of the GPU benchmarks) and the regret
benchmark's row schedule, on the CPU with a tiny random model: cheap enough for CI."""
import json

import pytest

from benchmarks.measure import Bench
from benchmarks.planner_regret import run_rows
from benchmarks.regret_table import merge
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload


def _plan(resident: int, group: int = 1, chunk: int = 32) -> Plan:
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0)


@pytest.fixture(scope="module")
def bench(tiny_config):
    with Bench(tiny_config, "cpu", 1 << 30, max_context=96, host_budget=1 << 30) as b:
        yield b


def test_two_rows_one_offloaded_measure_and_agree(bench):
    """Fault caught: the helper reusing a row's KV or prompt slice in the next row, or not running
    the plan it was given: an all-resident and an all-offloaded row of the same workload must both
    measure (positive prefill and decode times) and give bitwise-equal outputs (placement never
    changes a bit), and the offloaded row must report a host KV tier the resident one has not."""
    work = Workload(64, 3, 1)
    units = bench.spec.units
    resident = bench.row(_plan(units), work)
    offloaded = bench.row(_plan(0), work)
    for row in (resident, offloaded):
        assert row.ok, row.json
        m = row.json["measured"]
        assert m["prefill_s"] > 0 and m["decode_s_per_token"] > 0 and m["total_s"] >= m["prefill_s"]
        assert len(row.json["tokens"]) == 4 and row.json["wall_s"] >= m["total_s"]
    assert resident.json["output_digest"] == offloaded.json["output_digest"]
    assert resident.json["tokens"] == offloaded.json["tokens"]


def test_a_failing_row_is_recorded_and_the_next_runs(bench):
    """Fault caught: an error inside one row (here a head group that does not divide the KV heads,
    raised while the row is built) escaping the helper and ending the benchmark, and a plan over
    the budgets being run instead of refused like `kvpipe run` refuses it."""
    work = Workload(64, 2, 1)
    bad = bench.row(_plan(0, group=3), work)
    assert not bad.ok and "group" in bad.json["error"] and bad.json["oom"] is False
    tight = Bench(bench.model, "cpu", 1000, 96, host_budget=1 << 30)
    tight.spec = bench.spec
    over = tight.row(_plan(bench.spec.units), work)
    assert not over.ok and over.json["error"].startswith("does not fit")
    assert bench.row(_plan(1), work).ok


def test_context_past_the_prompt_is_refused(bench):
    """Fault caught: a row longer than the bench's one random prompt silently running on a
    shorter prompt slice."""
    with pytest.raises(ValueError, match="max_context"):
        bench.row(_plan(0), Workload(128, 1, 1))


def _res(walls: dict):
    """Two workloads, three ranked rows each, estimated walls from `walls`."""
    wl = lambda ctx, name: {"context": ctx, "decode_tokens": 1, "rows": [
        {"label": f"r{k}", "rank": k, "estimated_wall_s": walls[name][k]} for k in range(3)]}
    return {"workloads": {"A": wl(1, "A"), "B": wl(2, "B")}}


def test_schedule_runs_strongest_first_skips_over_budget_and_saves_each_row(tmp_path):
    """Fault caught: the regret schedule ignoring --budget-s (a 600 s device call killed with
    rows unsaved), running a weak contender before a pick, or saving only at the end. Rows
    measured here by a stand-in for the GPU that reports each row's wall as its estimate."""
    res = _res({"A": [1.0, 1.0, 1.0], "B": [1.0, 50.0, 1.0]})
    ran, saves = [], []
    clock = [0.0]

    def measure(name, row):
        ran.append((name, row["rank"]))
        clock[0] += row["estimated_wall_s"]
        return {"measured": {"total_s": 1.0 + row["rank"]}, "wall_s": row["estimated_wall_s"]}

    run_rows(res, "total_s", 10.0, 0.0, measure, lambda: saves.append(json.dumps(res)), order="rank",
             clock=lambda: clock[0])
    assert ran == [("A", 0), ("B", 0), ("A", 1), ("A", 2), ("B", 2)]   # B's rank 1 (50 s) skipped
    assert res["workloads"]["B"]["rows"][1]["skipped"].startswith("budget")
    assert len(saves) == 6
    assert res["workloads"]["A"]["pick_regret"] == 0.0 and res["workloads"]["A"]["measured_rows"] == 3


def test_table_joins_parts_before_judging_the_pick():
    """Fault caught: `--table A.json B.json` judging each call's share of a workload alone (the
    pick would look best in the call that measured it, whatever the other call found)."""
    head = {"objective": "total", "model": "m", "gpu_budget": "24GB", "device": "cuda"}
    rows = lambda measured: [dict({"label": f"r{k}", "rank": k}, **({"measured": {"total_s": v}} if v else
                                                                   {"skipped": "ranks"}))
                             for k, v in enumerate(measured)]
    a = dict(head, part="1", workloads={"256K": {"context": 1, "rows": rows([10.0, 10.5, None])}})
    b = dict(head, part="2", workloads={"256K": {"context": 1, "rows": rows([None, None, 9.0])}})
    (res,) = merge([a, b])
    wl = res["workloads"]["256K"]
    assert [r["measured"]["total_s"] for r in wl["rows"]] == [10.0, 10.5, 9.0]
    assert wl["measured_rows"] == 3 and abs(wl["pick_regret"] - (10.0 / 9.0 - 1)) < 1e-12


@pytest.mark.gpu
def test_cuda_rows_replay_agree_and_an_out_of_memory_row_is_survived(tmp_path_factory):
    """Fault caught, on CUDA: the helper's replayed resident and offloaded rows disagreeing or
    recording no allocator peak, and a CUDA out-of-memory in one row escaping the helper or
    leaving the next row without memory. The OOM is real: the test holds all but 2-4 MiB of the
    capped allocator while the row's first 8K-token activation needs 4 MiB."""
    import torch
    from conftest import write_config
    cfg = write_config(tmp_path_factory, torch_dtype="bfloat16", hidden_size=256, head_dim=64)
    torch.cuda.empty_cache()   # the cap is process-wide: it must leave 2 GB beyond what earlier tests still hold
    budget, seg = torch.cuda.memory_reserved() + 2 * 10**9, 2 << 20
    with Bench(cfg, "cuda", budget, max_context=8192, host_budget=1 << 30) as bench:
        work, units = Workload(8192, 4, 1), bench.spec.units
        a, b = bench.row(_plan(units, chunk=8192), work), bench.row(_plan(0, chunk=8192), work)
        assert a.ok and b.ok, (a.json, b.json)
        assert a.json["decode_issue"] == b.json["decode_issue"] == "graph"
        assert a.json["output_digest"] == b.json["output_digest"]
        assert a.json["measured"]["peak_gpu_bytes"] > 0
        hog = torch.empty((budget - torch.cuda.memory_reserved()) // seg * seg - seg, dtype=torch.uint8,
                          device="cuda")
        oom = bench.row(_plan(0, chunk=8192), work)
        del hog
        assert not oom.ok and oom.json["oom"], oom.json
        assert bench.row(_plan(0, chunk=8192), work).ok


@pytest.mark.gpu
def test_cuda_rows_in_one_process_leave_nothing_allocated(tmp_path_factory):
    """Fault caught, on CUDA: a run leaving memory allocated after it ends (each run's new compute
    stream got a cuBLAS workspace that torch never freed: 64 MiB a row on the H200, so a regret or
    sim_check process's later rows measured a peak ~1 GB above the plan's and ran out of memory).
    After a first row, four more rows of the same plan must leave memory_allocated where the
    first left it (a leak of one workspace per row would show as 4 x 32 MiB)."""
    import torch
    from conftest import write_config
    cfg = write_config(tmp_path_factory, torch_dtype="bfloat16", hidden_size=256, head_dim=64)
    torch.cuda.empty_cache()
    with Bench(cfg, "cuda", torch.cuda.memory_reserved() + 2 * 10**9, max_context=4096, host_budget=1 << 30) as bench:
        work, plan = Workload(4096, 3, 1), _plan(0, chunk=4096)
        assert bench.row(plan, work).ok
        after_one = torch.cuda.memory_allocated()
        for _ in range(4):
            assert bench.row(plan, work).ok
        assert torch.cuda.memory_allocated() - after_one < 16 << 20, (after_one, torch.cuda.memory_allocated())


def test_repeats_take_the_median_of_every_timed_run(bench):
    """Fault caught: `measured` holding one run (the first or the last) when a row asks for
    repeats, a repeat reusing the previous run's KV (its output would differ), or the runs'
    samples not kept: the median is recomputed here from the samples by hand."""
    row = bench.row(_plan(0), Workload(64, 2, 1), repeats=3)
    assert row.ok, row.json
    j = row.json
    assert j["repeats"] == 3 and len(j["samples"]) == 3 and j["repeat_outputs_agree"] is True
    for key in ("prefill_s", "decode_s_per_token", "total_s"):
        vals = sorted(s[key] for s in j["samples"])
        assert j["measured"][key] == vals[1]
    assert isinstance(j["child_processes"], int) and len(j["loadavg_1m"]) == 2
    bad = bench.row(_plan(0), Workload(64, 2, 1), repeats=0)
    assert not bad.ok and "repeats" in bad.json["error"]
