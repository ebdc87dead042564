"""A decode step's one-token projections (`x @ W.T + b` with one row of x) as one hand-written
Triton kernel, the fused decode step's matmul (executor/layers/fused.py) where it runs: cuBLAS
picks split-K tiles for these shapes and reads a 4096 x 4096 weight at 2.4 TB/s of the H200's 4.2
(docs/PERFORMANCE.md, "Resident decode"); a weight-streaming kernel with one program per BLOCK_N
rows reads it near the copy rate.

Products and sums in float32, one fixed order per row, rounded once to the model dtype (as
cuBLAS's bf16 GEMMs accumulate): not cuBLAS's bits, but the same bits on every call of a shape,
so eager issue and graph replay agree and where K/V live changes nothing. More than one row, a
dtype other than bf16/fp16, or KVPIPE_GEMV=cublas: F.linear.

The kernel (executor/layers/gemv_kernels.py) is imported on first use, so CPU CI needs no Triton;
on CPU tensors it runs only in Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported:
the CPU tests run it in a subprocess). A graph capture never compiles: each (device, dtype, N, K,
bias) is compiled by its first call outside a capture (FusedDecode.warm runs every piece), and a
capture that meets one not yet compiled is an error."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BLOCK_N = 8         # output rows a program
BLOCK_K = 512       # weight columns a loop step
WARPS = 4
STAGES = 3
DTYPES = (torch.bfloat16, torch.float16)
SETTINGS = ("auto", "cublas")
_warm: set[tuple] = set()


def setting() -> str:
    """KVPIPE_GEMV, validated (auto when unset): `cublas` keeps F.linear for one-token projections."""
    name = os.environ.get("KVPIPE_GEMV", "auto").strip().lower() or "auto"
    if name not in SETTINGS:
        raise ValueError(f"KVPIPE_GEMV={name!r}: expected one of {', '.join(SETTINGS)}")
    return name


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the kernel cannot serve `linear(x, w, b)`, or None."""
    if setting() == "cublas":
        return "KVPIPE_GEMV=cublas"
    if x.device.type != "cuda" and not _interpreted():
        return "the Triton one-token projection runs on CUDA only (or in Triton's interpreter)"
    if x.numel() != x.shape[-1] or x.shape[-1] != w.shape[1]:
        return "more than one row"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"dtype {x.dtype} / {w.dtype}: bf16 and fp16 only"
    if w.stride(1) != 1 or not x.is_contiguous():
        return "a weight or input that is not row-major"
    if x.device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "no working Triton on this GPU"
    return None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), by the kernel where `unavailable` is None. Never waits on the device."""
    if unavailable(x, w) is not None:
        return F.linear(x, w, b)
    N, K = w.shape
    key = (x.device.type, x.device.index, x.dtype, N, K, b is not None)
    capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing and key not in _warm:
        raise RuntimeError(f"one-token projection {key} not compiled before a graph capture (gemv_triton)")
    from kvpipe.executor.layers import gemv_kernels
    y = x.new_empty(*x.shape[:-1], N)
    gemv_kernels.gemv[(-(-N // BLOCK_N),)](x, w, w if b is None else b, y, N, K, w.stride(0),
                                           HAS_BIAS=b is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                           num_warps=WARPS, num_stages=STAGES)
    if not capturing:
        _warm.add(key)
    return y
