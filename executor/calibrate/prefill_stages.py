"""`kvpipe calibrate`'s prefill stages timed as a run issues them. A random-weight model of a few
Llama-3-8B-shaped layers prefills one chunk at each (KV heads per group, chunk, prefix) point
through the executor itself: the builder's graph of an all-resident plan whose chunk starts past
a prefix already home (pipeline/builder.build `starts`), run by executor/engine/runner.execute
over one KVStore, so every stage runs as a run's does (qkv, each group's attention over its own
chunk and its prefix with the merge, mlp; layer after layer), spans timed by the lanes' CUDA
events. Layer 0 is the warm-up (cuDNN plans, allocator); before layer 1 the compute stream is
held busy with GEMMs for longer than the host takes to issue the rest, so the spans from layer 1
on are device time of stages back to back at a sustained clock, never the host's issue rate.
pipeline/stage_fit.py turns the spans into the profile's figures. On a CPU the host clock times them."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvpipe.pipeline.run_rates import prefix_call
from kvpipe.pipeline.stage import Lane, Stage
from kvpipe.pipeline.stage_fit import Timed
from kvpipe.pipeline.trace import Trace

from kvpipe.executor.calibrate.host_issue import probe_model

WARM_LAYERS = 1   # layers of each point run before the timed ones (plans built, allocator warm)
ISSUE_MARGIN = 2.0   # the busy work lasts this many times the host's estimated issue time of the rest


def points(groups, chunks, rows, keys) -> list[tuple[int, int, int]]:
    """(KV heads per group, chunk tokens, prefix tokens) of every timed chunk: each (group, chunk)
    with no prefix (the own grid), then each prefix grid row (its pair, run_rates.prefix_call) over
    each prefix length."""
    own = [(g, n, 0) for g in groups for n in chunks]
    return own + [(*prefix_call(r, groups, chunks), p) for r in rows for p in keys]


def model_config(dims: dict, d: int) -> dict:
    """The probe model's HF overrides for GEMM dims `dims` (hidden, inner, q_dim, kv_dim) at head dim `d`."""
    return dict(hidden_size=dims["hidden"], intermediate_size=dims["inner"],
                num_attention_heads=dims["q_dim"] // d, num_key_value_heads=dims["kv_dim"] // d, head_dim=d,
                max_position_embeddings=1 << 20)


class Busy:
    """Holds the current CUDA stream busy for about `seconds` with bf16 GEMMs (`rate`: their FLOP/s
    at the settled clock), so the stages the host issues next queue behind them."""

    def __init__(self, dev: torch.device, rate_flops_per_s: float, size: int = 8192) -> None:
        self.a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        self.call_s = 2.0 * size ** 3 / rate_flops_per_s

    def __call__(self, seconds: float) -> None:
        for _ in range(max(1, math.ceil(seconds / self.call_s))):
            self.a @ self.a


def time_points(dev: torch.device, dims: dict, d: int, pts, layers: int,
                issue_s: Callable[[Stage], float], busy: Busy | None) -> list[Trace]:
    """One executor run per point (`points`) of a `layers`-layer probe model; their traces."""
    from kvpipe.executor.engine.runner import execute
    from kvpipe.executor.kv.layout import KVLayout
    from kvpipe.executor.kv.store import KVStore
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    model = probe_model(str(dev), layers, **model_config(dims, d))
    spec = HFAdapter(model).spec()
    plan = lambda g, n: Plan(Method.HEADWISE, PhasePlan(g, n, 2), PhasePlan(g, 1, 2), spec.units, 0)  # noqa: E731
    cap = max(p + n for _, n, p in pts)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab, (1, cap), generator=gen)
    traces = []
    with torch.inference_mode(), KVStore(KVLayout.of(build(spec, Workload(cap, 0, 1), plan(1, cap))), dev,
                                         HFAdapter(model).dtype) as store:
        for home in store.gpu:
            home.normal_()   # the prefixes attended: K/V of a normal's range, not uninitialised bits
        for g, n, p in pts:
            graph = build(spec, Workload(p + n, 0, 1), plan(g, n), starts=(p,))
            rest = [s for s in graph.stages if s.lane is Lane.GPU and (s.layer or 0) >= WARM_LAYERS]

            def hook(s: Stage, rest=rest) -> None:
                if busy is not None and s.id == rest[0].id:
                    busy(ISSUE_MARGIN * sum(issue_s(x) for x in rest))
            traces.append(execute(graph, model, ids[:, :p + n], dev, store=store, stage_hook=hook).trace)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return traces


def timed(traces: list[Trace]) -> list[Timed]:
    """The prefill qkv, attn and mlp stages of layers from WARM_LAYERS on, with their span's seconds."""
    out = []
    for tr in traces:
        for sp in tr.spans:
            s = tr.graph.stages[sp.stage]
            if s.tag in ("qkv", "attn", "mlp") and s.layer >= WARM_LAYERS:
                out.append(Timed(s, sp.end_s - sp.start_s))
    return out


def idle_s(tr: Trace) -> float:
    """Seconds the compute lane sat idle between the timed stages of a trace (0 where the busy
    work covered the host's issue: the spans are device time back to back)."""
    stages = tr.graph.stages
    spans = sorted((sp for sp in tr.spans if stages[sp.stage].lane is Lane.GPU
                    and (stages[sp.stage].layer or 0) >= WARM_LAYERS), key=lambda sp: sp.start_s)
    return sum(max(0.0, b.start_s - a.end_s) for a, b in zip(spans, spans[1:]))


