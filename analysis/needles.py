"""A synthetic long-context retrieval set at the attention level, and the error of a lossy attention
measured against exact float64 attention on the same inputs. We have no trained weights, so this
is where kvpipe's lossy options (quantised KV, sparse chunk selection) get their error figures.

One case is one KV head of a decoder with GQA: keys and values for `context` tokens, and
`steps` decode queries for each of the group's `gqa` query heads. The keys are built to have the
properties of a real post-RoPE K cache that matter to quantisation and to chunk selection:
  * locality: text is a run of segments (mean `segment` tokens) each about one topic; a topic is
    a random vector in the lowest-frequency rotary pairs, the channels that carry meaning over long
    distances in RoPE models (Barbero et al. 2024, "Round and round we go");
  * heavy tails: per-token noise is Student-t (8 degrees of freedom), channel scales log-normal;
  * outlier channels: a few low-frequency rotary pairs carry a large bias and scale (KIVI, Liu et
    al. 2024, and KVQuant, Hooper et al. 2024, report such fixed outlier channels in K);
  * an attention sink: token 0's key aligns with the queries' own bias (StreamingLLM);
  * RoPE (Llama-3 layout, theta 500000) over positions 0 .. context-1; queries sit after them.
Each query mixes the topics of a few earlier segments and of the most recent one. Step t of a
case retrieves needle t: a span of 1-4 tokens at a random position whose keys are pushed along a
random unit direction that the step's queries share (post-RoPE, so the boost holds whatever the
distance), by enough that the needle's score exceeds the log-sum-exp of the background scores by a
margin drawn from `needle_logit`: strong needles take most of the mass, faint ones a few percent. Values are Student-t (6 degrees of freedom) with a small per-channel
bias and no outlier channels (as KIVI reports for V).

Everything is generated in float64 from a seeded generator and then rounded to `dtype` (what the
cache would hold); the reference is float64 attention over those rounded values."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NeedleSpec:
    """Shape and seed of the set. `needle_logit` is the (low, high) range of a needle's score over the
    log-sum-exp of the background scores, in logits; `topic_logit` the score of a matching topic."""

    context: int = 32768
    head_dim: int = 128
    gqa: int = 4
    cases: int = 8
    steps: int = 8
    segment: int = 96
    topics: int = 256
    needle_logit: tuple[float, float] = (-4.0, 1.0)
    topic_logit: float = 4.0
    sink_logit: float = 10.0
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in ("context", "head_dim", "gqa", "cases", "steps", "segment", "topics"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"{f}: must be a positive integer, got {getattr(self, f)!r}")
        if self.head_dim % 8:
            raise ValueError(f"head_dim: must be a multiple of 8, got {self.head_dim}")
        if self.context < 1024 + 64 * self.steps:
            raise ValueError(f"context: {self.context} is too short for {self.steps} needles")


@dataclass(frozen=True)
class Case:
    """One KV head: k, v [S, D]; q [T, G, D] (T decode steps, G query heads); needles[t] is the
    (start, end) token span step t retrieves."""

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    needles: tuple[tuple[int, int], ...]


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotary embedding in the HF layout (channel i pairs with i + D/2); x [..., S, D], pos [S]."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)          # [D/2]
    ang = pos.to(torch.float64)[:, None] * inv[None, :]                        # [S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # [S, D]
    half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + half * sin


def _student_t(g: torch.Generator, df: int, shape) -> torch.Tensor:
    """Student-t samples scaled to unit variance; chi-square(df) = -2 sum log U over df/2
    uniforms (even df)."""
    assert df % 2 == 0 and df > 2
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    u = torch.rand((df // 2, *shape), generator=g, dtype=torch.float64).clamp_(min=1e-300)
    chi2 = -2 * torch.log(u).sum(0)
    return z / torch.sqrt(chi2 / df) / math.sqrt(df / (df - 2))


def make_case(spec: NeedleSpec, index: int) -> Case:
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    S, D, G, T = spec.context, spec.head_dim, spec.gqa, spec.steps
    P = D // 2
    low = torch.arange(P - P // 4, P)                      # lowest-frequency quarter of the pairs
    low_ch = torch.cat([low, low + P])                     # their channels
    rnd = lambda *s: torch.randn(s, generator=g, dtype=torch.float64)
    # --- keys (pre-RoPE) -----------------------------------------------------------------
    scale = torch.exp(0.3 * rnd(D))                        # uneven channel magnitudes
    out_pairs = low[torch.randperm(len(low), generator=g)[:3]]
    out_ch = torch.cat([out_pairs, out_pairs + P])
    bias = torch.zeros(D, dtype=torch.float64)
    bias[out_ch] = 6.0 * torch.sign(rnd(len(out_ch)))
    scale[out_ch] *= 3.0
    topic_vec = torch.zeros(spec.topics, D, dtype=torch.float64)
    topic_vec[:, low_ch] = rnd(spec.topics, len(low_ch)) / math.sqrt(len(low_ch))   # unit norm
    lengths = (-spec.segment * torch.log(torch.rand(S // 8 + 2, generator=g, dtype=torch.float64))).ceil().clamp(8)
    bounds = torch.cumsum(lengths.long(), 0)
    seg_of = torch.searchsorted(bounds, torch.arange(S), right=True)              # [S]
    nseg = int(seg_of[-1]) + 1
    seg_topic = torch.randint(spec.topics, (nseg,), generator=g)
    topic_amp = math.sqrt(spec.topic_logit * math.sqrt(D))  # q and k both carry it: score = topic_logit
    k = bias + scale * _student_t(g, 8, (S, D)) * 0.6 + topic_amp * topic_vec[seg_topic[seg_of]]
    # --- queries (pre-RoPE) ----------------------------------------------------------------
    qbias = torch.zeros(D, dtype=torch.float64)
    qbias[out_ch] = 2.0 * torch.sign(bias[out_ch])
    q = torch.empty(T, G, D, dtype=torch.float64)
    recent = int(seg_of[-1])
    for t in range(T):
        picks = torch.randint(nseg, (3,), generator=g).tolist() + [recent]
        mix = sum(topic_vec[seg_topic[s]] for s in picks)
        for h in range(G):
            q[t, h] = qbias + topic_amp * mix * (0.7 + 0.6 * torch.rand((), generator=g, dtype=torch.float64)) \
                + 0.8 * rnd(D)
    pos_k, pos_q = torch.arange(S), S + torch.arange(T)
    k = rope(k, pos_k)
    q = torch.stack([rope(q[t], pos_q[t:t + 1].expand(G)) for t in range(T)])
    # --- the attention sink: token 0 aligns with the queries' bias ---------------------------
    qb = rope(qbias[None], pos_q[:1])[0]
    k[0] += spec.sink_logit * math.sqrt(D) * qb / qb.norm() ** 2
    # --- needles (post-RoPE: the boost holds at any distance) --------------------------------
    slots = torch.randperm(T * 4, generator=g)[:T]             # distinct regions of the context
    region = (S - 1024) // (T * 4)
    needles = []
    for t in range(T):
        width = int(torch.randint(1, 5, (), generator=g))
        start = 64 + int(slots[t]) * region + int(torch.randint(region - 8, (), generator=g))
        u = rnd(D)
        u /= u.norm()
        lo, hi = spec.needle_logit
        margin = lo + (hi - lo) * float(torch.rand((), generator=g, dtype=torch.float64))
        s_bg = q[t] @ k.T / math.sqrt(D)                                  # [G, S] background scores
        boost = float(torch.logsumexp(s_bg, -1).mean() - s_bg[:, start:start + width].mean()) + margin
        a = math.sqrt(max(boost, 1.0) * math.sqrt(D))
        k[start:start + width] += a * u
        q[t] += a * u
        needles.append((start, start + width))
    v = 0.3 * rnd(D) + _student_t(g, 6, (S, D))
    dt = getattr(torch, spec.dtype)
    return Case(k.to(dt), v.to(dt), q.to(dt), tuple(needles))


def cases(spec: NeedleSpec):
    for i in range(spec.cases):
        yield make_case(spec, i)


# ---- measurement ------------------------------------------------------------------------------
def exact(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 softmax attention of every query over all keys: (weights [T, G, S], out [T, G, D])."""
    k, v, q = case.k.double(), case.v.double(), case.q.double()
    s = torch.einsum("tgd,sd->tgs", q, k) / math.sqrt(k.shape[-1])
    w = torch.softmax(s, -1)
    return w, w @ v


