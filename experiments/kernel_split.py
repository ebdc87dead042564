"""GPU time of each annotated stage of a profiled run, split by what ran: GEMM, fused attention,
small kernels (norms, RoPE, activations, casts, merges: everything else that computes) and copies
(memcpy / memset). Pure post-processing of a torch.profiler Chrome trace (its JSON), no torch:

  a kernel (cat kernel / gpu_memcpy / gpu_memset) is tied by `args.correlation` to the host
  runtime call that launched it (cudaLaunchKernel, cudaMemcpyAsync, cudaGraphLaunch, ...), and that
  call to the innermost `user_annotation` range open on its thread when it was made. benchmarks/
  diag.py opens one range per stage, named `ANNOTATION_PREFIX` + stage id, so every kernel lands on
  the stage whose issue launched it (all kernels of a replayed CUDA graph on the range open at the
  launch)."""
from __future__ import annotations

import bisect
import re
from collections import defaultdict

ANNOTATION_PREFIX = "kvpipe#"
CATEGORIES = ("gemm", "attention", "small", "copy")
_ATTENTION = re.compile(r"flash|fmha|sdpa|attention|cudnn_generated|cudnn.*(attn|mha)", re.I)
_GEMM = re.compile(r"gemm|gemv|nvjet|xmma|cublas|cutlass.*(sm90|sm80|tensorop)|wgmma|matmul", re.I)
_COPY_CATS = ("gpu_memcpy", "gpu_memset")
_KERNEL_CATS = ("kernel",) + _COPY_CATS


def category(cat: str, name: str) -> str:
    """One of CATEGORIES for a GPU event (its trace `cat` and kernel name). Attention is tested
    before GEMM: FA2's kernel names carry cutlass types."""
    if cat in _COPY_CATS or name.startswith("Memcpy") or name.startswith("Memset"):
        return "copy"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "small"


def split(trace_events: list[dict], prefix: str = ANNOTATION_PREFIX) -> dict[int, dict[str, list[float]]]:
    """{stage id: {category: [seconds, kernels]}} over the GPU events of a profiler trace
    (`json.load(f)["traceEvents"]`) whose launch falls in a `<prefix><id>` range; events launched
    outside every such range are under key -1."""
    ranges: dict[tuple, list[tuple[float, float, int]]] = defaultdict(list)   # (pid, tid) -> (start, end, id)
    launch: dict[int, tuple] = {}     # correlation -> (pid, tid, ts) of the host call
    gpu = []
    for e in trace_events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat == "user_annotation" and name.startswith(prefix) and name[len(prefix):].isdigit():
            ranges[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                                         int(name[len(prefix):])))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch[corr] = (e.get("pid"), e.get("tid"), float(e["ts"]))
        elif cat in _KERNEL_CATS:
            gpu.append(e)
    starts = {k: [r[0] for r in sorted(v)] for k, v in ranges.items()}
    for k in ranges:
        ranges[k].sort()
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: {c: [0.0, 0] for c in CATEGORIES})
    for e in gpu:
        stage = -1
        host = launch.get((e.get("args") or {}).get("correlation"))
        if host is not None:
            key, ts = (host[0], host[1]), host[2]
            i = bisect.bisect_right(starts.get(key, []), ts) - 1
            if i >= 0 and ranges[key][i][0] <= ts <= ranges[key][i][1]:
                stage = ranges[key][i][2]
        cell = out[stage][category(e.get("cat", ""), e.get("name", ""))]
        cell[0] += float(e.get("dur", 0)) / 1e6
        cell[1] += 1
    return dict(out)
