"""Published end-to-end figures of GPUs we do not own, each beside the simulator's prediction of the
same workload with the plan or method that matches what the measured system does, and the error.
Only figures read in a cited source (benchmarks/published_rows.py); every plan detail a source does
not state is named in `ASSUMED`. The profiles' own sources (micro-benchmarks, docs/HARDWARE.md) are
disjoint from these.

  python -m benchmarks.published     # prints the table and medians, writes benchmarks/results/cpu-<date>-published.json

Systems:
- HeadInfer (Luo et al., arXiv 2502.12574), Tables 6 (prefill s) and 7 (decode s/token), 3 and 5
  (maximum context), one RTX 4090 with 1 TB RAM; read from the paper's HTML tables as reproduced in
  github.com/deep-diver/ai-paper-reviewer content/paper-reviews/2502.12574/index.md. Its "head=h" is h
  KV heads per group (`--group h`), nothing resident. Its Standard, Chunked Prefill and Layer-offload
  rows are the Hugging Face transformers baselines it measured (system "hf", methods standard /
  chunked / layerwise).
- llama.cpp `llama-bench`, F16 weights, flash_attn = 0, as published in
  XiongjieDai/GPU-Benchmarks-on-LLM-Inference (README tables and the notebooks they come from).
  Predicted through sim/baselines.py: the prompt in 512-token micro-batches (chunked, chunk 512),
  decode all on the GPU (standard), kernels queued from C++ (`native_issue`), the attention
  scores materialised without flash attention (`prompt_scores_seconds`), and in the prompt its
  F16 GEMMs at the fp16-accumulate rate (`fp16_accumulate`) and its F32 elementwise kernels in
  place of kvpipe's (`elementwise_seconds`).
- LMDeploy's TurboMind on an A100 (its docs' static inference tables): decode all on the GPU, its
  first token as `turbomind_first_token` (the prompt less one in one pass, then a decode step).
Each prefill row carries its predicted seconds by stage (`prefill_split`)."""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.published_rows import (HEADINFER, HEADINFER_ROWS, LLAMACPP_ROWS, LMDEPLOY, LMDEPLOY_ROWS,
                                      MAX_CONTEXT_ROWS, why)
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.memory import breakdown, over_limits
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.cost import stage_small_seconds
from kvpipe.pipeline.plan import Method, PhasePlan
from kvpipe.pipeline.rules import default_plan, first_true
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.rules import max_context as rule_max_context
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.baselines import (HEADINFER_LIVE_COPIES, UBATCH, elementwise_seconds, fp16_accumulate, live_copies,
                                  native_issue, one_pass, prompt_scores_seconds, scores_seconds,
                                  turbomind_first_token)
from kvpipe.sim.simulate import simulate

HOST_BYTES = 10**12       # HeadInfer's 1 TB RAM
DECODE_STEPS = 16
ASSUMED = ("HeadInfer: prefill chunk 4096 tokens for its chunked and head-wise rows, depth 2, 16 decode steps, "
           "Tables 6 and 7 on the RTX 4090 of its setup; its maximum contexts (Tables 3, 5) with 16 decode tokens, "
           "searched in steps of 1K tokens as the paper reports them. llama.cpp: llama-bench's n_ubatch 512 as "
           "the chunk; tg N as 16 decode steps at context N/2 (the mean context of N steps from an empty prompt), "
           "its score traffic the mean over the N steps; pp N seconds = N / published tokens per second; "
           "the overview's 'A100 80GB' (an A100 80GB PCIe, as its notebook prints) with profile a100-80g (the SXM part). "
           "LMDeploy: its 'A100-80G' as profile a100-80g; its context attention as the simulator's FA2; decode "
           "per token at the mean context of its output steps")


def _simulate(model, work, plan, hw, budgets, split: dict | None = None) -> tuple[object, bool]:
    """(timing, fits); `split`, if given, receives `prefill_split` of the prediction."""
    fits = all(v <= budgets[p] for p, v in breakdown(model, work, plan).pools().items())
    pred = simulate(model, work, plan, hw)
    if split is not None:
        split.update(prefill_split(pred, hw))
    return pred.report.timing, fits


