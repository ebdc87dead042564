"""Hugging Face `generate()` with `kvpipe.HeadwiseCache` against `kvpipe run`, on the same plan, the
same random weights and the same prompt: prefill and decode time, peak GPU memory, and whether
the greedy tokens agree. Llama-3-8B shapes, bf16, batch 1, the GPU allocator capped (24 GB).

  python -m benchmarks.hf_cache                       # 32K and 128K, streamed and max-resident
  python -m benchmarks.hf_cache --contexts 32K --cases stream

Per context and case, `kvpipe run ... --json` runs first in its own process; its plan (JSON) and
seed are handed to a second process that runs `model.generate(ids, past_key_values=cache,
prefill_chunk_size=plan chunk)` after an untimed warm-up (one chunk, two tokens), timed by a
streamer that synchronizes the device at every token: prefill = prompt -> first token, decode =
mean step after the first decode step (as `kvpipe run` reports it). Results go to
benchmarks/results/<machine>-<date>-hf-cache.json (or --out); a table is printed last."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = {  # name -> `kvpipe run` knobs; the generate() side takes the plan kvpipe resolved
    "stream": ("--resident", "none", "--group", "8"),
    # `kvpipe run` issued eagerly: the same attention calls as generate()'s path (graph replay
    # attends prefix and new token in one varlen call, which changes last bits of the logits)
    "stream-eager": ("--resident", "none", "--group", "8", "--replay", "off"),
    "resident-max": ("--resident", "max", "--group", "8"),
}



def token_clock(sync):
    """A generate() streamer class whose instances record the host time at each token generate()
    emits (the prompt first), after `sync()` (the device synchronized)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value) -> None:
            sync()
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass
    return Clock

def sh(args: list[str], timeout: int) -> dict:
    """One measurement process; its last stdout line is JSON (or an error record)."""
    t0 = time.time()
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1],
                "command": " ".join(args), "wall_s": time.time() - t0}
    out = json.loads(r.stdout) if r.stdout.lstrip().startswith("{\n") else json.loads(r.stdout.strip().splitlines()[-1])
    out["command"], out["wall_s"] = " ".join(args), time.time() - t0
    return out


def worker(args) -> None:
    """The generate() side, in its own process: prints one JSON line."""
    from dataclasses import replace

    import torch

    import kvpipe
    from kvpipe.executor.engine import session
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.units import parse_bytes

    device = session.resolve_device(args.device)
    cuda = device.type == "cuda"
    spec = load_model(args.model)
    if cuda:
        budget = parse_bytes(args.gpu_mem, "gpu-mem")
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    model = session.load_hf_model(args.model, True, device, session.TORCH_DTYPES[spec.dtype], args.seed)
    ids = session.prompt_tensor(None, 1, args.context, spec.vocab, args.seed).to(device)
    plan = Plan.from_json(json.loads(args.plan_json))
    new = args.decode_tokens + 1
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    Clock = token_clock(sync)

    small = min(plan.prefill.chunk, 8192, args.context)   # warm-up: kernels, handles, attention plans
    warm = plan.with_(prefill=replace(plan.prefill, chunk=small))
    with kvpipe.HeadwiseCache(model, max_length=small + 2, plan=warm) as cache:
        model.generate(ids[:, :small], attention_mask=torch.ones_like(ids[:, :small]), past_key_values=cache,
                       max_new_tokens=2, prefill_chunk_size=small, **greedy)
    sync()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock()
    with kvpipe.HeadwiseCache(model, max_length=args.context + new, plan=plan) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                             prefill_chunk_size=plan.prefill.chunk, streamer=clock, **greedy)
        host = cache.stream.store.host_bytes
    steps = [b - a for a, b in zip(clock.t[1:], clock.t[2:])]
    print(json.dumps({
        "prefill_s": clock.t[1] - clock.t[0],
        "decode_s_per_token": sum(steps[1:]) / len(steps[1:]) if len(steps) > 1 else (steps or [None])[0],
        "decode_steps_s": steps, "total_s": clock.t[-1] - clock.t[0],
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0, "host_pinned_bytes": host,
        "tokens": out[:, args.context:].cpu().tolist(), "plan": plan.to_json()}))


