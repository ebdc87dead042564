"""Error of kvpipe's lossy options against exact attention, on the synthetic needle set
(analysis/needles.py: Llama-3-8B head shapes, GQA 4, bf16 cache). CPU only.

  python -m benchmarks.lossy_error                 # 8 cases x 8 steps x 4 query heads at 32K
  python -m benchmarks.lossy_error --context 8K --cases 2
  python -m benchmarks.lossy_error --probe-only    # the random-weights probe alone (minutes)

A tiny random Llama run through the executor (`tiny`, --tiny-context) gives logits KL and greedy
agreement of int4, sparse and sparse + int4 against its exact run (random weights: not accuracy).

For every method: the exact attention mass on the tokens it attended (recall), the relative L2
error of the attention output, and the needle hit rate (the step's needle keeps at least half its
exact mass), each against float64 softmax attention over the same bf16 K/V. Rows marked
`reference` are not kvpipe options: they bound what any selection at that budget can reach;
`variant` rows are settings kvpipe does not use by default, kept to show why.
The random-weights probe (`probe_cases`) measures each quantisation and sparse decode at
--probe-sparse fractions (the executor's token-sketch selection, alone and over int4 blocks)
against float64 attention. Sparse over int4 (`sparse F + int4, 32-token blocks`): whole quantised
blocks selected by the executor's rule, read back dequantised, the exact tail attended.
On the trained model (`--model-needles`, benchmarks/lossy_needle.py): a needle in a haystack of
prose through `kvpipe.generate`, greedy, exact and with each option; needle accuracy, token
agreement with exact and the attention-output error the runs measure.

  python -m benchmarks.lossy_error --model-needles --needle-prompts 30 --needle-contexts 2K,2K,4K,8K

The table is printed last; JSON (with the command and date) goes to
benchmarks/results/cpu-<date>-lossy-error.json (or --out)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpipe.analysis.needles import NeedleSpec, cases, concentration, errors, exact
from kvpipe.executor.quant.quantize import dequantize, quantize
from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.pipeline.lossy import BLOCK_RANK, LossySpec
from kvpipe.pipeline.units import parse_tokens


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None):
    """Float64 attention of q [T, G, D] over k, v [S, D], restricted to `keep` [T, S] if given:
    (weights [T, G, S], out [T, G, D])."""
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("tgd,sd->tgs", q, k) / math.sqrt(k.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
    w = torch.softmax(s, -1)
    return w, w @ v


def oracle(fraction: float):
    """Reference: the top `fraction` of tokens by exact attention of the group (sum over heads)."""
    def method(case, ref_w):
        n = max(1, int(fraction * case.k.shape[0]))
        idx = ref_w.sum(1).topk(n, -1).indices                 # [T, n]
        keep = torch.zeros(ref_w.shape[0], ref_w.shape[-1], dtype=torch.bool).scatter_(1, idx, True)
        return attend(case.q, case.k, case.v, keep)
    return method


def block_oracle(fraction: float, group: int = 32):
    """Reference: whole `group`-token blocks ranked by their exact attention mass (group sum) under
    the executor's block rule (`block_keep`: sink and recent blocks forced, the exact tail always
    attended, the same budget): the best any block selection (by any ranking) can reach."""
    spec = LossySpec("int4", group=group, sparse=fraction)

    def method(case, ref_w):
        sealed = case.k.shape[0] // spec.chunk * spec.chunk
        mass = ref_w.sum(1)[:, :sealed].clamp_min(1e-300).log()         # [T, sealed]: log of the exact share
        return attend(case.q, case.k, case.v, block_keep(case.q, case.k, spec, share=mass))
    return method


def window(fraction: float, sink: int = 4):
    """Reference: StreamingLLM's sink + recent window at the same token budget (no scoring)."""
    def method(case, ref_w):
        S = case.k.shape[0]
        keep = torch.zeros(ref_w.shape[0], S, dtype=torch.bool)
        keep[:, :sink] = True
        keep[:, S - (max(1, int(fraction * S)) - sink):] = True
        return attend(case.q, case.k, case.v, keep)
    return method


