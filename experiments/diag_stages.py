"""Stage-level diagnosis of sim_check rows on the GPU (experiments/diag.py --rows <sim_check rows>):
for each row, every stage's measured span and host issue time, its kernels' GPU time split into
GEMM / attention / small kernels / copies, and the device seconds pipeline/cost.py predicts for
it; summed per prefill chunk and per decode step in a table printed last.

Three passes per row: (A) after an untimed warm-up, the plan exactly as sim_check runs it (spans:
CUDA events per stage, no profiler), for EVERY row before any profiling (a profiler session
leaves the host slower for the rest of the process); then per row, in one profiler session,
(B) the prefill alone (decode 0), one range per stage opened by the runner's stage hook, and
(C) the whole plan, whose decode ranges give the replayed steps' kernels. Spans and host times
come from pass A only; kernel durations are GPU times, which the profiler does not change."""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict

from benchmarks import sim_check
from experiments.kernel_split import ANNOTATION_PREFIX, CATEGORIES, split


class StageRanges:
    """A runner stage hook that opens a profiler range per stage, `<prefix><stage id>`, closing the
    previous one (the lanes issue one stage at a time on one thread: the ranges never overlap)."""

    def __init__(self, prefix: str = ANNOTATION_PREFIX) -> None:
        self.prefix, self.cur = prefix, None

    def __call__(self, s) -> None:
        import torch
        self.close()
        self.cur = torch.autograd.profiler.record_function(f"{self.prefix}{s.id}")
        self.cur.__enter__()

    def close(self) -> None:
        if self.cur is not None:
            self.cur.__exit__(None, None, None)
            self.cur = None


def profiled(passes: dict) -> tuple[dict, dict]:
    """Run each `fn(hook)` of `passes` ({prefix: fn}) in turn under ONE torch.profiler session
    (CPU + CUDA; starting one costs seconds), each with its own range prefix; returns the kernel
    split per stage id of each pass and each pass's error (None when it ran)."""
    import torch
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    errors = {}
    with torch.profiler.profile(activities=acts) as p:
        for prefix, fn in passes.items():
            hook = StageRanges(prefix)
            try:
                fn(hook)
                errors[prefix] = None
            except Exception as e:   # e.g. graph capture under the profiler: the other pass stays
                errors[prefix] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            finally:
                hook.close()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        p.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    return {prefix: split(events, prefix) for prefix in passes}, errors


ALLOC_KEYS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def alloc_counters() -> dict[str, int]:
    """The caching allocator's cumulative counters that show it hitting the cap: retries (every
    cached block freed, the device synchronised, the allocation tried again), cudaMalloc / cudaFree
    calls, full-device synchronisations."""
    import torch
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ALLOC_KEYS}


def stage_key(s) -> dict:
    return {"phase": s.phase.value, "step": s.step, "layer": s.layer, "group": s.group, "tag": s.tag,
            "kind": s.kind.value, "tokens": list(s.tokens), "ops": s.ops, "bytes": s.bytes}


def measure_row(name: str, hf, ids_all, spec, device, hw) -> dict:
    """Pass A of row `name`: warm-up, then the plan as sim_check runs it; every stage's span, host
    issue seconds and predicted device seconds, and the allocator's counters over the run."""
    import torch

    from kvpipe.executor.engine.runner import execute
    from kvpipe.executor.engine.session import warm_up
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.cost import stage_seconds
    from kvpipe.pipeline.report import timing_from_trace
    from kvpipe.pipeline.workload import Workload
    context = sim_check.ROWS[name][0]
    work, plan = Workload(context, sim_check.DECODE, 1), sim_check.plan_of(name)
    graph = build(spec, work, plan)
    warm_up(graph, hf, ids_all[:, :context], device, replay="auto")
    before = alloc_counters()
    r = execute(graph, hf, ids_all[:, :context], device, replay="auto")
    alloc = {k: v - before.get(k, 0) for k, v in alloc_counters().items()}
    t = timing_from_trace(r.trace)
    replayed = r.decode_issue == "graph"
    spans = {sp.stage: sp for sp in r.trace.spans}
    stages = []
    for s in graph.stages:
        sp = spans[s.id]
        stages.append(dict(stage_key(s), id=s.id, measured_s=sp.end_s - sp.start_s, start_s=sp.start_s,
                           host_s=sp.host_s, predicted_s=stage_seconds(s, hw, spec.dtype, replayed and s.phase.value == "decode")))
    row = {"context": context, "decode_tokens": work.decode_tokens, "plan": plan.to_json(),
           "decode_issue": "graph" if replayed else "eager",
           "measured": {"prefill_s": t.prefill_s, "decode_s_per_token": t.decode_s_per_token},
           "allocator_pass_a": alloc, "peak_gpu_bytes_pass_a": r.peak_gpu_bytes, "stages": stages}
    del r
    torch.cuda.empty_cache()
    return row


