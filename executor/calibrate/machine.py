"""`kvpipe calibrate`: measure this machine and write a hardware profile whose numbers are
measurements — GEMM rate at the graph's shapes, small-kernel floor and elementwise rate of one
decoder layer's non-GEMM ops, attention rate per kernel (prefill chunks against
several prefixes, decode against long KV), kernel launch cost, pinned H2D/D2H as alpha + bytes/beta
from 64 KiB to 1 GiB and both at once, HBM copy rate, O_DIRECT disk read/write. Timings are CUDA
events around the region, medians of repeats, after a warm-up; the codecs of the h2d and disk
links on random-weight K/V (executor/calibrate/codecs.py). Datasheet peaks (which no measurement
gives) come from a base profile and are labelled so."""
from __future__ import annotations

import datetime
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpipe.pipeline.calibration import (Calibration, fit_alpha_beta, fit_alpha_beta_relative, half_rate_flops,
                                         host_issue_fields)
from kvpipe.pipeline.hardware import HardwareProfile

from kvpipe.executor.layers.attention import attend_part

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


def gemm(cal: Calibration, quick: bool, hidden: int = 4096, inner: int = 14336) -> float:
    """bf16/fp16/fp32 GEMM rates; the token counts span decode (1) to long prefill chunks."""
    tokens = [1, 16, 128, 1024, 4096, 16384] + ([] if quick else [65536])
    points, eff = [], {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        w = torch.randn(inner, hidden, device="cuda", dtype=dtype)
        rates = []
        for t in (tokens if name == "bf16" else tokens[-2:]):
            x = torch.randn(t, hidden, device="cuda", dtype=dtype)
            sec = cuda_median_s(lambda: x @ w.T, 5 if t < 16384 else 3)
            flops = 2.0 * t * hidden * inner
            rates.append(flops / sec)
            if name == "bf16":   # with the time its bytes take at the HBM copy rate (memory-bound points drop out)
                nbytes = 2 * (t * hidden + hidden * inner + t * inner)
                points.append((flops, sec, nbytes / cal.values["gpu.hbm_eff_bytes_per_s"]))
        eff[name] = max(rates)
        cal.set(f"gpu.compute.{name}.effective_flops_per_s", eff[name],
                f"{name} GEMM [T,{hidden}]x[{hidden},{inner}], best over T={tokens[-2:] if name != 'bf16' else tokens}")
        cal.extra[f"gemm_{name}_points"] = list(points) if name == "bf16" else rates
    cal.set("gpu.small_shape_half_flops", half_rate_flops(points, eff["bf16"]),
            "fit of rate = eff*f/(f+h) to the compute-bound bf16 GEMM points below 90% of eff (median)")
    return eff["bf16"]


def launch(cal: Calibration, n: int = 500) -> None:
    """GPU time per tiny kernel with the host far ahead (the kernels are queued behind a sleep
    kernel, so the host's issue rate cannot show), and the host's Python cost to issue one."""
    x = torch.zeros(16, device="cuda")
    x.add_(1.0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000_000)        # ~1 s of GPU cycles: longer than issuing n kernels
    a.record()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = (time.perf_counter() - t0) / n
    b.record()
    b.synchronize()
    gpu = a.elapsed_time(b) / 1e3 / n
    if host * n > 0.8:
        raise RuntimeError(f"calibrate: issuing {n} kernels took {host * n:.3f} s, longer than the sleep ahead of them")
    cal.set("gpu.launch_overhead_s", gpu, f"{n} tiny kernels queued behind a sleep kernel, GPU time each")
    cal.extra["host_issue_s_per_kernel"] = host


def host_issue(cal: Calibration) -> None:
    """Per-stage and per-launch host issue cost of the executor, host cost of a replayed decode
    step, GPU cost of a graph node (executor/calibrate/host_issue.py: small runs where the host binds)."""
    from kvpipe.executor.calibrate.host_issue import fit, graph_node_s, run_plans
    eager = run_plans("off", log=lambda s: None)
    per_stage, per_op = fit(eager)
    how = "least squares of decode step time = a*stages + b*ops over 4 eager plans of a 2-layer Llama-3-8B-shaped model"
    cal.set("host.issue_s_per_stage", max(0.0, per_stage), how + " (a)")
    cal.set("host.issue_s_per_op", max(0.0, per_op), how + " (b)")
    cal.set("gpu.graph_node_s", graph_node_s(), "a captured graph of 2000 tiny kernels replayed, GPU time per node")
    replay = run_plans("on", log=lambda s: None)
    cal.set("host.graph_replay_s", statistics.median(r["host_s_per_step"] for r in replay if r["resident"]),
            "host seconds of one replayed decode step (same model, resident plans), median")
    cal.extra["issue_probe"] = {"eager": eager, "replay": replay}


def host_stage_costs(cal: Calibration, context: int = 2048, chunk: int = 512) -> None:
    """Host seconds the executor spends issuing each stage (the lane actor's perf_counter around
    the stage's issue, `Span.host_s`), prefill and eager decode, for a 2-layer Llama-3-8B-shaped
    model under plans that cover the stage kinds (groups 1 / 2 / 8; all resident, half, none),
    with each phase's host wall (executor/issue_probe.stage_costs; the JSON record's
    `host_stage_costs`). Sets the copy pair, the prefill compute pair (per stage + per kernel
    launch) and the prefill gap between issues (pipeline/calibration.host_issue_fields)."""
    from kvpipe.executor.calibrate.host_issue import probe_model, stage_costs
    rec = stage_costs(probe_model("cuda"), "cuda", context, chunk)
    cal.extra["host_stage_costs"] = rec
    fields = host_issue_fields(rec)
    how = ("host seconds of the executor's {what} issued one by one (Span.host_s) in a 2-layer Llama-3-8B-shaped "
           "model's prefill and eager decode under 4 plans (executor/issue_probe.stage_costs); least squares "
           "of the median per group = a + b * {x} (pipeline/calibration.{fit})")
    copy = how.format(what="h2d / d2h stages", x="copy calls", fit="copy_issue_fit")
    cal.set("host.copy_s_per_stage", fields["host_copy_s_per_stage"], copy + " (a)")
    cal.set("host.copy_s_per_op", fields["host_copy_s_per_op"], copy + " (b)")
    pre = how.format(what="prefill compute stages", x="kernel launches (ops + small_ops)", fit="compute_issue_fit")
    cal.set("host.prefill_issue_s_per_stage", fields["host_prefill_issue_s_per_stage"], pre + " (a)")
    cal.set("host.prefill_issue_s_per_launch", fields["host_prefill_issue_s_per_launch"], pre + " (b)")
    cal.set("host.prefill_issue_gap_s", fields["host_prefill_issue_gap_s"],
            "the same runs: each prefill's host wall (first issue to the end of the last) minus its stages' "
            "summed issue seconds, per stage, pooled over the 4 plans (pipeline/calibration.issue_gap)")


def layer_small_ops(a, T: int, P: int):
    """The small kernels (executor/calibrate/op_inventory.py, calls kept) of layer 0 of adapter `a` for a
    T-token step over a P-token prefix, all KV heads in one group: qkv, the K/V written home,
    attention with its LSE merge, the output made contiguous, mlp."""
    from kvpipe.executor.calibrate.op_inventory import record
    dev, dt = a.device, a.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, a.model.config.vocab_size, (1, T), device=dev, generator=g)
    pre = torch.randn(1, a.kv_heads, P, 2, a.head_dim, device=dev, generator=g).to(dt)
    home = torch.empty(1, a.kv_heads, T, 2, a.head_dim, device=dev, dtype=dt)
    hidden, rope = a.embed(ids, P)

    def layer() -> None:
        q, kv = a.qkv(0, hidden, rope)
        home.copy_(kv)
        o = a.attend(0, q, pre[:, :, :, 0], pre[:, :, :, 1], kv[:, :, :, 0], kv[:, :, :, 1])
        a.mlp(0, hidden, o.transpose(1, 2).contiguous())
    return record(layer, keep=True)


