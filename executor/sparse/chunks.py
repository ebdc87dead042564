"""Sparse decode by chunk key summaries (LeoAM's IAKM/LKA, Quest): the keys of one KV head are cut
into chunks; a chunk's summary is its per-channel minimum and maximum. For a query q the bound
  sum_c max(q_c * lo_c, q_c * hi_c)  =  q . mid + |q| . half  >=  q . k   for every key k of the chunk
(mid, half: the centre and half-width of each channel's range) holds channel by channel, so it
bounds the chunk's best score without reading its keys (`upper_bound`, proved in the tests).
A decode step fetches the sink tokens, a recent window, and then the chunks of highest score (GQA:
the best over the group's query heads, each head's scores taken relative to its own maximum) until
a token budget is spent. Chunk sizes adapt per step (`select_refined`): the coarse chunks holding
the best `hot` x budget tokens are split into fine ones (64 -> 8 tokens) where the budget is
decided; flat cold regions stay whole. Lossy: the tokens not fetched are not attended.

Ranking by the bound itself (`alpha` = 1) over-rates chunks whose keys merely spread widely (heavy
tails widen every range). `select_refined` ranks by default with the range term shrunk,
q . mid + alpha |q| . half with alpha = 1/2, and, for GQA, by each chunk's estimated share of the
group's attention (`chunk_scores` share=True): HEURISTIC scores, not bounds (a chunk can hold a key
scoring above them); measured better on the needle set (benchmarks/lossy_error.py).
alpha = 1, share = False restores ranking by the proved bound.

Tensors: keys [..., S, D]; partition `bounds` [C+1] token offsets 0 = b0 < ... < bC = S;
summaries lo, hi [..., C, D]; queries [..., G, D]; scores [..., G, C]."""
from __future__ import annotations

import math

import torch

from kvpipe.pipeline.lossy import HOT_FACTOR

_U = 2.0 ** -53   # float64 unit roundoff
RANGE_ALPHA = 0.5  # select_refined's default shrink of the range term (a heuristic; 1 = the bound)


def even_bounds(length: int, chunk: int) -> torch.Tensor:
    """Partition of `length` tokens into `chunk`-token chunks (the last one shorter)."""
    if length <= 0 or chunk <= 0:
        raise ValueError(f"length/chunk: must be positive, got {length}, {chunk}")
    return torch.cat([torch.arange(0, length, chunk), torch.tensor([length])])


def summarise(k: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk, per-channel (min, max) of keys k [..., S, D]: two [..., C, D] tensors."""
    S, C = k.shape[-2], bounds.numel() - 1
    if int(bounds[0]) != 0 or int(bounds[-1]) != S or not bool((bounds[1:] > bounds[:-1]).all()):
        raise ValueError(f"bounds: must rise strictly from 0 to {S}")
    idx = torch.searchsorted(bounds[1:].to(k.device), torch.arange(S, device=k.device), right=True)
    idx = idx.view(*([1] * (k.dim() - 2)), S, 1).expand_as(k)
    shape = (*k.shape[:-2], C, k.shape[-1])
    lo = torch.empty(shape, dtype=k.dtype, device=k.device).scatter_reduce_(-2, idx, k, "amin", include_self=False)
    hi = torch.empty(shape, dtype=k.dtype, device=k.device).scatter_reduce_(-2, idx, k, "amax", include_self=False)
    return lo, hi


def upper_bound(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Upper bound of q . k (unscaled) over each chunk's keys, for q [..., G, D] and summaries
    [..., C, D]: [..., G, C]. Products are exact (float32 for bf16/fp16 inputs, whose products fit
    its 24-bit mantissa; float64 otherwise) and a margin of (D + 2) unit roundoffs times the sum of
    |terms| covers the rounding of the sum, so the bound holds exactly, not only up to rounding."""
    half = q.dtype in (torch.bfloat16, torch.float16) and lo.dtype in (torch.bfloat16, torch.float16)
    work, u = (torch.float32, 2.0 ** -24) if half else (torch.float64, _U)
    qw = q.to(work)[..., :, None, :]                                    # [..., G, 1, D]
    terms = torch.maximum(qw * lo.to(work)[..., None, :, :], qw * hi.to(work)[..., None, :, :])  # [..., G, C, D]
    return terms.sum(-1) + (q.shape[-1] + 2) * u * terms.abs().sum(-1)


def shrunk_score(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: float) -> torch.Tensor:
    """q . mid + alpha |q| . half (unscaled) for q [..., G, D] and summaries [..., C, D]: [..., G, C].
    A HEURISTIC for alpha < 1 (not a bound: a key at its range's edge can score above it); alpha = 1
    is `upper_bound`. Float32 for bf16/fp16 inputs, float64 otherwise."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha: must be in [0, 1], got {alpha!r}")
    if alpha == 1:
        return upper_bound(q, lo, hi)
    half = q.dtype in (torch.bfloat16, torch.float16) and lo.dtype in (torch.bfloat16, torch.float16)
    work = torch.float32 if half else torch.float64
    qw, low, high = q.to(work), lo.to(work), hi.to(work)
    mid, rad = (low + high) / 2, (high - low) / 2
    return qw @ mid.transpose(-1, -2) + alpha * (qw.abs() @ rad.transpose(-1, -2))


def chunk_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: float = 1.0,
                 share: bool = False) -> torch.Tensor:
    """Ranking key of each chunk for a KV head's query group q [..., G, D], from the scaled score
    (alpha = 1: the upper bound; < 1: the heuristic `shrunk_score`): [..., C].
    share=False: the best over heads of the score minus that head's largest (a log-density bound
    with alpha = 1). share=True (a HEURISTIC at any alpha): the log of the chunk's estimated share
    of the group's attention, each head's softmax of the scores over the chunks, summed over heads
    (a chunk that several heads want ranks above one that a single head wants as much)."""
    b = shrunk_score(q, lo, hi, alpha) / math.sqrt(q.shape[-1])
    if share:
        return torch.logsumexp(torch.log_softmax(b, -1), -2)
    return (b - b.amax(-1, keepdim=True)).amax(-2)


def select(scores: torch.Tensor, bounds: torch.Tensor, budget: int, sink: int, recent: int) -> torch.Tensor:
    """Tokens one step fetches for scores [C] of a partition: the first `sink`, the last `recent`,
    then whole chunks by decreasing score while the total stays within `budget` tokens: [S] bool."""
    S = int(bounds[-1])
    keep = torch.zeros(S, dtype=torch.bool, device=scores.device)
    keep[:min(sink, S)] = True
    keep[max(0, S - recent):] = True
    sizes = (bounds[1:] - bounds[:-1]).to(scores.device)
    starts = bounds[:-1].to(scores.device)
    covered = torch.zeros_like(sizes)
    covered += (torch.clamp(torch.minimum(starts + sizes, torch.full_like(starts, sink)) - starts, min=0))
    covered += torch.clamp(starts + sizes - torch.maximum(starts, torch.full_like(starts, S - recent)), min=0)
    new = (sizes - covered).clamp(min=0)
    order = torch.argsort(scores, descending=True, stable=True)
    room = budget - int(keep.sum())
    take = order[torch.cumsum(new[order], 0) <= room]
    chosen = torch.zeros(sizes.numel(), dtype=torch.bool, device=scores.device)
    chosen[take] = True
    keep |= torch.repeat_interleave(chosen, sizes)
    return keep


def pack_fine(coarse: tuple, fine: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Fine summaries as uint8 codes relative to their coarse chunk's range (which the GPU holds):
    the minimum rounded down, the maximum rounded up, so the bound stays a bound. Half the bytes
    of bf16 summaries. Returns (lo codes, hi codes), each [..., F, D]."""
    base, step, _ = _fine_grid(coarse, fine)
    lo = torch.floor((fine[1].double() - base) / step).clamp_(0, 255)
    hi = torch.ceil((fine[2].double() - base) / step).clamp_(0, 255)
    return lo.to(torch.uint8), hi.to(torch.uint8)


