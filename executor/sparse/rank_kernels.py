"""The Triton kernels of executor/sparse/rank_triton.py (which documents them). Imported only where
Triton is installed (by rank_triton, on first use); under TRITON_INTERPRET=1 (set before Triton
is imported) they run in Triton's interpreter on CPU tensors, which is how the CPU tests run them. Shapes: q [U, G, D] float32; lo, hi [U, C, D]; codes [U, S, D*BITS/8]
uint8; scores [U, G, S]; per-tile max/sum [U, G, n_tiles]; lse [U, G]; rank [U, S].
The integer arguments that change from step to step (token counts, tile counts, the rank's row
stride) are not specialised (`do_not_specialize`): Triton would otherwise compile a variant per
divisibility class of each, i.e. recompile during decode."""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S", "n_tiles"])
def score(q_ptr, lo_ptr, hi_ptr, codes_ptr, s_ptr, m_ptr, l_ptr, S, n_tiles,
           slo_u, slo_c, shi_u, shi_c, sc_u, sc_t,
           G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr,
           BLOCK: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)   # 64-bit offsets: units x tokens x bytes can pass 2^31
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)                             # [T] token
    live = t < S
    d = tl.arange(0, D)                                                # [D] channel
    per = 8 // BITS
    c = t // CHUNK                                                     # [T] chunk of each token
    byte = tl.load(codes_ptr + u * sc_u + t[:, None] * sc_t + (d // per)[None, :], mask=live[:, None], other=0)
    cell = ((byte.to(tl.int32) >> ((d % per) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    lo = tl.load(lo_ptr + u * slo_u + c[:, None] * slo_c + d[None, :], mask=live[:, None], other=0).to(tl.float32)
    hi = tl.load(hi_ptr + u * shi_u + c[:, None] * shi_c + d[None, :], mask=live[:, None], other=0).to(tl.float32)
    k = lo + (cell + 0.5) * ((hi - lo) / (1 << BITS))                  # [T, D] the rebuilt keys
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (u * G + g) * D + d)                      # [D] float32, already / sqrt(D)
        s = tl.sum(k * qg[None, :], axis=1)                            # [T]
        tl.store(s_ptr + (u * G + g) * S + t, s, mask=live)
        sm = tl.where(live, s, -float("inf"))
        mx = tl.max(sm, axis=0)
        tl.store(m_ptr + (u * G + g) * n_tiles + tile, mx)
        tl.store(l_ptr + (u * G + g) * n_tiles + tile, tl.sum(tl.exp(sm - mx), axis=0))


@triton.jit(do_not_specialize=["S", "n_tiles"])
def score_chunk(q_ptr, lo_ptr, hi_ptr, codes_ptr, s_ptr, m_ptr, l_ptr, S, n_tiles,
                slo_u, slo_c, shi_u, shi_c, sc_u, sc_t,
                G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):
    # `score` with the chunk's range factored out (BLOCK divides CHUNK: a tile lies in ONE chunk):
    # q . k_hat = q . (lo + step / 2) + sum_d cell_d (q_d step_d), so the tile loads its chunk's
    # lo, hi once as [D] vectors (not a [BLOCK, D] tile of each) and never rebuilds k_hat.
    u = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)                             # [T] token
    live = t < S
    d = tl.arange(0, D)                                                # [D] channel
    c = (tile * BLOCK) // CHUNK                                        # the tile's chunk
    lo = tl.load(lo_ptr + u * slo_u + c * slo_c + d).to(tl.float32)    # [D]
    hi = tl.load(hi_ptr + u * shi_u + c * shi_c + d).to(tl.float32)
    step = (hi - lo) / (1 << BITS)
    base = lo + 0.5 * step                                             # the centre of cell 0
    # each channel loads its byte (read by its 8/BITS channels; the reads coalesce): faster than
    # loading each byte once and splitting it by shifts ([T, D/per, per] reshaped)
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(codes_ptr + u * sc_u + t[:, None] * sc_t + (d // PER)[None, :], mask=live[:, None], other=0)
    cell = ((byte.to(tl.int32) >> ((d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)   # [T, D]
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (u * G + g) * D + d)                      # [D] float32, already / sqrt(D)
        s = tl.sum(cell * (qg * step)[None, :], axis=1) + tl.sum(qg * base, axis=0)   # [T]
        tl.store(s_ptr + (u * G + g) * S + t, s, mask=live)
        sm = tl.where(live, s, -float("inf"))
        mx = tl.max(sm, axis=0)
        tl.store(m_ptr + (u * G + g) * n_tiles + tile, mx)
        tl.store(l_ptr + (u * G + g) * n_tiles + tile, tl.sum(tl.exp(sm - mx), axis=0))


@triton.jit(do_not_specialize=["S", "n_tiles"])
def score_dot(q_ptr, lo_ptr, hi_ptr, codes_ptr, s_ptr, m_ptr, l_ptr, S, n_tiles,
              slo_u, slo_c, shi_u, shi_c, sc_u, sc_t,
              G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, CHUNK: tl.constexpr,
              BLOCK: tl.constexpr):
    # `score_chunk`'s sum on the tensor cores: the tile's packed codes are loaded once as bytes
    # [T, D / PER]; the codes at bit offset j * BITS of every byte are channels PER * i + j, so the
    # tile's scores are sum_j cells_j [T, D/PER] @ W_j [D/PER, GP] with W_j[i, g] = q_g[PER i + j]
    # step[PER i + j] (GP: the heads padded to a tensor-core width, >= 16): PER matrix products
    # and no unpacked [T, D] tile. Cells (< 2^BITS) are exact in tf32; W is split in two tf32
    # parts (3xTF32: ~2^-22 relative per term, against fp32's 2^-24), the products summed in fp32.
    u = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BLOCK + tl.arange(0, BLOCK)                             # [T] token
    live = t < S
    PER: tl.constexpr = 8 // BITS
    DB: tl.constexpr = D // PER                                        # bytes of one token's codes
    i = tl.arange(0, DB)                                               # [DB] byte
    g = tl.arange(0, GP)                                               # [GP] head (padded)
    hv = g < G
    c = (tile * BLOCK) // CHUNK                                        # the tile's chunk
    byte = tl.load(codes_ptr + u * sc_u + t[:, None] * sc_t + i[None, :], mask=live[:, None], other=0).to(tl.int32)
    acc = tl.zeros([BLOCK, GP], dtype=tl.float32)
    base = tl.zeros([GP], dtype=tl.float32)
    for j in tl.static_range(PER):
        d = i * PER + j                                                # [DB] channel of bits j * BITS
        lo = tl.load(lo_ptr + u * slo_u + c * slo_c + d).to(tl.float32)
        hi = tl.load(hi_ptr + u * shi_u + c * shi_c + d).to(tl.float32)
        step = (hi - lo) / (1 << BITS)
        qj = tl.load(q_ptr + (u * G + g[None, :]) * D + d[:, None], mask=hv[None, :], other=0.0)   # [DB, GP]
        w = qj * step[:, None]
        cell = ((byte >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)   # [T, DB]
        acc += tl.dot(cell, w, input_precision="tf32x3")
        base += tl.sum(qj * (lo + 0.5 * step)[:, None], axis=0)       # q . (lo + step / 2), per head
    sc = acc + base[None, :]                                           # [T, GP]
    tl.store(s_ptr + (u * G + g[None, :]) * S + t[:, None], sc, mask=live[:, None] & hv[None, :])
    sm = tl.where(live[:, None], sc, -float("inf"))
    mx = tl.max(sm, axis=0)                                            # [GP]
    tl.store(m_ptr + (u * G + g) * n_tiles + tile, mx, mask=hv)
    tl.store(l_ptr + (u * G + g) * n_tiles + tile, tl.sum(tl.exp(sm - mx[None, :]), axis=0), mask=hv)


@triton.jit(do_not_specialize=["n_tiles"])
def lse_rows(m_ptr, l_ptr, lse_ptr, n_tiles, BLOCK: tl.constexpr):
    # `lse` with one program per (unit, head) row and one pass: each lane keeps its own running
    # (max, sum of exp), rescaled when its max grows; the lanes combine at the end
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    mx = tl.full([BLOCK], -float("inf"), tl.float32)
    tot = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_tiles, BLOCK):
        ok = i + j < n_tiles
        mm = tl.load(m_ptr + row * n_tiles + i + j, mask=ok, other=-float("inf"))
        ll = tl.load(l_ptr + row * n_tiles + i + j, mask=ok, other=0.0)
        new = tl.maximum(mx, mm)
        safe = tl.where(new == -float("inf"), 0.0, new)                # a lane with nothing yet
        tot = tot * tl.exp(mx - safe) + ll * tl.exp(mm - safe)
        mx = new
    top = tl.max(mx, axis=0)
    tl.store(lse_ptr + row, top + tl.log(tl.sum(tl.where(mx == -float("inf"), 0.0, tot * tl.exp(mx - top)), axis=0)))


@triton.jit(do_not_specialize=["S"])
def share(s_ptr, lse_ptr, r_ptr, S, G: tl.constexpr, BLOCK: tl.constexpr, GB: tl.constexpr, SUM: tl.constexpr):
    # each token's log group share; GB > 1 (dividing BLOCK): then sketch.block_share in the
    # same kernel, per GB-token block the log of its summed share (SUM) or its best token's
    u = tl.program_id(0).to(tl.int64)   # 64-bit offsets: units x tokens x bytes can pass 2^31
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t < S
    mx = tl.full([BLOCK], -float("inf"), tl.float32)
    for g in tl.static_range(G):
        x = tl.load(s_ptr + (u * G + g) * S + t, mask=live, other=0.0) - tl.load(lse_ptr + u * G + g)
        mx = tl.maximum(mx, x)
    tot = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(G):
        x = tl.load(s_ptr + (u * G + g) * S + t, mask=live, other=0.0) - tl.load(lse_ptr + u * G + g)
        tot += tl.exp(x - mx)
    if GB == 1:
        tl.store(r_ptr + u * S + t, mx + tl.log(tot), mask=live)
    else:
        r = tl.reshape(mx + tl.log(tot), [BLOCK // GB, GB])           # [blocks, GB] token shares
        top = tl.max(r, axis=1)
        if SUM:
            top = top + tl.log(tl.sum(tl.exp(r - top[:, None]), axis=1))
        b = tl.program_id(1) * (BLOCK // GB) + tl.arange(0, BLOCK // GB)
        tl.store(r_ptr + u * (S // GB) + b, top, mask=b * GB < S)


@triton.jit(do_not_specialize=["sr_u", "prefix", "h0", "h1", "T"])
def sel_count(r_ptr, v_ptr, cnt_ptr, sr_u, prefix, h0, h1, T, prm_ptr, BLOCK: tl.constexpr, DEV: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    if DEV:   # the step's counts from the device (a replayed graph): prm = (prefix, h0, h1, room, n)
        prefix, h0, h1 = tl.load(prm_ptr), tl.load(prm_ptr + 1), tl.load(prm_ptr + 2)
    t = tile * BLOCK + tl.arange(0, BLOCK)
    ranked = (t >= h0) & (t < h1)
    r = tl.load(r_ptr + u * sr_u + t, mask=ranked, other=0.0)
    v = tl.load(v_ptr + u)
    above = ranked & (r > v)
    tied = ranked & (r == v)
    forced = (t < prefix) & ~ranked
    base = (u * 3) * T + tile
    tl.store(cnt_ptr + base, tl.sum(above.to(tl.int32), axis=0))
    tl.store(cnt_ptr + base + T, tl.sum(tied.to(tl.int32), axis=0))
    tl.store(cnt_ptr + base + 2 * T, tl.sum(forced.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["sr_u", "so_u", "prefix", "h0", "h1", "T", "room", "n"])
def sel_write(r_ptr, v_ptr, cnt_ptr, out_ptr, sr_u, so_u, prefix, h0, h1, T, room, n, prm_ptr,
              BLOCK: tl.constexpr, TB: tl.constexpr, DEV: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    if DEV:   # as sel_count; the output's rows keep their fixed stride so_u >= n
        prefix, h0, h1 = tl.load(prm_ptr), tl.load(prm_ptr + 1), tl.load(prm_ptr + 2)
        room, n = tl.load(prm_ptr + 3), tl.load(prm_ptr + 4)
    base = (u * 3) * T
    j0 = tl.arange(0, TB)
    total_above = tl.sum(tl.zeros([TB], tl.int32), axis=0)
    before = tl.sum(tl.zeros([TB], tl.int32), axis=0)         # above + forced tokens in earlier tiles
    tb = tl.sum(tl.zeros([TB], tl.int32), axis=0)             # tied tokens in earlier tiles
    for i in range(0, T, TB):                                 # the unit's tile counts, TB at a time
        j = i + j0
        above_n = tl.load(cnt_ptr + base + j, mask=j < T, other=0)
        total_above += tl.sum(above_n, axis=0)
        earlier = j < tile
        before += tl.sum(tl.where(earlier, above_n + tl.load(cnt_ptr + base + 2 * T + j, mask=earlier, other=0), 0), axis=0)
        tb += tl.sum(tl.load(cnt_ptr + base + T + j, mask=earlier, other=0), axis=0)
    need = room - total_above                                 # tied tokens to take, lowest index first
    off = before + tl.minimum(need, tb)                       # tokens kept before this tile
    t = tile * BLOCK + tl.arange(0, BLOCK)
    ranked = (t >= h0) & (t < h1)
    r = tl.load(r_ptr + u * sr_u + t, mask=ranked, other=0.0)
    v = tl.load(v_ptr + u)
    tied = ranked & (r == v)
    take = tied & (tb + tl.cumsum(tied.to(tl.int32), axis=0) <= need)
    keep = ((t < prefix) & ~ranked) | (ranked & (r > v)) | take
    pos = off + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + u * so_u + pos, t.to(tl.int64), mask=keep & (pos < n))


@triton.jit(do_not_specialize=["sr_u", "h0", "h1"])
def radix_hist(r_ptr, st_ptr, hist_ptr, sr_u, h0, h1, prm_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
               DEV: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    if DEV:   # the unforced range from the device (prm as sel_count's); the grid covers the widest
        h0, h1 = tl.load(prm_ptr + 1), tl.load(prm_ptr + 2)
    t = h0 + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t < h1
    r = tl.load(r_ptr + u * sr_u + t, mask=live, other=0.0)
    b = r.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF          # the float's bits, unsigned
    key = tl.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)    # ordered as the floats
    match = live & ((key >> (SHIFT + 8)) == tl.load(st_ptr + u * 2))   # the digits above decided
    digit = tl.where(match, (key >> SHIFT) & 255, 0).to(tl.int32)
    j = tl.arange(0, 256)
    h = tl.histogram(digit, 256) - tl.where(j == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)
    tl.atomic_add(hist_ptr + u * 256 + j, h)


@triton.jit
def radix_pick(st_ptr, hist_ptr, v_ptr, LAST: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, 256)
    h = tl.load(hist_ptr + u * 256 + 255 - j)                           # digits 255 .. 0
    cum = tl.cumsum(h, axis=0)                                          # tokens with a digit >= 255 - j
    kk = tl.load(st_ptr + u * 2 + 1)                                    # the rank sought among them
    js = tl.min(tl.where(cum >= kk, j, 256), axis=0)
    above = tl.sum(tl.where(j < js, h, 0), axis=0)
    key = (tl.load(st_ptr + u * 2) << 8) | (255 - js)
    tl.store(st_ptr + u * 2, key)
    tl.store(st_ptr + u * 2 + 1, kk - above)
    tl.store(hist_ptr + u * 256 + j, tl.zeros([256], tl.int32))        # ready for the next pass
    if LAST:
        b = tl.where(key >= 0x80000000, key - 0x80000000, 0xFFFFFFFF - key)
        tl.store(v_ptr + u, b.to(tl.int32).to(tl.float32, bitcast=True))