def quantised(quant: str, k_axis: int = 0, group: int | None = None):
    """kvpipe --lossy QUANT: K and V quantised (groups along tokens unless k_axis=-1: along channels,
    per token), attended in float64 after dequantisation."""
    spec = LossySpec(quant, group=group)

    def method(case, ref_w):
        k = dequantize(quantize(case.k, spec.bits, spec.group, axis=k_axis))
        v = dequantize(quantize(case.v, spec.bits, spec.group, axis=0))
        return attend(case.q, k, v)
    return method


def blocks(quant: str, group: int | None = None, v_per_channel: bool = False, v_group: int | None = None):
    """kvpipe --lossy QUANT as the executor stores it (executor/quant/store.py BlockCodec): whole
    `group`-token blocks, K per channel (groups along the block's tokens), V per token (groups of
    gcd(group, D) channels), the tokens of the last partial block exact; attended in float64.
    `v_per_channel`: V grouped along tokens like K (a variant); `v_group`: V per token in groups of
    `v_group` channels instead of gcd(group, D) (a variant: fewer scale bytes a token)."""
    spec = LossySpec(quant, group=group)

    def method(case, ref_w):
        return attend(case.q, *block_kv(case.k, case.v, spec, v_per_channel, v_group))
    return method


def block_kv(k: torch.Tensor, v: torch.Tensor, spec: LossySpec, v_per_channel: bool = False,
             v_group: int | None = None):
    """k, v [S, D] -> the K/V a lossy run reads back (full blocks dequantised, tail exact)."""
    from kvpipe.executor.quant.blocks import BlockCodec
    S, D = k.shape
    g = spec.group
    nb = S // g
    kv = torch.stack([k, v], 1)                                              # [S, 2, D]
    out = kv.clone()
    codec = BlockCodec(spec.bits, g, D, kv.dtype, spec.vgroup)
    full = kv[:nb * g].reshape(nb, g, 2, D)
    dq = torch.empty_like(full)
    codec.decode(codec.encode(full), dq)
    out[:nb * g] = dq.reshape(nb * g, 2, D)
    if v_per_channel:
        out[:nb * g, 1] = dequantize(quantize(v[:nb * g], spec.bits, g, axis=0))
    if v_group is not None:
        out[:nb * g, 1] = dequantize(quantize(v[:nb * g], spec.bits, v_group, axis=-1))
    return out[:, 0], out[:, 1]


def probe_cases(n: int, tokens: int, seed: int):
    """The random-weights probe of a `kvpipe run` (executor/quant/probe.py) rebuilt offline at
    Llama-3-8B shapes: layer-0 inputs are RMS-normalised embeddings (unit-variance entries),
    W_q, W_k, W_v drawn as HF initialises them (normal, std 0.02 = initializer_range), RoPE
    (theta 500000), one KV head and its 4 query heads; the last token's queries attend every key.
    Yields (k [S, D], v [S, D], q [1, 4, D]) rounded to bf16."""
    from kvpipe.analysis.needles import rope
    g = torch.Generator().manual_seed(seed)
    hidden, D, r = 4096, 128, 4
    for _ in range(n):
        x = torch.randn(tokens, hidden, generator=g)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        wk, wv = (torch.randn(hidden, D, generator=g) * 0.02 for _ in range(2))
        wq = torch.randn(hidden, r * D, generator=g) * 0.02
        pos = torch.arange(tokens)
        k = rope((x @ wk).double(), pos).to(torch.bfloat16)
        v = (x @ wv).to(torch.bfloat16)
        q = rope((x[-1:] @ wq).view(1, r, D).transpose(0, 1).double(), pos[-1:]).transpose(0, 1)
        yield k, v, q.to(torch.bfloat16)


