"""Timeline plot of one or two traces: lanes as rows, one bar per stage span colored by its tag,
so the next head group's H2D fetch shows directly below the attention it runs under. An overview
of the whole run (busy share per time bin) sits above a zoomed panel; two traces (sim and real)
are overlaid with one sub-row per trace in every lane. matplotlib is imported only when drawing."""
from __future__ import annotations

import math
from pathlib import Path

from kvpipe.pipeline.stage import Lane, Phase
from kvpipe.pipeline.trace import Trace

LANES = (Lane.GPU, Lane.H2D, Lane.D2H, Lane.DISK, Lane.CPU)   # top to bottom
TAG_COLORS = {
    "embed": "#9e9e9e", "qkv": "#4c72b0", "attn": "#c44e52", "mlp": "#55a868", "head": "#8172b3",
    "kv_fetch": "#ee8a2f", "kv_store": "#8c6d46", "kv_read": "#d97fc0", "kv_write": "#b5a531",
}
OTHER_COLOR = "#5f5f5f"
PANEL_PX = 1600      # pixels across a panel; spans narrower than one are merged and widened to one
SUBROW = 0.8         # bar height of a sub-row (the rest is the gap)
OVERVIEW_BIN_PX = 5  # pixels per time bin of the overview


def _lane_spans(tr: Trace) -> dict[Lane, dict[str, list[tuple[float, float]]]]:
    """lane -> tag -> [(start_s, end_s)] in issue order."""
    out: dict[Lane, dict[str, list[tuple[float, float]]]] = {}
    stages = tr.graph.stages
    for sp in tr.spans:
        st = stages[sp.stage]
        out.setdefault(st.lane, {}).setdefault(st.tag, []).append((sp.start_s, sp.end_s))
    return out


def default_window(tr: Trace) -> tuple[float, float]:
    """Seconds to zoom on: decode step 0 plus the end of the prefill before it (half as long as
    the step); without decode steps, the last prefill step."""
    stages = tr.graph.stages
    ttft = 0.0
    step0: list[tuple[float, float]] = []
    last_step = max((stages[sp.stage].step for sp in tr.spans
                     if stages[sp.stage].phase is Phase.PREFILL), default=0)
    last: list[tuple[float, float]] = []
    for sp in tr.spans:
        st = stages[sp.stage]
        if st.phase is Phase.PREFILL:
            if st.tag == "head":
                ttft = sp.end_s
            if st.step == last_step:
                last.append((sp.start_s, sp.end_s))
        elif st.step == 0:
            step0.append((sp.start_s, sp.end_s))
    chosen = step0 or last
    if not chosen:
        return 0.0, max(tr.end_s, 1e-9)
    end = max(e for _, e in chosen)
    if step0:
        return max(0.0, ttft - 0.5 * (end - ttft)), end
    return min(s for s, _ in chosen), end


def _bars(spans: list[tuple[float, float]], t0: float, t1: float, px: float):
    """(starts, widths) of the spans inside [t0, t1], clipped; runs of spans narrower than `px`
    with gaps under `px` are merged into one bar, and every bar is at least `px` wide."""
    import numpy as np

    a = np.asarray(spans, dtype=float).reshape(-1, 2)
    a = a[(a[:, 1] >= t0) & (a[:, 0] <= t1)]
    if not len(a):
        return a[:, 0], a[:, 0]
    a = a[np.argsort(a[:, 0], kind="stable")]
    s, e = np.clip(a[:, 0], t0, t1), np.clip(a[:, 1], t0, t1)
    narrow = (e - s) < px
    reach = np.maximum.accumulate(e)
    # A new bar starts where the gap to everything before is >= px, or either side is wide.
    new = np.ones(len(s), dtype=bool)
    new[1:] = (s[1:] - reach[:-1] >= px) | ~narrow[1:] | ~narrow[:-1]
    idx = np.flatnonzero(new)
    starts = s[idx]
    ends = np.maximum.reduceat(e, idx)
    return starts, np.maximum(ends - starts, px)


def _ms_formatter(width_s: float):
    from matplotlib.ticker import FuncFormatter

    digits = max(0, 2 - math.floor(math.log10(max(width_s * 1e3, 1e-9))))
    return FuncFormatter(lambda v, _pos: f"{v:,.{digits}f}")


def _busy_fraction(spans: list[tuple[float, float]], edges):
    """Fraction of each bin between consecutive `edges` covered by `spans` (which, being on one
    lane, do not overlap)."""
    import numpy as np

    a = np.asarray(spans, dtype=float).reshape(-1, 2)
    a = a[np.argsort(a[:, 0], kind="stable")]
    s, e = a[:, 0], a[:, 1]
    cum = np.concatenate(([0.0], np.cumsum(e - s)))
    k = np.searchsorted(s, edges, side="right")          # spans started by each edge
    prev_end = np.where(k > 0, e[np.maximum(k - 1, 0)], 0.0)
    busy = cum[k] - np.maximum(prev_end - edges, 0.0)     # busy seconds up to each edge
    return np.clip(np.diff(busy) / np.diff(edges), 0.0, 1.0)


def _style(ax, rows, t0: float, t1: float) -> None:
    n = len(rows)
    ax.set_xlim(t0 * 1e3, t1 * 1e3)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)], [label for label, _ in rows])
    ax.tick_params(axis="y", length=0)
    ax.xaxis.set_major_formatter(_ms_formatter(t1 - t0))
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)