def record(traces: list[Trace]) -> list[dict]:
    """The JSON record: per point its shape, the compute lane's idle time and each timed stage's seconds."""
    out = []
    for tr in traces:
        g, first = tr.graph.plan.prefill.group, next(s for s in tr.graph.stages if s.tag == "qkv")
        start, end = first.tokens
        out.append({"group": g, "chunk": end - start, "prefix": start, "idle_s": idle_s(tr),
                    "stages": [[t.stage.name, t.seconds] for t in timed([tr])]})
    return out


def so_far(cal, base):
    """`base` with the figures `cal` measured before this step that the fit and the busy work read
    (small kernels, launches, HBM rate; the host's prefill issue costs)."""
    from dataclasses import replace
    v = cal.values
    hbm = v["gpu.hbm_eff_bytes_per_s"]
    host = {f: v[k] for k, f in (("host.prefill_issue_s_per_stage", "host_prefill_issue_s_per_stage"),
                                 ("host.prefill_issue_s_per_launch", "host_prefill_issue_s_per_launch"),
                                 ("host.prefill_issue_gap_s", "host_prefill_issue_gap_s"),
                                 ("host.issue_s_per_stage", "host_issue_s_per_stage"),
                                 ("host.issue_s_per_op", "host_issue_s_per_op")) if k in v}
    return replace(base, launch_overhead_s=v["gpu.launch_overhead_s"], small_kernel_s=v["gpu.small_kernel_s"],
                   elementwise_efficiency=v["gpu.elementwise_efficiency"], hbm_eff_bytes_per_s=hbm,
                   hbm_peak_bytes_per_s=max(hbm, base.hbm_peak_bytes_per_s), **host)


def measure(cal, dev: torch.device, base, dims: dict, d: int, groups, chunks, rows, keys, layers: int = 4) -> None:
    """The step: time every point (`points`), fit (pipeline/stage_fit.py) and set the profile's
    GEMM rate and half, [gpu.stage_gemm], [gpu.attention_rates] and attention_efficiency."""
    from kvpipe.pipeline.cost import host_issue_seconds
    from kvpipe.pipeline.stage_fit import fit
    hw = so_far(cal, base)
    busy = None
    if dev.type == "cuda":
        warm = cal.extra.get("warm_clock_gemm_flops_per_s") or [cal.values["gpu.compute.bf16.effective_flops_per_s"]]
        busy = Busy(dev, warm[-1])
    pts = points(groups, chunks, rows, keys)
    traces = time_points(dev, dims, d, pts, layers, lambda s: host_issue_seconds(s, hw), busy)
    dtype = "bf16" if dev.type == "cuda" else "fp32"
    f = fit(timed(traces), hw, dtype)
    how = (f"the executor's prefill stages in a run's order (qkv, attention per group, mlp) of a {layers}-layer "
           f"random-weight model ({dims['hidden']} hidden, {dims['inner']} intermediate, {dims['q_dim'] // d}:"
           f"{dims['kv_dim'] // d} heads of {d}), one chunk per (group, chunk, prefix) point over a prefix home, "
           f"layers {WARM_LAYERS}.. queued behind GEMMs (CUDA events), less their small kernels and launches as the "
           "profile prices them (pipeline/stage_fit.py)")
    tokens = f"chunks {list(chunks)}"
    cal.set(f"gpu.compute.{dtype}.effective_flops_per_s", f.flops_per_s,
            f"{how}: the qkv and mlp stages at {tokens}, pooled; slope of stage GEMM seconds = (flops + half) / eff")
    cal.set("gpu.small_shape_half_flops", f.half_flops, f"{how}: the same fit's intercept x slope")
    cal.set("gpu.stage_gemm.dtype", dtype, "the models' dtype the stages ran in")
    for tag in ("qkv", "mlp"):
        rate, half = f.gemm.of(tag)
        cal.set(f"gpu.stage_gemm.{tag}_flops_per_s", rate, f"{how}: the {tag} stages at {tokens}, fit's slope")
        cal.set(f"gpu.stage_gemm.{tag}_half_flops", half, f"{how}: the {tag} stages' fit, intercept x slope")
    r = f.attention
    cal.set("gpu.attention_rates.dtype", r.dtype, "the models' dtype the stages ran in")
    cal.set("gpu.attention_rates.prefix_rows", list(r.prefix.xs), "prefix call grid: KV heads x chunk tokens per call")
    cal.set("gpu.attention_rates.prefix_keys", list(r.prefix.ys), "prefix call grid: prefix keys")
    cal.set("gpu.attention_rates.prefix_flops_per_s", [list(x) for x in r.prefix.rates],
            f"{how}: attention stages over a prefix, less their own call at the own grid's rate, median")
    cal.set("gpu.attention_rates.own_groups", list(r.own.xs), "own call grid: KV heads per call")
    cal.set("gpu.attention_rates.own_chunks", list(r.own.ys), "own call grid: chunk tokens")
    cal.set("gpu.attention_rates.own_flops_per_s", [list(x) for x in r.own.rates],
            f"{how}: attention stages of chunks with no prefix (causal pairs), median")
    cal.set("gpu.attention_efficiency", r.estimate_efficiency(f.flops_per_s),
            "the fastest rate of [gpu.attention_rates] over the stage-fitted GEMM rate (the planner's "
            "estimate bound; the simulator costs prefill attention from the grids)")
    cal.extra["prefill_stages"] = {"layers": layers, "clamped": list(f.clamped), "points": record(traces)}
