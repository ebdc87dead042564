"""Probe: UVA zero-copy gather rate from pinned host memory against the row size (one row = one
token's K+V of one head at 512 B, or a block of tokens), 20% of 512 MiB selected; plus 512 B rows
selected in contiguous runs (block selection gathered row by row). Plain H2D copy for reference."""
import json, os
import torch
out = {}
TOTAL = 512 << 20
h = torch.randint(-30000, 30000, (TOTAL // 2,), dtype=torch.int16).pin_memory()
class Iface:
    def __init__(self, t, shape):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (t.data_ptr(), False), "version": 2, "strides": None}
def timed(fn, reps=7):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    ts.sort(); return ts[len(ts) // 2]
dev = torch.empty_like(h, device="cuda")
t = timed(lambda: dev.copy_(h, non_blocking=True)); out["h2d_full_GBps"] = TOTAL / t / 1e9
for rb in (256, 512, 1024, 2048, 4096, 8192, 16384, 65536):
    n = TOTAL // rb
    g = torch.as_tensor(Iface(h, (n, rb // 2)), device="cuda")
    idx = torch.randperm(n, device="cuda")[: n // 5].sort().values
    t = timed(lambda: g.index_select(0, idx)); out[f"uva_rows_{rb}B_GBps"] = idx.numel() * rb / t / 1e9
    if rb == 512:
        assert torch.equal(g.index_select(0, idx[:1000]).cpu(), h.view(n, rb // 2)[idx[:1000].cpu()])
        for run in (4, 8, 16, 32, 64):
            blocks = torch.randperm(n // run, device="cuda")[: n // run // 5].sort().values
            ridx = (blocks[:, None] * run + torch.arange(run, device="cuda")).reshape(-1)
            t = timed(lambda: g.index_select(0, ridx)); out[f"uva_512B_runs{run}_GBps"] = ridx.numel() * rb / t / 1e9
            gb = torch.as_tensor(Iface(h, (n // run, run * rb // 2)), device="cuda")
            t = timed(lambda: gb.index_select(0, blocks)); out[f"uva_blocks{run}x512B_GBps"] = blocks.numel() * run * rb / t / 1e9
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "uva2-probe.json"), "w"), indent=1)