def replayer(inv):
    """A function that runs the kept small-kernel calls of `inv` again, in order (same inputs)."""
    def run() -> None:
        for func, args, kwargs in inv.ops:
            func(*args, **kwargs)
    return run


def small_kernels(cal: Calibration, tokens: int = 8192, reps: int = 20) -> None:
    """The per-kernel floor and the elementwise rate of the small kernels (norms, RoPE, SiLU * up,
    residual adds, casts, copies, the LSE merge): one decoder layer of a Llama-3-8B-shaped bf16
    model runs its qkv, one head group's attention over a prefix, and mlp pieces once under
    executor/op_inventory's recorder, which keeps every small kernel's call; those calls alone are
    then run again: at 1 token captured in a CUDA graph (GPU seconds per kernel: the floor), at
    `tokens` tokens eagerly (bytes read + written per second, over the HBM copy rate)."""
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.layers.loader import random_model
    cfg = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=2 * tokens + 8, tie_word_embeddings=False)
    a = HFAdapter(random_model(cfg, "cuda", torch.bfloat16, 0))
    found = {}
    for T in (1, tokens):
        inv = layer_small_ops(a, T, max(T, 16))
        small = replayer(inv)
        with torch.no_grad():
            if T == 1:
                def repeated() -> None:
                    for _ in range(reps):
                        small()
                sec = graph_median_s(repeated, 5) / reps
            else:
                sec = cuda_median_s(small, 5)
        found[T] = (inv.kernels, inv.bytes, sec)
    k1, _, s1 = found[1]
    kT, bT, sT = found[tokens]
    cal.set("gpu.small_kernel_s", s1 / k1, f"one Llama-3-8B-shaped layer's {k1} small kernels at 1 token "
            f"(recorded by executor/calibrate/op_inventory.py), {reps}x in a CUDA graph, GPU seconds per kernel")
    rate = bT / sT
    cal.set("gpu.elementwise_efficiency", min(1.0, rate / cal.values["gpu.hbm_eff_bytes_per_s"]),
            f"the same layer's {kT} small kernels at {tokens} tokens ({bT / 1e9:.2f} GB read + written) "
            f"in {sT * 1e3:.2f} ms, over the HBM copy rate")
    cal.extra["small_kernels"] = {str(T): {"kernels": k, "bytes": b, "seconds": s} for T, (k, b, s) in found.items()}
    cal.extra["elementwise_bytes_per_s"] = rate


