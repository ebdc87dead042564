"""Token-level sparse selection by a low-bit key sketch (LOSSY, `--sparse F`): every key of an
offloaded unit is kept on the GPU as `bits`-bit codes (default 2) within its 64-token chunk's
per-channel [min, max] (the chunk summary, also on the GPU), so no per-token
scale is stored: a sketch costs D * bits / 8 bytes a token, 1/16 of the exact K+V at 2 bits (bf16),
plus the chunk summaries' 1/64. A decode step scores EVERY sealed token of the unit from its sketch
(the key rebuilt at its cell's centre) for the step's query group, ranks tokens by their estimated
share of the group's attention (each head's softmax over the tokens, summed over heads: a
HEURISTIC, not a bound), and fetches the sink, the recent window, the unsealed tail chunk and the
best-ranked tokens, `budget` tokens in all. Nothing of the selection crosses PCIe: the sketch is
made on the GPU from K the GPU already holds when the token is stored, so a step moves exactly the
selected tokens' K/V. Why token level: on the needle set even an oracle over 8-token chunks recalls
less of the attention mass at a given fraction of tokens than the token oracle (docs/PERFORMANCE.md).

Tensors: keys [..., S, D]; chunk summaries lo, hi [..., C, D] (C = S / chunk, S a whole number of
chunks); codes [..., S, D * bits / 8] uint8 (channel 4i+j of a byte's 2-bit codes at bits 2j);
queries [..., G, D]; scores [..., G, S]; selection: token indices [..., N] int64, ascending."""
from __future__ import annotations

import math

import torch

SKETCH_BITS = (2, 4, 8)
PASS_VALUES = 1 << 25   # sketch values rebuilt per scoring pass: bounds the float32 temporaries (128 MiB),
                        # 4 passes per layer at 128K x 8 units (fewer launches than smaller passes)


def _check_bits(bits: int) -> int:
    if bits not in SKETCH_BITS:
        raise ValueError(f"sketch: bits must be one of {SKETCH_BITS}, got {bits!r}")
    return 8 // bits


