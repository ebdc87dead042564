"""`kvpipe run --gpus N`: tensor parallel by KV heads on N processes (executor/dist/): the layout's
rank plan decided as `plan --gpus N` decides it (sim/multi_choice.py, for this device), then every
rank runs it on its shard, launched here or, under torchrun, as the rank torchrun started."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvpipe.pipeline.model import load_model, preset
from kvpipe.pipeline.workload import Workload

from .options import DEFAULT_RUN_CONTEXT, RunOptions


@dataclass(frozen=True)
class GpusRunResult:
    """What `kvpipe run --gpus N` prints: the machine's prediction and each rank's measurement."""

    multi: object          # sim.multi_choice.MultiDecision
    ranks: list[dict]      # executor/dist/rank.py's results: every rank's, or rank 0's under torchrun
    device: str
    world: int

    def to_json(self) -> dict:
        runs = [r["runs"][0] for r in self.ranks]
        return {"multi_gpu": self.multi.to_json(), "plan": self.multi.chosen.decision.plan.to_json(),
                "predicted": self.multi.predicted.report_json(), "device": self.device,
                "tokens": runs[0]["tokens"], "ranks_agree": len({r["digest"] for r in runs}) == 1 if len(runs) == self.world else None,
                "ranks": [{"rank": r["rank"], **r["runs"][0]} for r in self.ranks]}

    def lines(self) -> list[str]:
        out = self.to_json()
        first = out["ranks"][0]
        return self.multi.describe() + [f"device: {self.device}; ranks agree bit for bit: {out['ranks_agree']}",
                                        f"measured on rank 0: prefill {first['prefill_s']:.3f} s, decode "
                                        f"{(first['decode_s_per_token'] or 0) * 1e3:.2f} ms/token",
                                        f"tokens: {first['tokens']}"]


def run_gpus(opts: RunOptions) -> GpusRunResult | None:
    """Decide, then launch the ranks (or be one under torchrun: None on ranks other than 0)."""
    from kvpipe.executor.dist.launch import launch, under_torchrun
    from kvpipe.executor.dist.rank import RankJob, rank_main
    from kvpipe.executor.engine import session
    from kvpipe.api import machine
    from kvpipe.sim.decide import Target
    from kvpipe.sim.multi_choice import decide_multi
    if opts.pp not in (None, 1):
        raise ValueError("pp: kvpipe run --gpus runs tensor parallel only; pipeline stages are predicted by kvpipe plan")
    if not opts.random_weights:
        raise ValueError("random-weights: kvpipe run --gpus builds each rank's shard from random weights; "
                         "pass --random-weights")
    dev = session.resolve_device(opts.device)
    spec = load_model(opts.model, opts.dtype)
    config = session.preset_config(spec) if preset(opts.model) else json.loads(_config_path(opts.model).read_text())
    work = Workload.parse(opts.context or DEFAULT_RUN_CONTEXT, opts.decode_tokens, opts.batch)
    profile, budgets = machine(opts, session, dev)
    multi = decide_multi(spec, work, profile, budgets, opts.gpus, lambda rank: opts.request(rank), tp=opts.gpus,
                         pp=1, objective=opts.objective, target=Target(dev.type, False))
    if multi.predicted.problems:
        raise ValueError(f"budget: the plan does not fit: {'; '.join(multi.predicted.problems)}")
    job = RankJob(config, spec.dtype, work, (multi.chosen.decision.plan,), opts.seed, dev.type,
                  whole_weights=dev.type == "cpu", gpu_budget=budgets["gpu"])
    if under_torchrun():   # torchrun watches the ranks and ends the others when one dies
        rank = int(os.environ["RANK"])
        folder = tempfile.mkdtemp(prefix=f"kvpipe-rank{rank}-")
        try:
            rank_main(rank, int(os.environ["WORLD_SIZE"]), job, folder, int(os.environ.get("LOCAL_RANK", rank)))
            mine = json.loads((Path(folder) / f"rank-{rank}.json").read_text())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return GpusRunResult(multi, [mine], str(dev), opts.gpus) if rank == 0 else None
    return GpusRunResult(multi, launch(job, opts.gpus), str(dev), opts.gpus)


def _config_path(model: str) -> Path:
    path = Path(model)
    return path / "config.json" if path.is_dir() else path
