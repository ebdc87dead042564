"""The Triton kernel of executor/quant/dequant_triton.py (which documents it). Imported only where Triton
is installed (by dequant_triton, on first use); under TRITON_INTERPRET=1 (set before Triton is
imported) it runs in Triton's interpreter on CPU tensors, which is how the CPU tests run it.
Shapes: records q [B, J, nb * REC] uint8 (REC bytes a record, the record's bytes contiguous);
the exact slot rows o [B, J, S_cap, 2, D] in the model dtype, any strides. No integer argument
changes between the calls of one store (the strides are the slot layout's; j0, j1 and the block
count only move the base pointers and size the grid; a replayed step's count is read from the
device), so nothing needs `do_not_specialize`."""
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr, INT_ROUND: tl.constexpr):
    """float32 -> `dtype`, rounded to nearest, ties to even (as torch's casts). Compiled, a cast
    (cvt.rn); in Triton's interpreter (INT_ROUND), bfloat16 by integer ops on the bits, as its cast
    to bfloat16 truncates (and its "rtne" rounds ties up, without the carry into the exponent).
    Finite x (a decoded value always is). Compiled, the integer way would cost a third more
    instructions a program than the cast."""
    if INT_ROUND and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def decode_records(q_ptr, o_ptr, count_ptr, sq_b, sq_j, so_b, so_j, so_t, so_kv, so_d,
                   D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, BITS: tl.constexpr,
                   REC: tl.constexpr, HAS_COUNT: tl.constexpr, INT_ROUND: tl.constexpr):
    # one program per (block, unit): 64-bit ids, as byte and element offsets can pass 2^31
    blk = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    if HAS_COUNT:   # a replayed step's kept blocks, on the device: the grid is sized for all
        if blk >= tl.load(count_ptr):
            return
    PER: tl.constexpr = 8 // BITS                      # codes per byte
    NV: tl.constexpr = D // GV                         # V groups per token
    # the record's fields (BlockCodec.parts), byte offsets; metadata float16
    KS: tl.constexpr = 0
    KZ: tl.constexpr = 2 * D
    VS: tl.constexpr = 4 * D
    VZ: tl.constexpr = 4 * D + 2 * G * NV
    KC: tl.constexpr = 4 * D + 4 * G * NV
    VC: tl.constexpr = KC + D * G // PER
    rec = q_ptr + b * sq_b + j * sq_j + blk * REC
    out = o_ptr + b * so_b + j * so_j + (blk * G) * so_t
    f16 = tl.pointer_type(tl.float16)
    dt = o_ptr.dtype.element_ty                        # the model dtype
    t = tl.arange(0, G)                                # token of the block
    d = tl.arange(0, D)                                # channel

    # K: channel-major codes, per channel its G tokens' codes: read as the contiguous [D, G/PER]
    # bytes, unpacked to [D, G] (token 2i in the low nibble), transposed to the slot's [G, D]
    ib = tl.arange(0, G // PER)
    kb = tl.load(rec + KC + d[:, None] * (G // PER) + ib[None, :])
    if BITS == 4:
        kb = tl.reshape(tl.join(kb & 0xF, kb >> 4), [D, G])
    ks = tl.load((rec + KS).to(f16) + d).to(tl.float32)
    kz = tl.load((rec + KZ).to(f16) + d).to(tl.float32)
    # code * scale is exact in float32 (8 x 11 significant bits): the fma rounds as mul-then-add
    k = _round(tl.fma(kb.to(tl.float32), ks[:, None], kz[:, None]), dt, INT_ROUND)          # [D, G]
    # transposed through shared memory (ttgir: one convert_layout), stored 16 bytes a thread
    tl.store(out + t[:, None] * so_t + d[None, :] * so_d, tl.trans(k))

    # V: token-major codes, per token its D channels': read as the contiguous [G, NV, GV/PER]
    # bytes, unpacked to [G, NV, GV] (channel 2i in the low nibble); per (token, group) scale and zero
    n = tl.arange(0, NV)
    ic = tl.arange(0, GV // PER)
    vb = tl.load(rec + VC + t[:, None, None] * (D // PER) + n[None, :, None] * (GV // PER) + ic[None, None, :])
    if BITS == 4:
        vb = tl.reshape(tl.join(vb & 0xF, vb >> 4), [G, NV, GV])
    m = t[:, None] * NV + n[None, :]                                                      # [G, NV]
    vs = tl.load((rec + VS).to(f16) + m).to(tl.float32)
    vz = tl.load((rec + VZ).to(f16) + m).to(tl.float32)
    v = _round(tl.fma(vb.to(tl.float32), vs[:, :, None], vz[:, :, None]), dt, INT_ROUND)   # [G, NV, GV]
    tl.store(out + so_kv + t[:, None] * so_t + d[None, :] * so_d, tl.reshape(v, [G, D]))
