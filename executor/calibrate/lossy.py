"""`kvpipe calibrate`'s LOSSY stages, with the executor's own kernels: the quantise a prefill chunk's
offloaded K/V goes through (executor/quant/blocks.BlockCodec.encode, int4 and int8) as
gpu.quant_call_s + bytes / gpu.quant_bytes_per_s over the bytes the simulator's `quant` stage
counts (pipeline/builder.py: the exact K/V read plus the records written), and sparse decode's
`score` stage (executor/sparse/rank_triton.rank_select_static, PIPE_UNITS units a piece, replayed
from a CUDA graph as a replayed step runs it) as gpu.sparse_score_call_s + code bytes /
gpu.sparse_score_bytes_per_s."""
from __future__ import annotations

import math

import torch

from kvpipe.pipeline.calibration import Calibration, fit_alpha_beta_relative
from kvpipe.pipeline.lossy import BLOCK_RANK, PIPE_UNITS, LossySpec

from kvpipe.executor.calibrate.run_shapes import back_to_back_s
from kvpipe.executor.calibrate.timing import graph_median_s


def quant_points(dev: torch.device, chunks, units: int = 8, d: int = 128) -> list[dict]:
    """BlockCodec.encode of `units` units' K/V of each chunk, int4 and int8: on CUDA its kernels'
    device time replayed from a CUDA graph (the host's issue and its range-check read are the
    simulator's host lane), on a CPU back to back."""
    from kvpipe.executor.quant.blocks import BlockCodec
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pts = []
    for quant, bits in (("int4", 4), ("int8", 8)):
        spec = LossySpec(quant)
        codec = BlockCodec(bits, spec.group, d, dt, spec.vgroup)
        for n in chunks:
            kv = torch.randn(units * n // spec.group, spec.group, 2, d, device=dev, dtype=dt)
            if dev.type == "cuda":   # its kernels' GPU time: the range check to a device flag, no host read
                flag = torch.zeros((), dtype=torch.bool, device=dev)   # (the simulator charges the read as a host wait)
                sec = graph_median_s(lambda: codec.encode(kv, flag), 5)
            else:
                sec = back_to_back_s(lambda: codec.encode(kv), dev)
            raw = units * n * 2 * d * dt.itemsize
            pts.append({"quant": quant, "tokens": n, "units": units, "seconds": sec,
                        "bytes": raw + units * spec.unit_bytes(n, d, dt.itemsize)})
            del kv
    return pts


def quant(cal: Calibration, dev: torch.device, chunks=(2048, 8192, 32768)) -> None:
    pts = quant_points(dev, chunks)
    call, rate = fit_alpha_beta_relative([p["bytes"] for p in pts], [p["seconds"] for p in pts])
    how = (f"executor/quant/blocks.BlockCodec.encode (int4 and int8, the default groups) of 8 units' K/V of "
           f"{list(chunks)}-token chunks, device time in a CUDA graph (range check to a device flag) after the clock "
           "warm-up; relative least squares of "
           "seconds = call_s + (exact bytes read + record bytes written) / rate")
    cal.set("gpu.quant_call_s", call, how + " (intercept)")
    cal.set("gpu.quant_bytes_per_s", rate, how + " (slope)")
    cal.extra["quant_points"] = pts


def score_point(dev: torch.device, prefix: int, units: int = 8, r: int = 4, d: int = 128,
                fraction: float = 0.2) -> tuple[int, float, int]:
    """(code bytes, device seconds, pieces) of one replayed score stage over `units` units of
    `prefix` tokens (random keys with heavy-tailed channels; the timing does not depend on them)."""
    from kvpipe.executor.replay import sparse_step
    from kvpipe.executor.sparse import rank_triton, sketch
    spec = LossySpec(sparse=fraction)
    sealed = prefix // spec.chunk * spec.chunk
    g = torch.Generator(device=dev).manual_seed(0)
    k = (torch.randn(units, sealed, d, generator=g, device=dev)
         * (1 + 10 * torch.rand(d, generator=g, device=dev))).bfloat16()
    blocks = k.view(units, sealed // spec.chunk, spec.chunk, d)
    lo, hi = blocks.amin(2), blocks.amax(2)
    codes = sketch.encode(k, lo, hi, spec.sketch)
    del k, blocks
    q = torch.randn(units, r, d, generator=g, device=dev).bfloat16()
    row = sparse_step.step_args(spec, prefix)
    a = torch.tensor(row, dtype=torch.long, device=dev)
    shapes = (row[sparse_step.TOTAL], row[sparse_step.H0], row[sparse_step.H1], row[sparse_step.N])
    sec = graph_median_s(lambda: rank_triton.rank_select_static(q, lo, hi, codes, spec.sketch, a, *shapes, blocks=1,
                                                                how=BLOCK_RANK, piece=PIPE_UNITS), 5)
    return codes.numel(), sec, math.ceil(units / PIPE_UNITS)


def sparse_score(cal: Calibration, dev: torch.device, prefixes=(32768, 131072)) -> None:
    """[gpu] sparse_score_*: t = pieces x call_s + code bytes / rate, relative least squares per piece."""
    from kvpipe.executor.sparse import rank_triton
    why = rank_triton.unavailable(dev, 128, LossySpec(sparse=0.2).sketch)
    if why is not None:
        raise RuntimeError(f"the Triton ranking does not run here ({why})")
    pts = [score_point(dev, p) for p in prefixes]
    call, rate = fit_alpha_beta_relative([b / k for b, _, k in pts], [t / k for _, t, k in pts])
    how = (f"the score stage (executor/sparse/rank_triton.rank_select_static, {PIPE_UNITS} units a piece, "
           f"2-bit codes, 20% of tokens, GQA 4, D 128) over 8 units at {list(prefixes)} tokens, CUDA-graph device "
           "time, median of 5; relative least squares of t = pieces x call_s + code bytes / rate")
    cal.set("gpu.sparse_score_call_s", call, how + " (intercept)")
    cal.set("gpu.sparse_score_bytes_per_s", rate, how + " (slope, packed code bytes read per second)")
    cal.extra["sparse_score_points"] = [{"prefix": p, "code_bytes": b, "seconds": t, "pieces": k}
                                        for p, (b, t, k) in zip(prefixes, pts)]


def gather_points(dev: torch.device, units: int = 8, rows: int = 4096, picks=(256, 1024, 4096)) -> list[dict]:
    """The UVA gather (executor/sparse/gather.py: index_select through a CUDA view of a pinned
    host home, one call per unit) of `picks` sorted random rows of `units` units, for int4's block
    records and for exact token rows, replayed in a CUDA graph: seconds per call."""
    from kvpipe.executor.quant.blocks import BlockCodec
    from kvpipe.executor.sparse.gather import device_view
    spec = LossySpec("int4")
    pts = []
    for what, row in (("int4 block records", BlockCodec(4, spec.group, 128, torch.bfloat16, spec.vgroup).record),
                      ("exact token rows", 2 * 128 * 2)):
        home = torch.randint(0, 255, (units, rows, row), dtype=torch.uint8).pin_memory()
        view = device_view(home, dev)
        if view is None:
            raise RuntimeError("the GPU cannot address pinned host memory (the run's gather is staged)")
        dst = torch.empty(units, rows, row, dtype=torch.uint8, device=dev)
        g = torch.Generator(device=dev).manual_seed(0)
        for n in picks:
            idx = torch.stack([torch.randperm(rows, generator=g, device=dev)[:n].sort().values for _ in range(units)])

            def step() -> None:
                for u in range(units):
                    torch.index_select(view[u], 0, idx[u], out=dst[u, :n])
            pts.append({"rows": what, "row_bytes": row, "picks": n, "bytes": n * row,
                        "seconds": graph_median_s(step, 5) / units})
        del view, home
    return pts


def gather(cal: Calibration, dev: torch.device) -> None:
    """[link] gather_*: t = call_s + bytes / rate per unit's gather, relative least squares."""
    pts = gather_points(dev)
    call, rate = fit_alpha_beta_relative([p["bytes"] for p in pts], [p["seconds"] for p in pts])
    how = ("the sparse decode's UVA gather (executor/sparse/gather.py: index_select through a CUDA view of a pinned "
           "host home) of 256-4096 sorted random rows of 8 units, int4 block records and exact token rows, one call "
           "per unit, CUDA-graph device time, median of 5; relative least squares of t = call_s + bytes / rate")
    cal.set("link.gather_call_s", call, how + " (intercept)")
    cal.set("link.gather_bytes_per_s", rate, how + " (slope)")
    cal.extra["gather_points"] = pts