def hbm(cal: Calibration) -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    sec = cuda_median_s(lambda: dst.copy_(src), 5)
    cal.set("gpu.hbm_eff_bytes_per_s", 2 * src.numel() / sec, "1 GiB device-to-device copy, read + write bytes")


def attention(cal: Calibration, eff_flops: float, quick: bool, heads_kv: int = 8, r: int = 4, d: int = 128) -> None:
    """The executor's own attention call (attend_part) per kernel: a prefill chunk of 4096 tokens
    against prefixes of several lengths (rate as a fraction of the GEMM rate), the first call at a
    new prefix length (plan build), and decode rows against long KV (bytes per second)."""
    prefixes = [8192, 32768] + ([] if quick else [131072])
    chunk, scale = 4096, d ** -0.5
    kernels = ["flash"] + (["cudnn"] if torch.cuda.get_device_capability() >= (9, 0) else [])
    old = os.environ.get("KVPIPE_ATTN")
    fractions: dict[str, list[float]] = {}
    plan_s: list[float] = []
    try:
        for kernel in kernels:
            os.environ["KVPIPE_ATTN"] = kernel
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
    finally:
        if old is None:
            os.environ.pop("KVPIPE_ATTN", None)
        else:
            os.environ["KVPIPE_ATTN"] = old
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
    old = os.environ.get("KVPIPE_ATTN")
    os.environ["KVPIPE_ATTN"] = "cudnn"
    scale = d ** -0.5
    lengths = [8192 + 136 * (i + 1) for i in range(n)]
    buf = torch.randn(1, heads_kv, max(lengths) + 64, 2, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, heads_kv, r * chunk, d, device="cuda", dtype=torch.bfloat16)
    points = []
    try:
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
    finally:
        if old is None:
            os.environ.pop("KVPIPE_ATTN", None)
        else:
            os.environ["KVPIPE_ATTN"] = old
    cal.set("gpu.attention_plan_s", statistics.median(p["first_host_s"] - p["steady_host_s"] for p in points),
            f"host time of the first cuDNN prefix attention at {n} new prefix lengths minus a steady call's, "
            f"after start-up at another length (plan build; chunk {chunk}, {heads_kv} KV heads), median")
    cal.extra["attention_plan_points"] = points


