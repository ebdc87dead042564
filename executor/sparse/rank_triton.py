"""LOSSY (`--sparse F`): the token ranking of executor/sparse/sketch.py as three Triton kernels, for
the CUDA path. The same arithmetic as the torch path (`sketch.scores` then `group_share`):
each sealed token's key is rebuilt per channel from its code, k_hat = lo + (cell + 1/2) step with
step = (hi - lo) / 2^bits of the token's chunk, scored s = (q / sqrt(D)) . k_hat in float32 for
every query head of the unit's group, and ranked by the log of its share of the group's attention,
logsumexp over heads of (s - logsumexp over tokens of s). Only the summation order differs (the
float32 results agree within rounding, not bit for bit), so near-ties may rank the other way.

  score    grid (unit, token tile): reads the tile's packed codes once, rebuilds k_hat, writes the
           G scores per token and, per head, the tile's max and sum of exp (for the softmax);
           `score_chunk` (the default) and `score_dot` (matrix products on the tensor cores, no
           faster) sum the same terms with the chunk's range factored out.
  lse      grid (unit x head): combines the tiles' (max, sum) into each head's logsumexp over the
           tokens (`lse_rows`, one pass).
  share    grid (unit, token tile): the log group share of each token (sketch.select then
           ranks the unforced ones), or, with quantised blocks, goes on to each block's rank
           (sketch.block_share), so sparse + int4 ranks blocks in the same three kernels.

The kernels (executor/sparse/rank_kernels.py) are imported on first use, so CPU CI needs no
Triton; on CPU tensors they run only in Triton's interpreter (TRITON_INTERPRET=1 set before Triton
is imported: the CPU tests run them in a subprocess). `unavailable`
says why this path cannot run; the caller then keeps the torch path (as executor/layers/fused.py does).
Tensors: q [U, G, D]; lo, hi [U, C, D] (C = S / chunk); codes [U, S, D * bits / 8] uint8; the
rank [U, S] float32 (U: the flattened leading dims)."""
from __future__ import annotations

import math
import os

import torch

BLOCK_T = 64        # tokens per program of score/share: a [64, D] float32 key tile in registers
SCORE_WARPS = 8     # warps per `score` ("token") program: no register spills at D 128 (4 warps spill)
CHUNK_WARPS = 2     # warps per `score_chunk` program: the fastest of the tilings timed (docs/PERFORMANCE.md)
BLOCK_LSE = 256     # tiles per iteration of lse_rows' loop
BLOCK_SEL = 1024    # tokens per program of sel_count/sel_write/radix_hist
SEL_TILES = 256     # tile counts sel_write reads per iteration (fixed: no recompile as the cache grows)
SCORE_KERNEL = "chunk"   # rank's score kernel: "chunk" (the chunk's range factored out), "dot" (the same on tensor cores) or "token"
KERNELS = ("token", "chunk", "dot")
BLOCK_SHARE = 256   # tokens per program of share


