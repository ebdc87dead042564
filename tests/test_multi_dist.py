"""Tensor-parallel ranks by KV heads on torch.distributed with gloo on CPU (executor/dist/): with
a given layout offloaded == resident bit for bit on every rank, the ranks agree, greedy tokens
equal one process's; a killed rank ends the run on every rank within seconds, naming it."""
import glob
import os
import re
import signal
import tempfile
import time

import pytest
import torch

from kvpipe.executor.dist.launch import RankFailed, launch
from kvpipe.executor.dist.rank import RankJob
from kvpipe.executor.engine.runner import execute
from kvpipe.executor.engine.session import prompt_tensor
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.layers.loader import random_model
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload

CFG = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096,
           initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False)
WORK = Workload(64, 4, 1)
SEED = 3
START = "fork"   # the test process has torch imported and no threads started: no import per rank


def _plans(tp: int, group: int = 1) -> tuple[Plan, ...]:
    units = CFG["num_hidden_layers"] * CFG["num_key_value_heads"] // tp
    return tuple(Plan(Method.HEADWISE, PhasePlan(group, 16), PhasePlan(group, 1), resident=r) for r in (0, units))


@pytest.fixture(scope="module")
def ranks():
    """tp -> each rank's results of the offloaded and the resident plan."""
    random_model(CFG, "cpu", torch.float32, SEED)   # transformers' modules imported before the fork
    return {tp: launch(RankJob(CFG, "fp32", WORK, _plans(tp), seed=SEED, threads=1), tp, start=START)
            for tp in (2, 4)}


@pytest.mark.parametrize("tp", [2, 4])
def test_offloaded_equals_resident_on_every_rank(ranks, tp):
    """Fault: a rank's offloaded heads read another rank's slice or a stale slot (digest differs
    from the resident run), or a rank skips an all-reduce (the ranks' outputs disagree)."""
    digests = {run["digest"] for r in ranks[tp] for run in r["runs"]}
    assert len(digests) == 1, digests   # bit for bit: placement and rank change no bit
    offloaded, resident = ranks[tp][0]["runs"]
    assert offloaded["resident"] == 0 and resident["resident"] == 2 * 4 // tp


def test_tokens_equal_one_process(ranks):
    """Fault: the shard takes the wrong rows or columns of a projection (another head's queries,
    the MLP's other half), so the tensor-parallel model is not the same model."""
    full = random_model(CFG, "cpu", torch.float32, SEED)
    spec = HFAdapter(full).spec()
    ids = prompt_tensor(None, WORK.batch, WORK.context, spec.vocab, SEED)
    ref = execute(build(spec, WORK, Plan(Method.HEADWISE, PhasePlan(1, 16), PhasePlan(1, 1), resident=spec.units)),
                  full, ids, "cpu")
    for tp in (2, 4):
        assert ranks[tp][0]["runs"][0]["tokens"] == ref.tokens.tolist(), tp


def test_killed_rank_ends_every_rank(tmp_path):
    """Fault: the launcher lets the run end without an error (a dead rank unnoticed), names the
    wrong rank, or leaves the ranks' folder (KV files) behind."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvpipe-ranks-*")))
    killed = {}

    def kill_rank1(line: str) -> None:
        pids = [int(p) for p in re.findall(r"\d+", line.split("pids", 1)[1])]
        os.kill(pids[1], signal.SIGKILL)
        killed["at"] = time.monotonic()

    long = Workload(1024, 400, 1)   # longer than the test waits: the kill lands mid-run
    job = RankJob(CFG, "fp32", long, _plans(2)[:1], seed=SEED, threads=1)
    with pytest.raises(RankFailed) as err:
        launch(job, 2, announce=kill_rank1, start=START)
    assert time.monotonic() - killed["at"] < 10
    assert str(err.value) == "rank 1 was killed by SIGKILL; the run was ended on every rank"
    assert err.value.rank == 1
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvpipe-ranks-*"))) == before
