"""Where a replayed decode step's GPU time goes: `kvpipe run` on a model of Llama-3-8B's layer
shapes cut to --layers layers (random weights; per-layer work is the full model's, the prefill
--layers/32 of it), with torch.profiler (CUPTI) around the decode, every kernel of each CUDA-graph
replay (a kernel launched by a graph carries its cudaGraphLaunch's correlation id), then per
kernel name and stream its calls and microseconds a step (mean of the last 3 replays) and the
last replay's kernel timeline (name, stream, start, duration in us from the step's first kernel).

  python -m experiments.replay_kernels --context 128K --group 8 --lossy int4 --sparse 0.2   # H200
  python -m experiments.replay_kernels --context 512K --group 8 --lossy int4 --sparse 0.2

How the ninth session found the replayed sparse + int4 step's costs (benchmarks/README.md): the
gather at the PCIe floor, the compiled dequantise 8x its HBM traffic, the attention's FA2 splits
sized to the whole slot, the selection's kernel latencies. The profiler adds host work, not GPU
time, to a replay; its ms/token is printed next to the prediction. JSON (command, date, device,
row, last_step) gzipped to benchmarks/results/replay-kernels-<tag>-<date>.json.gz or --out."""
from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def model_config(layers: int) -> dict:
    """A Hugging Face config.json of Llama-3-8B's shapes with `layers` layers."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": layers, "vocab_size": 128256, "head_dim": 128,
            "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}


def per_replay(events: list[dict]) -> list[list[dict]]:
    """The kernels (and device copies/sets) of each cudaGraphLaunch in a chrome trace's events, in
    launch order, each list sorted by start."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    launches = sorted((e for e in events if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"])
    at = {e["args"]["correlation"]: i for i, e in enumerate(launches)}
    out: list[list[dict]] = [[] for _ in launches]
    for e in events:
        c = e.get("args", {}).get("correlation")
        if e.get("cat") in kinds and c in at:
            out[at[c]].append(e)
    return [sorted(ks, key=lambda e: e["ts"]) for ks in out]


def aggregate(steps: list[list[dict]], last: int = 3) -> list[list]:
    """[name, stream, calls, us] per kernel name and stream, a step's mean over the `last` steps."""
    agg = collections.defaultdict(lambda: [0, 0.0])
    use = [s for s in steps if s][-last:]
    for s in use:
        for e in s:
            k = (e["name"][:90], e["args"].get("stream"))
            agg[k][0] += 1
            agg[k][1] += e["dur"]
    n = max(1, len(use))
    return sorted(([nm, st, round(c / n, 2), round(t / n, 1)] for (nm, st), (c, t) in agg.items()), key=lambda r: -r[3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="128K")
    ap.add_argument("--group", default="8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", help="a preset or config.json to profile whole instead of Llama-3-8B cut to --layers")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--resident", default="none", help="the run's --resident (none, all, max, a count)")
    ap.add_argument("--lossy", choices=("int8", "int4"))
    ap.add_argument("--sparse", type=float)
    ap.add_argument("--gpu-mem", default="24GB")
    ap.add_argument("--hw", default="h200-testbox")
    ap.add_argument("--priority", metavar="G,H,D", help="the lanes' stream priorities (compute, H2D, D2H; "
                    "CUDA's convention, lower is higher) instead of executor/lanes.LANE_PRIORITY's")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"layers: {args.layers} is not a positive count")
    prio = None
    if args.priority is not None:
        try:
            prio = tuple(int(x) for x in args.priority.split(","))
        except ValueError:
            prio = ()
        if len(prio) != 3:
            ap.error(f"priority: {args.priority!r} is not three integers G,H,D")
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kvpipe
    from kvpipe.executor.engine import lanes
    from kvpipe.executor.replay import capture as replay
    if not torch.cuda.is_available():
        print("replay_kernels: needs CUDA (it profiles CUDA-graph replays)", file=sys.stderr)
        return 2
    if prio is not None:
        lanes.LANE_PRIORITY.update(zip((lanes.Lane.GPU, lanes.Lane.H2D, lanes.Lane.D2H), prio))
    held = {}
    run_decode = replay.DecodeReplay.run

    def profiled(self, base, before=None):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            out = run_decode(self, base, before)
        held["p"] = p
        return out
    replay.DecodeReplay.run = profiled
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(model_config(args.layers)))
        t0 = time.time()
        res = kvpipe.run(model=args.model or str(cfg), random_weights=True, context=args.context, decode_tokens=args.decode_tokens,
                         gpu_mem=args.gpu_mem, group=args.group, resident=args.resident, device="cuda", hw=args.hw,
                         progress=False, lossy=args.lossy, sparse=args.sparse)
        trace = Path(tmp) / "trace.json"
        held["p"].export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    j = res.to_json()
    steps = per_replay(events)
    row = {"ms_tok": 1e3 * j["measured"]["decode_s_per_token"], "pred": 1e3 * j["predicted"]["decode_s_per_token"],
           "issue": (j.get("decode_issue") or {}).get("mode"), "wall": time.time() - t0, "plan": j["plan"],
           "priority": {lane.value: p for lane, p in lanes.LANE_PRIORITY.items()}, "digest": j["output_digest"],
           "launches": len(steps), "kernels_per_launch": [len(s) for s in steps],
           "step_span_us": [s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"] if s else None for s in steps],
           "agg_last3": aggregate(steps)}
    last = next((s for s in reversed(steps) if s), [])
    timeline = [(e["name"][:90], e["args"].get("stream"), round(e["ts"] - last[0]["ts"], 2), round(e["dur"], 2))
                for e in last]
    tag = f"{Path(args.model).stem + '-' if args.model else ''}{args.context}-g{args.group}-r{args.resident}-{args.lossy or 'exact'}-{args.sparse or 'dense'}"
    path = Path(args.out) if args.out else RESULTS / f"replay-kernels-{tag}-{datetime.date.today()}.json.gz"
    doc = {"command": " ".join([sys.executable, "-m", "experiments.replay_kernels", *(argv or sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "row": row, "last_step": timeline}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    print(f"wrote {path}")
    print(f"{tag}: {row['ms_tok']:.2f} ms/token (predicted {row['pred']:.2f}), decode {row['issue']}, "
          f"{len(last)} kernels a step, priorities {row['priority']}, output {row['digest'][:12]}")
    for name, stream, calls, us in row["agg_last3"][:25]:
        print(f"  {us:9.1f} us  {calls:6.2f} calls  stream {stream}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
