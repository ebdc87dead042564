"""The benchmarks' one timing loop: the median seconds of a callable over repeats, by CUDA events
on a CUDA device (the GPU's time of what it queued) and by the host clock elsewhere."""
from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, reps: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `reps` calls; the caller does any warm-up first."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)
