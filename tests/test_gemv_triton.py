"""The one-token projection kernel of executor/layers/gemv_triton.py (the fused decode step's
matmuls): against a float64 product written here, in Triton's interpreter on CPU (in a subprocess:
TRITON_INTERPRET must be set before Triton is imported), with weight rows past N and columns past
K poisoned with NaN; the reasons it falls back to F.linear; on CUDA compiled, as close to float64
as cuBLAS, a captured replay equal to the eager call, and a capture of a shape never compiled refused."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import run_interpreted
import torch.nn.functional as F

from kvpipe.executor.layers import gemv_triton

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (N, K, bias, gated, dtype, constants (BLOCK_N, BLOCK_K) or None for the module's): N and K not
# multiples of the blocks (masked tails), one row, a bias, the gated input, fp16, small blocks that loop
CASES = [(37, 1000, False, False, "bfloat16", None), (8, 512, True, False, "float16", None),
         (1, 7, True, False, "bfloat16", None), (50, 300, False, False, "bfloat16", (4, 64)),
         (16, 130, True, False, "float16", (16, 32)), (40, 300, False, True, "bfloat16", (8, 64)),
         (9, 100, True, True, "float16", None)]


def _inputs(case, seed: int, device="cpu"):
    """(x, w, b): w a view of a wider weight (row stride K + 5) whose extra rows and columns hold
    NaN, x one row [1, 1, K] ([1, 1, 2K], gate then up, when gated) cut from a wider buffer."""
    N, K, bias, gated, dtype, _ = case
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    big = torch.full((N + 3, K + 5), float("nan"))
    big[:N, :K] = torch.randn(N, K, generator=gen) / K ** 0.5
    n = 2 * K if gated else K
    xs = (torch.randn(1, 1, n + 2, generator=gen) * 2).to(dtype)
    b = (torch.randn(N, generator=gen).to(dtype).to(device)) if bias else None
    return xs[..., 1:n + 1].contiguous().to(device), big.to(dtype).to(device)[:N, :K], b


def reference(x, w, b, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 x @ w.T + b, the bound of float32 sums and roundings: |w| @ |x| + |b|); gated: x is
    silu(gate) * up as HF's two bf16/fp16 ops round them."""
    if gated:
        gate, up = x.cpu().chunk(2, dim=-1)
        x = (F.silu(gate) * up).to(x.device)
    y, bound = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    return (y, bound) if b is None else (y + b.double(), bound + b.double().abs())


def _close(got, ref, dtype) -> bool:
    """Within one step of the model dtype of |w| @ |x| + |b| (Triton's interpreter truncates float32
    to bf16 where CUDA rounds to nearest, and the gated input's roundings may differ by a step)."""
    y, bound = ref
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    return bool(torch.isfinite(got).all()) and bool(((got.double() - y).abs() <= step * bound + 1e-6).all())


_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_gemv_triton import _inputs
from kvpipe.executor.layers import gemv_triton as g
out = []
for i, case in enumerate(eval(sys.argv[2])):
    if case[-1] is not None:
        g.BLOCK_N, g.BLOCK_K = case[-1]
    x, w, b = _inputs(case, i)
    assert g.unavailable(x, w, gated=case[3]) is None
    out.append(g.gated_linear(x, w, b, "silu", None) if case[3] else g.linear(x, w, b))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernel cannot be interpreted")
def test_the_one_token_projection_equals_a_float64_product_in_the_interpreter(tmp_path):
    # Faults caught: rows past N or columns past K read (NaN there: a tail unmasked), the weight's
    # row stride ignored (w is a view of a wider buffer), the bias dropped or added twice, the K
    # loop stopping after one block (small constants), the output not rounded to x's dtype, and
    # the gated input wrong (up read from gate's half, silu left out, gate and up swapped).
    got = run_interpreted(_SCRIPT, CASES, tmp_path, KVPIPE_GEMV="auto")
    for i, (case, y) in enumerate(zip(CASES, got)):
        x, w, b = _inputs(case, i)
        assert y.shape == (1, 1, case[0]) and y.dtype == x.dtype, case
        assert _close(y, reference(x, w, b, case[3]), x.dtype), case