DECODE_GROUPS = (1, 2, 4, 8)
DECODE_LENGTHS = (2048, 8192, 32768, 131072)
COLD_BYTES = 256 * MiB   # KV a graph of decode calls reads: several times the L2, as in a step


def decode_attention_point(G: int, L: int, r: int = 4, d: int = 128, reps: int = 5) -> tuple[int, float, int]:
    """GPU seconds of one `attend_decode` call (executor/layers/attention.py, the kernel a replayed decode
    step runs per head group: FA2 varlen split-KV, the length read on the device) of G KV heads
    over L keys, in a buffer of capacity L + 16 (a store's capacity is context + decode tokens).
    `calls` calls, each over its own buffer so that a graph reads at least COLD_BYTES (a step's
    K/V is not in L2: every layer's weights pass between), captured in one CUDA graph as replay
    runs them; returns (KV bytes one call reads, seconds per call, calls)."""
    from kvpipe.executor.layers.attention import attend_decode
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


def decode_attention(cal: Calibration, groups=DECODE_GROUPS, lengths=DECODE_LENGTHS) -> None:
    """Per group size G (KV heads per call), the replayed decode attention call as `call_s +
    bytes / bytes_per_s` (relative least squares over `lengths`): a per-call cost (launch of the
    split-KV kernel and its combine, the splits' fixed work) and the rate at which one call reads
    its K/V. Small groups read far below the copy rate (few heads: few CTAs per split)."""
    points = []
    for G in groups:
        pts = [decode_attention_point(G, L) for L in lengths]
        call_s, rate = fit_alpha_beta_relative([b for b, _, _ in pts], [t for _, t, _ in pts])
        how = (f"attend_decode (FA2 varlen split-KV, GQA 4:1, D=128, bf16) of {G} KV heads over "
               f"{list(lengths)} keys, each length a CUDA graph of calls over distinct buffers")
        cal.set(f"gpu.decode_attention.g{G}.call_s", call_s, how + "; intercept of the relative least-squares fit t = call_s + bytes/rate")
        cal.set(f"gpu.decode_attention.g{G}.bytes_per_s", rate, how + "; slope of the same fit (K/V bytes read)")
        points += [{"group": G, "keys": L, "kv_bytes": b, "seconds": t, "calls": c} for L, (b, t, c) in zip(lengths, pts)]
    cal.extra["decode_attention_points"] = points


def copy_series(direction, n: int, size: int, reps: int = 5) -> tuple[float, float]:
    """Seconds per copy of `n` copies of `size` bytes queued back to back on one stream, as the
    executor issues a group's per-head fetches and a lane's consecutive stages: (queued eagerly
    behind a sleep kernel, so the host's issue rate cannot show; captured in a CUDA graph and
    replayed, as a replayed decode step runs its fetches)."""
    stream = torch.cuda.current_stream()
    queued = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)          # tens of ms of GPU cycles: longer than issuing n copies
        a.record(stream)
        for i in range(n):
            direction(size, i)
        b.record(stream)
        b.synchronize()
        queued.append(a.elapsed_time(b) / 1e3 / n)
    def copies() -> None:
        for i in range(n):
            direction(size, i)
    graphed = graph_median_s(copies, reps) / n
    return statistics.median(queued[1:]), graphed


SERIES_SIZES = (64 * 1024, 256 * 1024, MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)


