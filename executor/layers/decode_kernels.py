"""The Triton kernels of executor/layers/decode_triton.py (which documents them). Imported only where
Triton is installed (by decode_triton, on first use); under TRITON_INTERPRET=1 (set before Triton
is imported) they run in Triton's interpreter on CPU tensors, which is how the CPU tests run them.
The integer arguments that move between calls (strides that follow a buffer's capacity, the
split count) are never 1 and always multiples of 16, so one compiled variant serves every call of
a (dtype, head dim, query rows) and a captured graph never compiles."""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def split_attend(q_ptr, kv_ptr, lens_ptr, o_ptr, lse_ptr, scale2,
                 sq_h, skv_g, skv_t, skv_kv, so_g, so_s, sl_g,
                 R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    # one program per (KV head, split of SPLIT keys): its R query heads against the split's keys
    # below lens, read once; the split's output normalised within it and its log2-sum-exp2
    g = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    lens = tl.load(lens_ptr)
    s0 = sp * SPLIT
    if s0 >= lens:          # past the step's keys: the combine never reads this split
        return
    s1 = tl.minimum(s0 + SPLIT, lens)
    rows = tl.arange(0, RP)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (g * R + rows)[:, None] * sq_h + cols[None, :], mask=(rows < R)[:, None], other=0.0)
    if F32:     # Triton's interpreter: its bf16 products are wrong, so the tiles go to float32
        q = q.to(tl.float32)
    m = tl.full([RP], float("-inf"), tl.float32)
    l = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, D], tl.float32)
    base = kv_ptr + g * skv_g
    for t0 in range(s0, s1, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < s1
        at = base + t.to(tl.int64)[:, None] * skv_t + cols[None, :]
        k = tl.load(at, mask=ok[:, None], other=0.0)
        v = tl.load(at + skv_kv, mask=ok[:, None], other=0.0)
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale2                          # [RP, BLOCK_N], log2 units
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        hi = p.to(v.dtype)   # P as two model-dtype terms: P.V to ~16 bits of P, not FA2's 8
        lo = (p - hi.to(tl.float32)).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(hi, v) + tl.dot(lo, v)
        m = m_new
    out = acc / l[:, None]
    keep = (rows < R)[:, None]
    tl.store(o_ptr + g * so_g + sp * so_s + rows[:, None] * D + cols[None, :], out, mask=keep)
    tl.store(lse_ptr + g * sl_g + sp * R + rows, m + tl.log2(l), mask=rows < R)


@triton.jit
def combine(o_ptr, lse_ptr, lens_ptr, out_ptr, so_g, so_s, sl_g, sout_h,
            R: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    # one program per query head: the splits' outputs weighted by their share of the softmax, in
    # split order (fixed: the bits never depend on which program finished first)
    h = tl.program_id(0)
    g = (h // R).to(tl.int64)
    r = h % R
    n = (tl.load(lens_ptr) + SPLIT - 1) // SPLIT
    j = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, D)
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for j0 in range(0, n, BLOCK_S):
        top = tl.maximum(top, tl.load(lse_ptr + g * sl_g + (j0 + j) * R + r, mask=j0 + j < n, other=float("-inf")))
    M = tl.max(top, 0)
    den = tl.zeros([BLOCK_S], tl.float32)
    num = tl.zeros([BLOCK_S, D], tl.float32)
    for j0 in range(0, n, BLOCK_S):
        ok = j0 + j < n
        w = tl.exp2(tl.load(lse_ptr + g * sl_g + (j0 + j) * R + r, mask=ok, other=float("-inf")) - M)
        o = tl.load(o_ptr + g * so_g + (j0 + j)[:, None] * so_s + r * D + cols[None, :], mask=ok[:, None], other=0.0)
        den += w
        num += w[:, None] * o
    res = tl.sum(num, 0) / tl.sum(den, 0)
    tl.store(out_ptr + h * sout_h + cols, res.to(out_ptr.dtype.element_ty))
