"""The Triton kernel of executor/layers/gemv_triton.py (which documents it). Imported only where
Triton is installed (by gemv_triton, on first use); under TRITON_INTERPRET=1 (set before Triton is
imported) it runs in Triton's interpreter on CPU tensors, which is how the CPU tests run it."""
import triton
import triton.language as tl


@triton.jit
def gemv(x_ptr, w_ptr, b_ptr, y_ptr, N, K, sw_n,
         HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per BLOCK_N output rows: each row's whole K in one fixed order (no split-K, no
    # atomics), so every call of a shape gives the same bits, eager or replayed. GATED: x holds
    # [gate | up] (2K values) and the input is silu(gate) * up, each rounded to the model dtype
    # as HF's two ops round them
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = rows < N
    at = w_ptr + rows.to(tl.int64)[:, None] * sw_n
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = cols < K
        x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(x_ptr + K + cols, mask=ok, other=0.0).to(tl.float32)
            act = (x / (1.0 + tl.exp(-x))).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(at + cols[None, :], mask=live[:, None] & ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=live)