def link_series(cal: Calibration, n: int = 32) -> None:
    """The link costs the lanes pay: pinned copies queued back to back on one stream (n per size,
    each from/to its own region), seconds per copy vs size, fitted as alpha + bytes/beta in
    relative error. These replace the isolated-copy fit of `links` (kept in the JSON record as
    link_isolated): a copy's latency alone (launch, completion) is not what the next copy queued
    behind it waits for. The same series captured in a CUDA graph (a replayed step's fetches) is
    fitted too and kept in the record (`{h2d,d2h}_graph_alpha_s`, `..._bytes_per_s`)."""
    top = max(SERIES_SIZES)
    host = torch.empty(n * top, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n * top, dtype=torch.uint8, device="cuda")
    cal.extra["link_isolated"] = {k: cal.values[k] for k in ("link.h2d_alpha_s", "link.h2d_bytes_per_s",
                                                             "link.d2h_alpha_s", "link.d2h_bytes_per_s")}
    for name, direction in (("h2d", lambda s, i: dev[i * s:(i + 1) * s].copy_(host[i * s:(i + 1) * s], non_blocking=True)),
                            ("d2h", lambda s, i: host[i * s:(i + 1) * s].copy_(dev[i * s:(i + 1) * s], non_blocking=True))):
        pts = [copy_series(direction, n, s) for s in SERIES_SIZES]
        alpha, beta = fit_alpha_beta_relative(SERIES_SIZES, [q for q, _ in pts])
        how = (f"{n} pinned {name.upper()} copies queued back to back on one stream behind a sleep kernel, sizes "
               f"{SERIES_SIZES[0] // 1024} KiB-{top // MiB} MiB, GPU seconds per copy")
        cal.set(f"link.{name}_alpha_s", alpha, how + ", intercept of the relative least-squares fit")
        cal.set(f"link.{name}_bytes_per_s", beta, "slope of the same fit (" + how + ")")
        g_alpha, g_beta = fit_alpha_beta_relative(SERIES_SIZES, [g for _, g in pts])
        cal.extra[f"{name}_graph_alpha_s"], cal.extra[f"{name}_graph_bytes_per_s"] = g_alpha, g_beta
        cal.extra[f"{name}_series_points"] = [{"bytes": s, "queued_s": q, "graph_s": g}
                                              for s, (q, g) in zip(SERIES_SIZES, pts)]


