"""The one-token projection kernel of executor/layers/gemv_triton.py (the fused decode step's
matmuls): against a float64 product written here, in Triton's interpreter on CPU (in a subprocess:
TRITON_INTERPRET must be set before Triton is imported), with weight rows past N and columns past
K poisoned with NaN; the reasons it falls back to F.linear; on CUDA compiled, as close to float64
as cuBLAS, a captured replay equal to the eager call, and a capture of a shape never compiled refused."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvpipe.executor.layers import gemv_triton

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (N, K, bias, dtype, constants (BLOCK_N, BLOCK_K) or None for the module's): N and K not
# multiples of the blocks (masked tails), one row, a bias, fp16, and small blocks that loop
CASES = [(37, 1000, False, "bfloat16", None), (8, 512, True, "float16", None), (1, 7, True, "bfloat16", None),
         (50, 300, False, "bfloat16", (4, 64)), (16, 130, True, "float16", (16, 32))]


def _inputs(case, seed: int, device="cpu"):
    """(x, w, b): w a view of a wider weight (row stride K + 5) whose extra rows and columns hold
    NaN, x one row [1, 1, K] in a wider buffer."""
    N, K, bias, dtype, _ = case
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    big = torch.full((N + 3, K + 5), float("nan"))
    big[:N, :K] = torch.randn(N, K, generator=gen) / K ** 0.5
    xs = torch.randn(1, 1, K + 2, generator=gen).to(dtype)
    b = (torch.randn(N, generator=gen).to(dtype).to(device)) if bias else None
    return xs[..., 1:K + 1].contiguous().to(device), big.to(dtype).to(device)[:N, :K], b


def reference(x, w, b) -> torch.Tensor:
    """float64 x @ w.T + b."""
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def _close(got, ref, dtype) -> bool:
    """Within one step of the model dtype (Triton's interpreter truncates float32 to bf16 where CUDA
    rounds to nearest) plus float32 summation noise."""
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    return bool(torch.isfinite(got).all()) and bool(((got.double() - ref).abs() <= step * ref.abs() + 1e-5).all())


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
    assert g.unavailable(x, w) is None
    out.append(g.linear(x, w, b))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernel cannot be interpreted")
def test_the_one_token_projection_equals_a_float64_product_in_the_interpreter(tmp_path):
    # Faults caught: rows past N or columns past K read (NaN there: a tail unmasked), the weight's
    # row stride ignored (w is a view of a wider buffer), the bias dropped or added twice, the K
    # loop stopping after one block (small constants), and the output not rounded to x's dtype.
    path = tmp_path / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVPIPE_GEMV": "auto"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), repr(CASES), os.path.dirname(__file__)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(path)
    assert len(got) == len(CASES)
    for i, (case, y) in enumerate(zip(CASES, got)):
        x, w, b = _inputs(case, i)
        assert y.shape == (1, 1, case[0]) and y.dtype == x.dtype, case
        assert _close(y, reference(x, w, b), x.dtype), case


def test_the_reasons_the_one_token_projection_falls_back_to_f_linear(monkeypatch):
    # Faults caught: the CPU taken for a device the kernel runs on (outside the interpreter), two
    # rows (a prefill chunk, a batch) or fp32 sent to the one-row kernel, a column-major weight
    # read as row-major, KVPIPE_GEMV=cublas ignored or a bad value accepted; and a fallback that
    # is not F.linear's own answer.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVPIPE_GEMV", raising=False)
    x, w = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert "CUDA" in gemv_triton.unavailable(x, w)
    assert torch.equal(gemv_triton.linear(x, w), F.linear(x, w))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gemv_triton.unavailable(x, w) is None
    assert "more than one row" in gemv_triton.unavailable(torch.randn(1, 2, 64, dtype=torch.bfloat16), w)
    assert "float32" in gemv_triton.unavailable(x.float(), w.float())
    assert "row-major" in gemv_triton.unavailable(x, torch.randn(64, 32, dtype=torch.bfloat16).T)
    monkeypatch.setenv("KVPIPE_GEMV", "cublas")
    assert "cublas" in gemv_triton.unavailable(x, w)
    monkeypatch.setenv("KVPIPE_GEMV", "fast")
    with pytest.raises(ValueError, match="KVPIPE_GEMV"):
        gemv_triton.unavailable(x, w)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_the_compiled_one_token_projection_on_cuda(monkeypatch):
    # Faults caught: as the interpreter test, compiled; an error against float64 larger than
    # cuBLAS's by more than a rounding step at the decode shapes; a captured replay giving other
    # bits than the eager call; and a capture of a shape not compiled before it let through.
    monkeypatch.delenv("KVPIPE_GEMV", raising=False)
    for i, case in enumerate(CASES[:3] + [(6144, 4096, False, "bfloat16", None), (4096, 14336, True, "bfloat16", None)]):
        x, w, b = _inputs(case, i, "cuda")
        got = gemv_triton.linear(x, w, b)
        ref = reference(x, w, b)
        assert _close(got, ref, x.dtype), case
        mine, theirs = (got.double() - ref).norm().item(), (F.linear(x, w, b).double() - ref).norm().item()
        assert mine <= 1.1 * theirs + 1e-6, (case, mine, theirs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv_triton.linear(x, w, b)
    g.replay()
    assert torch.equal(out.view(torch.int16), got.view(torch.int16))
    x7, w7 = torch.zeros(1, 1, 72, dtype=torch.bfloat16, device="cuda"), torch.zeros(7, 72, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="not compiled"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            gemv_triton.linear(x7, w7)