def profile_row(name: str, row: dict, hf, ids_all, spec, device) -> None:
    """Passes B and C of row `name` under one profiler session: each stage's kernels into `row`."""
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.workload import Workload
    context = sim_check.ROWS[name][0]
    plan = sim_check.plan_of(name)
    ids = ids_all[:, :context]
    graph = build(spec, Workload(context, sim_check.DECODE, 1), plan)
    pre_graph = build(spec, Workload(context, 0, 1), plan)
    split_of, errs = profiled({
        "kvpipe-pre#": lambda hook: execute(pre_graph, hf, ids, device, stage_hook=hook),
        "kvpipe-all#": lambda hook: execute(graph, hf, ids, device, stage_hook=hook, replay="auto")})
    pre, full = split_of["kvpipe-pre#"], split_of["kvpipe-all#"]
    # pre_graph's prefill stages are graph's (same builder, same plan, decode after): match by key
    pre_ids = {json.dumps(stage_key(s)): s.id for s in pre_graph.stages}
    for s, st in zip(graph.stages, row["stages"]):
        st["kernels"] = (pre.get(pre_ids.get(json.dumps(stage_key(s)), -2)) if s.phase.value == "prefill"
                         else full.get(s.id))
    # outside the pass's own ranges, the OTHER pass's kernels included (one session holds both)
    row["unattributed_kernels"] = {"prefill_pass": pre.get(-1), "full_pass": full.get(-1)}
    row["pass_errors"] = errs


def per_step(row: dict) -> list[dict]:
    """Per (phase, step): GPU-lane span sums (measured, predicted) per compute tag, host issue
    seconds, kernel seconds per category, the step's GPU-lane extent, h2d/d2h span sums."""
    acc: dict[tuple, dict] = {}
    for s in row["stages"]:
        k = (s["phase"], s["step"])
        a = acc.setdefault(k, {"phase": s["phase"], "step": s["step"], "measured": defaultdict(float),
                               "predicted": defaultdict(float), "host_s": 0.0,
                               "kernels": {c: 0.0 for c in CATEGORIES}, "first": None, "last": 0.0})
        lane_tag = s["tag"] if s["kind"] == "compute" else s["kind"]
        a["measured"][lane_tag] += s["measured_s"]
        a["predicted"][lane_tag] += s["predicted_s"]
        a["host_s"] += s["host_s"]
        for c, (sec, _) in (s.get("kernels") or {}).items():
            a["kernels"][c] += sec
        if s["kind"] == "compute":
            a["first"] = s["start_s"] if a["first"] is None else min(a["first"], s["start_s"])
            a["last"] = max(a["last"], s["start_s"] + s["measured_s"])
    return list(acc.values())


def table(name: str, row: dict) -> list[str]:
    lines = [f"{name}: allocator during the run {row['allocator_pass_a']}, peak {row['peak_gpu_bytes_pass_a'] / 1e9:.1f} GB"]
    lines += [f"{name}: prefill {row['measured']['prefill_s']:.3f} s, decode "
             f"{(row['measured']['decode_s_per_token'] or 0) * 1e3:.2f} ms; per step, ms measured/predicted "
             "(GPU lane: qkv attn mlp head (a replayed step: all of it); h2d d2h), host issue, kernels gemm/attn/small/copy"]
    for a in per_step(row):
        m, p, k = a["measured"], a["predicted"], a["kernels"]
        cells = " ".join(f"{t}={m.get(t, 0) * 1e3:.1f}/{p.get(t, 0) * 1e3:.1f}" for t in ("qkv", "attn", "mlp", "head", "h2d", "d2h"))
        lines.append(f"  {a['phase'][:3]} {a['step']:>2} {cells} host={a['host_s'] * 1e3:.1f} "
                     f"k={'/'.join(f'{k[c] * 1e3:.1f}' for c in CATEGORIES)}")
    return lines


def stage_trace(names: list[str], out: dict, hw_name: str, save) -> None:
    """Trace `names` (sim_check rows) into `out[name]`, predicted with profile `hw_name`, calling
    `save()` after each row."""
    import torch

    from kvpipe.executor.engine import session
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.model import load_model
    t0 = time.perf_counter()
    spec, hw = load_model(sim_check.MODEL), load_profile(hw_name)
    device = session.resolve_device("cuda")
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, sim_check.GPU_BUDGET / torch.cuda.get_device_properties(device).total_memory), device)
    hf = session.load_hf_model(sim_check.MODEL, True, device, torch.bfloat16, 0)
    ids_all = session.prompt_tensor(None, 1, max(sim_check.ROWS[n][0] for n in names), spec.vocab, 0)
    print(f"diag: model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    lines = []
    # Every row's pass A first: on the H200 (2026-11-30) the rows measured after a profiler session
    # issued 1.5-2.4x slower than the same process's first row and the calibrate probe (suspected:
    # the profiler's residue), so no span or host time is measured after the first profiler starts.
    for name in names:
        t1 = time.perf_counter()
        try:
            out[name] = measure_row(name, hf, ids_all, spec, device, hw)
        except Exception as e:   # one failed row must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            torch.cuda.empty_cache()
        print(f"diag: {name} measured in {time.perf_counter() - t1:.1f} s", flush=True)
        save()
    for name in names:
        if "error" in out[name]:
            lines.append(f"{name}: failed: {out[name]['error']}")
            continue
        t1 = time.perf_counter()
        try:
            profile_row(name, out[name], hf, ids_all, spec, device)
        except Exception as e:
            out[name]["pass_errors"] = {"profile": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            torch.cuda.empty_cache()
        lines += table(name, out[name])
        print(f"diag: {name} profiled in {time.perf_counter() - t1:.1f} s", flush=True)
        save()
    print("\n".join(lines), flush=True)
