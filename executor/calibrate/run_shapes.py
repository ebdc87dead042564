"""`kvpipe calibrate`'s timers at the shapes a run has, after the warm-up a run has: the GPU held
busy first until its clock settles (a run's prefill keeps it busy for seconds; a cold GPU's first
calls run at boost clocks); calls timed back to back behind a sleep kernel, so the host's issue
rate never shows, as in a prefill whose host runs ahead (the LOSSY quantise, executor/calibrate/lossy.py);
a layer's GEMMs as callables (a decode step's few-row GEMMs, executor/calibrate/gemm_shapes.py).
The prefill stages are timed in a run's sequence instead (executor/calibrate/prefill_stages.py).
Device-generic: on a CPU the host clock times them (for tests)."""
from __future__ import annotations

import math
import statistics
import time

import torch

from kvpipe.executor.layers import gemv_triton
from kvpipe.pipeline.calibration import Calibration

CYCLES_PER_S = 2.0e9   # the sleep kernel counts GPU cycles; at a lower clock it only sleeps longer


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def back_to_back_s(fn, dev: torch.device, reps: int = 3, window_s: float = 0.02, max_calls: int = 64) -> float:
    """Seconds per call of `fn` issued back to back: once untimed (plans, workspaces), once timed
    alone (its host issue time and its wall time), then `reps` windows of k calls (k fills
    ~`window_s`), each queued on CUDA behind a sleep kernel longer than their issue, timed by
    events around the calls; the median window over k."""
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    sync(dev)
    one = max(time.perf_counter() - t0, 1e-6)
    k = max(1, min(max_calls, math.ceil(window_s / one)))
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int((1.5 * k * host + 1e-3) * CYCLES_PER_S))
            a.record()
            for _ in range(k):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / k)
        else:
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            out.append((time.perf_counter() - t0) / k)
    return statistics.median(out)


def warm_clock(cal: Calibration, dev: torch.device, seconds: float = 2.0, size: int = 8192) -> None:
    """Hold the GPU busy with bf16 GEMMs for up to `seconds`, in windows of ~0.25 s of GEMMs, until
    two windows in a row agree within 1% (after at least 1 s): the clock a run's prefill settles
    at. The windows' rates go to the JSON record."""
    if dev.type != "cuda":
        return
    torch.cuda.set_per_process_memory_fraction(1.0, dev)   # no run's cap left over: the grids need their room
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    flops, rates, t_end = 2.0 * size ** 3, [], time.perf_counter() + seconds
    a @ a
    sync(dev)
    t0 = time.perf_counter()
    a @ a
    sync(dev)
    k = max(1, math.ceil(0.25 / max(time.perf_counter() - t0, 1e-5)))
    while time.perf_counter() < t_end:
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(k):
            a @ a
        ev1.record()
        ev1.synchronize()
        rates.append(k * flops / (ev0.elapsed_time(ev1) / 1e3))
        if len(rates) >= 4 and abs(rates[-1] / rates[-2] - 1) < 0.01:
            break
    cal.extra["warm_clock_gemm_flops_per_s"] = rates


def stage_gemms(dev: torch.device, T: int, hidden: int, inner: int, q_dim: int, kv_dim: int, dt,
                fused: bool = False):
    """(qkv stage, mlp stage): each a callable running the stage's GEMMs at T tokens as the HF
    modules run them (q, k, v projections; o, gate, up, down), or with `fused` as the fused decode
    step does (executor/layers/fused.py: q/k/v one GEMM, gate/up one, one-token rows by
    gemv_triton's kernel), and each stage's FLOPs."""
    shapes = {"o": (hidden, q_dim), "down": (hidden, inner)}
    if fused:
        shapes.update({"qkv": (q_dim + 2 * kv_dim, hidden), "gate_up": (2 * inner, hidden)})
    else:
        shapes.update({"q": (q_dim, hidden), "k": (kv_dim, hidden), "v": (kv_dim, hidden),
                       "gate": (inner, hidden), "up": (inner, hidden)})
    w = {n: torch.randn(o, i, device=dev, dtype=dt) for n, (o, i) in shapes.items()}
    x = torch.randn(T, hidden, device=dev, dtype=dt)
    a = torch.randn(T, q_dim, device=dev, dtype=dt)
    h = torch.randn(T, inner, device=dev, dtype=dt)
    first, middle = (["qkv"], ["gate_up"]) if fused else (["q", "k", "v"], ["gate", "up"])
    mm = gemv_triton.linear if fused else torch.nn.functional.linear   # as each step runs them

    def qkv() -> None:
        for n in first:
            mm(x, w[n])

    def mlp() -> None:
        mm(a, w["o"])
        for n in middle:
            mm(x, w[n])
        mm(h, w["down"])
    f_qkv = 2.0 * T * hidden * (q_dim + 2 * kv_dim)
    f_mlp = 2.0 * T * (q_dim * hidden + 3 * hidden * inner)
    return (qkv, f_qkv), (mlp, f_mlp), sum(t.numel() * t.element_size() for t in w.values())