def links(cal: Calibration, quick: bool) -> None:
    sizes = [64 * 1024, MiB, 16 * MiB, 128 * MiB, 512 * MiB] + ([] if quick else [1024 * MiB])
    host = torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(sizes[-1], dtype=torch.uint8, device="cuda")
    for name, direction in (("h2d", lambda n: dev[:n].copy_(host[:n], non_blocking=True)),
                            ("d2h", lambda n: host[:n].copy_(dev[:n], non_blocking=True))):
        secs = [cuda_median_s(lambda n=n: direction(n), 5) for n in sizes]
        alpha, beta = fit_alpha_beta(sizes, secs)
        cal.set(f"link.{name}_alpha_s", alpha, f"least squares of pinned {name.upper()} copies 64 KiB-{sizes[-1] // MiB} MiB")
        cal.set(f"link.{name}_bytes_per_s", beta, f"slope of the same fit (pinned {name.upper()})")
        cal.extra[f"{name}_points"] = list(zip(sizes, secs))
    n = 256 * MiB
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            dev[:n].copy_(host[:n], non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev[n:2 * n], non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
    sec = cuda_median_s(both, 5)
    one = n / cal.values["link.h2d_bytes_per_s"]
    cal.set("link.pcie_duplex", bool(sec < 1.5 * one), f"256 MiB each way on two streams took {sec * 1e3:.1f} ms vs {one * 1e3:.1f} ms one way")
    cal.extra["duplex_total_bytes_per_s"] = 2 * n / sec


def disk(cal: Calibration, kv_dir: str, quick: bool, block: int = 16 * MiB, depth: int = 4) -> None:
    """O_DIRECT sequential write then read of one file in `kv_dir`, `depth` requests in flight."""
    total = (512 if quick else 2048) * MiB
    cal.set("disk.bytes", shutil.disk_usage(kv_dir).free, f"free bytes of {kv_dir} at calibration")
    path = os.path.join(kv_dir, f"kvpipe-calibrate-{os.getpid()}.bin")
    bufs = [mmap.mmap(-1, block) for _ in range(depth)]   # page-aligned, as O_DIRECT needs
    for b in bufs:
        b.write(os.urandom(block))
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        offsets = list(range(0, total, block))
        with ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: os.pwrite(fd, bufs[i % depth], offsets[i]), range(len(offsets))))
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(lambda i: os.preadv(fd, [bufs[i % depth]], offsets[i]), range(len(offsets))))
            read_s = time.perf_counter() - t0
        small = mmap.mmap(-1, 4096)
        lat = []
        for off in offsets[:: max(1, len(offsets) // 32)]:
            t0 = time.perf_counter()
            os.preadv(fd, [small], off + block // 2)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    direct = "O_DIRECT" if hasattr(os, "O_DIRECT") else "buffered (no O_DIRECT on this OS)"
    cal.set("disk.write_bytes_per_s", total / write_s, f"{direct} write of {total // MiB} MiB in {block // MiB} MiB blocks, {depth} in flight, fsync")
    cal.set("disk.read_bytes_per_s", total / read_s, f"{direct} read of the same file, {depth} in flight")
    cal.set("disk.alpha_s", statistics.median(lat), f"{direct} 4 KiB reads at {len(lat)} offsets, median")



def codecs(cal: Calibration, quick: bool, tokens: int = 32768) -> None:
    """The codecs on the K/V of a prefill of `tokens` random ids through two random-weight
    Llama-3-8B-shaped layers (executor/calibrate/codecs.py): the disk link's CPU codec
    ([codec.zstd-planes], host.cpu_codec_bytes_per_s) and the h2d link's GPU codec
    ([codec.nvcomp-ans-planes]: per-call cost and rate of encode and decode on batches of the
    executor's blocks, the byte-plane kernels, whether a decode waits for in-flight H2D copies).
    Each is optional: a failure (no zstandard, no nvCOMP) leaves its table out and says so."""
    from kvpipe.pipeline.codecs import H2D_BLOCK_TOKENS

    from kvpipe.executor.calibrate import codecs as cp
    from kvpipe.executor.kv.store import MAX_BLOCK, DiskOptions
    made: list[torch.Tensor] = []

    def kv() -> torch.Tensor:                    # [units, tokens, 2, D] bf16, made once (a failure: each step says so)
        if not made:
            made.append(cp.llama_kv(tokens, "cuda"))
        return made[0]
    what = f"the K/V of a {tokens}-token prefill through 2 random-weight Llama-3-8B-shaped layers"
    _optional(cal, "codec.zstd-planes", lambda c: cp.cpu_codec(c, kv(), DiskOptions().threads, MAX_BLOCK, what,
                                                               (64 if quick else 256) << 20))
    _optional(cal, "codec.nvcomp-ans-planes", lambda c: gpu_codec(c, kv(), H2D_BLOCK_TOKENS, what))
    made.clear()
    torch.cuda.empty_cache()


def gpu_codec(cal: Calibration, kv: torch.Tensor, block_tokens: int, what: str) -> None:
    """[codec.nvcomp-ans-planes] as executor/codecs/h2d_store.py runs it (nvCOMP on the gpu lane's stream)."""
    from kvpipe.executor.calibrate import codecs as cp
    from kvpipe.executor.codecs.nvcomp_ans_planes import AnsBlocks
    try:
        import nvidia.nvcomp  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"nvCOMP does not import ({e})") from None
    name = "codec.nvcomp-ans-planes"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())      # the prefill that made `kv`
    with torch.cuda.stream(stream):
        blocks = cp.kv_blocks(kv, block_tokens)
        ans = AnsBlocks(torch.device("cuda", torch.cuda.current_device()), stream, blocks[0].numel())
        try:
            points, ratio, (kept, decode, planes) = cp.gpu_codec_points(blocks, ans, cp.queued_timer(stream))
            cp.set_gpu_codec(cal, "nvcomp-ans-planes", points, ratio, block_tokens, what)
            idle = next(p["decode_host_s"] for p in points if p["blocks"] == kept)
            try:   # the rates stand without it: a failed probe leaves only the wait flag out
                probe = cp.decode_waits_for_h2d(decode, planes, stream, idle)
            except Exception as e:   # noqa: BLE001 - recorded and said, as _optional does for a table
                probe = {"waits": None, "error": f"{type(e).__name__}: {e}"}
        finally:
            ans.close()
    cal.extra[name + ".waits_probe"] = probe
    if probe["waits"] is None:
        print("kvpipe: calibrate: whether an nvCOMP decode waits for in-flight H2D copies is undecided "
              "(see the JSON record); the profile leaves it out", file=sys.stderr)
        return
    ms = ", ".join(f"{r['decode_end_ms']:.1f}" for r in probe["rows"])
    copy = ", ".join(f"{r['decode_copy_end_ms']:.1f}" for r in probe["rows"])
    host = ", ".join(f"{r['decode_host_ms']:.1f}" for r in probe["rows"])
    cal.set(name + ".decompress_waits_h2d", probe["waits"],
            f"a decode of {kept} blocks issued on the codec's stream just after a "
            f"{probe['copy_bytes'] >> 20} MiB pinned H2D copy on another stream ended at {ms} ms, the copy at {copy} ms "
            f"(host ms in the call: {host}; {probe['idle_host_ms']:.2f} with no copy in flight; torch kernels in "
            "the same place ended before the copy: they overlap)")


def _optional(cal: Calibration, what: str, step) -> None:
    """Run a step whose table the profile can do without (the planner then never picks it): a
    failure is recorded in the JSON record and printed, and the calibration goes on."""
    try:
        step(cal)
    except Exception as e:   # noqa: BLE001 - any failure leaves the table out, said so
        for key in [k for k in cal.values if k.startswith(what + ".")]:   # no half-written table
            del cal.values[key], cal.notes[key]
        cal.extra[what] = f"not measured: {type(e).__name__}: {e}"
        print(f"kvpipe: calibrate: {what} not measured ({type(e).__name__}: {e}); the profile has no such table",
              file=sys.stderr)

def _driver_version() -> str:
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0] if out else f"unknown (CUDA runtime {torch.version.cuda})"


