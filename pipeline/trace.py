"""Timelines of stages (simulated or measured) and their Chrome trace-event JSON form, which opens
in Perfetto with one track per lane; sim and real traces can share a file as two processes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .stage import Graph, Lane, Phase

_LANE_TID = {lane: i for i, lane in enumerate(Lane)}


@dataclass(frozen=True, slots=True)
class Span:
    """One stage's interval on its lane, in seconds from the start of the run. `host_s` is the
    host time spent issuing the stage (measured runs only)."""

    stage: int
    start_s: float
    end_s: float
    host_s: float = 0.0


@dataclass
class Trace:
    """Spans of a graph's stages from one source ('sim' or 'real')."""

    graph: Graph
    source: str
    spans: list[Span] = field(default_factory=list)
    note: str = ""

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    def lane_busy_s(self) -> dict[str, dict[str, float]]:
        """Busy seconds per phase and lane: {'prefill': {'gpu': ..., ...}, 'decode': {...}}."""
        busy = {ph.value: {lane.value: 0.0 for lane in Lane} for ph in Phase}
        for sp in self.spans:
            st = self.graph.stages[sp.stage]
            busy[st.phase.value][st.lane.value] += sp.end_s - sp.start_s
        return busy

    def chrome_events(self, pid: int) -> list[dict]:
        events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"kvpipe {self.source}"}}]
        for lane, tid in _LANE_TID.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane.value}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for sp in self.spans:
            st = self.graph.stages[sp.stage]
            args = {"phase": st.phase.value, "step": st.step, "layer": st.layer, "group": st.group,
                    "tokens": list(st.tokens), "bytes": st.bytes, "flops": st.flops, "kind": st.kind.value}
            if sp.host_s:
                args["host_us"] = round(sp.host_s * 1e6, 3)
            events.append({"ph": "X", "name": st.name, "cat": st.kind.value, "pid": pid,
                           "tid": _LANE_TID[st.lane], "ts": sp.start_s * 1e6,
                           "dur": max(sp.end_s - sp.start_s, 0.0) * 1e6, "args": args})
        return events


def write_chrome(path: str | Path, *traces: Trace) -> None:
    """Write one Chrome trace-event file holding every trace as its own process."""
    events: list[dict] = []
    for pid, tr in enumerate(traces):
        events.extend(tr.chrome_events(pid))
    meta = {tr.source: tr.note for tr in traces if tr.note}
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}))