def prefill_split(pred, hw) -> dict[str, float]:
    """Seconds of a predicted prefill by stage: its GPU time in GEMMs (with their launches),
    fused attention and small kernels (pipeline/layer_ops.py), and what the GPU waits on besides
    (h2d, host issue: 'waits'). Shares from the trace the simulator keeps (a sampled prefill's
    windows), scaled to the whole prefill's seconds."""
    parts, lo, hi = {"gemm": 0.0, "attn": 0.0, "small": 0.0}, float("inf"), 0.0
    for sp in pred.trace.spans:
        st = pred.trace.graph.stages[sp.stage]
        if st.phase is not Phase.PREFILL:
            continue
        lo, hi = min(lo, sp.start_s), max(hi, sp.end_s)
        if st.kind is Kind.COMPUTE:
            small = stage_small_seconds(st, hw)
            parts["small"] += small
            parts["attn" if st.tag == "attn" else "gemm"] += sp.end_s - sp.start_s - small
    scale = pred.report.timing.prefill_s / (hi - lo) if hi > lo else 0.0
    out = {k: v * scale for k, v in parts.items()}
    out["waits"] = max(0.0, pred.report.timing.prefill_s - sum(out.values()))
    return out


def split_text(split: dict[str, float], total: float) -> str:
    """`split`'s stages as shares of the predicted figure, largest first: 'gemm 70%, small 18%, ...'."""
    shares = sorted(((v / total, k) for k, v in split.items() if v > 0.005 * total), reverse=True)
    return ", ".join(f"{k} {f:.0%}" for f, k in shares)


def headinfer_plan(model, work, method: str, group: int | None, budgets):
    plan = default_plan(Method(method), model, work, budgets)
    if group is not None:   # HeadInfer: every head offloaded, `group` heads per group in both phases
        plan = plan.with_(prefill=PhasePlan(group, min(plan.prefill.chunk, work.context), 2),
                          decode=PhasePlan(group, 1, 2), resident=0, disk=0)
    return plan


def predict_headinfer(method: str, group: int | None, context: int, what: str) -> dict:
    model, hw = PRESETS["llama-3-8b"], load_profile("rtx4090")
    work = Workload(context, DECODE_STEPS if what == "decode_s_per_token" else 0)
    budgets = {"gpu": hw.gpu_mem_bytes, "host": HOST_BYTES, "disk": hw.disk_bytes}
    plan = headinfer_plan(model, work, method, group, budgets)
    split = {} if what == "prefill_s" else None
    timing, fits = _simulate(model, work, plan, hw, budgets, split)
    return {"predicted": getattr(timing, what), "fits": fits, "plan": plan.describe(), "split": split}


def predict_max_context(model_name: str, method: str, group: int | None) -> dict:
    """The longest prompt (in 1K steps) the system's plan fits on the RTX 4090 with 1 TB host."""
    model, hw = PRESETS[model_name], load_profile("rtx4090")
    budgets = {"gpu": hw.gpu_mem_bytes, "host": HOST_BYTES, "disk": 0}
    if method == "standard":
        n = rule_max_context(Method(method), model, DECODE_STEPS, 1, budgets, limit=2**24)
        return {"predicted": n, "fits": True, "plan": method}

    def memory_plan(work):
        plan = headinfer_plan(model, work, method, group, budgets)
        if group is not None:
            return live_copies(plan, HEADINFER_LIVE_COPIES)
        return one_pass(plan, work.context) if method == "layerwise" else plan

    def fits(k: int) -> bool:
        work = Workload(k * 1024, DECODE_STEPS)
        return not over_limits(breakdown(model, work, memory_plan(work)), budgets)
    n = (first_true(1, 2**14, lambda k: not fits(k)) - 1) * 1024
    label = {"layerwise": "layerwise, one pass", "chunked": "chunked"}.get(method, f"headwise group {group}, 4 copies")
    return {"predicted": n, "fits": True, "plan": label}


