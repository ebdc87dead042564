"""Probe: where the measured GPU peak of a planner pick comes from. Records the allocator history
for one row (the 32K and 128K picks of planner-regret-plans.json), finds the peak, and groups the
blocks live at the peak by the first kvpipe/transformers/torch frame that allocated them. Prints
next to the plan's pipeline.memory breakdown."""
import json, os, sys, collections
import torch
from benchmarks.measure import Bench
from kvpipe.pipeline.plan import Plan
from kvpipe.pipeline.workload import Workload
from kvpipe.pipeline.memory import breakdown
OUT = os.environ.get("OUT", "/tmp")
plans = json.load(open(sys.argv[1]))["workloads"]
ctxs = sys.argv[2].split(",")
res = {}
def site(frames):
    keep = []
    for f in frames:
        fn = f.get("filename", "")
        if any(k in fn for k in ("kvpipe", "transformers", "benchmarks")):
            keep.append(f"{fn.split('site-packages/')[-1]}:{f.get('line')}:{f.get('name')}")
            if len(keep) == 2: break
    return " <- ".join(keep) or (frames[0].get("filename","?") + ":" + str(frames[0].get("line")) if frames else "?")
with Bench("llama-3-8b", "cuda", 24_000_000_000, max_context=max(plans[c]["context"] for c in ctxs)) as bench:
    for c in ctxs:
        w = plans[c]
        row = w["rows"][0]
        plan = Plan.from_json(row["plan"], bench.spec)
        work = Workload(w["context"], w["decode_tokens"], 1)
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
        r = bench.row(plan, work)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        ev = snap["device_traces"][0]
        live, cur, peak, peak_i = {}, 0, 0, -1
        for i, e in enumerate(ev):
            a = e["action"]
            if a == "alloc": live[e["addr"]] = e["size"]; cur += e["size"]
            elif a in ("free_completed",): cur -= live.pop(e["addr"], 0)
            if cur > peak: peak, peak_i = cur, i
        live2 = {}
        for e in ev[:peak_i + 1]:
            if e["action"] == "alloc": live2[e["addr"]] = e
            elif e["action"] == "free_completed": live2.pop(e["addr"], None)
        by = collections.Counter(); cnt = collections.Counter()
        for e in live2.values():
            s = site(e.get("frames", [])); by[s] += e["size"]; cnt[s] += 1
        bd = breakdown(bench.spec, work, plan)
        res[c] = {"row": r.json.get("measured", r.json), "peak_events_bytes": peak, "events": len(ev),
                  "peak_event": {k: ev[peak_i].get(k) for k in ("action", "size")} if peak_i >= 0 else None,
                  "peak_stack": site(ev[peak_i].get("frames", [])) if peak_i >= 0 else None,
                  "planner": {"gpu": bd.gpu, **bd.gpu_breakdown()}, "predicted_peak": row["predicted"]["peak_gpu_bytes"],
                  "plan": row["plan"],
                  "live_at_peak": [{"site": s, "bytes": b, "n": cnt[s]} for s, b in by.most_common(40)]}
        print(c, json.dumps({k: v for k, v in res[c].items() if k != "live_at_peak"})[:800])
        for x in res[c]["live_at_peak"][:25]: print(f"  {x['bytes']/2**30:7.3f} GiB n={x['n']:4d} {x['site']}")
json.dump(res, open(os.path.join(OUT, "mem-probe.json"), "w"), indent=1)
