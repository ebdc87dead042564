"""One long document, then four questions about it, through `kvpipe serve`, against `kvpipe
generate` with the same plan flags: TTFT and decode time per token as the client sees them
(streamed /v1/completions, the prompt as token ids) and as the server's engine measured them
(/metrics), next to generate's measured prefill and decode. Llama-3-8B shapes with random bf16
weights, beside a word-level tokenizer whose every id of the model's vocabulary decodes to its own
word, so each token reaches the client as its own chunk (with a real tokenizer of a smaller
vocabulary most random ids decode to nothing, and a per-chunk clock overstates decode time).

    python benchmarks/serve_doc.py --context 128K --gpu-mem 24GB --new-tokens 64

`--server-plan same` (default) gives the server the plan generate ran (`--plan`), so the figures
compare serving with generation on one plan; `own` lets the server decide its plan for its
context and answers of PLANNED_NEW_TOKENS (kvpipe/serve/cli.py). Both plan lines are recorded.
Writes the JSON (default benchmarks/results/<machine>-<date>-serve-doc.json) after each step.
Targets: question 1's TTFT within 1.05x of generate's prefill; questions 2-4 at most 5% of it
(prefix reuse); decode per token within 1.05x of generate's."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_helpers import ServerProcess  # noqa: E402
from generate_json import generate_json  # noqa: E402
from result_file import result_file  # noqa: E402


def word_tokenizer(d: Path, vocab: int) -> None:
    """A fast word-level tokenizer of `vocab` words `t0 .. t{vocab-1}` saved in `d`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(d)


def model_dir(root: Path, tokenizer: str | None, config: str | None) -> Path:
    """Llama-3-8B's config.json (the preset's shapes) beside a tokenizer (default: word_tokenizer)."""
    from kvpipe.executor.engine.session import preset_config
    from kvpipe.pipeline.model import preset
    d = root / "llama-3-8b"
    d.mkdir()
    cfg = json.loads(Path(config).read_text()) if config else preset_config(preset("llama-3-8b"))
    cfg.update(eos_token_id=None)
    (d / "config.json").write_text(json.dumps(cfg))
    if tokenizer is None:
        word_tokenizer(d, cfg["vocab_size"])
    else:
        for f in Path(tokenizer).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (d / f.name).write_bytes(f.read_bytes())
    return d


def engine_sums(url: str) -> dict:
    """The server's TTFT and decode-per-token histogram sums (/metrics)."""
    from serve_helpers import metric
    text = httpx.get(url + "/metrics", timeout=60).text
    return {k: metric(text, f"kvpipe_{k}_sum") for k in ("ttft_seconds", "decode_seconds_per_token")}


def stream_one(url: str, ids: list[int], new: int) -> dict:
    """One streamed completion: client-side TTFT (the first text chunk) and decode per token
    (first to last chunk over the tokens between), and the engine's own figures (/metrics)."""
    body = {"model": "bench", "prompt": ids, "max_tokens": new, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    before = engine_sums(url)
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
    wall = time.perf_counter() - t0
    after = engine_sums(url)
    n = usage["completion_tokens"]
    return {"ttft_s": times[0], "decode_s_per_token": (times[-1] - times[0]) / max(1, n - 1),
            "completion_tokens": n, "text_chunks": len(times), "wall_s": wall,
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "engine_ttft_s": after["ttft_seconds"] - before["ttft_seconds"],
            "engine_decode_s_per_token": after["decode_seconds_per_token"] - before["decode_seconds_per_token"]}


def generate_one(d: Path, ids: list[int], new: int, flags: list[str]) -> dict:
    out = generate_json(str(d), ids, new, *flags)
    t = out["timings"]
    return {"ttft_s": t["ttft_s"], "decode_s_per_token": t["decode_s_per_token"], "plan_line": out["plan_line"],
            "plan": out["plan"], "decode": out["decode"], "completion_tokens": len(out["tokens"])}


def server_plan(s: ServerProcess) -> str | None:
    """The plan line the server printed on stderr at start."""
    return next((line.split("kvpipe: plan: ", 1)[1] for line in s.stderr().splitlines()
                 if line.startswith("kvpipe: plan: ")), None)


def ratios(res: dict) -> dict:
    served, ref = res["served"], res["generate"]
    first = served[0]["ttft_s"]
    return {"ttft_q1_over_generate_prefill": first / ref["ttft_s"],
            "ttft_q2_4_over_q1": [q["ttft_s"] / first for q in served[1:]],
            "decode_over_generate": served[0]["decode_s_per_token"] / ref["decode_s_per_token"],
            "engine_ttft_q1_over_generate_prefill": served[0]["engine_ttft_s"] / ref["ttft_s"],
            "engine_decode_over_generate": served[0]["engine_decode_s_per_token"] / ref["decode_s_per_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="128K")
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokenizer", help="a directory holding a tokenizer (default: a word-level one, one word per id)")
    ap.add_argument("--config", help="a config.json instead of Llama-3-8B's shapes (a CPU smoke run)")
    ap.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--chunk", help="pin the prefill chunk of both (a CPU smoke run: shorter than the context)")
    ap.add_argument("--server-plan", choices=["same", "own"], default="same",
                    help="same: the server runs generate's plan (--plan); own: it decides its own")
    ap.add_argument("--out")
    a = ap.parse_args()
    from kvpipe.pipeline.workload import Workload
    n = Workload.parse(a.context, 1, 1).context - 4 * 32
    rng = random.Random(0)
    doc = [rng.randrange(1, 49152) for _ in range(n)]
    questions = [[rng.randrange(1, 49152) for _ in range(32)] for _ in range(4)]
    flags = ["--gpu-mem", a.gpu_mem, "--dtype", a.dtype] + (["--device", a.device] if a.device else [])
    pins = ["--chunk", a.chunk] if a.chunk else []
    dev = a.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    path = Path(a.out) if a.out else result_file("serve-doc", dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    res = {"benchmark": "serve_doc", "context": n + 32, "gpu_mem": a.gpu_mem, "new_tokens": a.new_tokens,
           "server_plan": a.server_plan, "generate": None, "served": []}
    save = lambda: path.write_text(json.dumps(res, indent=2))   # noqa: E731  (after each step: a cut run keeps it)
    with tempfile.TemporaryDirectory() as root:
        d = model_dir(Path(root), a.tokenizer, a.config)
        res["generate"] = ref = generate_one(d, doc + questions[0], a.new_tokens, flags + pins)
        save()
        # The server plans once for its whole context: the document, a question and the answer.
        argv = ["--model", str(d), "--random-weights", "--served-model-name", "bench",
                "--max-context", str(n + 32 + a.new_tokens), *flags]
        if a.server_plan == "same":
            (Path(root) / "plan.json").write_text(json.dumps(ref["plan"]))
            argv += ["--plan", str(Path(root) / "plan.json")]
        else:
            argv += pins
        # as many host threads as generate's process has (serve_helpers' default is 1, for tests)
        s = ServerProcess(argv, env={"OMP_NUM_THREADS": str(__import__("torch").get_num_threads())})
        try:
            res["server_plan_line"] = server_plan(s)
            save()
            for q in questions:
                res["served"].append(stream_one(s.url, doc + q, a.new_tokens))
                save()
        finally:
            s.stop()
    res.update(ratios(res))
    save()
    print(json.dumps(res, indent=2))
    print(f"serve_doc: written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
