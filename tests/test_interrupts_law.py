"""executor/engine/interrupts.py from a user's program: a run takes SIGTERM (and, for a background
job, SIGINT) only while it runs; however the run ends (done, failed, terminated), the caller's own
handlers are back afterwards, the very objects it installed."""
import os
import signal

import pytest
import torch

import kvpipe
from kvpipe.executor.engine.interrupts import Terminated
from kvpipe.executor.engine.runner import execute
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def caller_handlers():
    """The handlers a user's program installed before calling kvpipe (restored after the test)."""
    seen = []

    def on_term(signum, frame):
        seen.append(signum)

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # as a shell starts a background job
    yield on_term, seen
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])


def _assert_restored(on_term) -> None:
    assert signal.getsignal(signal.SIGTERM) is on_term
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_kvpipe_run_gives_the_callers_sigterm_handler_back(tiny_config, caller_handlers):
    """Fault caught: the caller's SIGTERM handler not restored after a run (`kvpipe.run()` from a
    user's program would leave kvpipe's in place, and a later SIGTERM would raise in whatever
    code runs then instead of calling the program's handler). Nothing else inspects handlers."""
    on_term, seen = caller_handlers
    kvpipe.run(model=tiny_config, random_weights=True, device="cpu", progress=False, context=32,
               decode_tokens=2, chunk=16, resident="none", group=1, seed=1, disk_mem="1GiB")
    _assert_restored(on_term)
    os.kill(os.getpid(), signal.SIGTERM)           # the program's own handler runs again
    assert seen == [signal.SIGTERM]


def _graph(model):
    plan = Plan(Method.HEADWISE, PhasePlan(1, 16, 2), PhasePlan(1, 1, 2), 0, 0)
    return build(HFAdapter(model).spec(), Workload(32, 2), plan)


@pytest.mark.parametrize("ending", ["failed", "terminated"])
def test_a_run_that_does_not_finish_gives_the_handlers_back_too(tiny_model, caller_handlers, ending):
    """Fault caught: the handlers restored on the normal path only: a stage that fails, or a
    SIGTERM during the run (which must stop the run as Terminated, not call the caller's
    handler), leaves kvpipe's handlers installed."""
    on_term, seen = caller_handlers
    model = tiny_model("llama", kv_heads=2, q_heads=4, head_dim=16)
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))

    def hook(stage):
        if stage.id == 5:
            if ending == "failed":
                raise RuntimeError("a stage failed")
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(RuntimeError if ending == "failed" else Terminated):
        execute(_graph(model), model, ids, stage_hook=hook)
    assert seen == []                              # the run took the SIGTERM, not the program
    _assert_restored(on_term)
