"""One replay rule for both backends (pipeline/replay.py): the planner predicts decode replayed
exactly where the executor replays it, and a plan the executor cannot replay is never handed to
it as replayed. CPU only: the executor's choice (`runner.decode_mode`) needs no GPU to be asked."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from kvpipe.executor.engine import runner  # noqa: E402
from kvpipe.pipeline import replay as rule  # noqa: E402
from kvpipe.pipeline.builder import build  # noqa: E402
from kvpipe.pipeline.lossy import LossySpec  # noqa: E402
from kvpipe.pipeline.model import ModelSpec  # noqa: E402
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, decode_replayed  # noqa: E402
from kvpipe.pipeline.replay import Replay  # noqa: E402
from kvpipe.pipeline.workload import Workload  # noqa: E402
from kvpipe.sim import planner, space  # noqa: E402
from kvpipe.sim.planner import _Search  # noqa: E402

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROOMY = {"gpu": 2**40, "host": 2**40, "disk": 2**40}
H2D = (("h2d", "nvcomp-ans-planes"), ("d2h", "none"), ("disk", "none"))


def _plans():
    base = Plan(Method.HEADWISE, PhasePlan(1, 32), PhasePlan(1, 1), 0)
    coded = base.with_(prefill=replace(base.prefill, codecs=H2D), decode=replace(base.decode, codecs=H2D))
    return {"plain": base, "disk": base.with_(disk=2), "int4 alone": base.with_(lossy=LossySpec("int4")),
            "sparse": base.with_(lossy=LossySpec(sparse=0.2)), "h2d codec": coded}


def test_the_executor_and_the_planner_import_the_one_rule():
    """Fault caught: a second copy of the replay rule (the executor's own check beside the
    planner's, which drift apart: a decode predicted replayed and then run eagerly)."""
    assert runner.blocker is rule.blocker and runner.resolve is rule.resolve
    assert planner.blocker is rule.blocker and space.blocker is rule.blocker
    from kvpipe.executor.replay import capture
    assert not [n for n in vars(capture) if "supported" in n or n == "resolve_mode"]


@pytest.mark.parametrize("dtype, batch, head_dim, decode",
                         list(itertools.product(("bf16", "fp16", "fp32"), (1, 2), (64, 128, 256, 264, 60), (0, 2))))
def test_predicted_replayed_exactly_where_the_executor_replays(dtype, batch, head_dim, decode):
    """Fault caught: the planner predicting a decode replayed that the executor runs eagerly, or the
    reverse (e.g. head dim 256 judged one way by the simulator and another by the run), for every
    dtype, batch, head dim and plan kind; and --replay on accepted by the planner where the
    executor refuses it."""
    spec = ModelSpec("rule", "llama", 2, 4 * head_dim, 4, 2, head_dim, 512, 256, dtype)
    work = Workload(64, decode, batch)
    search = _Search(spec, work, None, ROOMY)
    cuda = torch.device("cuda")
    for name, plan in _plans().items():
        graph = build(spec, work, plan)
        ran = runner.decode_mode(graph, Replay.AUTO, cuda, TORCH[dtype])
        assert (ran is Replay.ON) is decode_replayed(spec, work, plan), (name, dtype, batch, head_dim)
        assert search.can_replay(plan) is (ran is Replay.ON), name
        if search.can_replay(plan):
            assert runner.decode_mode(graph, Replay.ON, cuda, TORCH[dtype]) is Replay.ON
        elif decode:
            with pytest.raises(ValueError, match="^replay: "):
                runner.decode_mode(graph, Replay.ON, cuda, TORCH[dtype])
        assert runner.decode_mode(graph, Replay.AUTO, torch.device("cpu"), TORCH[dtype]) is Replay.OFF
        assert not decode_replayed(spec, work, plan, "cpu")


def test_head_dim_256_replays_and_264_does_not():
    """Fault caught: the bound of the decode kernel's head dim moved in one backend only."""
    assert rule.shape_blocker("bf16", 1, 256) is None
    assert "head dim" in rule.shape_blocker("bf16", 1, 264)


def test_replay_has_one_spelling_and_no_truth_value():
    """Fault caught: a replay written as a bool (`if plan.replay:` reads every member as true) or
    an unknown name accepted."""
    assert [Replay.parse(n) for n in ("auto", "ON", " off ", None)] == [Replay.AUTO, Replay.ON, Replay.OFF, Replay.AUTO]
    with pytest.raises(ValueError, match="^replay: expected one of auto, on, off"):
        Replay.parse("issue")
    with pytest.raises(TypeError):
        bool(Replay.OFF)
    with pytest.raises(ValueError, match="^replay: must be"):
        Plan(Method.HEADWISE, PhasePlan(1, 32), PhasePlan(1, 1), 0, replay=True)
    assert [Replay.from_json(v).to_json() for v in (True, False, None)] == [True, False, None]
