"""The planner and the executor agree on which decodes are replayed as CUDA graphs: for every
dtype, batch, head dim (256, the kernel's bound, among them) and plan kind, the decode the planner
predicts replayed (and simulates so) is the one `kvpipe run --replay auto` replays on a CUDA GPU,
and the reverse. Asked of each side's public decision, not of a shared helper, so the test holds
whichever function the rule lives in. CPU only: the executor's choice needs no GPU to be asked."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from kvpipe.executor.engine import runner  # noqa: E402
from kvpipe.pipeline.builder import build  # noqa: E402
from kvpipe.pipeline.lossy import LossySpec  # noqa: E402
from kvpipe.pipeline.model import ModelSpec  # noqa: E402
from kvpipe.pipeline.plan import Method, PhasePlan, Plan, decode_replayed  # noqa: E402
from kvpipe.pipeline.workload import Workload  # noqa: E402
from kvpipe.sim.planner import _Search  # noqa: E402

TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROOMY = {"gpu": 2**40, "host": 2**40, "disk": 2**40}
H2D = (("h2d", "nvcomp-ans-planes"), ("d2h", "none"), ("disk", "none"))


def _plans() -> dict[str, Plan]:
    base = Plan(Method.HEADWISE, PhasePlan(1, 32), PhasePlan(1, 1), 0)
    coded = base.with_(prefill=replace(base.prefill, codecs=H2D), decode=replace(base.decode, codecs=H2D))
    return {"plain": base, "disk": base.with_(disk=2), "int4 alone": base.with_(lossy=LossySpec("int4")),
            "sparse": base.with_(lossy=LossySpec(sparse=0.2)), "h2d codec": coded}


def _executor_replays(graph, dtype: torch.dtype) -> bool:
    """Whether `execute(graph, ..., replay="auto")` on a CUDA device replays the decode steps
    (before the store opens; a sparse run may still fall back then, and says so)."""
    cuda = torch.device("cuda")
    return runner.decode_mode(graph, "auto", cuda, dtype).value == "on"


SHAPES = list(itertools.product(("bf16", "fp16", "fp32"), (1, 2), (64, 128, 256, 264, 60, 512), (0, 2)))


@pytest.mark.parametrize("dtype, batch, head_dim, decode", SHAPES)
def test_predicted_replayed_exactly_where_the_executor_replays(dtype, batch, head_dim, decode):
    """Fault caught: the executor's and the planner's rule for what can be replayed disagreeing
    (e.g. head dim 256 predicted replayed and run eagerly: the prediction then describes another
    run than the one measured), for any dtype, batch, head dim and plan kind."""
    spec = ModelSpec("rule", "llama", 2, 4 * head_dim, 4, 2, head_dim, 512, 256, dtype)
    work = Workload(64, decode, batch)
    search = _Search(spec, work, None, ROOMY)
    for name, plan in _plans().items():
        graph = build(spec, work, plan)
        ran = _executor_replays(graph, TORCH[dtype])
        assert decode_replayed(spec, work, plan) is ran, (name, dtype, batch, head_dim, decode)
        assert search.can_replay(plan) is ran, name          # what the search offers the run


def test_head_dim_256_is_replayed_by_both():
    """The boundary itself: FA2's varlen decode takes head dims up to 256, so a bf16 batch-1
    decode of head dim 256 is replayed by the run and predicted so; 264 by neither."""
    for head_dim, want in ((256, True), (264, False)):
        spec = ModelSpec("rule", "llama", 2, 4 * head_dim, 4, 2, head_dim, 512, 256, "bf16")
        work = Workload(64, 2, 1)
        plan = _plans()["plain"]
        assert _executor_replays(build(spec, work, plan), torch.bfloat16) is want
        assert decode_replayed(spec, work, plan) is want
