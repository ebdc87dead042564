"""executor/engine/lanes.py on CPU: which cross-lane waits a stage needs, that every stream wait targets
the dependency's END event (checked with recording fake streams and events: they record calls,
they do not stand in for anything measured), and the shuffled turn order that lets the CPU
executor explore many interleavings, with a proof that it catches a missing dependency."""

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.engine.lanes import STREAM_LANES, Lanes, cross_lane_waits
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build, build_lazily
from kvpipe.pipeline.model import ModelSpec
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Graph, Kind, Lane, Phase, Stage
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")

SPEC = ModelSpec("tiny", "llama", layers=3, hidden=64, q_heads=8, kv_heads=4, head_dim=16,
                 intermediate=96, vocab=128, dtype="fp32")


def headwise(group, chunk, depth, resident, decode_group=None, disk=0):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth), PhasePlan(decode_group or group, 1, depth),
                resident, disk)


def hand_graph() -> Graph:
    """Seven stages on three lanes, two of them with TWO dependencies on one other lane (listed
    earliest first, so "first" and "latest" differ)."""
    C, H, D = Kind.COMPUTE, Kind.H2D, Kind.D2H
    spec = [(C, ()), (H, ()), (H, ()), (C, (1, 2, 0)), (D, (3, 0)), (C, (1, 4, 2)), (H, (3, 5))]
    stages = [Stage(i, kind, f"s{i}", Phase.PREFILL, 0, 0, None, (0, 1), deps)
              for i, (kind, deps) in enumerate(spec)]
    return Graph(SPEC, Workload(4, 0), headwise(1, 4, 2, 0), stages)


# Hand-written: per stage, the latest dependency on each OTHER lane (same-lane ones are implied).
HAND_WAITS = [(), (), (), (2,), (3,), (2, 4), (5,)]


def test_cross_lane_waits_keep_the_latest_dep_per_other_lane_hand_graph():
    """Fault caught: keeping the FIRST dependency per other lane instead of the latest (the stage
    would run before the later fetch landed). No builder graph has two deps on one other lane
    for the executor's lanes yet; disk plans will."""
    assert cross_lane_waits(hand_graph()) == HAND_WAITS


def test_cross_lane_waits_on_a_disk_plan_graph():
    """A disk plan: kv_fetch depends on kv_write and kv_read, both on the disk lane."""
    g = build(SPEC, Workload(12, 3), headwise(1, 4, 2, 2, disk=5))
    waits = cross_lane_waits(g)
    two_on_one_lane = 0
    for s in g.stages:
        by_lane = {}
        for d in s.deps:
            if g.stages[d].lane is not s.lane:
                by_lane.setdefault(g.stages[d].lane, []).append(d)
        two_on_one_lane += any(len(ds) > 1 for ds in by_lane.values())
        assert waits[s.id] == tuple(sorted(max(ds) for ds in by_lane.values())), s.name
    assert two_on_one_lane > 0   # the graph really exercises the "latest" rule


def test_a_dependency_on_a_later_stage_is_an_error():
    """Fault caught: a bad graph checked by `assert` (gone under python -O, then a deadlock)."""
    g = hand_graph()
    g.stages[1] = Stage(1, Kind.H2D, "s1", Phase.PREFILL, 0, 0, None, (0, 1), (3,))
    with pytest.raises(ValueError, match="stage 1"):
        cross_lane_waits(g)


# ---- recording fake streams: the wait logic of the CUDA path, on CPU --------------------------
class FakeEvent:
    def __init__(self, n: int, stream):
        self.n, self.stream = n, stream

    def __repr__(self):
        return f"ev{self.n}@{self.stream}"


class RecordingStreams:
    """Same methods as lanes.CudaStreams; logs every call in order, with the current stream."""

    def __init__(self):
        self.log, self.current, self.streams = [], None, 0
        self.priority = {}   # stream -> the priority it was made with

    def new_stream(self, priority=0):
        self.streams += 1
        self.priority[f"stream{self.streams}"] = priority
        return f"stream{self.streams}"

    def record(self, stream):
        ev = FakeEvent(len(self.log), stream)
        self.log.append(("record", stream, ev))
        return ev

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def follow_current(self, stream):
        self.log.append(("follow", stream, None))

    def use(self, stream):
        """A reusable context (like torch.cuda.stream's) making `stream` current."""
        rec = self

        class Use:
            def __enter__(self):
                self.before, rec.current = rec.current, stream

            def __exit__(self, *exc):
                rec.current = self.before

        return Use()

    def protect(self, tensor, stream):
        self.log.append(("protect", stream, tensor))

    def synchronize(self):
        self.log.append(("sync", None, None))

    def seconds(self, base, event):
        return float(event.n - base.n)