def unpack_fine(coarse: tuple, fine_bounds: torch.Tensor, codes: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 (lo, hi) from `pack_fine` codes, widened by the float32 rounding of the decode so
    that lo <= every key and hi >= every key of the fine chunk."""
    base, step, parent = _fine_grid(coarse, (fine_bounds,))
    base, step = base.float(), step.float()
    slack = 2.0 ** -21 * (base.abs() + 255 * step)
    return base + codes[0].float() * step - slack, base + codes[1].float() * step + slack


def _fine_grid(coarse: tuple, fine: tuple):
    """Per fine chunk: its coarse chunk's minimum and 1/255 of its range, [..., F, D] (float64)."""
    cb, clo, chi = coarse
    parent = torch.searchsorted(cb[1:].to(fine[0].device), fine[0][:-1], right=True).to(clo.device)
    base = clo.double().index_select(-2, parent)
    step = ((chi.double() - clo.double()) / 255).index_select(-2, parent).clamp(min=1e-30)
    return base, step, parent


def select_refined(q: torch.Tensor, coarse: tuple, fine: tuple, budget: int, sink: int, recent: int,
                   hot: float = HOT_FACTOR, alpha: float = RANGE_ALPHA, share: bool = True) -> tuple[torch.Tensor, int]:
    """Two-level selection, LeoAM's split where scores concentrate: the coarse chunks (`coarse` =
    (bounds, lo, hi)) are ranked for the query group q [G, D]; those holding the best `hot` x
    `budget` tokens are split into their fine chunks (`fine`, nested in the coarse ones), which are
    ranked and selected under the budget; flat, cold regions stay whole and unfetched. Both levels
    rank by `chunk_scores` with `alpha` and `share` (defaults: range term x 1/2, the group's
    estimated attention share: a heuristic, see the module docstring; alpha=1, share=False: the
    bound). Returns (keep [S] bool, summaries scored)."""
    cb, clo, chi = coarse
    fb, flo, fhi = fine
    cs = chunk_scores(q, clo, chi, alpha, share)                              # [C]
    sizes = cb[1:] - cb[:-1]
    order = torch.argsort(cs, descending=True, stable=True)
    is_hot = torch.zeros_like(cs, dtype=torch.bool)
    is_hot[order[torch.cumsum(sizes[order].to(cs.device), 0) <= hot * budget]] = True
    parent = torch.searchsorted(cb[1:].to(fb.device), fb[:-1], right=True)  # coarse chunk of each fine one
    if not bool((cb[parent] <= fb[:-1]).all() and (fb[1:] <= cb[parent + 1]).all()):
        raise ValueError("fine: chunks must nest in the coarse chunks")
    use = is_hot[parent.to(cs.device)]
    fs = torch.full((fb.numel() - 1,), -math.inf, dtype=torch.float64, device=cs.device)
    fs[use] = chunk_scores(q, flo[use], fhi[use], alpha, share).double()
    return select(fs, fb, budget, sink, recent), cs.numel() + int(use.sum())
