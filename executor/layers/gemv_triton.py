"""A decode step's one-token projections whose output is no wider than their input (`x @ W.T + b`
with one row of x and N <= K: Llama's o and down) as one hand-written Triton kernel, in the fused
decode step (executor/layers/fused.py). For these shapes cuBLAS splits K and adds a reduce kernel
(2.5 TB/s for a 4096 x 4096 weight on the H200, 3.5 for 4096 x 14336); a weight-streaming kernel
with one program per BLOCK_N rows reads them at 2.9 and 3.7 (experiments/gemv.py,
docs/PERFORMANCE.md "Resident decode"). Wider outputs (q/k/v, gate/up, lm_head) keep cuBLAS, whose
own tiles read them faster than this kernel. `gated_linear` also folds the MLP's silu(gate) * up
into the down projection's loads (one kernel and one round trip fewer).

Products and sums in float32, one fixed order per row, rounded once to the model dtype (as
cuBLAS's bf16 GEMMs accumulate): not cuBLAS's bits, but the same bits on every call of a shape,
so eager issue and graph replay agree and where K/V live changes nothing. More than one row, a
dtype other than bf16/fp16, or KVPIPE_GEMV=cublas: F.linear.

The kernel (executor/layers/gemv_kernels.py) is imported on first use, so CPU CI needs no Triton;
on CPU tensors it runs only in Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported:
the CPU tests run it in a subprocess). A graph capture never compiles: each (device, dtype, N, K,
bias, gated) is compiled by its first call outside a capture (FusedDecode.warm runs every piece),
and a capture that meets one not yet compiled is an error."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpipe.executor.layers import kernel_env

BLOCK_N = 4         # output rows a program   (the least time over o + down of 36 settings swept)
BLOCK_K = 1024      # weight columns a loop step
WARPS = 4
STAGES = 2
DTYPES = (torch.bfloat16, torch.float16)
SETTINGS = ("auto", "cublas")
_warm: set[tuple] = set()


def setting() -> str:
    """KVPIPE_GEMV, validated (auto when unset): `cublas` keeps F.linear for one-token projections."""
    return kernel_env.setting("KVPIPE_GEMV", SETTINGS)


def unavailable(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> str | None:
    """Why the kernel cannot serve `linear(x, w, b)` (`gated_linear` with `gated`), or None."""
    if setting() == "cublas":
        return "KVPIPE_GEMV=cublas"
    if x.device.type != "cuda" and not kernel_env.interpreted():
        return "the Triton one-token projection runs on CUDA only (or in Triton's interpreter)"
    if x.numel() != x.shape[-1] or x.shape[-1] != w.shape[1] * (2 if gated else 1):
        return "more than one row"
    if w.shape[0] > w.shape[1]:
        return f"an output wider than its input ({w.shape[0]} > {w.shape[1]}): cuBLAS's tiles read it faster"
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
    return _launch(x, w, b, False)


def gated_linear(gate_up: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str, act_mul) -> torch.Tensor:
    """F.linear(act(gate) * up, w, b) for gate_up [..., 2K] = [gate | up], by the kernel where it
    runs (act "silu"); elsewhere `act_mul(gate, up)` then F.linear."""
    if act != "silu" or unavailable(gate_up, w, gated=True) is not None:
        return F.linear(act_mul(*gate_up.chunk(2, dim=-1)), w, b)
    return _launch(gate_up, w, b, True)


def _launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gated: bool) -> torch.Tensor:
    N, K = w.shape
    key = (x.device.type, x.device.index, x.dtype, N, K, b is not None, gated)
    capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing and key not in _warm:
        raise RuntimeError(f"one-token projection {key} not compiled before a graph capture (gemv_triton)")
    from kvpipe.executor.layers import gemv_kernels
    y = x.new_empty(*x.shape[:-1], N)
    gemv_kernels.gemv[(-(-N // BLOCK_N),)](x, w, w if b is None else b, y, N, K, w.stride(0),
                                           HAS_BIAS=b is not None, GATED=gated, BLOCK_N=BLOCK_N,
                                           BLOCK_K=BLOCK_K, num_warps=WARPS, num_stages=STAGES)
    if not capturing:
        _warm.add(key)
    return y
