"""The buyer's table (kvpipe/buyers.py): list flags, one row per (card, budget), the binding budget."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpipe import buyers
from kvpipe.options import PlanOptions

GiB = 2**30
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2   # Llama-3-8B: K and V, 32 layers, 8 KV heads, head dim 128, bf16


def test_split_list_reads_commas_and_refuses_empty_items():
    """Fault caught: a comma list read as one name, spaces kept, or an empty item let through."""
    assert buyers.split_list("rtx4090, rtx5090,a100-80g", "--hw") == ["rtx4090", "rtx5090", "a100-80g"]
    assert buyers.split_list(None, "--host-mem") == [None]
    with pytest.raises(ValueError, match="--host-mem"):
        buyers.split_list("64GB,,128GB", "--host-mem")


def test_binding_pools_names_only_the_pools_that_raise_the_context():
    """Fault caught: a pool reported as binding although raising it alone lets no longer context fit
    (here the context is min(gpu / 10, host + disk): host and disk bind, the GPU does not)."""
    largest_of = lambda b: min(b["gpu"] // 10, b["host"] + b["disk"])  # noqa: E731
    budgets = {"gpu": 1000, "host": 30, "disk": 20}
    assert buyers.binding_pools(largest_of, budgets, largest_of(budgets)) == ("host", "disk")
    budgets = {"gpu": 100, "host": 30, "disk": 20}     # now gpu / 10 = 10 < 50: only the GPU binds
    assert buyers.binding_pools(largest_of, budgets, largest_of(budgets)) == ("gpu",)


def test_all_on_gpu_method_is_bound_by_the_gpu_alone():
    """Fault caught: host or disk reported as binding for a plan that keeps every byte on the GPU, or a
    longest context whose K/V alone overflows the GPU budget left after the weights (hand-worked:
    24 GiB - 16.06 GB of bf16 weights leaves under 74K tokens of 128 KiB each)."""
    opts = PlanOptions(model="llama-3-8b", hw="rtx4090", method="standard", gpu_mem="24GiB", host_mem="8GiB")
    row = buyers.row(opts, contexts=())
    assert row.binds == ("gpu",)
    weights = 8_030_261_248 * 2
    assert 0 < row.max_context * KV_PER_TOKEN <= 24 * GiB - weights


def test_table_has_one_row_per_card_and_budget_in_order():
    """Fault caught: rows missing, repeated or out of order when several cards and budgets are given;
    a context past the longest that fits predicted instead of marked as no fit."""
    opts = PlanOptions(model="llama-3-8b", method="standard")
    rows = buyers.table(opts, ["rtx4090", "rtx5090"], ["32GB", "64GB"], contexts=(8192, 1 << 20))
    assert [(r.hw, r.budgets["host"]) for r in rows] == [
        ("rtx4090", 32 * 10**9), ("rtx4090", 64 * 10**9), ("rtx5090", 32 * 10**9), ("rtx5090", 64 * 10**9)]
    for r in rows:
        short, long_ = r.exact
        assert short.decode_s_per_token is not None and short.ttft_s > 0
        assert long_.ttft_s is None and long_.decode_s_per_token is None   # 1M is past the GPU alone
    text = "\n".join(buyers.lines(rows, "llama-3-8b"))
    assert text.count("rtx4090") == 2 and "no fit" in text


def test_cli_lists_go_to_the_table_and_json():
    """Fault caught: `kvpipe plan` with a comma list failing as one profile name or one size."""
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--hw", "rtx4090,rtx3090", "--host-mem", "64GB",
                        "--method", "standard", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["hw"] for row in out["rows"]] == ["rtx4090", "rtx3090"]
    assert all(row["binds"] == ["gpu"] for row in out["rows"])


def test_a_given_context_is_the_tables_column_and_max_context_refuses_it():
    """Fault caught: `--context 32K` with several --hw dropped in silence (the table printed its
    128K and 1M columns only), or `plan --max-context --context 128K` ignoring the context
    without a word: a flag the command cannot use is refused, never dropped."""
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--hw", "rtx4090,rtx3090", "--host-mem", "64GB",
                        "--method", "standard", "--context", "32K", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [[p["context"] for p in row["exact"]] for row in json.loads(r.stdout)["rows"]] == [[32768], [32768]]
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--max-context", "--context", "128K"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("kvpipe: error: --context: not with --max-context"), r.stderr


def test_an_unknown_card_in_the_list_fails_in_one_line_naming_it():
    """Fault caught: a bad name in --hw failing with a traceback instead of one line naming it."""
    r = subprocess.run([sys.executable, "-m", "kvpipe", "plan", "--hw", "rtx4090,nope", "--method", "standard"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "'nope'" in r.stderr and "Traceback" not in r.stderr


def test_shared_simulations_pick_what_separate_searches_pick():
    """Fault caught: the card's shared simulations (sim/memo.SimMemo) answering a search with another
    plan's, workload's or issue mode's prediction, so the winner, its runners-up or their values
    differ from each budget's search simulating every plan itself; and the sharing never reused."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim import decide as d
    from kvpipe.sim.memo import SimMemo
    # 20 GB of GPU leaves part of 32K's K/V resident, so plans differ in resident units; both host
    # budgets hold the rest, so the two searches simulate the same plans
    jobs = [PlanOptions(model="llama-3-8b", hw="rtx4090", gpu_mem="20GB", host_mem=h) for h in ("16GB", "64GB")]
    spec, hw, work, memo = load_model("llama-3-8b"), load_profile("rtx4090"), Workload(32768, 32), SimMemo()

    def picks(opts, memo):
        budgets = opts.budgets(hw.gpu_mem_bytes, hw.host_mem_bytes, hw.disk_bytes)
        found = d.decide(spec, work, hw, budgets, opts.request(spec), memo=memo).search
        return [(c.plan, c.value) for c in (found.best, *found.alternatives)]
    assert [picks(j, memo) for j in jobs] == [picks(j, None) for j in jobs]
    assert memo.hits > 0


