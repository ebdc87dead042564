"""Host time before a question's first token on a kept conversation, as a server's questions about
one document see it (benchmarks/serve_doc.py's shapes): per question, the wall time from the call
to the first token reaching the engine's token callback, the engine's TTFT, and how many decode
steps' stages the run's graph held at that moment (a graph built whole before the prefill holds
them all: the cost behind the second question's TTFT, docs/PERFORMANCE.md). Beside it, with no
model (`--graph-only`): the host seconds of building one question's stage graph whole, of its
prefill part alone, and per decode step, for Llama-3-8B's shapes under the plan the H200 decides
at --gpu-mem 24GB for a 128K context.

    python -m benchmarks.first_token --graph-only                        # the build, any machine
    python -m benchmarks.first_token --context 8K --device cpu           # CPU: a 32-layer narrow model
    python -m benchmarks.first_token --model llama-3-8b --context 128K --gpu-mem 24GB   # H200

The CPU model is Llama-3-8B's stage structure (32 layers, 8 KV heads, the same plan: the same
stages per step) at a width a CPU runs. Writes the JSON (benchmarks/results/<machine>-<date>-first-token.json)."""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from unittest import mock

from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.units import parse_tokens

from .result_file import result_file

# Llama-3-8B's stage structure at a CPU's width: 32 layers of 8 KV heads, fp32
NARROW = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 8,
          "max_position_embeddings": 1 << 20, "torch_dtype": "float32", "tie_word_embeddings": False}
# the plan the H200 profile decides for Llama-3-8B, 128K, --gpu-mem 24GB (`kvpipe plan --hw h200`)
H200_PLAN = {"schema": 3, "model": "llama-3-8b", "method": "headwise",
             "prefill": {"group": 4, "chunk": 4096, "depth": 2}, "decode": {"group": 4, "chunk": 1, "depth": 2},
             "resident": 78, "disk": 0, "source": "planner", "replay": False}


def graph_costs(context: int, question: int, new: int) -> dict:
    """Host seconds of one later question's graph (its prefill starts past the document)."""
    from kvpipe.pipeline.builder import build, build_lazily
    from kvpipe.pipeline.model import preset
    from kvpipe.pipeline.plan import Plan
    from kvpipe.pipeline.workload import Workload
    spec = preset("llama-3-8b")
    plan = Plan.from_json(H200_PLAN, spec)
    doc = context - 4 * question
    work = Workload(doc + question, new - 1, 1)
    t0 = time.perf_counter()
    whole = build(spec, work, plan, starts=(doc,))
    t1 = time.perf_counter()
    graph, more = build_lazily(spec, work, plan, starts=(doc,))
    t2 = time.perf_counter()
    for _ in more:
        pass
    t3 = time.perf_counter()
    assert graph == whole
    return {"model": "llama-3-8b", "plan": H200_PLAN, "prompt": doc + question, "decode_steps": new - 1,
            "stages": len(whole.stages), "build_whole_s": t1 - t0, "build_prefill_s": t2 - t1,
            "build_per_decode_step_s": (t3 - t2) / max(1, new - 1)}


def question(c, ids: list[int], new: int, graphs: list) -> dict:
    """One question: wall time to the first token and the decode steps built by then."""
    first: list = []

    def after_token() -> bool:   # asked after each token: its first call follows the first token
        if not first:
            stages = graphs[-1].stages
            first.append((time.perf_counter() - t0, sum(s.phase is Phase.DECODE and s.tag == "embed" for s in stages)))
        return False
    t0 = time.perf_counter()
    res = c.append(ids, max_new_tokens=new, ignore_eos=True, reuse=True, cancel=after_token)
    return {"wall_first_token_s": first[0][0], "decode_steps_built_at_first_token": first[0][1],
            "engine_ttft_s": res.timings["ttft_s"], "wall_s": time.perf_counter() - t0,
            "prefill_tokens": res.timings["prefill_tokens"], "decode_s_per_token": res.timings["decode_s_per_token"],
            "output_digest": res.output_digest}


def questions(args, context: int) -> dict:
    from kvpipe.conversation import Conversation
    from kvpipe.executor.engine import live
    rng = random.Random(0)
    model = args.model
    if model is None:
        model = str(Path(args.tmp) / "narrow.json")
        Path(model).write_text(json.dumps(NARROW))
    plan = json.loads(Path(args.plan).read_text()) if args.plan else None
    if plan is None and args.model is None:   # the H200's plan, named for the narrow model
        plan = dict(H200_PLAN, model=model)
    opts = dict(random_weights=True, chat=False, device=args.device, gpu_mem=args.gpu_mem, max_new_tokens=args.new,
                plan=plan)
    doc_n = context - 4 * args.question
    vocab = NARROW["vocab_size"] if args.model is None else 32000
    doc = [rng.randrange(1, vocab) for _ in range(doc_n)]
    qs = [[rng.randrange(1, vocab) for _ in range(args.question)] for _ in range(4)]
    graphs, execute = [], live.execute

    def spied(graph, *a, **kw):
        graphs.append(graph)
        return execute(graph, *a, **kw)
    with Conversation(model, max_context=doc_n + args.question + args.new, **opts) as c, \
            mock.patch.object(live, "execute", spied):
        rows = [question(c, doc + q, args.new, graphs) for q in qs]
    first = rows[0]["wall_first_token_s"]
    return {"context": context, "questions": rows,
            "wall_first_token_q2_4_over_q1": [r["wall_first_token_s"] / first for r in rows[1:]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph-only", action="store_true", help="time the graph build only (no model, no torch)")
    ap.add_argument("--model", help="preset or config.json (random weights; default: the narrow 32-layer model)")
    ap.add_argument("--plan", help="a plan.json (default with the narrow model: the H200's 128K plan)")
    ap.add_argument("--context", default="128K", help="the document plus four questions")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device")
    ap.add_argument("--gpu-mem")
    ap.add_argument("--out")
    args = ap.parse_args()
    context = parse_tokens(args.context, "context")
    dev = args.device or "cpu"
    out = {"benchmark": "first_token", "graph": graph_costs(context, args.question, args.new)}
    if not args.graph_only:
        import tempfile
        import torch
        dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        with tempfile.TemporaryDirectory() as tmp:
            args.tmp, args.device = tmp, dev
            out["run"] = questions(args, context)
    path = Path(args.out) if args.out else result_file("first-token", dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