QUANT_SWEEP = (("int8", 64), ("int4", 16), ("int4", 32), ("int4", 64), ("int4", 128))
PROBE_SPARSE = "0.1,0.2,0.3"
OTHER_RANK = next(h for h in ("sum", "max") if h != BLOCK_RANK)   # the block rank kvpipe does not use


def probe_block_name(fraction: float, group: int = 32) -> str:
    return f"sparse {fraction:.0%} + int4, {group}-token blocks ({BLOCK_RANK}), 2-bit sketch"


def probe_sparse_name(fraction: float) -> str:
    return f"sparse {fraction:.0%}, 2-bit token sketch"


def probe_rows(n: int, tokens: int, seed: int, fractions: tuple[float, ...] = ()) -> dict:
    """Relative error of the probe's attention output per quantisation (executor layout) and per
    sparse fraction (the token sketch's selection, `sketch_keep`; with the exact attention mass
    on the selected tokens, recall, against float64 attention over every key)."""
    errs = {q: [] for q in QUANT_SWEEP}
    serr = {(f, b): ([], [], []) for f in fractions for b in (False, True)}   # rel err, recall, fetched
                                                    # (fraction); b: sparse over int4 blocks
    for k, v, q in probe_cases(n, tokens, seed):
        ref_w, ref = attend(q, k, v)
        for quant, group in QUANT_SWEEP:
            out = attend(q, *block_kv(k, v, LossySpec(quant, group=group)))[1]
            errs[(quant, group)].append(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten())
        for (f, b), acc in serr.items():
            if b:   # sparse over int4 blocks: the selected blocks dequantised, the exact tail
                spec = LossySpec("int4", sparse=f, sketch=2)
                keep = block_keep(q, k, spec)
                out = attend(q, *block_kv(k, v, spec), keep)[1]
            else:
                keep = sketch_keep(q, k, LossySpec(sparse=f, sketch=2))                   # [1, S]
                out = attend(q, k, v, keep)[1]
            acc[0].append(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten())
            acc[1].append((ref_w * keep[:, None, :]).sum(-1).flatten())             # [G]
            acc[2].append(keep.double().mean().item())
    rows = {f"{quant} (group {group})": {"rel_err_mean": torch.cat(e).mean().item(),
                                          "rel_err_max": torch.cat(e).max().item(),
                                          "bits_per_value": 16 * LossySpec(quant, group=group).ratio(2)}
            for (quant, group), e in errs.items()}
    for (f, b), (rel, rec, got) in serr.items():
        name = probe_block_name(f) if b else probe_sparse_name(f)
        rows[name] = {"fraction": f, "rel_err_mean": torch.cat(rel).mean().item(),
                      "rel_err_max": torch.cat(rel).max().item(), "recall_mean": torch.cat(rec).mean().item(),
                      "recall_min": torch.cat(rec).min().item(), "tokens_fetched": statistics.fmean(got)}
    return rows


def sketched(fraction: float, bits: int = 2):
    """kvpipe --sparse F (the default, executor/sparse/homes.py): every sealed token scored from its
    `bits`-bit key sketch within its 64-token chunk's min/max (both GPU-resident), ranked by the
    group's estimated attention share; sink 64 + recent 256 + the best tokens, F of the tokens in
    all. The very functions the executor runs (executor/sparse/sketch.py, float32)."""
    spec = LossySpec(sparse=fraction, sketch=bits)

    def method(case, ref_w):
        return attend(case.q, case.k, case.v, sketch_keep(case.q, case.k, spec))
    return method


