"""benchmarks/replay_kernels.py's reading of a profiler trace, on a trace written here by hand."""
from __future__ import annotations

from benchmarks.replay_kernels import aggregate, model_config, per_replay


def _k(name, ts, dur, corr, stream=7, cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr, "stream": stream}}


def test_kernels_are_grouped_by_their_graph_launch_and_averaged_over_the_last_steps():
    # Faults caught: a kernel counted in a replay it was not launched by (kernels of eager launches,
    # whose correlation ids match no cudaGraphLaunch, or of another launch), a replay's kernels out
    # of start order, device copies left out, the mean taken over all steps instead of the last 3,
    # calls summed instead of averaged per step. Expected figures by hand.
    launches = [{"name": "cudaGraphLaunch", "ts": 10.0 * i, "args": {"correlation": 100 + i}} for i in range(4)]
    events = launches + [
        _k("eager_kernel", 1, 5, 999),                                   # no graph launch: not counted
        _k("a", 3, 2, 100), _k("b", 1, 4, 100),                          # step 0 (left out of the mean)
        _k("a", 11, 3, 101), _k("copy", 12, 1, 101, cat="gpu_memcpy"),
        _k("a", 21, 6, 102), _k("a", 25, 3, 102),
        _k("b", 33, 9, 103), _k("a", 31, 3, 103),
    ]
    steps = per_replay(events)
    assert [[e["name"] for e in s] for s in steps] == [["b", "a"], ["a", "copy"], ["a", "a"], ["a", "b"]]
    agg = {(n, st): (c, us) for n, st, c, us in aggregate(steps)}
    # last 3 steps: a = 3 + (6 + 3) + 3 = 15 us over 4 calls, b = 9 us, copy = 1 us; per step / 3
    assert agg == {("a", 7): (1.33, 5.0), ("b", 7): (0.33, 3.0), ("copy", 7): (0.33, 0.3)}


def test_the_model_config_keeps_llama_3_8b_layer_shapes():
    # Fault caught: the cut model's layer shapes drifting from the preset it stands for (the
    # per-layer costs measured would then be another model's).
    from kvpipe.pipeline.model import PRESETS, from_hf_config
    m, ref = from_hf_config(model_config(4)), PRESETS["llama-3-8b"]
    assert m.layers == 4
    for f in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        assert getattr(m, f) == getattr(ref, f), f
