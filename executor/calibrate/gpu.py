"""`kvpipe calibrate`'s GPU rates: GEMM at the graph's shapes, kernel launch cost, the small-kernel
floor and elementwise rate of one decoder layer's non-GEMM ops, and the HBM copy rate."""
from __future__ import annotations

import time

import torch

from kvpipe.pipeline.calibration import Calibration, half_rate_flops

from kvpipe.executor.calibrate.timing import cuda_median_s, graph_median_s


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
    executor/calibrate/op_inventory.py's recorder, which keeps every small kernel's call; those calls alone are
    then run again: at 1 token captured in a CUDA graph (GPU seconds per kernel: the floor), at
    `tokens` tokens eagerly (bytes read + written per second, over the HBM copy rate)."""
    cfg = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=2 * tokens + 8, tie_word_embeddings=False)
    found = {T: small_point(cfg, T, reps) for T in (1, tokens)}
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


def small_point(cfg: dict, T: int, reps: int) -> tuple[int, int, float]:
    """(kernels, bytes, GPU seconds) of the recorded small kernels of layer 0 of random-weight bf16
    `cfg` at T tokens: replayed `reps`x in a CUDA graph at 1 token (seconds per replay), eagerly else."""
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.layers.loader import random_model
    a = HFAdapter(random_model(cfg, "cuda", torch.bfloat16, 0))
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
    return inv.kernels, inv.bytes, sec


def hbm(cal: Calibration) -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    sec = cuda_median_s(lambda: dst.copy_(src), 5)
    cal.set("gpu.hbm_eff_bytes_per_s", 2 * src.numel() / sec, "1 GiB device-to-device copy, read + write bytes")
