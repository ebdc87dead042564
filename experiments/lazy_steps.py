"""`kvpipe.generate` with its stage graph built step by step as the run reaches each step (what it
does) against the graph built whole before the run (what it did: `build_lazily` swapped for
`build` here), in one process, alternating, on the same plan: the wall time of the call, TTFT and
decode ms/token. Where steps are built as the run goes, their host work must stay inside the
GPU's step time (a small model's short steps the hardest case); this shows whether it does.

    python -m experiments.lazy_steps --out lazy-steps.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

SMOL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "vocab_size": 49152, "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}   # SmolLM2-135M's shapes


def one(model: str, context: int, new: int, knobs: dict, whole: bool) -> dict:
    import kvpipe
    from kvpipe.pipeline import builder
    lazily = builder.build_lazily
    if whole:
        builder.build_lazily = lambda spec, work, plan, **kw: (builder.build(spec, work, plan, **kw), None)
    try:
        ids = " ".join(str(3 + (i * 7919) % 20000) for i in range(context))
        t0 = time.perf_counter()
        res = kvpipe.generate(model, ids, prompt_format="ids", chat=False, max_new_tokens=new, ignore_eos=True,
                              random_weights=True, device="cuda", gpu_mem="24GB", **knobs)
        wall = time.perf_counter() - t0
    finally:
        builder.build_lazily = lazily
    t = res.timings
    return {"graph": "whole" if whole else "lazy", "wall_s": wall, "ttft_s": t["ttft_s"],
            "decode_ms_per_token": t["decode_s_per_token"] * 1e3, "decode": res.run.decode_issue["mode"],
            "tokens_digest": res.output_digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--out", default="lazy-steps.json")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(SMOL))
    rows = [("smollm2-shapes", str(d / "config.json"), 8192, dict(resident="max", group=1)),
            ("llama-3-8b", "llama-3-8b", 8192, dict(resident="max", group=8)),
            ("llama-3-8b", "llama-3-8b", 32768, dict(resident="none", group=8))]
    out = []
    for name, model, ctx, knobs in rows:
        for whole in (False, True, False, True):
            r = {"model": name, "context": ctx, **knobs, **one(model, ctx, a.new, knobs, whole)}
            out.append(r)
            print(f"{name} {ctx} {knobs}: {r['graph']:5s} wall {r['wall_s']:.2f} s, TTFT {r['ttft_s']:.3f} s, "
                  f"decode {r['decode_ms_per_token']:.3f} ms/token ({r['decode']})", flush=True)
            Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