def check_waits(graph: Graph, turns=None) -> None:
    rec = RecordingStreams()
    lanes = Lanes(torch.device("cpu"), streams=rec, turns=turns)

    def issue(s):
        rec.log.append(("issue", rec.current, s.id))

    with lanes:
        lanes.run(graph, issue)
    stream_of = {lane: f"stream{i + 1}" for i, lane in enumerate(STREAM_LANES)}   # made in this order
    log = rec.log
    base = log[1][2]
    assert log[0] == ("follow", stream_of[STREAM_LANES[0]], None) and log[1][0] == "record"
    at = {entry[2]: i for i, entry in enumerate(log) if entry[0] == "issue"}
    start, end = {}, {}
    for sid, i in at.items():   # the stage's start and end marks sit right around its issue
        assert log[i - 1][0] == "record" and log[i + 1][0] == "record", log[i - 1: i + 2]
        start[sid], end[sid] = log[i - 1][2], log[i + 1][2]
    starts = {id(ev) for ev in start.values()}
    for s in graph.stages:
        stream = stream_of[s.lane]
        assert log[at[s.id]][1] == stream, s.name          # issued with its lane's stream current
        assert start[s.id].stream == end[s.id].stream == stream
        # The waits this stage's stream makes right before its start mark.
        j = at[s.id] - 2
        waited = []
        while log[j][1] == stream and log[j][0] == "wait":
            waited.append(log[j][2])
            j -= 1
        # Expected, computed here: the latest dependency on every other lane.
        latest = {}
        for d in s.deps:
            lane = graph.stages[d].lane
            if lane is not s.lane:
                latest[lane] = max(latest.get(lane, -1), d)
        expect = sorted(latest.values())
        for ev in waited:
            assert id(ev) not in starts, f"{s.name} waits on a START event {ev}"
        got = sorted(next(d for d, e in end.items() if e is ev) for ev in waited if ev is not base)
        assert got == expect, (s.name, got, expect)
    for lane in STREAM_LANES:   # every stream waits on the base mark before any of its stages
        first = next((i for i, e in enumerate(log) if e[0] == "wait" and e[1] == stream_of[lane]), None)
        if any(s.lane is lane for s in graph.stages):
            assert log[first][2] is base


def test_every_cross_lane_wait_targets_the_dependency_end_event_hand_graph():
    """Fault caught: a stream waiting on the dependency's START event (the copy or kernel it
    depends on may still be running); only GPU timing could show it otherwise, and rarely."""
    check_waits(hand_graph())


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_every_cross_lane_wait_targets_the_dependency_end_event_builder_graph(seed):
    """The same check on a builder graph (fetches, write-backs, mixed groups), in fixed and shuffled
    turns."""
    g = build(SPEC, Workload(12, 3, 2), headwise(1, 5, 3, 2, decode_group=2))
    check_waits(g, None if seed is None else random.Random(seed))


# ---- shuffled turns ------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_shuffled_turns_keep_lane_order_and_dependencies(seed):
    """Whatever the turn order, a lane issues in its order and after every dependency."""
    g = build(SPEC, Workload(12, 4, 2), headwise(2, 5, 3, 1, decode_group=1))
    issued = []
    with Lanes(torch.device("cpu"), turns=random.Random(seed)) as lanes:
        lanes.run(g, lambda s: issued.append(s.id))
    assert_issue_order(g, issued)


def assert_issue_order(g, issued: list[int]) -> None:
    """Every stage issued once, each lane in its order, each stage after its dependencies."""
    pos = {sid: i for i, sid in enumerate(issued)}
    assert sorted(issued) == list(range(len(g.stages)))
    for order in g.lane_order().values():
        assert [pos[s.id] for s in order] == sorted(pos[s.id] for s in order)
    for s in g.stages:
        assert all(pos[d] < pos[s.id] for d in s.deps), s.name

