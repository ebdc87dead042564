"""A probe (seventh session, H200; run: python experiments/probes/first_run.py OUT.json; result
benchmarks/results/h200-2026-12-01-first-run-s7.json): is the first timed run's extra host time (group 1/2 rows, 1.1-1.35x) the
caching allocator's cudaMalloc calls after the warm-up's empty_cache?
Answer on 2026-12-01 (one process, 3 timed runs a row): not alone. Cold, the first runs made
39-46 cudaMallocs against 13-14 after and were 1.1-1.4x slower; with no empty_cache anywhere
("keep") the first runs made 13-30 and 4k-g1-all-c2k's was still 1.14x its next, while
8k-g2-some-c2k ran 0.61 s in all three runs, against 0.37 s in its 2nd and 3rd cold runs of the
same process: these host-bound rows vary ~1.6x within one process as well as between them."""
import json
import sys

from benchmarks.measure import Bench
from benchmarks.sim_check import ROWS, plan_of, GPU_BUDGET, MODEL
from kvpipe.api import default_alloc_conf
default_alloc_conf()
from kvpipe.pipeline.workload import Workload
import torch
import kvpipe.executor.engine.session as session
out = {}
names = ["4k-g1-all-c2k", "16k-g1-all-c16k", "8k-g2-some-c2k", "16k-g8-none-c4k"]
with Bench(MODEL, "cuda", GPU_BUDGET, 16384) as b:
    for keep in (False, True):
        if keep:   # warm-up without its closing empty_cache: the timed run starts from the warm-up's cached blocks
            session.torch.cuda.empty_cache, orig = (lambda: None), session.torch.cuda.empty_cache
        for n in names:
            r = b.row(plan_of(n), Workload(ROWS[n][0], 6, 1), repeats=3)
            s = r.json.get("samples", [])
            out[f"{n}{'-keep' if keep else ''}"] = s
            print(n, "keep" if keep else "cold", [(round(x["prefill_s"], 3), x["device_allocs"]) for x in s], r.json.get("error"), flush=True)
        if keep:
            session.torch.cuda.empty_cache = orig
json.dump(out, open(sys.argv[1], "w"), indent=1)