def _draw_overview(ax, rows, end: float) -> set[str]:
    """Per row, the busy fraction of each time bin as stacked tag colors (height = fraction)."""
    import numpy as np

    edges = np.linspace(0.0, end, PANEL_PX // OVERVIEW_BIN_PX + 1)
    x = np.repeat(edges * 1e3, 2)[1:-1]                   # step outline of the bins
    tags, n = set(), len(rows)
    for i, (_label, by_tag) in enumerate(rows):
        base = np.full(len(edges) - 1, n - 1 - i + (1 - SUBROW) / 2)
        for tag in [t for t in TAG_COLORS if t in by_tag] + sorted(set(by_tag) - set(TAG_COLORS)):
            frac = _busy_fraction(by_tag[tag], edges) * SUBROW
            if not frac.any():
                continue
            tags.add(tag)
            ax.fill_between(x, np.repeat(base, 2), np.repeat(base + frac, 2),
                            color=TAG_COLORS.get(tag, OTHER_COLOR), linewidth=0)
            base = base + frac
    _style(ax, rows, 0.0, end)
    return tags


def _draw_zoom(ax, rows, t0: float, t1: float) -> set[str]:
    """One bar per span over [t0, t1]; bars wider than a few pixels get a white edge so that
    back-to-back stages stay apart."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    px = (t1 - t0) / PANEL_PX
    boxes: dict[bool, list] = {True: [], False: []}
    colors: dict[bool, list] = {True: [], False: []}
    tags, n = set(), len(rows)
    for i, (_label, by_tag) in enumerate(rows):
        y0 = n - 1 - i + (1 - SUBROW) / 2
        for tag, spans in by_tag.items():
            starts, widths = _bars(spans, t0, t1, px)
            if not len(starts):
                continue
            tags.add(tag)
            box = np.empty((len(starts), 4, 2))
            box[:, 0, 0] = box[:, 1, 0] = starts * 1e3
            box[:, 2, 0] = box[:, 3, 0] = (starts + widths) * 1e3
            box[:, 0, 1] = box[:, 3, 1] = y0
            box[:, 1, 1] = box[:, 2, 1] = y0 + SUBROW
            wide = widths >= 4 * px
            for flag in (True, False):
                sel = box[wide == flag]
                boxes[flag].append(sel)
                colors[flag].extend([TAG_COLORS.get(tag, OTHER_COLOR)] * len(sel))
    for wide in (False, True):
        if colors[wide]:
            ax.add_collection(PolyCollection(np.concatenate(boxes[wide]), facecolors=colors[wide],
                                             edgecolors="white" if wide else "face",
                                             linewidths=0.5 if wide else 0.0))
    _style(ax, rows, t0, t1)
    return tags


def plot_timeline(path: str | Path, *traces: Trace, title: str = "",
                  window: tuple[float, float] | None = None) -> Path:
    """Write a PNG of `traces` (one, or sim and real to overlay) to `path`: an overview of the
    whole run above a zoomed panel over `window` (seconds; default: the end of the prefill and
    decode step 0 of the first trace). Returns the path."""
    if not traces:
        raise ValueError("traces: give at least one trace to plot")
    if window is not None and not (len(window) == 2 and window[0] < window[1]):
        raise ValueError(f"window: need (t0, t1) seconds with t0 < t1, got {window!r}")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    per_trace = [_lane_spans(tr) for tr in traces]
    names = [tr.source for tr in traces]
    if len(set(names)) < len(names):
        names = [f"{name} {i + 1}" for i, name in enumerate(names)]
    rows = [(f"{lane.value} · {name}" if len(traces) > 1 else lane.value, spans.get(lane, {}))
            for lane in LANES if any(lane in spans for spans in per_trace)
            for name, spans in zip(names, per_trace)]
    end = max(tr.end_s for tr in traces) or 1e-9
    t0, t1 = window if window is not None else default_window(traces[0])
    what = "window" if window is not None else "zoom: end of prefill + decode step 0"

    height = 0.32 * len(rows) + 1.1
    fig = Figure(figsize=(PANEL_PX / 100, 2 * height + 1.0), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1)
    tags = _draw_overview(top, rows, end)
    top.axvspan(t0 * 1e3, t1 * 1e3, color="#ffd54f", alpha=0.35, zorder=0)
    top.set_title(f"whole run ({end * 1e3:,.1f} ms), bar height = share of time busy; "
                  "shaded: the zoomed window", fontsize=10, loc="left")
    tags |= _draw_zoom(bottom, rows, t0, t1)
    bottom.set_title(f"{what} ({t0 * 1e3:,.3f}–{t1 * 1e3:,.3f} ms)", fontsize=10, loc="left")
    for ax in (top, bottom):
        lanes_drawn = len(rows) // len(traces)
        for k in range(1, lanes_drawn):       # separators between lanes
            ax.axhline(k * len(traces), color="#888888", linewidth=0.8)
    order = [t for t in TAG_COLORS if t in tags] + sorted(tags - set(TAG_COLORS))
    fig.legend(handles=[Patch(color=TAG_COLORS.get(t, OTHER_COLOR), label=t) for t in order],
               loc="outside upper right", ncols=len(order), fontsize=9, frameon=False)
    fig.suptitle(title or " / ".join(names), x=0.01, ha="left", fontsize=12)
    fig.savefig(path)
    return Path(path)