@dataclass(frozen=True)
class Errors:
    """Per (step, query head) figures of one case: `recall` is the exact attention mass on the
    tokens the method attended; `rel_err` the relative L2 error of the output; `needle_hit`
    whether the method gave the step's needle at least half its exact mass."""

    recall: torch.Tensor
    rel_err: torch.Tensor
    needle_hit: torch.Tensor


def errors(case: Case, ref_w: torch.Tensor, ref_out: torch.Tensor,
           w: torch.Tensor, out: torch.Tensor) -> Errors:
    """Compare a method's attention weights `w` [T, G, S] (0 where it did not attend) and output
    `out` [T, G, D] with the exact ones."""
    recall = (ref_w * (w > 0)).sum(-1)
    rel = (out.double() - ref_out).norm(dim=-1) / ref_out.norm(dim=-1)
    hit = torch.stack([w[t, :, a:b].sum(-1) >= 0.5 * ref_w[t, :, a:b].sum(-1)
                       for t, (a, b) in enumerate(case.needles)])
    return Errors(recall, rel, hit)


def concentration(ref_w: torch.Tensor, fraction: float) -> torch.Tensor:
    """Exact mass on the top `fraction` of tokens per query (the best any selection at that budget
    can reach, token by token): [T, G]."""
    n = max(1, int(fraction * ref_w.shape[-1]))
    return ref_w.topk(n, -1).values.sum(-1)
