"""HF `generate()` with `kvpipe.HeadwiseCache` against `kvpipe.generate`, in ONE process, on the
same plan, random weights and prompt: TTFT and decode ms/token of both and their ratio
(generate() / kvpipe). Llama-3-8B shapes, bf16, batch 1, the GPU allocator capped at --gpu-mem.

  python -m benchmarks.hf_generate --context 32K --cases stream,resident-max --gpu-mem 24GB \
      --out benchmarks/results/h200-hf-generate.json

Per case, `kvpipe.generate` runs first (its own untimed warm-up; TTFT and decode from its measured
trace); its plan is handed to `HeadwiseCache(model, plan=...)` and HF's `generate()` runs with no
`prefill_chunk_size` (the cache chunks the prompt by the plan) on one cache (reset between calls,
so the decode step captured by the warm-up is replayed by every timed call): TTFT = prompt ->
first token, timed by a streamer that synchronizes at each token; decode = the difference of two
runs without a streamer (new tokens and a quarter of them) per token, the prefill cancelling. The
JSON says which decode path generate() ran (`decode_path`: graph, static or eager), why not the
graph (`decode_note`), and the graph replays. Both sides use --ignore-eos semantics (no early stop).
`--decode graph` captures the step of streamed plans too (decode auto leaves them to HF's loop on CUDA)."""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

CASES = {"stream": dict(resident="none", group=8), "resident-max": dict(resident="max", group=8)}


def engine_side(args, context: int, knobs: dict) -> tuple[dict, object]:
    import kvpipe
    from kvpipe.executor.engine import session
    from kvpipe.pipeline.model import load_model

    ids = session.prompt_tensor(None, 1, context, load_model(args.model).vocab, args.seed)[0].tolist()
    res = kvpipe.generate(args.model, " ".join(map(str, ids)), prompt_format="ids", chat=False,
                          max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0, seed=args.seed,
                          random_weights=True, device=args.device, gpu_mem=args.gpu_mem, **knobs)
    t = res.timings
    return {"ttft_s": t["ttft_s"], "decode_s_per_token": t["decode_s_per_token"], "tokens": list(res.tokens),
            "decode": (res.run.decode_issue or {}).get("mode"), "plan_line": res.plan.describe()}, res.plan


def hf_side(args, context: int, plan) -> dict:
    import torch

    import kvpipe
    from kvpipe.executor.engine import session
    from kvpipe.executor.hf.generate import cache_argument
    from kvpipe.pipeline.model import load_model

    device = session.resolve_device(args.device)
    spec = load_model(args.model)
    model = session.load_hf_model(args.model, True, device, session.TORCH_DTYPES[spec.dtype], args.seed)
    ids = session.prompt_tensor(None, 1, context, spec.vocab, args.seed).to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    from benchmarks.hf_cache import token_clock
    Clock = token_clock(sync)

    def once(cache, n_ids, new, streamer=None):
        cache.reset()   # the same buffers (and the captured decode step) for every call
        sync()
        t0 = time.perf_counter()
        out = model.generate(n_ids, attention_mask=torch.ones_like(n_ids), max_new_tokens=new,
                             streamer=streamer, **{cache_argument(model): cache}, **greedy)
        sync()
        return out, time.perf_counter() - t0

    few = max(2, args.new_tokens // 4)
    with kvpipe.HeadwiseCache(model, max_length=context + args.new_tokens, plan=plan, decode=args.decode) as cache:
        once(cache, ids[:, :min(plan.prefill.chunk + 1, context)], 3)   # warm-up: kernels, the graph's capture
        clock = Clock()
        once(cache, ids, 2, clock)                                      # TTFT: prompt -> first token
        once(cache, ids, args.new_tokens)                               # untimed: every prefix bucket's graph captured
        out, t_all = once(cache, ids, args.new_tokens)                  # decode: no streamer, no per-token sync
        _, t_few = once(cache, ids, few)
        res = {"ttft_s": clock.t[1] - clock.t[0],
               "decode_s_per_token": (t_all - t_few) / (args.new_tokens - few) if args.new_tokens > few else None,
               "tokens": out[0, context:].cpu().tolist(),
               "decode_path": cache.decode_path, "decode_note": cache.decode_note, "replays": cache.replays,
               "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
    del model
    return res


def free() -> None:
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", default="32K")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (random weights)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode", default="auto", help="HeadwiseCache(decode=...): auto, graph, static, eager")
    ap.add_argument("--out", required=True, help="JSON path")
    args = ap.parse_args(argv)
    from kvpipe.pipeline.units import parse_tokens
    context = parse_tokens(args.context, "context")
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"--cases: unknown {case!r} (known: {', '.join(CASES)})")
        engine, plan = engine_side(args, context, CASES[case])
        free()
        gen = hf_side(args, context, plan)
        free()
        ratio = {k: gen[k] / engine[k] if engine[k] and gen[k] else None for k in ("ttft_s", "decode_s_per_token")}
        rows.append({"context": context, "case": case, "plan": plan.to_json(), "kvpipe": engine, "generate": gen,
                     "ratio": ratio, "tokens_equal": engine["tokens"] == gen["tokens"]})
        print(f"{case:13} context {context}: TTFT kvpipe {engine['ttft_s']:.3f} s, generate() {gen['ttft_s']:.3f} s "
              f"({ratio['ttft_s']:.2f}x); decode kvpipe {1e3 * engine['decode_s_per_token']:.2f} ms/token, "
              f"generate() {1e3 * gen['decode_s_per_token']:.2f} ms/token ({ratio['decode_s_per_token']:.2f}x); "
              f"tokens {'equal' if rows[-1]['tokens_equal'] else 'DIFFER'}; generate() decode path {gen['decode_path']}"
              f" ({gen['replays']} replays{'; ' + gen['decode_note'] if gen['decode_note'] else ''})", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(["python -m benchmarks.hf_generate", *sys.argv[1:]]),
                                              "gpu_mem": args.gpu_mem, "model": args.model, "rows": rows}, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