def test_memo_reuses_a_prediction_only_for_the_same_inputs():
    """Fault caught: a SimMemo key missing the workload, the profile (a p90 run answered with the
    median one) or how decode is issued, so one simulation answers another; or a true repeat
    simulated again. Reference: simulate() called directly."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import PRESETS
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    from kvpipe.sim.memo import SimMemo
    from kvpipe.sim.simulate import simulate
    m, hw = PRESETS["llama-3-8b"], load_profile("rtx4090")
    plan = Plan(Method.HEADWISE, PhasePlan(8, 2048, 2), PhasePlan(8, 1, 2), 200, 0)
    memo = SimMemo()
    cases = [(Workload(4096, 4), hw, False), (Workload(8192, 4), hw, False),
             (Workload(8192, 4), hw.at_quantile("p90"), False), (Workload(8192, 4), hw, True)]
    for work, h, replay in cases:
        got = memo.simulate(m, work, plan, h, replay=replay).report.timing
        assert got == simulate(m, work, plan, h, replay=replay).report.timing, (work, replay)
    assert memo.hits == 0
    memo.simulate(m, Workload(8192, 4), plan, hw, replay=True)
    assert memo.hits == 1


def test_one_card_on_more_cores_runs_its_rows_apart_in_order():
    """Fault caught: a card's rows, split over processes when there are fewer cards than workers,
    lost, repeated or out of budget order, or predicted differently from one process's."""
    opts = PlanOptions(model="llama-3-8b", method="standard")
    split = buyers.table(opts, ["rtx4090"], ["32GB", "64GB", "96GB"], contexts=(8192,), workers=4)
    assert [r.budgets["host"] for r in split] == [32 * 10**9, 64 * 10**9, 96 * 10**9]
    assert split == buyers.table(opts, ["rtx4090"], ["32GB", "64GB", "96GB"], contexts=(8192,), workers=1)


def test_last_partial_round_of_cards_runs_row_by_row_with_the_same_picks():
    """Fault caught: the cards of the last, partial round of workers (3 cards on 2 cores: the
    third) split into rows that are lost, repeated or out of order, or whose searches pick other
    plans or predict other figures than one process searching every row (the default method's
    search at 8K on a 20 GB GPU budget)."""
    cards = [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]
    assert buyers.tasks(cards, 2) == [["a1", "a2"], ["b1", "b2"], ["c1"], ["c2"]]
    assert buyers.tasks(cards, 3) == cards and buyers.tasks(cards[:1], 2) == [["a1"], ["a2"]]
    opts = PlanOptions(model="llama-3-8b", gpu_mem="20GB")
    hws, hosts = ["rtx4090", "rtx5090", "a100-80g"], ["16GB", "64GB"]
    split = buyers.table(opts, hws, hosts, contexts=(8192,), workers=2)
    assert split == buyers.table(opts, hws, hosts, contexts=(8192,), workers=1)
    assert [(r.hw, r.budgets["host"]) for r in split] == [(h, m * 10**9) for h in hws for m in (16, 64)]
