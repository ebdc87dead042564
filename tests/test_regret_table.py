"""benchmarks/regret_table.current_picks: today's planner picks found among saved measurements."""
from benchmarks.regret_table import current_picks


def _plan(group, replay=None):
    return {"method": "headwise", "prefill": {"group": group, "chunk": 4096}, "decode": {"group": group, "chunk": 1},
            "resident": 0, "disk": 0, "replay": replay}


def _saved(rows):
    return {"objective": "total", "model": "m", "gpu_budget": "24GB", "workloads": {"128K": {"rows": rows}}}


def test_the_pick_is_matched_by_knobs_and_decode_mode():
    """Faults caught: matching a pick that chose eager decode to the replayed measurement of the
    same knobs (or the other way round), and judging it against anything but the best measured."""
    rows = [{"rank": 0, "label": "planner pick", "replay": "auto", "plan": _plan(4), "measured": {"total_s": 11.0}},
            {"rank": 1, "label": "group 8", "replay": "auto", "plan": _plan(8), "measured": {"total_s": 10.0}},
            {"rank": 2, "label": "replay off", "replay": "off", "plan": _plan(4), "measured": {"total_s": 10.2}}]
    eager_pick = {"workloads": {"128K": {"rows": [{"plan": _plan(4, replay=False), "replay": "off"}]}}}
    line, = current_picks([_saved(rows)], eager_pick)
    assert "'replay off'" in line and "+2.0%" in line and "within 5%" in line
    replayed_pick = {"workloads": {"128K": {"rows": [{"plan": _plan(4, replay=True), "replay": "auto"}]}}}
    line, = current_picks([_saved(rows)], replayed_pick)
    assert "'planner pick'" in line and "+10.0%" in line and "MISSES" in line
    by_plan = [rows[0], {"rank": 1, "label": "eager plan", "replay": "auto", "plan": _plan(4, replay=False),
                         "measured": {"total_s": 10.5}}]   # run --replay auto executes the plan's eager choice
    line, = current_picks([_saved(by_plan)], eager_pick)
    assert "'eager plan'" in line and "+0.0%" in line
    unmeasured = {"workloads": {"128K": {"rows": [{"plan": _plan(2), "replay": "auto"}]}}}
    line, = current_picks([_saved(rows)], unmeasured)
    assert "not measured" in line
