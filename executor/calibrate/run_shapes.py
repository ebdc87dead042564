"""`kvpipe calibrate`'s rates at the shapes a run has, after the warm-up a run has: the GPU held
busy first until its clock settles (a run's prefill keeps it busy for seconds; a cold GPU's first
calls run at boost clocks), then the prefill attention calls at the planner's chunks, groups and
the prefixes real plans reach ([gpu.attention_rates]), the GEMMs of a layer's qkv and mlp stages at
those chunks (the effective rate and small-shape half the simulator's stage formula uses), and a
decode step's few-row GEMMs replayed in a CUDA graph (their weight-read rate). Calls are timed
back to back behind a sleep kernel, so the host's issue rate never shows, as in a prefill whose
host runs ahead. Device-generic: on a CPU the host clock times them (for tests)."""
from __future__ import annotations

import math
import statistics
import time

import torch

from kvpipe.pipeline.calibration import Calibration
from kvpipe.pipeline.run_rates import OWN_CHUNKS, OWN_GROUPS, PREFIX_KEYS, PREFIX_ROWS, AttentionRates, RateGrid

from kvpipe.executor.layers.attention import attend_part, repeat_kv

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


def attention_rates(cal: Calibration, dev: torch.device, r: int = 4, d: int = 128, kv_heads: int = 8,
                    rows=PREFIX_ROWS, keys=PREFIX_KEYS, groups=OWN_GROUPS, chunks=OWN_CHUNKS) -> AttentionRates:
    """[gpu.attention_rates]: the executor's attend_part (the kernel it picks by shape: cuDNN for
    prefill chunks on sm90+, else FA2) as attend_chunk calls it: the prefix call over interleaved
    K/V views of one buffer (the KV store's layout) with the query heads folded into rows, and the
    own causal call over the chunk's K/V repeated per query head; FLOP/s per grid point."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    scale = d ** -0.5
    pre = []
    for R in rows:
        G = min(kv_heads, 8, max(1, R // 4096))
        n = R // G
        line = []
        for P in keys:
            buf = torch.randn(1, G, P, 2, d, device=dev, dtype=dt)
            q = torch.randn(1, G, r * n, d, device=dev, dtype=dt)
            sec = back_to_back_s(lambda: attend_part(q, buf[:, :, :, 0], buf[:, :, :, 1], scale, False), dev)
            line.append(4.0 * G * r * n * P * d / sec)
            del buf, q
        pre.append(line)
    own = []
    for G in groups:
        line = []
        for n in chunks:
            q = torch.randn(1, G * r, n, d, device=dev, dtype=dt)
            kv = torch.randn(1, G, n, 2, d, device=dev, dtype=dt)
            k, v = repeat_kv(kv[:, :, :, 0], r).contiguous(), repeat_kv(kv[:, :, :, 1], r).contiguous()
            sec = back_to_back_s(lambda: attend_part(q, k, v, scale, True), dev)
            line.append(4.0 * G * r * d * n * (n + 1) / 2 / sec)
            del q, kv, k, v
        own.append(line)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rates = AttentionRates(RateGrid(tuple(rows), tuple(keys), tuple(map(tuple, pre))),
                           RateGrid(tuple(groups), tuple(chunks), tuple(map(tuple, own))),
                           "bf16" if dt == torch.bfloat16 else "fp32")
    how = (f"attend_part (executor/layers/attention.py, the kernel it picks by shape) as attend_chunk calls it, "
           f"GQA {r}:1, D={d}, {dt}; calls back to back behind a sleep kernel after the clock warm-up, median of 3 windows")
    cal.set("gpu.attention_rates.dtype", rates.dtype, "the models' dtype the grids were measured in")
    cal.set("gpu.attention_rates.prefix_rows", list(rows), "prefix call grid: KV heads x chunk tokens per call")
    cal.set("gpu.attention_rates.prefix_keys", list(keys), "prefix call grid: prefix keys")
    cal.set("gpu.attention_rates.prefix_flops_per_s", pre, f"the chunk over its prefix, no mask: {how}")
    cal.set("gpu.attention_rates.own_groups", list(groups), "own call grid: KV heads per call")
    cal.set("gpu.attention_rates.own_chunks", list(chunks), "own call grid: chunk tokens")
    cal.set("gpu.attention_rates.own_flops_per_s", own, f"the chunk over itself, causal (causal pairs): {how}")
    return rates


def stage_gemms(dev: torch.device, T: int, hidden: int, inner: int, q_dim: int, kv_dim: int, dt,
                fused: bool = False):
    """(qkv stage, mlp stage): each a callable running the stage's GEMMs at T tokens as the HF
    modules run them (q, k, v projections; o, gate, up, down), or with `fused` as the fused decode
    step does (executor/layers/fused.py: q/k/v one GEMM, gate/up one), and each stage's FLOPs."""
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

    def qkv() -> None:
        for n in first:
            x @ w[n].T

    def mlp() -> None:
        a @ w["o"].T
        for n in middle:
            x @ w[n].T
        h @ w["down"].T
    f_qkv = 2.0 * T * hidden * (q_dim + 2 * kv_dim)
    f_mlp = 2.0 * T * (q_dim * hidden + 3 * hidden * inner)
    return (qkv, f_qkv), (mlp, f_mlp), sum(t.numel() * t.element_size() for t in w.values())
