"""Tests of analysis/timeline.py: PNGs for one trace and for an overlay of two, the zoom window,
and that importing the analysis package leaves matplotlib unloaded."""
import subprocess
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from kvpipe.analysis.timeline import TAG_COLORS, default_window, plot_timeline
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.engine import run

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@lru_cache(maxsize=None)
def sim_trace():
    """Llama-3-8B, 8K prompt in two chunks and 4 decode steps, every KV head streamed from host
    RAM one head group at a time, except the last layers' heads, which come from disk."""
    model, work = PRESETS["llama-3-8b"], Workload(8192, 4)
    plan = Plan(Method.HEADWISE, PhasePlan(1, 4096), PhasePlan(1, 1), resident=0, disk=32)
    trace, _ = run(build(model, work, plan), load_profile("rtx4090"))
    return trace


def colors_in(png: Path) -> set[tuple[int, int, int]]:
    from matplotlib.image import imread

    rgb = (imread(png)[:, :, :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(c) for c in rgb}


def rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def test_png_of_one_trace(tmp_path):
    """Fault caught: the timeline plot failing or drawing nothing for a single trace."""
    out = plot_timeline(tmp_path / "sim.png", sim_trace(), title="llama-3-8b 8K on rtx4090")
    assert out == tmp_path / "sim.png"
    assert out.read_bytes()[:8] == PNG_MAGIC
    seen = colors_in(out)
    for tag in ("qkv", "attn", "mlp", "kv_fetch", "kv_store", "kv_read", "kv_write"):
        assert rgb(TAG_COLORS[tag]) in seen, tag


def test_png_of_an_overlay(tmp_path):
    sim = sim_trace()
    real = replace(sim, source="real")       # stands in for a measured trace
    single = plot_timeline(tmp_path / "one.png", sim)
    both = plot_timeline(tmp_path / "both.png", sim, real, title="sim vs real")
    assert both.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread

    # Each lane gets a sub-row per trace, so the overlay is taller.
    assert imread(both).shape[0] > imread(single).shape[0]


def test_given_window(tmp_path):
    """Fault caught: an explicit zoom window ignored."""
    out = plot_timeline(tmp_path / "w.png", sim_trace(), window=(0.010, 0.020))
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="window"):
        plot_timeline(tmp_path / "bad.png", sim_trace(), window=(0.02, 0.01))
    with pytest.raises(ValueError, match="traces"):
        plot_timeline(tmp_path / "none.png")


def test_default_window_holds_decode_step_0_and_the_prefill_end():
    """Fault caught: the default window missing the prefill/decode boundary."""
    tr = sim_trace()
    t0, t1 = default_window(tr)
    stages = tr.graph.stages
    step0 = [sp for sp in tr.spans if stages[sp.stage].phase is Phase.DECODE and stages[sp.stage].step == 0]
    assert t1 == max(sp.end_s for sp in step0)
    ttft = max(sp.end_s for sp in tr.spans if stages[sp.stage].tag == "head"
               and stages[sp.stage].phase is Phase.PREFILL)
    assert 0 <= t0 < ttft < t1


def test_import_leaves_matplotlib_unloaded():
    """Fault caught: importing analysis pulling in matplotlib (slow start of `kvpipe plan`)."""
    code = "import sys, analysis, analysis.timeline; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env={"PYTHONPATH": str(ROOT), "PATH": ""})