def token_share(q: torch.Tensor, k: torch.Tensor, spec: LossySpec) -> torch.Tensor:
    """The sketch's rank of every sealed token for queries q [T, G, D] over keys k [S, D], as the
    executor computes it (executor/sparse/homes.py on the torch path): each whole `spec.chunk`-token
    chunk's per-channel key min/max, its keys sketched within them, the group's estimated share:
    [T, sealed]."""
    sealed = k.shape[0] // spec.chunk * spec.chunk
    if not sealed:
        return torch.zeros(q.shape[0], 0)
    chunks = k[:sealed].reshape(-1, spec.chunk, k.shape[-1])                                # [C, chunk, D]
    lo, hi = chunks.amin(1), chunks.amax(1)                                                 # [C, D]
    codes = sparse_sketch.encode(k[:sealed], lo, hi, spec.sketch)
    return torch.stack([sparse_sketch.group_share(sparse_sketch.scores(qt, lo, hi, codes, spec.sketch))
                        for qt in q])


def sketch_keep(q: torch.Tensor, k: torch.Tensor, spec: LossySpec) -> torch.Tensor:
    """The tokens kvpipe run's sparse decode fetches for queries q [T, G, D] over keys k [S, D]:
    every sealed token ranked by `token_share` and sparse_sketch.select's pick (sink, recent
    window, unsealed tail, best tokens): keep [T, S] bool."""
    S = k.shape[0]
    idx = sparse_sketch.select(token_share(q, k, spec), S, spec.fetched_tokens(S), spec.sink, spec.recent)   # [T, N]
    return torch.zeros(q.shape[0], S, dtype=torch.bool).scatter_(1, idx, True)


def sketched_blocks(fraction: float, quant: str = "int4", group: int = 32, how: str = BLOCK_RANK):
    """kvpipe --sparse F --lossy QUANT (executor/sparse/homes.py over executor/quant/store.py): whole
    `group`-token blocks selected by their tokens' sketch ranks (`how`: sum or max), the selected
    blocks read back dequantised and the exact tail attended (`block_keep`, `block_kv`)."""
    spec = LossySpec(quant, group=group, sparse=fraction, sketch=2)

    def method(case, ref_w):
        return attend(case.q, *block_kv(case.k, case.v, spec), block_keep(case.q, case.k, spec, how))
    return method


