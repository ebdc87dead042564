"""The benchmarks' one timing loop: the median seconds of a callable over repeats, by CUDA events
on a CUDA device (the GPU's time of what it queued) and by the host clock elsewhere."""
from __future__ import annotations

import torch


def median_seconds(fn, reps: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `reps` calls; the caller does any warm-up first. The loops are
    calibrate's (executor/calibrate/machine.cuda_median_s on CUDA, executor/calibrate/codecs.perf_timer on the
    host clock elsewhere), so benchmarks and profiles time alike."""
    if device.type == "cuda":
        from kvpipe.executor.calibrate.timing import cuda_median_s
        return cuda_median_s(fn, reps, warmups=0)
    from kvpipe.executor.calibrate.codecs import perf_timer
    return perf_timer(fn, reps, warmups=0)