def test_the_reasons_the_one_token_projection_falls_back_to_f_linear(monkeypatch):
    # Faults caught: the CPU taken for a device the kernel runs on (outside the interpreter), two
    # rows (a prefill chunk, a batch) or fp32 sent to the one-row kernel, a column-major weight
    # read as row-major, a wide output (q/k/v, gate/up: cuBLAS is faster there) sent to it,
    # KVPIPE_GEMV=cublas ignored or a bad value accepted; and a fallback that is not F.linear's
    # own answer, or a gated fallback that skips act_mul.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVPIPE_GEMV", raising=False)
    x, w = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert "CUDA" in gemv_triton.unavailable(x, w)
    assert torch.equal(gemv_triton.linear(x, w), F.linear(x, w))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gemv_triton.unavailable(x, w) is None
    assert "more than one row" in gemv_triton.unavailable(torch.randn(1, 2, 64, dtype=torch.bfloat16), w)
    assert "float32" in gemv_triton.unavailable(x.float(), w.float())
    assert "row-major" in gemv_triton.unavailable(x, torch.randn(32, 64, dtype=torch.bfloat16).T.contiguous().T)
    assert "wider" in gemv_triton.unavailable(torch.randn(1, 1, 32, dtype=torch.bfloat16), torch.randn(64, 32, dtype=torch.bfloat16))
    assert "more than one row" in gemv_triton.unavailable(x, w, gated=True)   # gated: x holds 2K
    monkeypatch.setenv("KVPIPE_GEMV", "cublas")
    assert "cublas" in gemv_triton.unavailable(x, w)
    gu = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    act_mul = lambda g, u: F.silu(g) * u   # noqa: E731
    assert torch.equal(gemv_triton.gated_linear(gu, w, None, "silu", act_mul), F.linear(act_mul(*gu.chunk(2, -1)), w))
    monkeypatch.setenv("KVPIPE_GEMV", "fast")
    with pytest.raises(ValueError, match="KVPIPE_GEMV"):
        gemv_triton.unavailable(x, w)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_the_compiled_one_token_projection_on_cuda(monkeypatch):
    # Faults caught: as the interpreter test, compiled (CUDA rounds to nearest: the gated input must
    # round as F.silu then the product do); an error against float64 larger than cuBLAS's (after
    # HF's act_mul for the gated input) by a tenth, at the test's and the decode shapes; a captured replay giving other
    # bits than the eager call; and a capture of a shape not compiled before it let through.
    monkeypatch.delenv("KVPIPE_GEMV", raising=False)
    act_mul = lambda g, u: F.silu(g) * u   # noqa: E731
    for i, case in enumerate(CASES + [(4096, 4096, False, False, "bfloat16", None), (4096, 14336, False, True, "bfloat16", None)]):
        x, w, b = _inputs(case, i, "cuda")
        assert gemv_triton.unavailable(x, w, gated=case[3]) is None, case
        got = gemv_triton.gated_linear(x, w, b, "silu", act_mul) if case[3] else gemv_triton.linear(x, w, b)
        ref = reference(x, w, b, case[3])
        assert _close(got, ref, x.dtype), case
        cublas = F.linear(act_mul(*x.chunk(2, -1)) if case[3] else x, w, b)
        mine, theirs = (got.double() - ref[0]).norm().item(), (cublas.double() - ref[0]).norm().item()
        assert mine <= 1.1 * theirs + 1e-6, (case, mine, theirs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):     # the last case: the gated down projection at Llama-3-8B's shape
        out = gemv_triton.gated_linear(x, w, b, "silu", act_mul)
    g.replay()
    assert torch.equal(out.view(torch.int16), got.view(torch.int16))
    x7, w7 = torch.zeros(1, 1, 72, dtype=torch.bfloat16, device="cuda"), torch.zeros(7, 72, dtype=torch.bfloat16, device="cuda")   # 7 x 72: never compiled
    with pytest.raises(RuntimeError, match="not compiled"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gemv_triton.linear(x7, w7)
