"""A chat's later turns on one kvpipe.Conversation: turn 1 the document, then turns of
`--question` new tokens each. Per turn: the engine's TTFT (CUDA events), the wall time from the
call to the first token reaching the stream callback, the tokens prefilled, the host time of the
prefill's stages and the five slowest of them (a kernel's plan build, an allocation or a host sync
shows there), and how the decode ran (graphs captured, capture and compile seconds). Target: a
later turn's TTFT is the new tokens' prefill, not the conversation's (tens of ms at 32K).

    python -m benchmarks.chat_turns --gpu-mem 24GB --contexts 32K,128K
    python -m benchmarks.chat_turns --model tests-like/config.json --contexts 1K --device cpu   # CPU smoke

Writes the JSON (benchmarks/results/<machine>-<date>-chat-turns.json) after every context."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvpipe.conversation import Conversation
from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.stage import Phase
from kvpipe.pipeline.units import parse_tokens

from .result_file import result_file


def turn(c: Conversation, ids: list[int], new: int) -> dict:
    first: list[float] = []
    t0 = time.perf_counter()
    res = c.append(ids, max_new_tokens=new, ignore_eos=True,
                   stream=lambda piece: first or first.append(time.perf_counter() - t0))
    wall = time.perf_counter() - t0
    trace = res.run.real_trace
    stages = trace.graph.stages
    pre = [sp for sp in trace.spans if stages[sp.stage].phase is Phase.PREFILL]
    slow = sorted(pre, key=lambda sp: -sp.host_s)[:5]
    return {"ttft_s": res.timings["ttft_s"], "wall_first_token_s": first[0] if first else None, "wall_s": wall,
            "prefill_tokens": res.timings["prefill_tokens"], "prefill_stages": len(pre),
            "prefill_host_s": sum(sp.host_s for sp in pre),
            "slowest_prefill_stages": [[stages[sp.stage].name, sp.host_s] for sp in slow],
            "decode_s_per_token": res.timings["decode_s_per_token"], "decode": res.run.decode_issue,
            "tokens": res.tokens}


def row(args, context: int) -> dict:
    g = torch.Generator().manual_seed(context)
    vocab = load_model(args.model).vocab
    doc = torch.randint(0, vocab, (context,), generator=g).tolist()
    qs = [torch.randint(0, vocab, (args.question,), generator=g).tolist() for _ in range(args.turns - 1)]
    cap = context + args.turns * (args.question + args.new) + 1
    with Conversation(args.model, max_context=cap, max_new_tokens=args.new, random_weights=True, chat=False,
                      device=args.device, gpu_mem=args.gpu_mem, kv_dir=args.kv_dir) as c:
        plan = c.engine.plan.describe()
        turns = [turn(c, doc, args.new)]
        for q in qs:
            turns.append(turn(c, c.tokens + turns[-1].pop("tokens")[-1:] + q, args.new))
        turns[-1].pop("tokens")
    return {"context": context, "plan": plan, "turns": turns,
            "later_ttft_over_first": [t["ttft_s"] / turns[0]["ttft_s"] for t in turns[1:]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (random weights)")
    ap.add_argument("--contexts", default="32K")
    ap.add_argument("--question", type=int, default=64, help="new tokens of each later turn's question")
    ap.add_argument("--new", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = Path(args.out) if args.out else result_file("chat-turns", dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "chat_turns", "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
           "model": args.model, "gpu_mem": args.gpu_mem, "rows": []}
    for c in args.contexts.split(","):
        out["rows"].append(row(args, parse_tokens(c, "contexts")))
        path.write_text(json.dumps(out, indent=2))
        print(json.dumps(out["rows"][-1], indent=2), flush=True)


if __name__ == "__main__":
    main()
