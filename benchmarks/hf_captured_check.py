"""Is HF `generate()`'s captured decode step exact with offloaded heads? Llama-3-8B shapes, random
weights, bf16, batch 1, streamed (`--resident none`), per decode group; the GPU allocator capped at
--gpu-mem as `kvpipe generate` caps it (benchmarks/hf_generate.py runs the same way).

  python -m benchmarks.hf_captured_check --context 32K --groups 8 --gpu-mem 24GB \
      --out benchmarks/results/h200-hf-captured-check.json

Per group: `kvpipe.generate` (the engine) twice, replayed (`replay="on"`: its decode attends with
the kernel the captured step runs, FA2 over the slot with the step's own K/V in it) and eager
(`replay="off"`: prefix, own keys and a log-sum-exp merge, as HF's loop over the cache attends);
then on ONE `HeadwiseCache(plan=...)` per decode path, HF's generate() runs the calls a benchmark
makes (a short warm-up prompt, two tokens, the whole decode twice, a quarter of it): the captured
step (`decode="graph"`), the same step issued without a graph (`"static"`, its bitwise reference),
the captured step with every unit resident (`"resident"`, the placement reference: no host copy)
and HF's own loop (`"eager"`). Each path is held to the reference of its own kernels: graph,
static and resident to the replayed engine, eager to the eager engine (on random bf16 weights the
two roundings part within a few tokens). Printed per path: the tokens equal to its engine
reference (leading run), equal across the two whole calls, zeros, and decode ms/token (the second
whole call minus the quarter one, per token). Last line: whether the captured step equalled the
issued one and the every-unit-resident one on every call of every group (then
`executor/hf/loop.py`'s OFFLOADED_AUTO may be True)."""
from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path


def engine(args, context: int, group: int, replay: str) -> dict:
    import kvpipe
    from kvpipe.executor.engine import session
    from kvpipe.pipeline.model import load_model

    ids = session.prompt_tensor(None, 1, context, load_model(args.model).vocab, args.seed)[0].tolist()
    res = kvpipe.generate(args.model, " ".join(map(str, ids)), prompt_format="ids", chat=False,
                          max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0, seed=args.seed,
                          random_weights=True, device=args.device, gpu_mem=args.gpu_mem, resident="none", group=group,
                          replay=replay)
    return {"tokens": list(res.tokens), "decode_s_per_token": res.timings["decode_s_per_token"],
            "decode": (res.run.decode_issue or {}).get("mode"), "plan": res.plan}


def hf_calls(model, plan, ids, args, decode: str, sync) -> dict:
    """The benchmark's calls on one cache -> tokens of each call, timings and the decode path."""
    import torch

    import kvpipe
    from kvpipe.executor.hf.generate import cache_argument

    context, n = ids.shape[1], args.new_tokens
    few = max(2, n // 4)
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    out = {"calls": [], "wall_s": []}
    if decode == "resident":   # the same plan with every unit on the GPU, captured
        from dataclasses import replace

        plan, decode = replace(plan, resident=model.config.num_hidden_layers * model.config.num_key_value_heads), "graph"
    with kvpipe.HeadwiseCache(model, max_length=context + n, plan=plan, decode=decode) as cache:
        for prompt, new in ((ids[:, :plan.prefill.chunk + 1], 3), (ids, 2), (ids, n), (ids, n), (ids, few)):
            cache.reset()
            sync()
            t0 = time.perf_counter()
            toks = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                  **{cache_argument(model): cache}, **greedy)
            sync()
            out["wall_s"].append(time.perf_counter() - t0)
            out["calls"].append(toks[0, prompt.shape[1]:].cpu().tolist())
        out.update(path=cache.decode_path, note=cache.decode_note, replays=cache.replays)
    out["decode_s_per_token"] = (out["wall_s"][3] - out["wall_s"][4]) / (n - few) if n > few else None
    return out


