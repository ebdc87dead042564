"""Runs repeated in one process, as a server or a measuring process makes them: each run starts
from what the runs before it left (the caching allocator, streams, torch's pinned blocks), and
must neither read it nor keep it."""
import pytest
import torch

from kvpipe.executor.engine.runner import execute
from kvpipe.executor.engine.session import output_digest
from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.workload import Workload


def _plan(resident: int, group: int = 1, chunk: int = 32) -> Plan:
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, 2), PhasePlan(group, 1, 2), resident, 0)


def _ids(spec, context: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, spec.vocab, (1, context), generator=torch.Generator().manual_seed(0)).to(device)


def test_a_resident_and_an_offloaded_run_in_one_process_agree(tiny_model):
    """Fault caught: a run reusing the previous run's KV or prompt, or not running the plan it was
    given: an all-resident and then an all-offloaded run of one workload on one model must give
    bitwise-equal outputs (placement never changes a bit), each with its prefill token and three
    decode tokens."""
    model = tiny_model("llama")
    spec = HFAdapter(model).spec()
    work, ids = Workload(64, 3, 1), _ids(spec, 64)
    resident = execute(build(spec, work, _plan(spec.units)), model, ids)
    offloaded = execute(build(spec, work, _plan(0)), model, ids)
    assert resident.tokens.shape == (1, 4)
    assert output_digest(resident) == output_digest(offloaded)
    assert torch.equal(resident.tokens, offloaded.tokens)


def _cuda_model(tiny_model, context: int):
    return tiny_model("llama", kv_heads=2, q_heads=4, head_dim=64, layers=2, dtype=torch.bfloat16, device="cuda",
                      hidden_size=256, intermediate_size=512, max_position_embeddings=context + 64)


@pytest.mark.gpu
def test_cuda_replayed_runs_one_after_another_agree(tiny_model):
    """Fault caught, on CUDA: a replayed resident run and the replayed offloaded run after it
    disagreeing (the second capture reading the first run's buffers), a decode that did not
    replay, or no allocator peak recorded."""
    model = _cuda_model(tiny_model, 8192)
    spec = HFAdapter(model).spec()
    work, ids = Workload(8192, 4, 1), _ids(spec, 8192, "cuda")
    a = execute(build(spec, work, _plan(spec.units, chunk=8192)), model, ids, replay="auto")
    b = execute(build(spec, work, _plan(0, chunk=8192)), model, ids, replay="auto")
    assert a.decode_issue == b.decode_issue == "graph"
    assert output_digest(a) == output_digest(b)
    assert a.peak_gpu_bytes > 0


@pytest.mark.gpu
def test_cuda_runs_in_one_process_leave_nothing_allocated(tiny_model):
    """Fault caught, on CUDA: a run leaving memory allocated after it ends (each run's new compute
    stream got a cuBLAS workspace that torch never freed: 64 MiB a run on the H200, so a process
    measuring many plans saw its later peaks ~1 GB above the plan's and ran out of memory).
    After a first run, four more runs of the same plan must leave memory_allocated where the
    first left it (a leak of one workspace per run would show as 4 x 32 MiB)."""
    model = _cuda_model(tiny_model, 4096)
    spec = HFAdapter(model).spec()
    work, ids = Workload(4096, 3, 1), _ids(spec, 4096, "cuda")
    graph = build(spec, work, _plan(0, chunk=4096))
    execute(graph, model, ids, replay="auto")
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()
    for _ in range(4):
        execute(graph, model, ids, replay="auto")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - after_one < 16 << 20, (after_one, torch.cuda.memory_allocated())