@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_graph_built_as_it_runs_issues_every_stage_in_order_and_late(seed):
    """Fault caught: lanes that build a growing graph whole before issuing it (its steps' build
    again in front of the first token), or that lose or reorder the stages a growth adds (a lane
    whose actor stopped at the end of the first part, or issued a stage before its dependency).
    When a stage is issued the graph holds at most the steps up to the next one."""
    whole = build(SPEC, Workload(20, 4), headwise(2, 5, 3, 1, decode_group=1, disk=2))
    graph, more = build_lazily(SPEC, Workload(20, 4), headwise(2, 5, 3, 1, decode_group=1, disk=2))
    step_of = lambda s: s.step if s.phase is Phase.PREFILL else 4 + s.step   # noqa: E731  (4 chunks first)
    issued, ahead = [], []

    def issue(s: Stage) -> None:
        issued.append(s.id)
        ahead.append(max(step_of(t) for t in graph.stages[-1:]) - step_of(s))
    with Lanes(torch.device("cpu"), turns=random.Random(seed)) as lanes:
        spans = lanes.run(graph, issue, more=more)
    assert graph == whole and len(spans) == len(whole.stages)
    assert_issue_order(whole, issued)
    assert max(ahead) <= 1, max(ahead)


def test_shuffled_turns_give_many_interleavings():
    """Fault caught: a `turns` mode that does not change the order (the bitwise property would
    then still see only the one fixed interleaving)."""
    g = build(SPEC, Workload(12, 2), headwise(1, 4, 2, 0))
    orders = set()
    for seed in range(8):
        issued = []
        with Lanes(torch.device("cpu"), turns=random.Random(seed)) as lanes:
            lanes.run(g, lambda s: issued.append(s.id))
        orders.add(tuple(issued))
    assert len(orders) >= 6


def without_deps(graph: Graph, tag: str, on_tag: str) -> Graph:
    """The graph with every dependency of `tag` stages on `on_tag` stages removed."""
    st_ = graph.stages
    stages = [replace(s, deps=tuple(d for d in s.deps if not (s.tag == tag and st_[d].tag == on_tag)))
              for s in st_]
    return Graph(graph.model, graph.workload, graph.plan, stages, graph.static)


@pytest.mark.parametrize("tag,on_tag", [("attn", "kv_fetch"), ("kv_fetch", "attn")])
def test_shuffled_turns_expose_a_missing_dependency(tiny_model, tag, on_tag):
    """The shuffled mode bites: with attention no longer waiting for its fetch (or a fetch no
    longer waiting for the slot's last reader), some interleaving gives other bits than the
    all-resident run. (On this graph the fixed turn order misses the first fault: the h2d lane
    always runs ahead there.) The correct graph stays bitwise equal under the same seeds."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=2)
    spec = HFAdapter(model).spec()
    w, plan = Workload(20, 3), headwise(1, 6, 2, 2, decode_group=2)
    ids = torch.randint(0, spec.vocab, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = execute(build(spec, w, plan.with_(resident=spec.units)), model, ids, keep_logits=True)
    good, bad = build(spec, w, plan), without_deps(build(spec, w, plan), tag, on_tag)
    differs = []
    for seed in range(4):
        ok = execute(good, model, ids, keep_logits=True, turns=random.Random(seed))
        assert torch.equal(ok.step_logits, ref.step_logits), seed
        broken = execute(bad, model, ids, keep_logits=True, turns=random.Random(seed))
        differs.append(not torch.equal(broken.step_logits, ref.step_logits))
    assert any(differs), differs


def test_lanes_make_their_streams_with_the_lane_priorities():
    """Fault caught: Lanes.open making its streams without LANE_PRIORITY (every stream at the
    default), or with another lane's, so the H2D lane's UVA gathers do not outrank compute and
    compute does not outrank the upkeep stream (priority 0). The GPU test below checks that torch
    applies them."""
    rec = RecordingStreams()
    with Lanes(torch.device("cpu"), streams=rec) as lanes:
        got = {lane: rec.priority[lanes.streams[lane]] for lane in STREAM_LANES}
    assert got[Lane.H2D] < got[Lane.GPU] < 0   # CUDA: a lower value is the higher priority


@pytest.mark.gpu
def test_h2d_lane_stream_outranks_compute():
    """Fault caught: the lanes' streams made without their priorities (LANE_PRIORITY dropped, or
    torch's default stream priority taken), so a sparse step's UVA gathers on the H2D lane queue
    behind the score kernels beside them instead of taking freed SMs first."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with Lanes(torch.device("cuda")) as lanes:
        gpu, h2d = lanes.streams[Lane.GPU], lanes.streams[Lane.H2D]
        assert h2d.priority < gpu.priority   # CUDA: a lower value is the higher priority