def block_keep(q: torch.Tensor, k: torch.Tensor, spec: LossySpec, how: str = BLOCK_RANK,
               share: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens kvpipe run's sparse decode over quantised blocks attends (executor/sparse/homes.py
    on the torch path) for queries q [T, G, D] over keys k [S, D]: the token ranks (`share`
    [T, sealed], default the sketch's `token_share`), a rank per `spec.group`-token block
    (sparse_sketch.block_share), sparse_sketch.select over blocks with LossySpec.block_args, every
    token of the chosen blocks and the exact tail: keep [T, S] bool."""
    S, g = k.shape[0], spec.group
    nb, sealed_b, budget, sink, recent = spec.block_args(S)
    keep = torch.zeros(q.shape[0], S, dtype=torch.bool)
    keep[:, nb * g:] = True                                                  # the exact tail
    share = token_share(q, k, spec) if share is None else share
    idx = sparse_sketch.select(sparse_sketch.block_share(share, g, how), nb, budget, sink, recent)   # [T, n]
    toks = (idx[..., None] * g + torch.arange(g)).flatten(-2)
    return keep.scatter_(1, toks, True)


def methods(fraction: float, first: bool = True) -> dict[str, tuple[str, object]]:
    """name -> (kind, method(case, exact weights) -> (weights, out)): the kvpipe options at
    `fraction`, the references bounding them, and variants; quantisation rows and the variants
    that do not depend on the fraction only when `first`."""
    pct = f"{fraction:.0%}"
    rows = {f"oracle top {pct} tokens": ("reference", oracle(fraction)),
            f"sink + recent window {pct}": ("reference", window(fraction))}
    if first:   # quantisation as the executor stores it (blocks); a group sweep of int4 as variants
        rows |= {"int8 (group 64)": ("kvpipe", blocks("int8", 64)),
                 "int4 (group 32)": ("kvpipe", blocks("int4", 32))}
        rows |= {f"int4 (group {g})": ("variant", blocks("int4", g)) for g in (16, 64, 128)}
        rows |= {"int4 (group 32), V per channel": ("variant", blocks("int4", 32, v_per_channel=True))}
        rows |= {f"int4 (group 32), V groups of {vg} channels": ("variant", blocks("int4", 32, v_group=vg))
                 for vg in (32, 64, 128)}   # 64: the executor's int4 layout (a check of this emulation)
    rows |= {f"sparse {pct} + int4, 32-token blocks ({BLOCK_RANK})": ("kvpipe", sketched_blocks(fraction)),
             f"sparse {pct} + int4, 32-token blocks ({OTHER_RANK})": ("variant",
                                                                      sketched_blocks(fraction, how=OTHER_RANK)),
             f"sparse {pct} + int4, 16-token blocks ({BLOCK_RANK})": ("variant",
                                                                      sketched_blocks(fraction, group=16)),
             f"oracle {pct}, 32-token blocks": ("reference", block_oracle(fraction, 32))}
    rows |= {f"sparse {pct}, 2-bit token sketch": ("kvpipe", sketched(fraction))}
    if first:
        rows |= {f"sparse {pct}, 4-bit token sketch": ("variant", sketched(fraction, 4)),
                 "int8, K per token (group 64)": ("variant", quantised("int8", k_axis=-1))}
    return rows


TINY = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
            initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float32")


TINY_INITS = (0.1, 0.02)   # weight std: the tests' tiny models (peaky attention), HF's default (flat)


def tiny_rows(context: int, decode: int, seed: int, fraction: float = 0.2) -> dict:
    """Per weight init of TINY_INITS, `tiny_init_rows`."""
    return {f"init {init}": tiny_init_rows(context, decode, seed, init, fraction) for init in TINY_INITS}


def tiny_init_rows(context: int, decode: int, seed: int, init: float, fraction: float = 0.2) -> dict:
    """`kvpipe run`'s executor on a tiny random Llama (TINY with weight std `init`, float32, every KV
    unit offloaded) per lossy option against the exact run of the same graph: logits KL(exact ||
    lossy) per step (prefill's last and every decode step: mean, max) and greedy-token agreement
    (free-running: once a token differs, the inputs differ). Random weights: not an accuracy."""
    from kvpipe.executor.layers.loader import random_model
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.model import from_hf_config
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    cfg = dict(TINY, initializer_range=init)
    hf = random_model(cfg, seed=seed)
    spec = from_hf_config(cfg, "tiny")
    work = Workload(context, decode, 1)
    ids = torch.randint(0, TINY["vocab_size"], (1, context), generator=torch.Generator().manual_seed(seed))
    plan = Plan(Method.HEADWISE, PhasePlan(1, 256), PhasePlan(1, 1), 0)
    run = lambda lossy: execute(build(spec, work, plan.with_(lossy=lossy)), hf, ids, keep_logits=True)
    ex = run(None)
    p = torch.log_softmax(ex.step_logits.double(), -1)           # prefill's last, then each decode step
    out = {}
    for name, lossy in ((f"int4 (group 32)", LossySpec("int4")),
                        (f"sparse {fraction:.0%}, 2-bit token sketch", LossySpec(sparse=fraction)),
                        (f"sparse {fraction:.0%} + int4, 32-token blocks ({BLOCK_RANK})",
                         LossySpec("int4", sparse=fraction))):
        lo = run(lossy)
        q = torch.log_softmax(lo.step_logits.double(), -1)
        kl = (p.exp() * (p - q)).sum(-1)
        out[name] = {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                     "greedy_agreement": (ex.tokens == lo.tokens).double().mean().item(),
                     "first_token_agrees": bool(ex.tokens[0, 0] == lo.tokens[0, 0])}
    return out


def summarise_errors(errs: list, fetched: list[float]) -> dict:
    recall = torch.cat([e.recall.flatten() for e in errs])
    rel = torch.cat([e.rel_err.flatten() for e in errs])
    hit = torch.cat([e.needle_hit.flatten() for e in errs])
    return {"recall_mean": recall.mean().item(), "recall_p5": recall.quantile(0.05).item(),
            "recall_min": recall.min().item(), "rel_err_mean": rel.mean().item(),
            "rel_err_max": rel.max().item(), "needle_hit_rate": hit.double().mean().item(),
            "needles": hit.numel(), "tokens_fetched": sum(fetched) / len(fetched)}


def fractions_arg(text: str) -> tuple[float, ...] | None:
    """Comma-separated fractions in (0, 1], or None (the caller says so on stderr)."""
    try:
        out = tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        return None
    return out if all(0 < f <= 1 for f in out) else None


def needle_rows(spec: NeedleSpec, fractions: list[float], only: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Every method's row on the needle set (`only`: those whose name holds one of its strings),
    and the set's description (exact attention's shape)."""
    table, frac_of = {}, {}
    for i, f in enumerate(fractions):
        new = {n: m for n, m in methods(f, first=(i == 0)).items() if not only or any(o in n for o in only)}
        table |= new
        frac_of |= {name: f for name in new}
    errs = {name: [] for name in table}
    fetched = {name: [] for name in table}
    shape = {"top20_mass": [], "needle_mass": [], "sink_mass": []}
    for case in cases(spec):
        ref_w, ref_out = exact(case)
        shape["top20_mass"].append(concentration(ref_w, 0.2).flatten())
        shape["sink_mass"].append(ref_w[..., 0].flatten())
        shape["needle_mass"].append(torch.stack([ref_w[t, :, a:b].sum(-1) for t, (a, b) in enumerate(case.needles)]).flatten())
        for name, (_, method) in table.items():
            w, out = method(case, ref_w)
            errs[name].append(errors(case, ref_w, ref_out, w, out))
            fetched[name].append(((w > 0).any(1).double().mean()).item())
    stats = {k: torch.cat(v) for k, v in shape.items()}
    rows = {name: dict(kind=table[name][0], fraction=frac_of[name], **summarise_errors(errs[name], fetched[name]))
            for name in table}
    for name, row in rows.items():   # stored bits per KV value (codes + float16 scale and zero)
        quant = next((q for q in ("int8", "int4") if name.startswith(q)), None)
        if quant:
            row["bits_per_value"] = 16 * LossySpec(quant, group=int(name.split("group ")[1].split(")")[0])).ratio(2)
    info = {"context": spec.context, "head_dim": spec.head_dim, "gqa": spec.gqa, "cases": spec.cases,
            "steps": spec.steps, "seed": spec.seed, "dtype": spec.dtype,
            "needle_logit": list(spec.needle_logit), "topic_logit": spec.topic_logit,
            "sink_logit": spec.sink_logit,
            "exact_needle_mass": {"min": stats["needle_mass"].min().item(),
                                  "median": stats["needle_mass"].median().item()},
            "exact_sink_mass_median": stats["sink_mass"].median().item(),
            "exact_top20pct_mass": {"mean": stats["top20_mass"].mean().item(),
                                    "min": stats["top20_mass"].min().item()}}
    return rows, info


def print_needles(spec: NeedleSpec, rows: dict, s: dict) -> None:
    print(f"synthetic needle set: {spec.cases} cases x {spec.steps} steps x {spec.gqa} query heads, "
          f"{spec.context} tokens, D={spec.head_dim}, {spec.dtype} cache, reference float64 attention")
    print(f"exact attention: top 20% of tokens hold {s['exact_top20pct_mass']['mean']:.3f} of the mass "
          f"(min {s['exact_top20pct_mass']['min']:.3f}); needle mass median {s['exact_needle_mass']['median']:.3f} "
          f"(min {s['exact_needle_mass']['min']:.2g}); sink median {s['exact_sink_mass_median']:.3f}")
    print(f"{'method':44}{'kind':>10}{'fetched':>9}{'recall':>8}{'rec p5':>8}{'rel err':>10}{'max':>10}"
          f"{'needles':>9}")
    for name, r in rows.items():
        print(f"{name:44}{r['kind']:>10}{r['tokens_fetched']:>9.3f}{r['recall_mean']:>8.3f}"
              f"{r['recall_p5']:>8.3f}"
              f"{r['rel_err_mean']:>10.2e}{r['rel_err_max']:>10.2e}{r['needle_hit_rate']:>9.1%}")


def print_probe(probe: dict, rows: dict, context: int | None, cases_: int, tokens: int) -> None:
    needles = "" if context is None else f"the {context}-token needle set and "
    print(f"quantisation error vs group size (mean / max rel err of the attention output) on {needles}"
          f"the random-weights probe ({cases_} x {tokens} tokens):")
    print(f"{'quantisation':24}{'bits/value':>11}{'needle mean':>13}{'needle max':>12}{'probe mean':>12}"
          f"{'probe max':>12}")
    for name, p in probe.items():
        if "bits_per_value" not in p:
            continue
        r = rows.get(name, {})
        nm = f"{r['rel_err_mean']:.2e}" if r else "-"
        nx = f"{r['rel_err_max']:.2e}" if r else "-"
        print(f"{name:24}{p['bits_per_value']:>11.2f}{nm:>13}{nx:>12}{p['rel_err_mean']:>12.2e}{p['rel_err_max']:>12.2e}")
    sparse_rows = {n: p for n, p in probe.items() if "fraction" in p}
    if sparse_rows:
        print(f"sparse decode on the random-weights probe (the executor's token-sketch selection; "
              f"recall: exact attention mass on the fetched tokens):")
        print(f"{'sparse':56}{'fetched':>9}{'recall':>8}{'rec min':>9}{'rel err':>10}{'max':>10}")
        for name, p in sparse_rows.items():
            print(f"{name:56}{p['tokens_fetched']:>9.3f}{p['recall_mean']:>8.3f}{p['recall_min']:>9.3f}"
                  f"{p['rel_err_mean']:>10.2e}{p['rel_err_max']:>10.2e}")


def needle_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model-needles", action="store_true",
                    help="only the trained-model needle set (SmolLM2-135M, kvpipe.generate)")
    ap.add_argument("--needle-prompts", type=int, default=30, help="trained-model needle set: prompts")
    ap.add_argument("--needle-contexts", default="2K,2K,4K,8K",
                    help="trained-model needle set: prompt tokens, cycled over the prompts (comma list)")
    ap.add_argument("--device", default="cpu", help="trained-model needle set: the device kvpipe runs on")
    ap.add_argument("--cache", help="trained-model needle set: GGUF conversion cache (default: kvpipe's)")
    ap.add_argument("--needle-merge", nargs="+", metavar="JSON",
                    help="trained-model needle set: merge these runs' JSON into --out (no run)")