def encode(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of keys k [..., C*chunk, D] within their chunk's [lo, hi] [..., C, D]: the cell
    floor((k - lo) / step), step = (hi - lo) / 2^bits, packed 8 / bits to a byte: [..., S, D*bits/8]."""
    per = _check_bits(bits)
    C, D = lo.shape[-2], lo.shape[-1]
    S = k.shape[-2]
    if S % C or D % per:
        raise ValueError(f"k: {S} tokens are not {C} whole chunks, or head_dim {D} not a multiple of {per}")
    chunk, L = S // C, 1 << bits
    lead = k.shape[:-2]
    kc = k.float().reshape(*lead, C, chunk, D)
    base, step = lo.float()[..., None, :], ((hi.float() - lo.float()) / L).clamp(min=1e-30)[..., None, :]
    c = torch.floor((kc - base) / step).clamp_(0, L - 1).to(torch.uint8).reshape(*lead, S, D // per, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=k.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)                  # disjoint bits: the sum is an OR


def decode_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpacked cells [..., S, D] uint8 of `encode`'s codes."""
    per = _check_bits(bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return ((codes[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*codes.shape[:-1], codes.shape[-1] * per)


def scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Scaled scores q . k_hat / sqrt(D) in float32 of the group q [..., G, D] against every
    sketched key (k_hat = lo + (cell + 1/2) step, per channel): [..., G, S]."""
    C, D = lo.shape[-2], lo.shape[-1]
    S = codes.shape[-2]
    chunk, L = S // C, 1 << bits
    qf = q.float() / math.sqrt(D)
    lof, step = lo.float(), (hi.float() - lo.float()) / L
    base = qf @ (lof + 0.5 * step).transpose(-1, -2)                # [..., G, C]
    lead = codes.shape[:-2]
    out = torch.empty(*lead, q.shape[-2], C, chunk, dtype=torch.float32, device=q.device)
    rows = max(1, PASS_VALUES // max(1, math.prod(lead) * chunk * D))   # chunks per pass
    for c0 in range(0, C, rows):
        c1 = min(C, c0 + rows)
        cells = decode_codes(codes[..., c0 * chunk:c1 * chunk, :], bits).float()
        cells = cells.reshape(*lead, c1 - c0, chunk, D)                  # [..., c, chunk, D]
        w = qf[..., :, None, :] * step[..., None, c0:c1, :]             # [..., G, c, D]
        out[..., c0:c1, :] = torch.einsum("...gcd,...ctd->...gct", w, cells) + base[..., c0:c1, None]
    return out.reshape(*lead, q.shape[-2], S)


def group_share(s: torch.Tensor) -> torch.Tensor:
    """Log of each token's estimated share of the group's attention from scores s [..., G, S]:
    each head's softmax over the tokens, summed over the heads: [..., S]."""
    return torch.logsumexp(torch.log_softmax(s, -1), -2)


def _ranges(prefix: int, sealed: int, sink: int, recent: int) -> list[tuple[int, int]]:
    """Disjoint ascending [a, b) ranges of the tokens every step fetches: the first `sink`, then
    from the earlier of the recent window's start and the unsealed tail's start to the end."""
    if not 0 <= sealed <= prefix:
        raise ValueError(f"sealed: must lie in 0..{prefix}, got {sealed}")
    head, tail = min(sink, prefix), min(max(0, prefix - recent), sealed)
    return [(0, head), (max(head, tail), prefix)]


def forced(prefix: int, sealed: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """Indices [F] (ascending, made on `device`: no host-to-device copy) every step fetches: the
    first `sink` tokens, the last `recent`, and the unsealed tail [sealed, prefix) (no sketch yet)."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in _ranges(prefix, sealed, sink, recent)])


def count(prefix: int, sealed: int, budget: int, sink: int, recent: int) -> int:
    """Tokens a step fetches: `budget`, or the forced ones when they alone are more; never above
    the prefix. The same for every unit of a step (their prefixes are equal)."""
    return split(prefix, sealed, budget, sink, recent)[0]


def split(prefix: int, sealed: int, budget: int, sink: int, recent: int) -> tuple[int, int, int, int]:
    """(n, room, h0, h1): the tokens a step fetches (`count`), how many of them are chosen by rank
    (`room`, <= 0 when the forced ones fill the count), and the unforced tokens' range [h0, h1)."""
    ranges = _ranges(prefix, sealed, sink, recent)
    n = min(prefix, max(budget, sum(b - a for a, b in ranges)))
    return n, n - sum(b - a for a, b in ranges), ranges[0][1], ranges[1][0]


def ranks(prefix: int, sealed: int, budget: int, sink: int, recent: int) -> bool:
    """Whether `select` reads the ranking: False when the forced tokens fill the count, or when
    every token is selected (F = 1), so the caller can skip scoring."""
    n, room, _, _ = split(prefix, sealed, budget, sink, recent)
    return n < prefix and room > 0


def select(share: torch.Tensor, prefix: int, budget: int, sink: int, recent: int) -> torch.Tensor:
    """Tokens to fetch for the ranking share [..., sealed] of the sealed tokens: the forced ones,
    then the best-ranked others, `count(...)` in all: [..., N] int64, ascending. Ties go to the
    lower index, so CPU and GPU pick the same tokens for the same ranking (the set a stable
    descending sort would take). Every size is known on the host: on CUDA nothing here waits for
    the GPU.

    No sort: the unforced tokens are one range [h0, h1) of the sealed ones; the `room`-th largest
    rank v among them comes from torch.topk (its values only); every token ranked above v is
    taken, and of those equal to v the lowest-indexed ones until `room` are; the chosen and forced
    tokens are written in token order by a prefix sum (a scatter to their place among the chosen).
    With F = 1 (every token selected) nothing is ranked: 0..prefix-1. The unforced ranks must be
    finite (the sketch's shares of finite keys are)."""
    sealed = share.shape[-1]
    n, room, h0, h1 = split(prefix, sealed, budget, sink, recent)     # the unforced tokens: [h0, h1)
    lead, dev = share.shape[:-1], share.device
    if room <= 0:
        return forced(prefix, sealed, sink, recent, dev)[:n].expand(*lead, n).contiguous()
    if n == prefix:                                         # every token, in order (F = 1: exact)
        return torch.arange(prefix, device=dev).expand(*lead, prefix).contiguous()
    mid = share[..., h0:h1]
    v = torch.topk(mid, room, dim=-1, sorted=False).values.amin(-1, keepdim=True)    # [..., 1]
    above, tied = mid > v, mid == v
    need = room - above.sum(-1, keepdim=True)                                          # >= 1
    keep = torch.ones(*lead, prefix, dtype=torch.bool, device=dev)                     # forced: True
    keep[..., h0:h1] = above | (tied & (tied.cumsum(-1) <= need))
    at = torch.where(keep, keep.cumsum(-1) - 1, n)                                     # [..., prefix]
    out = torch.zeros(*lead, n + 1, dtype=torch.int64, device=dev)                     # column n: the rest
    out.scatter_(-1, at, torch.arange(prefix, device=dev).expand(*lead, prefix))
    return out[..., :n]


def block_share(share: torch.Tensor, group: int, how: str = "sum") -> torch.Tensor:
    """Rank of each whole `group`-token block from its tokens' ranks share [..., S] (S a multiple
    of `group`), for sparse decode over quantised blocks: "sum" the log of the block's summed
    share (logsumexp), "max" its best token's: [..., S / group] float32, contiguous."""
    if share.shape[-1] % group:
        raise ValueError(f"share: {share.shape[-1]} tokens are not whole {group}-token blocks")
    blocks = share.float().reshape(*share.shape[:-1], -1, group)
    if how == "sum":
        return torch.logsumexp(blocks, -1).contiguous()
    if how == "max":
        return blocks.amax(-1).contiguous()
    raise ValueError(f"block rank: must be sum or max, got {how!r}")
