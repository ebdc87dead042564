"""Timers of `kvpipe calibrate`: CUDA-event medians of a region, eager or replayed as a CUDA graph."""
from __future__ import annotations

import statistics

import torch

MiB = 1 << 20


def cuda_median_s(fn, reps: int, warmups: int = 1) -> float:
    """Median seconds of `fn` on the current stream (CUDA events), after `warmups` calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_median_s(fn, reps: int) -> float:
    """Median seconds of one replay of a CUDA graph holding `fn`'s work (no host issue in it):
    `fn` runs once on a side stream first (kernels loaded, workspaces allocated outside the
    capture), then is captured, then the graph is timed by `cuda_median_s`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return cuda_median_s(g.replay, reps)