def model_needles(args, argv: list[str]) -> int:
    """The trained-model needle set (benchmarks/lossy_needle.py), its JSON and its table."""
    from benchmarks import lossy_needle
    from benchmarks.result_file import result_file
    try:
        contexts = [parse_tokens(c) for c in args.needle_contexts.split(",") if c.strip()]
    except ValueError:
        contexts = []
    if not contexts or args.needle_prompts < 1:
        print("--needle-contexts: expected token counts (e.g. 2K,4K) and --needle-prompts >= 1", file=sys.stderr)
        return 2
    out = Path(args.out or result_file("lossy-needle", args.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.needle_merge:
        result = lossy_needle.merge([Path(p) for p in args.needle_merge], out, argv)
        lossy_needle.print_summary(result)
        print(f"json: {out}")
        return 0
    result = lossy_needle.run(contexts, args.needle_prompts, args.seed, args.device, out,
                             Path(args.cache) if args.cache else None, argv)
    lossy_needle.print_summary(result)
    print(f"json: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="32K")
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fraction", default="0.2", help="token budget of sparse rows; a comma list runs each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/cpu-<date>-lossy-error.json)")
    ap.add_argument("--probe-cases", type=int, default=4, help="random-weights probe cases (0: none)")
    ap.add_argument("--probe-tokens", default="16K", help="random-weights probe: tokens per case")
    ap.add_argument("--probe-sparse", default=PROBE_SPARSE,
                    help="random-weights probe: sparse fractions measured (comma list; empty: none)")
    ap.add_argument("--probe-only", action="store_true", help="only the random-weights probe (no needle set)")
    ap.add_argument("--tiny-context", default="2K", help="tiny random model: prompt tokens (0: no tiny rows)")
    ap.add_argument("--tiny-decode", type=int, default=32, help="tiny random model: decode steps")
    ap.add_argument("--only", default="", help="needle set: only the rows whose name holds one of these "
                                               "comma-separated strings (default: every row)")
    needle_args(ap)
    args = ap.parse_args(argv)
    if args.model_needles:
        return model_needles(args, argv if argv is not None else sys.argv[1:])
    spec = NeedleSpec(context=parse_tokens(args.context), cases=args.cases, steps=args.steps, seed=args.seed)
    torch.manual_seed(0)
    fractions = fractions_arg(args.fraction)
    probe_fractions = fractions_arg(args.probe_sparse) if args.probe_sparse.strip() else ()
    for flag, val, got in (("--fraction", args.fraction, fractions), ("--probe-sparse", args.probe_sparse,
                                                                      probe_fractions)):
        if got is None or (flag == "--fraction" and not got):
            print(f"{flag}: expected fractions in (0, 1], comma-separated, got {val!r}", file=sys.stderr)
            return 2
    if args.probe_only and not args.probe_cases:
        print("--probe-cases: --probe-only needs at least one probe case", file=sys.stderr)
        return 2
    t0 = time.time()
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    rows, info = ({}, None) if args.probe_only else needle_rows(spec, list(fractions), only)
    tokens = parse_tokens(args.probe_tokens)
    probe = probe_rows(args.probe_cases, tokens, args.seed, probe_fractions) if args.probe_cases else {}
    tiny_ctx = parse_tokens(args.tiny_context) if args.tiny_context != "0" else 0
    tiny = tiny_rows(tiny_ctx, args.tiny_decode, args.seed) if tiny_ctx else {}
    result = {
        "command": "python -m benchmarks.lossy_error " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__} (CPU)".strip(),
        "wall_s": round(time.time() - t0, 1),
        "set": info,
        "rows": rows,
        "probe": {"what": "random-weights probe at Llama-3-8B shapes (HF init std 0.02, layer 0, last query "
                          "over every key), as `kvpipe run --random-weights --lossy` measures itself; not task accuracy",
                  "cases": args.probe_cases, "tokens": tokens, "rows": probe},
        "tiny": {"what": "executor runs of a tiny random Llama (benchmarks/lossy_error.py TINY, float32, every unit "
                         "offloaded) against the exact run: logits KL and greedy agreement over the decode steps; "
                         "random weights, not task accuracy",
                 "context": tiny_ctx, "decode_tokens": args.tiny_decode, "rows": tiny},
    }
    from benchmarks.result_file import result_file
    out = Path(args.out or result_file("lossy-error"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if info:
        print_needles(spec, rows, info)
    if probe:
        print_probe(probe, rows, None if args.probe_only else spec.context, args.probe_cases, tokens)
    if tiny:
        print(f"tiny random model, executor runs against the exact run ({tiny_ctx} tokens, {args.tiny_decode} "
              f"decode steps; not accuracy):")
        print(f"{'weights':12}{'option':46}{'KL mean':>10}{'KL max':>10}{'greedy agree':>14}")
        for init, rows_ in tiny.items():
            for name, t in rows_.items():
                print(f"{init:12}{name:46}{t['kl_mean']:>10.2e}{t['kl_max']:>10.2e}{t['greedy_agreement']:>14.1%}")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
