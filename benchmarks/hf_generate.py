"""HF `generate()` with `kvpipe.HeadwiseCache` against `kvpipe.generate`, in ONE process, on the
same plan, random weights and prompt: TTFT and decode ms/token of both and their ratio
(generate() / kvpipe). Llama-3-8B shapes, bf16, batch 1, the GPU allocator capped at --gpu-mem.

  python -m benchmarks.hf_generate --context 32K --cases stream,resident-max --gpu-mem 24GB \
      --out benchmarks/results/h200-hf-generate.json

Per case, `kvpipe.generate` runs first (its own untimed warm-up; TTFT and decode from its measured
trace); its plan is handed to `HeadwiseCache(model, plan=...)` and HF's `generate()` runs with no
`prefill_chunk_size` (the cache chunks the prompt by the plan), after an untimed warm-up, timed
by a streamer that synchronizes the device at each token: TTFT = prompt -> first token, decode =
mean step after the first decode step. Both sides use --ignore-eos semantics (no early stop)."""
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
    from transformers.generation.streamers import BaseStreamer

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

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value) -> None:
            sync()
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    def once(n_ids, new, streamer=None):
        with kvpipe.HeadwiseCache(model, max_length=n_ids.shape[1] + new, plan=plan) as cache:
            out = model.generate(n_ids, attention_mask=torch.ones_like(n_ids), max_new_tokens=new,
                                 streamer=streamer, **{cache_argument(model): cache}, **greedy)
        return out

    once(ids[:, :min(plan.prefill.chunk + 1, context)], 3)   # warm-up: kernels, handles, both step kinds
    sync()
    clock = Clock()
    out = once(ids, args.new_tokens, clock)
    steps = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
    res = {"ttft_s": clock.t[1] - clock.t[0],
           "decode_s_per_token": sum(steps[1:]) / len(steps[1:]) if len(steps) > 1 else None,
           "tokens": out[0, context:].cpu().tolist(),
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
              f"tokens {'equal' if rows[-1]['tokens_equal'] else 'DIFFER'}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(["python -m benchmarks.hf_generate", *sys.argv[1:]]),
                                              "gpu_mem": args.gpu_mem, "model": args.model, "rows": rows}, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
