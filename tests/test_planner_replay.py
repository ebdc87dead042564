"""Graph replay of decode as a dimension of the search (sim/planner.py) and a field of the plan
(pipeline/plan.py `Plan.replay`): the planner scores replayed and eager decode and keeps the
better, a user pin holds, the plan file carries the choice (old files load with none), a replay
true that the plan or the run cannot honour is refused on one line, and `run` executes it."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import PLAN_SCHEMA, Method, PhasePlan, Plan
from kvpipe.pipeline.replay import Replay
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.estimate import decode_host_seconds, layer_classes, phase_layout
from kvpipe.sim.planner import Pins, _Search, objective_value, search
from kvpipe.sim.simulate import host_step_s, simulate

MODEL = ModelSpec("tiny", "llama", 2, 4 * 32, 4, 2, 32, 2 * 4 * 32, 256)   # bf16: decode can replay
WORK = Workload(4096, 16)
ROOMY = {"gpu": 2**40, "host": 2**40, "disk": 2**40}


def _plan(replay=Replay.AUTO, resident=0, disk=0) -> Plan:
    return Plan(Method.HEADWISE, PhasePlan(1, 1024), PhasePlan(1, 1), resident, disk, replay=replay)


def _hw(**changes):
    return replace(load_profile("rtx4090"), **changes)


# ---- the search ------------------------------------------------------------------------------

def test_eager_decode_wins_where_a_replay_costs_the_host_more_than_issuing_the_step():
    """Fault caught: the planner never scoring eager decode (replay a setting, not a dimension).
    With a graph replay costing the host 50 ms a step and eager issue a few hundred microseconds,
    the simulator predicts eager decode far faster: the pick must be replay off, the reason must
    say so, and its replayed twin must be no better."""
    hw = _hw(graph_replay_s=0.05)
    res = search(MODEL, WORK, hw, ROOMY)
    assert res.best.plan.replay is Replay.OFF, res.best.plan.describe()
    assert "decode eager (replay off)" in res.reason and "better on total than replayed decode" in res.reason
    twin = simulate(MODEL, WORK, res.best.plan.with_(replay=Replay.ON), hw, replay=True, fuse=True)
    assert objective_value(twin, "total") > res.best.value
    pinned = search(MODEL, WORK, hw, ROOMY, Pins(replay=Replay.ON))
    assert pinned.best.plan.replay is Replay.ON and pinned.best.value > res.best.value


def test_replayed_decode_wins_where_the_host_binds_eager_steps():
    """Fault caught: eager decode picked where issuing every stage binds the step (the host's
    issue cost missing from the eager twin's score, or the comparison inverted): with 5 ms of host
    per stage and a 10 us replay the pick must be replayed."""
    hw = _hw(host_issue_s_per_stage=5e-3, graph_replay_s=1e-5)
    res = search(MODEL, WORK, hw, ROOMY)
    assert res.best.plan.replay is Replay.ON, res.best.plan.describe()
    assert "decode replayed" in res.reason
    eager = search(MODEL, WORK, hw, ROOMY, Pins(replay=Replay.OFF))
    assert eager.best.value > res.best.value


@pytest.mark.parametrize("pin", [Replay.ON, Replay.OFF])
def test_a_replay_pin_holds_for_the_pick_and_the_runners_up(pin):
    """Fault caught: --replay on/off overridden by the search. Under either pin every plan the
    planner returns decodes that way, whatever the machine favours."""
    hw = _hw(graph_replay_s=0.05) if pin is Replay.ON else _hw(host_issue_s_per_stage=5e-3, graph_replay_s=1e-5)
    res = search(MODEL, WORK, hw, ROOMY, Pins(replay=pin))
    assert [c.plan.replay for c in (res.best,) + res.alternatives] == [pin] * (1 + len(res.alternatives))
    assert "pinned by --replay" in res.reason


def test_plans_that_cannot_replay_keep_no_choice_and_a_pin_on_leaves_them_out():
    """Fault caught: a replay choice on a plan whose decode no CUDA graph holds (disk units), or
    --replay on returning one. Host RAM for a third of the KV puts units on disk: no choice there;
    pinned on, the search must refuse and name the host budget that replays."""
    from kvpipe.pipeline.rules import HOST_KV_FRACTION
    from kvpipe.sim.planner import NoPlanFits
    unit = WORK.kv_capacity * MODEL.kv_unit_bytes_per_token
    tight = dict(ROOMY, host=int(3 * unit / HOST_KV_FRACTION))   # three of the four units, less staging
    res = search(MODEL, WORK, _hw(), tight, Pins(resident=0))
    assert all(c.plan.disk and c.plan.replay is Replay.AUTO for c in (res.best,) + res.alternatives)
    assert "decode replayed" not in res.reason and "decode eager" not in res.reason
    with pytest.raises(NoPlanFits, match="--replay on") as err:
        search(MODEL, WORK, _hw(), tight, Pins(resident=0, replay=Replay.ON))
    named = float(str(err.value).split("--host-mem ")[1].split("MiB")[0]) * 2**20
    assert search(MODEL, WORK, _hw(), dict(tight, host=int(named)), Pins(resident=0, replay=Replay.ON)).best.plan.replay \
        is Replay.ON


def test_eager_host_issue_estimate_equals_the_simulators_step():
    """Catches estimate.decode_host_seconds drifting from the builder's stages or
    cost.host_issue_seconds (the eager twins' lower bound and rank): equal to simulate.host_step_s
    over a built decode step, with and without the profile's copy-issue pair."""
    for hw in (_hw(), _hw(host_copy_s_per_stage=3e-5, host_copy_s_per_op=2e-6)):
        for g, r, d in ((1, 0, 0), (2, 1, 0), (1, 1, 2), (2, 4, 0)):
            plan = Plan(Method.HEADWISE, PhasePlan(g, 1024), PhasePlan(g, 1), r, d)
            step = build(MODEL, WORK, plan, prefill=False, decode=range(1))
            layout = phase_layout(MODEL, layer_classes(MODEL, r, d), g)
            assert decode_host_seconds(MODEL, WORK, hw, layout, g) == pytest.approx(host_step_s(step, hw, False),
                                                                                    rel=1e-12)


@pytest.mark.parametrize("objective", ["total", "decode", "ttft"])
def test_eager_lower_bound_holds(objective):
    """Catches unsound pruning of eager twins: their bound (lanes, the host issuing every decode
    stage, the replayed twin's simulated first token) never exceeds the simulated value."""
    for hw in (_hw(), _hw(graph_replay_s=0.05), _hw(host_issue_s_per_stage=5e-3)):
        s = _Search(MODEL, WORK, hw, ROOMY)
        for resident in (0, 2, 4):
            plan = _plan(Replay.ON, resident)
            twin = plan.with_(replay=Replay.OFF)
            replayed = simulate(MODEL, WORK, plan, hw, replay=True, fuse=s.fuses(plan))
            eager = simulate(MODEL, WORK, twin, hw, replay=False)
            bound = s.estimate(twin).lower_bound(objective, replayed.report.timing.ttft_s)
            assert bound <= objective_value(eager, objective) * (1 + 1e-9), (objective, hw.graph_replay_s, resident)


# ---- the plan field --------------------------------------------------------------------------

@pytest.mark.parametrize("choice, written", [(Replay.ON, True), (Replay.OFF, False), (Replay.AUTO, None)])
def test_plan_json_round_trips_its_replay_choice(choice, written):
    """Fault caught: --out dropping the replay choice (run would replay a plan chosen eager)."""
    plan = _plan(choice)
    obj = json.loads(json.dumps(plan.to_json(MODEL)))
    assert obj["schema"] == PLAN_SCHEMA and obj.get("replay") is written
    assert ("replay" in obj) is (choice is not Replay.AUTO)
    assert Plan.from_json(obj, MODEL) == plan


def test_a_plan_file_of_the_previous_schema_loads_with_no_replay_choice():
    """Fault caught: the schema bump refusing every plan file written before it."""
    old = {k: v for k, v in _plan().to_json(MODEL).items() if k != "replay"}
    old["schema"] = 2
    assert Plan.from_json(old, MODEL).replay is Replay.AUTO
    with pytest.raises(ValueError, match="plan.schema"):
        Plan.from_json({k: v for k, v in old.items() if k != "schema"}, MODEL)   # schema 1 still refused


@pytest.mark.parametrize("bad, needle", [({"replay": True, "disk": 2}, "plan.replay: true, but decode replay cannot run disk"),
                                         ({"replay": "yes"}, "plan.replay: expected true, false or null")])
def test_a_plan_file_whose_replay_cannot_be_honoured_is_refused_naming_the_field(bad, needle):
    """Fault caught: replay true on a plan with disk units (no graph can hold their reads), or a
    replay that is not a boolean, read without complaint."""
    obj = dict(_plan().to_json(MODEL), **bad)
    with pytest.raises(ValueError, match=needle):
        Plan.from_json(obj, MODEL)
    with pytest.raises(ValueError, match="replay: on, but decode replay cannot run disk"):
        _plan(Replay.ON, disk=2)
    assert _plan(Replay.ON).with_(disk=2).replay is Replay.AUTO   # a copy that gains disk units drops the choice


# ---- the command line ------------------------------------------------------------------------

def _kvpipe(*args):
    return subprocess.run([sys.executable, "-m", "kvpipe", *args], capture_output=True, text=True, timeout=600)


def test_plan_refuses_a_replay_true_plan_file_with_disk_units_on_one_line(tmp_path):
    """Fault caught: a hand-edited plan file asking to replay disk units predicted (or run) as if
    it could; `kvpipe plan --plan` must exit 2 with one line naming plan.replay."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dict(_plan().to_json(), replay=True, disk=3)))
    r = _kvpipe("plan", "--context", "16K", "--decode-tokens", "2", "--plan", str(path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "plan.replay" in r.stderr, r.stderr


def test_plan_replay_flag_pins_the_choice_in_the_json():
    """Fault caught: `kvpipe plan --replay` missing or not pinning: the plan and its runners-up
    in --json carry the pinned choice."""
    for flag, want in (("off", False), ("on", True)):
        r = _kvpipe("plan", "--context", "16K", "--decode-tokens", "2", "--replay", flag, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["plan"]["replay"] is want and all(a["plan"]["replay"] is want for a in out["alternatives"])


def test_run_refuses_a_replay_true_plan_file_on_the_cpu(tiny_config, tmp_path, capsys):
    """Fault caught: a plan file's replay true run eagerly without a word, or dying in the
    executor, where this run cannot capture decode (the CPU): one line naming plan.replay, exit 2."""
    from kvpipe.cli import main
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": PLAN_SCHEMA, "method": "headwise", "prefill": {"group": 1, "chunk": 32},
                                "decode": {"group": 1, "chunk": 1}, "resident": 0, "replay": True}))
    rc = main(["run", "--device", "cpu", "--no-progress", "--model", tiny_config, "--random-weights",
               "--context", "64", "--decode-tokens", "2", "--plan", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "plan.replay" in err, err


@pytest.mark.parametrize("flag, choice, told", [("auto", Replay.ON, Replay.ON), ("auto", Replay.OFF, Replay.OFF),
                                                ("auto", Replay.AUTO, Replay.AUTO), ("off", Replay.AUTO, Replay.OFF),
                                                ("on", Replay.ON, Replay.ON)])
def test_a_given_plan_carries_the_replay_the_executor_is_told(flag, choice, told):
    """Fault caught: the executor told to replay a plan that was chosen eager (or the reverse): a
    given plan's replay becomes, under the flag, the one the executor runs; `run` hands it
    `Plan.replay` and nothing else (test_run_hands_the_executor_the_plans_replay)."""
    from kvpipe.sim.decide import Target, apply_replay
    assert apply_replay(MODEL, WORK, _plan(choice), Replay.parse(flag), Target("cuda")).replay is told


def test_run_hands_the_executor_the_plans_replay(tiny_config, tmp_path, monkeypatch):
    """Fault caught: `kvpipe run` choosing the executor's replay again (the flag passed on instead of
    the plan's choice): run_graph receives the decided plan's `replay`, a Replay, as it is."""
    import kvpipe
    from kvpipe.executor.engine import session
    seen = []

    def record(graph, *args, replay, **kw):
        seen.append((graph.plan.replay, replay))
        raise KeyboardInterrupt("stop")
    monkeypatch.setattr(session, "run_graph", record)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"schema": PLAN_SCHEMA, "method": "headwise", "prefill": {"group": 1, "chunk": 32},
                                "decode": {"group": 1, "chunk": 1}, "resident": 0, "replay": False}))
    for kw in (dict(plan=str(path)), dict(replay="off"), dict()):
        with pytest.raises(KeyboardInterrupt):
            kvpipe.run(model=tiny_config, random_weights=True, device="cpu", context=64, decode_tokens=2, **kw)
    assert len(seen) == 3 and all(told is plan for plan, told in seen) and Replay.ON not in [t for _, t in seen]
