"""Hugging Face transformers' own inference as the baseline (docs/BASELINES.md):
one forward over the prompt with `logits_to_keep=1`, then greedy decode steps, with
`DynamicCache` all on the GPU or `DynamicCache(offloading=True)` (HF's layer-wise offload).
Prints one JSON object. Run on a GPU: `python -m benchmarks.hf_baseline --context 131072`."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig


def llama3_8b_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 20,
                       rope_theta=500000.0)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--mode", choices=["standard", "offload"], default="standard")
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    cfg = llama3_8b_config()
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), device="cuda")
    with torch.inference_mode():  # warm-up: kernels, cuBLAS handles, allocator
        model(ids[:, :512], past_key_values=DynamicCache(config=cfg), use_cache=True, logits_to_keep=1)
    cache = DynamicCache(config=cfg, offloading=args.mode == "offload")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        out, prefill_s = timed(lambda: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1))
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        steps = []
        for _ in range(args.decode_steps):
            out, dt = timed(lambda: model(tok, past_key_values=cache, use_cache=True))
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(dt)
    print(json.dumps({"method": f"hf-{args.mode}", "context": args.context, "prefill_s": prefill_s,
                      "decode_s_per_token": statistics.median(steps), "decode_steps_s": steps,
                      "peak_gpu_bytes": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    main()
