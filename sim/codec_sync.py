"""Where a GPU codec's decode call synchronises with copies in flight: when the profile says a
codec's decode starts only after the host -> device copies issued before it (on other streams)
have ended (`[codec.<name>] decompress_waits_h2d`, measured by `kvpipe calibrate`), each of its
`gpu_decompress` stages waits for the last `kv_fetch` the executor has issued by then.

Which fetch that is follows from how the executor issues (executor/engine/lanes.py): each lane's actor
issues its stages in order, a stage as soon as its dependencies are issued, and the actors take
turns stage by stage. So when the gpu lane issues a decompress, the h2d lane has issued every
fetch whose dependencies (on the gpu lane: stages before the decompress) are issued: with
`depth` slots, the fetches of the next `depth - 1` head groups, which the graph means to overlap
with this decode. The wait points forward in issue order, so it is not a graph dependency (the
executor could not wait on it); the event simulation honours it."""
from __future__ import annotations

from kvpipe.pipeline.hardware import HardwareProfile
from kvpipe.pipeline.stage import Graph, Kind, Lane


def decompress_waits(graph: Graph, hw: HardwareProfile) -> dict[int, int]:
    """{gpu_decompress stage id: the h2d stage it must wait for} for the codecs whose decode
    waits for in-flight H2D copies; empty when none does."""
    waiting = {c.name for c in hw.codecs if c.decompress_waits_h2d}
    decodes = [s for s in graph.stages if s.kind is Kind.GPU_DECOMPRESS and s.codec in waiting]
    if not decodes:
        return {}
    order = graph.lane_order()
    lanes = [lane for lane in Lane if lane is not Lane.GPU]
    where = {s.id: k for lane in lanes for k, s in enumerate(order[lane])}
    issued = {lane: 0 for lane in lanes}     # how many of each lane's stages are issued (a prefix)
    stages = graph.stages

    def ready(s, before: int) -> bool:
        for d in s.deps:
            lane = stages[d].lane
            if lane is Lane.GPU:
                if d >= before:
                    return False
            elif where[d] >= issued[lane]:
                return False
        return True

    out: dict[int, int] = {}
    for dec in decodes:      # in issue order: the issued prefixes only grow
        moved = True
        while moved:
            moved = False
            for lane in lanes:
                seq = order[lane]
                while issued[lane] < len(seq) and ready(seq[issued[lane]], dec.id):
                    issued[lane] += 1
                    moved = True
        if issued[Lane.H2D]:
            last = order[Lane.H2D][issued[Lane.H2D] - 1]
            if last.id not in dec.deps:
                out[dec.id] = last.id
    return out
