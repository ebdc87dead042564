"""The benchmarks' one timing loop: the median seconds of a callable over repeats, by CUDA events
on a CUDA device (the GPU's time of what it queued) and by the host clock elsewhere."""
from __future__ import annotations

import statistics
import time

import torch


def median_seconds(fn, reps: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `reps` calls; the caller does any warm-up first. On CUDA
    the loop is calibrate's (executor/calibrate.cuda_median_s), so benchmarks and profiles time alike."""
    if device.type == "cuda":
        from kvpipe.executor.calibrate import cuda_median_s
        return cuda_median_s(fn, reps, warmups=0)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)