def triton_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def unavailable(device: torch.device, head_dim: int, bits: int) -> str | None:
    """Why the Triton ranking cannot run for these tensors, or None where it can."""
    if device.type != "cuda":
        return "the Triton ranking runs on CUDA only (CPU keeps the torch path)"
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head_dim {head_dim} is not a power of two >= 16 (a Triton tile's width)"
    if bits not in (2, 4, 8):
        return f"sketch bits {bits} not in (2, 4, 8)"
    from torch.utils._triton import has_triton
    if not has_triton():
        return "no working Triton on this GPU"
    return None


def rank(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, bits: int,
         with_scores: bool = False, block: int = BLOCK_T, warps: int | None = None, kernel: str = SCORE_KERNEL,
         blocks: int = 1, how: str = "sum"):
    """The ranking [..., S] float32 of the S sealed tokens (codes [..., S, D*bits/8], summaries lo,
    hi [..., S/chunk, D], queries q [..., G, D]): the log group share (`sketch.group_share` of
    `sketch.scores`, summed in another order). CUDA tensors: compiled kernels; CPU tensors: interpreted.
    `with_scores`: also the float32 scores [..., G, S] (for the tests); `block`, `warps`: the score
    kernel's tokens per program (a power of two) and warps (None: the kernel's default; other
    values time other tilings);
    `kernel`: "token" rebuilds each token's key k_hat from a [block, D] tile of its chunk's lo and hi
    (`score`); "chunk" (`score_chunk`) loads the chunk's lo, hi once and scores
    q . (lo + step/2) + sum cell (q step), with block cut to the chunk where it is larger (a tile
    in one chunk; the chunk a power of two, else "token" runs); "dot" (`score_dot`) sums the same
    terms as matrix products on the tensor cores (3xTF32), where the tile and a token's code bytes
    are at least 16 wide (else "chunk" runs). They round differently.
    `blocks` > 1: the rank of each whole `blocks`-token block instead ([..., S / blocks]:
    sketch.block_share's `how`, "sum" or "max", in the share kernel)."""
    lead, (G, D), S = q.shape[:-2], q.shape[-2:], codes.shape[-2]
    C = lo.shape[-2]
    if codes.shape[:-2] != lead or lo.shape[:-2] != lead or hi.shape != lo.shape or lo.shape[-1] != D:
        raise ValueError(f"rank: shapes disagree: q {tuple(q.shape)}, lo {tuple(lo.shape)}, codes {tuple(codes.shape)}")
    if codes.shape[-1] * 8 != D * bits or S == 0 or S % C:
        raise ValueError(f"codes: {tuple(codes.shape)} are not {bits}-bit codes of {C} whole chunks of head_dim {D}")
    if blocks < 1 or S % blocks or how not in ("sum", "max"):
        raise ValueError(f"blocks: {blocks}-token blocks ({how}) must divide {S} tokens, ranked by sum or max")
    if blocks & (blocks - 1):   # share reshapes a tile into blocks: a power of two only
        from kvpipe.executor.sparse.sketch import block_share
        got = rank(q, lo, hi, codes, bits, with_scores, block, warps, kernel)
        return ((block_share(got[0], blocks, how), got[1]) if with_scores else block_share(got, blocks, how))
    U, dev = math.prod(lead), q.device
    qf = (q.float() / math.sqrt(D)).reshape(U, G, D).contiguous()      # as sketch.scores scales it
    lo3, hi3, c3 = lo.reshape(U, C, D), hi.reshape(U, C, D), codes.reshape(U, S, -1)
    if lo3.stride(-1) != 1 or hi3.stride(-1) != 1 or c3.stride(-1) != 1:
        lo3, hi3, c3 = lo3.contiguous(), hi3.contiguous(), c3.contiguous()
    s = torch.empty(U, G, S, dtype=torch.float32, device=dev)
    lse = torch.empty(U, G, dtype=torch.float32, device=dev)
    out = torch.empty(U, S // blocks, dtype=torch.float32, device=dev)
    _interpretable(dev, "rank")
    from kvpipe.executor.sparse.rank_kernels import lse_rows, share
    score_k, block, warps, extra = _score_kernel(kernel, S // C, block, warps, G, D, bits)
    n_tiles = -(-S // block)
    m = torch.empty(U, G, n_tiles, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    score_k[(U, n_tiles)](qf, lo3, hi3, c3, s, m, lsum, S, n_tiles, lo3.stride(0), lo3.stride(1),
                          hi3.stride(0), hi3.stride(1), c3.stride(0), c3.stride(1),
                          G=G, D=D, BITS=bits, CHUNK=S // C, BLOCK=block, num_warps=warps, **extra)
    lse_rows[(U * G,)](m, lsum, lse, n_tiles, BLOCK=BLOCK_LSE)
    bs = max(BLOCK_SHARE, blocks)
    share[(U, -(-S // bs))](s, lse, out, S, G=G, BLOCK=bs, GB=blocks, SUM=how == "sum")
    out = out.reshape(*lead, S // blocks)
    return (out, s.reshape(*lead, G, S)) if with_scores else out


def _score_kernel(kernel: str, chunk: int, block: int, warps: int | None, G: int, D: int, bits: int):
    """(the score kernel, tokens per program, warps, extra constexprs) that `rank`'s `kernel`
    runs for this chunk and tile (see `rank`: "dot" and "chunk" fall back where they cannot)."""
    from kvpipe.executor.sparse.rank_kernels import score, score_chunk, score_dot
    if kernel not in KERNELS:
        raise ValueError(f"kernel: must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "dot" and (chunk & (chunk - 1) or min(block, chunk) < 16 or D * bits // 8 < 16):
        kernel = "chunk"      # tl.dot needs 16-wide tiles: a small chunk or few code bytes a token
    if kernel in ("chunk", "dot") and chunk & (chunk - 1) == 0:
        if kernel == "dot":
            # with score_chunk's warps: the dot kernel's tiling was never tuned apart
            return score_dot, min(block, chunk), warps or CHUNK_WARPS, dict(GP=max(16, triton_pow2(G)))
        return score_chunk, min(block, chunk), warps or CHUNK_WARPS, {}
    return score, block, warps or SCORE_WARPS, {}


def threshold(rank: torch.Tensor, h0: int, h1: int, room: int, prm: torch.Tensor | None = None) -> torch.Tensor:
    """The `room`-th largest value of each row of rank[:, h0:h1] (rank [U, S] float32 contiguous,
    0 < room <= h1 - h0): [U] float32, exactly an element of the row. A radix select, 8 bits a
    pass from the top of the float's order-preserving 32-bit key: per pass, radix_hist counts the
    next digit of the tokens whose higher digits match the ones decided (a histogram per 1024-token
    tile, added atomically per row), radix_pick takes the digit where the `room`-th largest falls.
    Four passes of 2 kernels plus a zeroed histogram, fewer launches than torch.topk's multi-pass
    select. `prm` (int64 [5] on the device: prefix, h0, h1, room, n): the kernels
    read h0, h1 and room from it (a replayed graph's step) and the host's h0, h1 only size the grid
    (their range must be at least as wide as the device's)."""
    from kvpipe.executor.sparse.rank_kernels import radix_hist, radix_pick
    U, dev = rank.shape[0], rank.device
    st = torch.zeros(U, 2, dtype=torch.int64, device=dev)           # per row: key digits so far, rank sought
    if prm is None:
        st[:, 1] = room
    else:
        st[:, 1].copy_(prm[3].expand(U))
    hist = torch.zeros(U, 256, dtype=torch.int32, device=dev)
    v = torch.empty(U, dtype=torch.float32, device=dev)
    tiles = -(-(h1 - h0) // BLOCK_SEL)
    dummy = st if prm is None else prm
    for shift in (24, 16, 8, 0):
        radix_hist[(U, tiles)](rank, st, hist, rank.stride(0), h0, h1, dummy, SHIFT=shift, BLOCK=BLOCK_SEL,
                               DEV=prm is not None)
        radix_pick[(U,)](st, hist, v, LAST=shift == 0)
    return v


def select(rank: torch.Tensor, prefix: int, budget: int, sink: int, recent: int, radix: bool = True,
           sel_tiles: int = SEL_TILES) -> torch.Tensor:
    """`sketch.select` (the same tokens: forced ones, then the best-ranked, ties to the
    lower index, [..., N] int64 ascending) without torch's sort or topk and with its compaction in
    two Triton kernels instead of ~17 torch ops: `threshold` gives the threshold v; sel_count counts, per 1024-token tile, the
    tokens ranked above v, tied with v, and forced; sel_write turns the counts into each tile's
    place in the output (the kept tokens of the earlier tiles: their above and forced ones, and
    min(need, their tied ones) as ties go to the lower index; summed in every program, no host
    sync) and writes the kept tokens there in token order. rank [..., sealed] float32 contiguous, CUDA (or CPU
    under TRITON_INTERPRET=1). `radix` False: the threshold from torch.topk instead;
    `sel_tiles` (a power of two): tile counts per iteration of sel_write's loop (tests shrink it)."""
    from kvpipe.executor.sparse import sketch
    sealed = rank.shape[-1]
    if not sketch.ranks(prefix, sealed, budget, sink, recent):
        return sketch.select(rank, prefix, budget, sink, recent)    # forced only, or F = 1
    n, room, h0, h1 = sketch.split(prefix, sealed, budget, sink, recent)
    lead, dev = rank.shape[:-1], rank.device
    _interpretable(dev, "select")
    U = math.prod(lead)
    r2 = rank.reshape(U, sealed).float().contiguous()
    if radix:
        v = threshold(r2, h0, h1, room)                                                # [U]
    else:   # torch.topk's values: the same v
        v = torch.topk(r2[:, h0:h1], room, dim=-1, sorted=False).values.amin(-1).contiguous()
    out = torch.empty(U, n, dtype=torch.int64, device=dev)
    _compact(r2, v, out, prefix, h0, h1, room, n, None, sel_tiles)
    return out.reshape(*lead, n)


def select_static(rank: torch.Tensor, prm: torch.Tensor, prefix_max: int, h0_min: int, h1_max: int,
                  n_max: int, sel_tiles: int = SEL_TILES, out: torch.Tensor | None = None) -> torch.Tensor:
    """`select` for a replayed graph: the step's counts are read on the device from prm (int64 [5]:
    prefix, h0, h1, room, n, as sketch.split gives them; `ranks` must hold), so one capture
    serves every step whose counts lie within the fixed shapes: prefix <= prefix_max, [h0, h1]
    within [h0_min, h1_max], n <= n_max. Returns [..., n_max] int64: the step's n tokens ascending
    (the same ones `select` picks), then zeros (valid rows that a gather may read and nothing
    attends). Radix threshold only. `out`: where to write them (int64, [U, n_max] with unit rows
    contiguous, zeroed: a view of a bigger selection), else a new tensor."""
    sealed = rank.shape[-1]
    lead, dev = rank.shape[:-1], rank.device
    _interpretable(dev, "select")
    U = math.prod(lead)
    r2 = rank.reshape(U, sealed).float().contiguous()
    v = threshold(r2, h0_min, h1_max, 0, prm)
    if out is None:
        out = torch.zeros(U, n_max, dtype=torch.int64, device=dev)
    assert out.shape == (U, n_max) and out.stride(1) == 1 and out.dtype == torch.int64, (out.shape, out.stride())
    _compact(r2, v, out, prefix_max, h0_min, h1_max, 0, n_max, prm, sel_tiles)
    return out.reshape(*lead, n_max)


def rank_select_static(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, bits: int,
                       prm: torch.Tensor, prefix_max: int, h0_min: int, h1_max: int, n_max: int,
                       blocks: int = 1, how: str = "sum", piece: int = 0,
                       events: list | None = None) -> torch.Tensor:
    """`rank` (over `blocks`-token blocks by `how`) then `select_static` of units q [U, G, D], lo,
    hi [U, C, D], codes [U, S, D*bits/8] -> [U, n_max]. `piece` > 0: the units ranked and selected
    `piece` at a time, the i-th piece's CUDA event events[i] recorded once its rows are written
    (ceil(U / piece) of them), so a consumer of a piece's rows may start while the next pieces
    are ranked: the same kernels over fewer units' rows compute the same values, so the same
    selection (a replayed step, SparseHomes.select_static)."""
    fixed = (prm, prefix_max, h0_min, h1_max, n_max)
    if not piece:
        return select_static(rank(q, lo, hi, codes, bits, blocks=blocks, how=how), *fixed)
    U = q.shape[0]
    assert events is None or len(events) == -(-U // piece), (U, piece, len(events))
    out = torch.zeros(U, n_max, dtype=torch.int64, device=q.device)
    for i, u in enumerate(range(0, U, piece)):
        v = slice(u, min(U, u + piece))
        select_static(rank(q[v], lo[v], hi[v], codes[v], bits, blocks=blocks, how=how), *fixed, out=out[v])
        if events is not None:
            events[i].record()
    return out


def _interpretable(dev: torch.device, who: str) -> None:
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{who}: CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 before importing triton)")


def _compact(r2, v, out, prefix, h0, h1, room, n, prm, sel_tiles) -> None:
    """sel_count then sel_write into out [U, n_row] (host counts, or prm's on the device)."""
    from kvpipe.executor.sparse.rank_kernels import sel_count, sel_write
    U, T = r2.shape[0], -(-prefix // BLOCK_SEL)
    cnt = torch.empty(U, 3, T, dtype=torch.int32, device=r2.device)
    p = v if prm is None else prm
    sel_count[(U, T)](r2, v, cnt, r2.stride(0), prefix, h0, h1, T, p, BLOCK=BLOCK_SEL, DEV=prm is not None)
    sel_write[(U, T)](r2, v, cnt, out, r2.stride(0), out.stride(0), prefix, h0, h1, T, room, n, p,
                      BLOCK=BLOCK_SEL, TB=sel_tiles, DEV=prm is not None)
