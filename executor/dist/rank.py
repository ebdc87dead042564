"""What one rank does: join the process group (gloo on CPU, NCCL on CUDA, with a timeout so a
lost peer ends a collective instead of hanging it), build its shard of the model, run each plan
it was handed on its shard with the engine, and write what it measured to the run's folder."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.workload import Workload

COLLECTIVE_TIMEOUT_S = 60   # a collective waiting longer on a peer ends the rank


@dataclass(frozen=True)
class RankJob:
    """The same for every rank: the whole model's HF config, the plans (one rank's, the same on
    every rank: the ranks are symmetric), the workload and where to meet."""

    config: dict
    dtype: str                       # bf16 / fp16 / fp32
    work: Workload
    plans: tuple[Plan, ...]
    seed: int = 0
    device: str = "cpu"              # cpu or cuda (rank r on cuda:<local rank>)
    whole_weights: bool = True       # the whole seeded model sliced (exact against one process), else a seeded shard
    threads: int | None = None       # torch threads per rank on CPU
    prompt: tuple[int, ...] | None = None
    init_method: str = "env://"
    gpu_budget: int | None = None    # CUDA: the allocator's cap per GPU (bytes)


def _device(job: RankJob, local: int) -> torch.device:
    if job.device == "cuda":
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def rank_main(rank: int, world: int, job: RankJob, folder: str, local: int | None = None) -> None:
    """Rank `rank` of `world`: results in `folder`/rank-<r>.json, KV files under `folder`/kv-<r>."""
    from kvpipe.executor.engine.runner import execute
    from kvpipe.executor.engine.session import TORCH_DTYPES, output_digest, prompt_tensor, warm_up
    from kvpipe.executor.kv.layout import DiskOptions
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.layers.loader import random_model

    from .shard import Reduced, shard_config, shard_model
    if job.threads and job.device == "cpu":
        torch.set_num_threads(job.threads)
    dev = _device(job, rank if local is None else local)
    if dev.type == "cuda" and job.gpu_budget:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_budget / total), dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=job.init_method, rank=rank,
                            world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    reduce = lambda t: dist.all_reduce(t)   # noqa: E731  (sum; gloo's order is fixed by the layout)
    dtype = TORCH_DTYPES[job.dtype]
    if job.whole_weights:
        model = shard_model(random_model(job.config, dev, dtype, job.seed), job.config, rank, world, reduce)
    else:   # big shapes: only this rank's shard is ever built (its own seed)
        model = random_model(shard_config(job.config, world), dev, dtype, job.seed + rank)
        for layer in model.model.layers:
            layer.self_attn.o_proj = Reduced(layer.self_attn.o_proj, reduce)
            layer.mlp.down_proj = Reduced(layer.mlp.down_proj, reduce)
    spec = HFAdapter(model).spec()
    w = job.work
    ids = prompt_tensor(list(job.prompt) if job.prompt else None, w.batch, w.context, spec.vocab, job.seed)
    kv_dir = Path(folder) / f"kv-{rank}"
    kv_dir.mkdir(exist_ok=True)
    (Path(folder) / f"ready-{rank}").touch()
    dist.barrier()
    out = []
    for plan in job.plans:
        if dev.type == "cuda":   # untimed, as kvpipe run warms up
            warm_up(build(spec, w, plan), model, ids, dev, replay=plan.replay, disk=DiskOptions(str(kv_dir)))
        res = execute(build(spec, w, plan), model, ids, dev, replay=plan.replay, disk=DiskOptions(str(kv_dir)))
        t = _timing(res)
        out.append({"tokens": res.tokens.cpu().tolist(), "digest": output_digest(res), **t,
                    "peak_gpu_bytes": res.peak_gpu_bytes, "host_pinned_bytes": res.host_pinned_bytes,
                    "resident": plan.resident, "disk": plan.disk})
    dist.barrier()
    dist.destroy_process_group()
    tmp = Path(folder) / f"rank-{rank}.json.tmp"
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(), "runs": out}))
    tmp.rename(Path(folder) / f"rank-{rank}.json")


def _timing(res) -> dict:
    from kvpipe.pipeline.report import timing_from_trace
    t = timing_from_trace(res.trace)
    return {"prefill_s": t.prefill_s, "ttft_s": t.ttft_s, "decode_s_per_token": t.decode_s_per_token,
            "total_s": t.total_s}
