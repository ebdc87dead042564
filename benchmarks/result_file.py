"""Where a benchmark writes its result by default: benchmarks/results/<machine>-<date>-<benchmark>.json,
the machine a short GPU name (`h200`) or `cpu`, the date the run's (UTC)."""
from __future__ import annotations

import datetime
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"   # not the working directory's: a run from elsewhere keeps its file


def machine(device: str = "cpu") -> str:
    """`cpu`, or the CUDA device's name shortened to its model (`NVIDIA H200` -> `h200`)."""
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch
    name = torch.cuda.get_device_name().lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cuda"


def result_file(benchmark: str, device: str = "cpu", suffix: str = ".json") -> Path:
    """The default result path of `benchmark` run on `device` today."""
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return RESULTS / f"{machine(device)}-{today}-{benchmark}{suffix}"