def leading(a: list, b: list) -> int:
    """How many leading tokens of a and b agree."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", default="32K")
    ap.add_argument("--groups", default="8,4")
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (random weights)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", default="graph,static,resident,eager",
                    help="HeadwiseCache(decode=...) paths to run (resident: graph with every unit resident)")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args(argv)

    import torch

    from kvpipe.executor.engine import session
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.units import parse_bytes, parse_tokens

    context, groups = parse_tokens(args.context, "context"), [int(g) for g in args.groups.split(",")]
    refs, cuda = {}, session.resolve_device(args.device).type == "cuda"
    for g in groups:   # the engine first, each run loading and freeing its own model
        for replay in ("on", "off") if cuda else ("off",):   # no replayed engine off CUDA (a smoke run)
            refs[g, replay] = engine(args, context, g, replay)
            gc.collect()
            torch.cuda.empty_cache()
        refs.setdefault((g, "on"), refs[g, "off"])
    device = session.resolve_device(args.device)
    spec = load_model(args.model)
    if device.type == "cuda":   # the cap kvpipe's run set, set again for this side
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(args.gpu_mem, "gpu_mem") / total), device)
    model = session.load_hf_model(args.model, True, device, session.TORCH_DTYPES[spec.dtype], args.seed)
    ids = session.prompt_tensor(None, 1, context, spec.vocab, args.seed).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows, exact = [], True
    for g in groups:
        paths, ref = {}, refs[g, "on"]
        for decode in args.paths.split(","):
            try:
                plan = refs[g, "off" if decode == "eager" else "on"]["plan"]   # each path on its reference's plan
                r = paths[decode] = hf_calls(model, plan, ids, args, decode, sync)
            except (ValueError, torch.cuda.OutOfMemoryError) as e:   # refused or too large: say why, check the others
                print(f"group {g} decode={decode}: refused: {e}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            whole, against = r["calls"][3], refs[g, "off" if decode == "eager" else "on"]
            r["engine_leading"] = leading(whole, against["tokens"])
            r["engine_reference"] = f"replay {'off' if decode == 'eager' else 'on'} ({against['decode']})"
            r["calls_agree"] = r["calls"][2] == r["calls"][3]
            r["zeros"] = sum(t == 0 for t in whole)
            ms = 1e3 * r["decode_s_per_token"] if r["decode_s_per_token"] else float("nan")
            print(f"group {g} decode={decode:8} (ran {r['path']}, {r['replays']} replays): tokens = engine "
                  f"{r['engine_reference']} {r['engine_leading']}/{len(whole)}, whole calls agree {r['calls_agree']}, "
                  f"zeros {r['zeros']}, decode {ms:.2f} ms/token{'; ' + r['note'] if r['note'] else ''}", flush=True)
        graph, issued, resident, loop = (paths.get(k, {}) for k in ("graph", "static", "resident", "eager"))
        same = bool(graph) and graph["path"] == "graph" and graph["calls"] == issued.get("calls")
        placed = None if not resident else bool(graph) and graph["calls"] == resident["calls"]   # None: did not fit
        exact &= same and placed is not False and graph["calls_agree"]
        print(f"group {g}: engine {1e3 * ref['decode_s_per_token']:.2f} ms/token ({ref['decode']}), eager "
              f"{1e3 * refs[g, 'off']['decode_s_per_token']:.2f}; captured == issued on every call: {same}; "
              f"captured == every unit resident: {'not run' if placed is None else placed}; captured == HF's loop: "
              f"{bool(graph) and graph['calls'] == loop.get('calls')} (other rounding: not required)", flush=True)
        rows.append({"group": g, "engine": {k: v for k, v in ref.items() if k != "plan"},
                     "engine_eager": {k: v for k, v in refs[g, "off"].items() if k != "plan"},
                     "plan": ref["plan"].to_json(), "plan_eager": refs[g, "off"]["plan"].to_json(), **paths})
    print(f"captured step exact with offloaded heads at {args.context}: {'yes' if exact else 'NO'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"context": context, "gpu_mem": args.gpu_mem, "model": args.model,
                                              "rows": rows, "exact": exact}, indent=2))


if __name__ == "__main__":
    main()
