"""Probe: GPU time of one sparse-decode score stage's parts at 128K x 8 offloaded units, GQA 4, D 128,
2-bit sketch: scores (unpack + einsum), group_share, select (stable sort); and candidate cheaper
forms: bf16 bmm scores, topk selection, one compiled scores+share over the whole capacity."""
import json, os, math, torch
from kvpipe.executor.sparse import sketch as ss
dev = "cuda"; B, U, G, D, S, chunk, bits = 1, 8, 4, 128, 131072, 64, 2
C = S // chunk
torch.manual_seed(0)
k = torch.randn(B, U, S, D, device=dev, dtype=torch.bfloat16)
blocks = k.view(B, U, C, chunk, D); lo, hi = blocks.amin(3), blocks.amax(3)
codes = ss.encode(k, lo, hi, bits)
q = torch.randn(B, U, G, D, device=dev, dtype=torch.bfloat16)
def timed(fn, reps=10):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts)//2]
out = {}
s = ss.scores(q, lo, hi, codes, bits); share = ss.group_share(s)
budget = int(0.2 * S)
out["scores_ms"] = timed(lambda: ss.scores(q, lo, hi, codes, bits))
out["group_share_ms"] = timed(lambda: ss.group_share(s))
out["select_sort_ms"] = timed(lambda: ss.select(share, S, budget, 4, 256))
out["topk_ms"] = timed(lambda: torch.topk(share, budget, dim=-1, sorted=False))
out["topk_then_sort_ms"] = timed(lambda: torch.sort(torch.topk(share, budget, dim=-1, sorted=False).indices, -1))
out["kthvalue_ms"] = timed(lambda: torch.kthvalue(share, S - budget, dim=-1))
def sc_sum(q, lo, hi, codes):
    qf = q.float() / math.sqrt(D); lof = lo.float(); step = (hi.float() - lof) / (1 << bits)
    base = qf @ (lof + 0.5 * step).transpose(-1, -2)
    cells = ss.decode_codes(codes, bits).float().view(B, U, 1, C, chunk, D)
    w = (qf[..., :, None, :] * step[..., None, :, :])[..., None, :]      # [B,U,G,C,1,D]
    sc = (w * cells).sum(-1) + base[..., None]
    sc = sc.reshape(B, U, G, S)
    return torch.logsumexp(torch.log_softmax(sc, -1), -2)
try:
    f = torch.compile(sc_sum, dynamic=False)
    f(q, lo, hi, codes); torch.cuda.synchronize()
    out["compiled_scores_share_ms"] = timed(lambda: f(q, lo, hi, codes))
    out["compiled_max_abs_diff"] = float((f(q, lo, hi, codes) - share).abs().max())
except Exception as e:
    out["compiled_error"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "score-probe.json"), "w"), indent=1)