def calibrate(base: HardwareProfile, name: str, kv_dir: str | None = None, quick: bool = False,
              progress=print) -> Calibration:
    """Measure this machine (CUDA required). `base` supplies only the datasheet peaks."""
    if not torch.cuda.is_available():
        raise ValueError("calibrate: needs a CUDA GPU (torch.cuda.is_available() is False)")
    kv_dir = kv_dir or tempfile.gettempdir()
    props = torch.cuda.get_device_properties(0)
    driver = _driver_version()
    source = (f"kvpipe calibrate{' --quick' if quick else ''} on {props.name}, CUDA driver {driver}, "
              f"torch {torch.__version__}, {datetime.date.today().isoformat()}")
    free_host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cal = Calibration(name, f"{props.name} (calibrated; datasheet peaks from profile {base.name})", source)
    cal.set("gpu.mem_bytes", torch.cuda.mem_get_info()[1], "cudaMemGetInfo total")
    cal.set("host.mem_bytes", free_host, "physical RAM (sysconf)")
    steps = [("HBM copy", lambda: hbm(cal)), ("kernel launch", lambda: launch(cal)),
             ("small kernels", lambda: small_kernels(cal))]
    eff = {}
    steps.append(("GEMM", lambda: eff.setdefault("bf16", gemm(cal, quick))))
    steps.append(("attention", lambda: attention(cal, eff["bf16"], quick)))
    steps.append(("decode attention", lambda: decode_attention(cal)))
    steps.append(("PCIe links", lambda: links(cal, quick)))
    steps.append(("PCIe back-to-back", lambda: link_series(cal)))
    steps.append(("disk", lambda: disk(cal, kv_dir, quick)))
    steps.append(("host issue", lambda: host_issue(cal)))
    steps.append(("host issue per stage", lambda: host_stage_costs(cal)))
    steps.append(("codecs", lambda: codecs(cal, quick)))
    for i, (label, step) in enumerate(steps, 1):
        t0 = time.perf_counter()
        step()
        progress(f"calibrate [{i}/{len(steps)}] {label}: {time.perf_counter() - t0:.1f} s")
    peak_hbm = max(base.hbm_peak_bytes_per_s, cal.values["gpu.hbm_eff_bytes_per_s"])
    cal.set("gpu.hbm_peak_bytes_per_s", peak_hbm, f"datasheet peak, from profile {base.name}", measured=False)
    for dtype in ("bf16", "fp16", "fp32"):
        key = f"gpu.compute.{dtype}.effective_flops_per_s"
        cal.set(f"gpu.compute.{dtype}.peak_flops_per_s", max(base.flops_peak(dtype), cal.values[key]),
                f"datasheet peak, from profile {base.name}", measured=False)
    if "host.cpu_codec_bytes_per_s" not in cal.values:   # the CPU codec step failed (said so)
        cal.set("host.cpu_codec_bytes_per_s", base.cpu_codec_bytes_per_s,
                f"the CPU codec step failed (see the JSON record); from profile {base.name}", measured=False)
    cal.set("gpu.launch_queue_ops", base.launch_queue_ops, f"assumption carried from profile {base.name}",
            measured=False)
    return cal
