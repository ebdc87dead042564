"""Several GPUs of one host, tensor parallel by KV heads: Llama-3-8B shapes streamed at 128K and
512K on 1, 2 and 4 GPUs (24 GB budget each), Llama-3-70B shapes on 4 GPUs (48 GB each) at 128K
and 1M; each row `kvpipe run` (with --gpus N beyond one) next to `kvpipe plan`'s prediction of the
same layout, and the floors measured in the same run: pinned H2D of one GPU alone and of N GPUs
at once (the host memory bandwidth they share).

    python -m benchmarks.multi_gpu                    # every row (a 4-GPU host)
    python -m benchmarks.multi_gpu --rows 8b-128k-2   # one row
    python -m benchmarks.multi_gpu --resident none   # every unit streamed: the link scaling
    python -m benchmarks.multi_gpu --list

Writes benchmarks/results/<machine>-<date>-multi_gpu.json."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from benchmarks.result_file import result_file

# name -> (model, context, gpus, per-GPU budget)
ROWS = {f"8b-{c.lower()}-{n}": ("llama-3-8b", c, n, "24GB") for c in ("128K", "512K") for n in (1, 2, 4)}
ROWS.update({f"70b-{c.lower()}-4": ("llama-3-70b", c, 4, "48GB") for c in ("128K", "1M")})
DECODE_TOKENS = 16
COPY_BYTES = 1 << 30


def concurrent_h2d(gpus: int, repeats: int = 5) -> float:
    """Pinned host -> device bytes/s of ONE GPU's link while `gpus` GPUs copy at once (threads;
    the copies release the GIL): the median of `repeats` 1 GiB copies each, slowest GPU."""
    import torch
    bufs = [(torch.empty(COPY_BYTES, dtype=torch.uint8).pin_memory(),
             torch.empty(COPY_BYTES, dtype=torch.uint8, device=f"cuda:{g}")) for g in range(gpus)]
    rates = [[] for _ in range(gpus)]
    go = threading.Barrier(gpus)

    def copy(g: int) -> None:
        host, dev = bufs[g]
        torch.cuda.set_device(g)
        for _ in range(repeats):
            go.wait()
            torch.cuda.synchronize(g)
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(g)
            rates[g].append(COPY_BYTES / (time.perf_counter() - t))

    threads = [threading.Thread(target=copy, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return min(sorted(r)[len(r) // 2] for r in rates)


def host_ram() -> str:
    """This machine's RAM in bytes, less a tenth for the processes themselves."""
    import os
    return str(int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.9))


def kvpipe(command: str, model: str, context: str, gpus: int, budget: str, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "kvpipe", command, "--model", model, "--context", context, "--gpu-mem", budget,
            "--decode-tokens", str(DECODE_TOKENS), "--replay", "off", "--json", *extra]
    if gpus > 1:
        argv += ["--gpus", str(gpus), "--tp", str(gpus)]
    if command == "run":
        argv += ["--random-weights", "--no-progress"]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode not in (0, 3):
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout)


def row(name: str, hw: str, resident: str) -> dict:
    model, context, gpus, budget = ROWS[name]
    extra = ["--hw", hw, "--resident", resident, "--host-mem", host_ram()]   # plan and run: this host's RAM
    plan = kvpipe("plan", model, context, gpus, budget, extra)
    ran = kvpipe("run", model, context, gpus, budget, extra)
    out = {"row": name, "model": model, "context": context, "gpus": gpus, "gpu_mem": budget}
    if "error" in plan or "error" in ran:
        return {**out, "plan_error": plan.get("error"), "run_error": ran.get("error")}
    measured = ran["ranks"][0] if gpus > 1 else ran["measured"]
    pred = plan["predicted"]
    link = concurrent_h2d(gpus)
    offloaded = _offloaded_bytes_per_step(plan, model, context, gpus)
    out.update(predicted_decode_s=pred["decode_s_per_token"], measured_decode_s=measured["decode_s_per_token"],
               predicted_prefill_s=pred["prefill_s"], measured_prefill_s=measured["prefill_s"],
               link_bytes_per_s_concurrent=link, floor_decode_s=offloaded / link,
               ranks_agree=ran.get("ranks_agree", True), plan=plan["plan"])
    out["sim_error"] = abs(out["predicted_decode_s"] - out["measured_decode_s"]) / out["measured_decode_s"]
    return out


def _offloaded_bytes_per_step(plan: dict, model: str, context: str, gpus: int) -> float:
    """K/V bytes one rank fetches per decode step: its offloaded units x context x unit bytes."""
    from kvpipe.pipeline.model import load_model
    from kvpipe.pipeline.units import parse_tokens
    spec = load_model(model)
    rank_units = spec.units // gpus
    return (rank_units - plan["plan"]["resident"]) * parse_tokens(context) * spec.kv_unit_bytes_per_token


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS), help="rows to run (default: all)")
    ap.add_argument("--hw", default="h200", help="profile the predictions use")
    ap.add_argument("--resident", default="auto", help="none: every unit streamed (the link-scaling rows)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{k}: {v}" for k, v in ROWS.items()))
        return 0
    results = []
    for name in args.rows:
        results.append(row(name, args.hw, args.resident))
        print(json.dumps(results[-1]), flush=True)
    speedups = {}
    by = {r["row"]: r for r in results if "measured_decode_s" in r}
    for c in ("128k", "512k"):
        one = by.get(f"8b-{c}-1")
        for n in (2, 4):
            if one and f"8b-{c}-{n}" in by:
                speedups[f"8b-{c}-{n}"] = one["measured_decode_s"] / by[f"8b-{c}-{n}"]["measured_decode_s"]
    out = args.out or result_file("multi_gpu", "cuda")
    with open(out, "w") as f:
        json.dump({"rows": results, "decode_speedup_vs_1_gpu": speedups}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
