"""`kvpipe calibrate`'s attention rates, per kernel, through the executor's own calls: prefill
chunks against several prefixes, cuDNN's plan build at a new prefix length, and replayed decode
attention per head group as `call_s + bytes / bytes_per_s`."""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from kvpipe.pipeline.calibration import Calibration, fit_alpha_beta_relative

from kvpipe.executor.calibrate.timing import MiB, cuda_median_s, graph_median_s
from kvpipe.executor.layers import decode_triton
from kvpipe.executor.layers.attention import attend_decode, attend_part


@contextlib.contextmanager
def attention_kernel(name: str):
    """KVPIPE_ATTN set to `name` inside the block (the executor's attention reads it per call), restored after."""
    old = os.environ.get("KVPIPE_ATTN")
    os.environ["KVPIPE_ATTN"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KVPIPE_ATTN", None)
        else:
            os.environ["KVPIPE_ATTN"] = old


def attention(cal: Calibration, eff_flops: float, quick: bool, heads_kv: int = 8, r: int = 4, d: int = 128) -> None:
    """The executor's own attention call (attend_part) per kernel: a prefill chunk of 4096 tokens
    against prefixes of several lengths (rate as a fraction of the GEMM rate), the first call at a
    new prefix length (plan build), and decode rows against long KV (bytes per second)."""
    prefixes = [8192, 32768] + ([] if quick else [131072])
    chunk, scale = 4096, d ** -0.5
    kernels = ["flash"] + (["cudnn"] if torch.cuda.get_device_capability() >= (9, 0) else [])
    fractions: dict[str, list[float]] = {}
    plan_s: list[float] = []
    for kernel in kernels:
        with attention_kernel(kernel):
            fractions[kernel] = []
            for p in prefixes:
                q = torch.randn(1, heads_kv, r * chunk, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, heads_kv, p, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                attend_part(q, k, v, scale, False)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                sec = cuda_median_s(lambda: attend_part(q, k, v, scale, False), 3)
                fractions[kernel].append(4.0 * heads_kv * r * chunk * p * d / sec / eff_flops)
                if kernel == "cudnn":
                    plan_s.append(max(0.0, first - sec))
            kv = torch.randn(1, heads_kv, prefixes[-1], d, device="cuda", dtype=torch.bfloat16)
            qd = torch.randn(1, heads_kv, r, d, device="cuda", dtype=torch.bfloat16)
            sec = cuda_median_s(lambda: attend_part(qd, kv, kv, scale, False), 10)
            cal.extra[f"decode_attention_{kernel}_bytes_per_s"] = 2 * kv.numel() * 2 / sec
            cal.extra[f"prefill_attention_{kernel}_fraction"] = fractions[kernel]
    prefill = kernels[-1]   # the executor's prefill kernel on this GPU (cuDNN on sm90+, else FA2)
    cal.set("gpu.attention_efficiency", min(1.0, statistics.median(fractions[prefill])),
            f"{prefill} attention of a 4096-token chunk (GQA {r}:1, D={d}) over prefixes {prefixes}, "
            f"median rate / bf16 GEMM rate")
    cal.extra["attention_plan_s_first_calls"] = plan_s   # the first includes cuDNN's one-off start-up
    if prefill == "cudnn":
        attention_plan(cal, heads_kv, r, d)
    else:
        cal.set("gpu.attention_plan_s", 0.0, "FA2 builds no plan per shape")


def attention_plan(cal: Calibration, heads_kv: int = 8, r: int = 4, d: int = 128, chunk: int = 4096,
                   n: int = 5) -> None:
    """Host seconds cuDNN spends building the execution plan of a new prefix length: the executor's
    prefix attention (attend_part over interleaved K/V views of a larger buffer, as the KV store
    holds them) at `n` prefix lengths never seen before, after a call at another length has paid
    cuDNN's one-off start-up; per length, the host time until the first call returns minus that of
    a steady call at the same length (the build runs on the host inside the call), median."""
    scale = d ** -0.5
    lengths = [8192 + 136 * (i + 1) for i in range(n)]
    buf = torch.randn(1, heads_kv, max(lengths) + 64, 2, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, heads_kv, r * chunk, d, device="cuda", dtype=torch.bfloat16)
    points = []
    with attention_kernel("cudnn"):
        attend_part(q, buf[:, :, :1000, 0], buf[:, :, :1000, 1], scale, False)   # start-up, another shape
        torch.cuda.synchronize()
        for P in lengths:
            k, v = buf[:, :, :P, 0], buf[:, :, :P, 1]
            host = []
            for _ in range(4):                 # the first call builds the plan, the others reuse it
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                attend_part(q, k, v, scale, False)
                host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            points.append({"prefix": P, "first_host_s": host[0], "steady_host_s": statistics.median(host[1:])})
    cal.set("gpu.attention_plan_s", statistics.median(p["first_host_s"] - p["steady_host_s"] for p in points),
            f"host time of the first cuDNN prefix attention at {n} new prefix lengths minus a steady call's, "
            f"after start-up at another length (plan build; chunk {chunk}, {heads_kv} KV heads), median")
    cal.extra["attention_plan_points"] = points


DECODE_GROUPS = (1, 2, 4, 8)
DECODE_LENGTHS = (2048, 8192, 32768, 131072)
COLD_BYTES = 256 * MiB   # KV a graph of decode calls reads: several times the L2, as in a step


def decode_attention_point(G: int, L: int, r: int = 4, d: int = 128, reps: int = 5) -> tuple[int, float, int]:
    """GPU seconds of one `attend_decode` call (executor/layers/attention.py, the kernel a replayed decode
    step runs per head group: the Triton split-KV pair, or FA2's where it cannot run; the length read
    on the device) of G KV heads
    over L keys, in a buffer of capacity L + 16 (a store's capacity is context + decode tokens).
    `calls` calls, each over its own buffer so that a graph reads at least COLD_BYTES (a step's
    K/V is not in L2: every layer's weights pass between), captured in one CUDA graph as replay
    runs them; returns (KV bytes one call reads, seconds per call, calls)."""
    S, dt = L + 16, torch.bfloat16
    per = G * S * 2 * d * dt.itemsize
    calls = min(512, max(32, -(-COLD_BYTES // per)))
    n_buf = min(calls, max(2, -(-COLD_BYTES // per)))
    pool = torch.randn(n_buf, 1, G, S, 2, d, device="cuda", dtype=dt)
    q = torch.randn(1, G * r, 1, d, device="cuda", dtype=dt)
    lens = torch.tensor([L], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    scale = d ** -0.5

    def step() -> None:
        for i in range(calls):
            attend_decode(q, pool[i % n_buf], lens, cu_q, cu_k, scale)
    sec = graph_median_s(step, reps) / calls      # warmed outside the capture (workspace, kernels)
    del pool
    return G * L * 2 * d * dt.itemsize, sec, calls


def decode_kernel_label() -> str:
    """The kernel `attend_decode` runs at the probe's shapes on this GPU: Triton or FA2."""
    q = torch.empty(1, 4, 1, 128, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(1, 1, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    return "FA2 varlen" if decode_triton.unavailable(q, kv) else "Triton"


def decode_attention(cal: Calibration, groups=DECODE_GROUPS, lengths=DECODE_LENGTHS) -> None:
    """Per group size G (KV heads per call), the replayed decode attention call as `call_s +
    bytes / bytes_per_s` (relative least squares over `lengths`): a per-call cost (launch of the
    split-KV kernel and its combine, the splits' fixed work) and the rate at which one call reads
    its K/V. Small groups read far below the copy rate (few heads: few CTAs per split)."""
    points = []
    for G in groups:
        pts = [decode_attention_point(G, L) for L in lengths]
        call_s, rate = fit_alpha_beta_relative([b for b, _, _ in pts], [t for _, t, _ in pts])
        how = (f"attend_decode ({decode_kernel_label()} split-KV, GQA 4:1, D=128, bf16) of {G} KV heads over "
               f"{list(lengths)} keys, each length a CUDA graph of calls over distinct buffers")
        cal.set(f"gpu.decode_attention.g{G}.call_s", call_s, how + "; intercept of the relative least-squares fit t = call_s + bytes/rate")
        cal.set(f"gpu.decode_attention.g{G}.bytes_per_s", rate, how + "; slope of the same fit (K/V bytes read)")
        points += [{"group": G, "keys": L, "kv_bytes": b, "seconds": t, "calls": c} for L, (b, t, c) in zip(lengths, pts)]
    cal.extra["decode_attention_points"] = points