def predict_llamacpp(profile: str, model_name: str, kind: str, n: int) -> dict:
    """llama-bench pp N (prompt seconds) or tg N (seconds per token) through sim/baselines.py."""
    model = replace(PRESETS[model_name], dtype="fp16")   # llama.cpp F16 weights and KV
    hw = native_issue(load_profile(profile))
    budgets = {"gpu": hw.gpu_mem_bytes, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    if kind == "pp":
        hw = fp16_accumulate(hw)
        work = Workload(n, 0)
        plan = default_plan(Method.CHUNKED, model, work, budgets)
        plan = plan.with_(prefill=replace(plan.prefill, chunk=min(UBATCH, n)))
        split = {}
        timing, fits = _simulate(model, work, plan, hw, budgets, split)
        scores, small = prompt_scores_seconds(model, n, hw), elementwise_seconds(model, n, hw)
        # llama.cpp's F32 elementwise kernels in place of kvpipe's (the split holds the GPU's seconds in them)
        predicted = timing.prefill_s - split["small"] + small + scores
        return {"predicted": predicted, "scores_s": scores, "fits": fits, "plan": plan.describe(),
                "split": {**split, "small": small, "scores": scores}}
    work = Workload(max(n // 2, 1), DECODE_STEPS)
    plan = default_plan(Method.STANDARD, model, work, budgets)
    timing, fits = _simulate(model, work, plan, hw, budgets)
    scores = sum(scores_seconds(model, i, 1, hw) for i in range(n)) / n
    return {"predicted": timing.decode_s_per_token + scores, "scores_s": scores, "fits": fits,
            "plan": plan.describe()}


def predict_lmdeploy(model_name: str, prompt: int, out: int) -> dict:
    """TurboMind on the A100: a C++ engine (`native_issue`), the prompt in one pass with flash
    attention, decode all on the GPU; FP16 weights and KV. First token (prompts of 2 or more) as
    `turbomind_first_token` says: the context pass of all but the last prompt token, then one
    decode step; decode per token at the mean context of its `out` steps."""
    model = replace(PRESETS[model_name], dtype="fp16")
    hw = native_issue(load_profile("a100-80g"))
    budgets = {"gpu": hw.gpu_mem_bytes, "host": hw.host_mem_bytes, "disk": hw.disk_bytes}
    ftl, split = None, {}
    if prompt >= 2:
        context, steps = turbomind_first_token(prompt)
        first = Workload(context, DECODE_STEPS)
        t, _ = _simulate(model, first, default_plan(Method.STANDARD, model, first, budgets), hw, budgets, split)
        ftl = t.ttft_s + steps * t.decode_s_per_token
        split["first decode step"] = ftl - t.prefill_s
    work = Workload(prompt + out // 2, DECODE_STEPS)
    plan = default_plan(Method.STANDARD, model, work, budgets)
    timing, fits = _simulate(model, work, plan, hw, budgets)
    return {"ttft_s": ftl, "decode_s_per_token": timing.decode_s_per_token, "fits": fits,
            "plan": plan.describe(), "split": split}


def lmdeploy_rows() -> list[dict]:
    """Each table row's decode per token, (out / throughput - FTL) / (out - 1), and, for prompts
    of 128 and more with 128 out, its FTL as prefill."""
    out = []
    for model_name, prompt, n, tps, ftl in LMDEPLOY_ROWS:
        p = predict_lmdeploy(model_name, prompt, n)
        base = {"system": "lmdeploy", "hw": "a100-80g", "model": model_name, "source": LMDEPLOY,
                "fits": p["fits"], "plan": p["plan"], "method": "standard, C++ queue"}
        first = {"method": "prompt - 1 in one pass + 1 decode step, C++ queue"}
        where = f"Static Inference Benchmark, {model_name.replace('-2-', '2-')}, batch 1, tp 1, prompt {prompt}, out {n}"
        out.append({**base, "what": "decode_s_per_token", "context": prompt + n // 2,
                    "published": (n / tps - ftl) / (n - 1), "predicted": p["decode_s_per_token"],
                    "where": where + ": (out / throughput - FTL) / (out - 1)"})
        if prompt >= 128 and n == 128:
            out.append({**base, **first, "what": "prefill_s", "context": prompt, "published": ftl,
                        "predicted": p["ttft_s"], "split": p["split"], "where": where + ": FTL(ave)"})
    return out


def rows() -> list[dict]:
    out = []
    for system, method, group, ctx, what, value, where in HEADINFER_ROWS:
        p = predict_headinfer(method, group, ctx, what)
        out.append({"system": system, "hw": "rtx4090", "model": "llama-3-8b", "what": what, "context": ctx,
                    "method": method + (f" group {group}" if group else ""), "published": value,
                    "source": HEADINFER, "where": where, **p})
    for system, model_name, method, group, value, where in MAX_CONTEXT_ROWS:
        p = predict_max_context(model_name, method, group)
        out.append({"system": system, "hw": "rtx4090", "model": model_name, "what": "max_context", "context": value,
                    "method": p["plan"], "published": value, "source": HEADINFER, "where": where, **p})
    for profile, model_name, kind, n, tps, source, where in LLAMACPP_ROWS:
        p = predict_llamacpp(profile, model_name, kind, n)
        what = "prefill_s" if kind == "pp" else "decode_s_per_token"
        out.append({"system": "llama.cpp", "hw": profile, "model": model_name, "what": what, "context": n,
                    "method": "ubatch 512, C++ queue, no FA" if kind == "pp" else "standard, C++ queue, no FA",
                    "published": n / tps if kind == "pp" else 1 / tps, "source": source, "where": where, **p})
    out += lmdeploy_rows()
    for r in out:
        r["error"] = r["predicted"] / r["published"] - 1
        r["why"] = why(r)
        split = r.pop("split", None)
        if r["what"] == "prefill_s":
            r["stages_s"] = split
            r["stages"] = split_text(split, r["predicted"])
    return out


def markdown(rs: list[dict]) -> str:
    """The rows as benchmarks/published.md's table."""
    fmt = lambda r, v: f"{v / 1024:.0f}K" if r["what"] == "max_context" else f"{v:.4g}"  # noqa: E731
    out = ["| system | profile | model | figure | context | plan / method | published | predicted | error "
           "| source, where | prefill predicted by stage | row over 25%: the stage that explains it |",
           "|" + "---|" * 12]
    for r in rs:
        ctx = "" if r["what"] == "max_context" else f"{r['context'] // 1024}K" if r["context"] >= 1024 else str(r["context"])
        out.append(f"| {r['system']} | {r['hw']} | {r['model']} | {r['what']} | {ctx} | {r['method']} "
                   f"| {fmt(r, r['published'])} | {fmt(r, r['predicted'])} | {r['error']:+.0%} "
                   f"| [{r['where']}]({r['source']}) | {r.get('stages', '')} | {r['why']} |")
    return "\n".join(out)


def summary(rs: list[dict]) -> dict:
    """Median and max |error| per figure kind, and the signed median."""
    out = {}
    for what in ("prefill_s", "decode_s_per_token", "max_context"):
        errs = [r["error"] for r in rs if r["what"] == what]
        if not errs:
            continue
        out[what] = {"rows": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                     "max_abs": max(abs(e) for e in errs), "median_signed": statistics.median(errs),
                     "over_25pct": sum(abs(e) > 0.25 for e in errs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None, help="also write the rows as a markdown table here")
    args = ap.parse_args(argv)
    if args.out is None:
        from benchmarks.result_file import result_file
        args.out = str(result_file("published"))
    rs = rows()
    summ = {"all": summary(rs)}
    for name, systems in (("headinfer+hf", ("headinfer", "hf")), ("llama.cpp", ("llama.cpp",)),
                          ("lmdeploy", ("lmdeploy",))):
        summ[name] = summary([r for r in rs if r["system"] in systems])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"assumed": ASSUMED, "summary": summ, "rows": rs}, indent=2))
    print(f"published vs predicted (error = predicted / published - 1)\nassumed: {ASSUMED}")
    print(f"{'system':<10} {'hw':<12} {'model':<11} {'figure':<19} {'ctx':>8} {'plan':<30} "
          f"{'published':>10} {'predicted':>10} {'error':>7}  where")
    for r in rs:
        label = r["method"] + ("" if r["fits"] else " (NO FIT)")
        print(f"{r['system']:<10} {r['hw']:<12} {r['model']:<11} {r['what']:<19} {r['context']:>8} {label:<30} "
              f"{r['published']:>10.4g} {r['predicted']:>10.4g} {r['error']:>+7.0%}  {r['where']}")
    for group, s in summ.items():
        for what, v in s.items():
            print(f"{group} {what}: {v['rows']} rows, median |error| {v['median_abs']:.1%}, max {v['max_abs']:.1%}, "
                  f"median signed {v['median_signed']:+.1%}, {v['over_25pct']} over 25%")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rs) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