def kvpipe_run(args, context: int, knobs: tuple[str, ...]) -> dict:
    return sh([sys.executable, "-m", "kvpipe", "run", "--model", args.model, "--random-weights",
               "--context", str(context), "--decode-tokens", str(args.decode_tokens), "--gpu-mem", args.gpu_mem,
               "--device", args.device, "--seed", str(args.seed), "--chunk", str(args.chunk), "--json", "--no-progress",
               *knobs], args.timeout)


def generate_run(args, context: int, plan: dict) -> dict:
    return sh([sys.executable, "-m", "benchmarks.hf_cache", "--worker", "--model", args.model,
               "--context", str(context), "--decode-tokens", str(args.decode_tokens), "--gpu-mem", args.gpu_mem,
               "--device", args.device, "--seed", str(args.seed), "--plan-json", json.dumps(plan)], args.timeout)


def table(rows: list[dict]) -> None:
    print(f"\n{'context':>8} {'case':13}{'prefill s':>10}{'gen':>9}{'gen/run':>8}{'decode s/tok':>13}"
          f"{'gen':>9}{'gen/run':>8}{'peak GB':>8}{'gen':>6}  tokens")
    for r in rows:
        k, g = r["kvpipe_run"], r["generate"]
        if "measured" not in k or "prefill_s" not in g:
            print(f"{r['context']:>8} {r['case']:13}  error: {k.get('error') or g.get('error')}")
            continue
        m = k["measured"]
        print(f"{r['context']:>8} {r['case']:13}{m['prefill_s']:10.2f}{g['prefill_s']:9.2f}"
              f"{g['prefill_s'] / m['prefill_s']:8.2f}{m['decode_s_per_token']:13.3f}{g['decode_s_per_token']:9.3f}"
              f"{g['decode_s_per_token'] / m['decode_s_per_token']:8.2f}{m['peak_bytes']['gpu'] / 1e9:8.1f}"
              f"{g['peak_gpu_bytes'] / 1e9:6.1f}  {'equal' if r['tokens_equal'] else 'DIFFER'}")
    print("prefill/decode: `kvpipe run` (measured), then generate()+HeadwiseCache; gen/run = ratio")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072", help="comma-separated prompt lengths")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (random weights)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (HF's prefill_chunk_size too)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=420, help="seconds per measurement process")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plan-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from kvpipe.pipeline.units import parse_tokens
    contexts = [parse_tokens(c, "contexts") for c in args.contexts.split(",")]
    cases = args.cases.split(",")
    for c in cases:
        if c not in CASES:
            ap.error(f"cases: unknown {c!r} (known: {', '.join(CASES)})")
    date = datetime.datetime.now(datetime.timezone.utc)
    from benchmarks.result_file import result_file
    out = Path(args.out or result_file("hf-cache", "cuda"))
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], "-m", "benchmarks.hf_cache", *sys.argv[1:]]),
           "date": date.isoformat(timespec="seconds"), "gpu_budget": args.gpu_mem, "model": args.model, "rows": []}
    for context in contexts:
        for case in cases:
            row = {"context": context, "case": case, "kvpipe_run": kvpipe_run(args, context, CASES[case])}
            plan = row["kvpipe_run"].get("plan")
            row["generate"] = generate_run(args, context, plan) if plan else {"error": "kvpipe run failed"}
            row["tokens_equal"] = row["kvpipe_run"].get("tokens") == row["generate"].get("tokens")
            res["rows"].append(row)
            out.write_text(json.dumps(res, indent=2))   # after every row: a timeout keeps the rest
    table(res["rows"])
    print(f"results: {out}")


if __name__ == "__main__":
    main()
