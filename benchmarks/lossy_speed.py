"""Speed of kvpipe's lossy options on the KV path of a decode step, against the exact streamed KV
path measured in the same run (Llama-3-8B shapes: 32 layers x 8 KV heads x 128, GQA 4, bf16, the
whole cache in pinned host RAM, batch 1).

  python -m benchmarks.lossy_speed                      # 128K and 512K, on the H200
  python -m benchmarks.lossy_speed --context 8K --device cpu --steps 1   # smoke test of the code

What is timed is the KV part of a decode step, not a whole model step: for each of the 32 layers,
the 8 KV heads' cache crosses PCIe and is attended by the 32 query heads. (`kvpipe run` does not
execute sparse plans yet; int8/int4 runs whole model steps in benchmarks/lossy_run.py. The weights'
share of a step is ~4 ms of the exact step's ~310 ms at 128K, see benchmarks/README.md.) Variants:
  exact        whole layer copied (one H2D per layer, next layer prefetched during attention)
  int8 / int4  the quantised layer copied (codes + float16 scales/zero-points, groups of 64 / 32
               tokens per channel), dequantised on the GPU, attended
  sparse       chunk summaries (per-channel key min/max per 64 tokens, resident on the GPU) scored
               for the layer's queries, the best 20% of tokens (incl. the first chunk and the last
               4) gathered from pinned host memory by a zero-copy GPU kernel, attended; the fetch
               waits for the layer's queries, so nothing is prefetched across layers
  sparse-refined  as sparse, then the chunks holding the best HOT_FACTOR x budget are refined to 8 tokens:
               their packed summaries (uint8 within the coarse range) are gathered from host RAM
               and scored, and the best 8-token chunks gathered (kvpipe's default sparse method)
  sparse+int4  the 64-token selection over the int4 cache, dequantised after the gather
`--dequant` instead times the executor's dequantise alone (executor/quant/store.py: the fused
compiled decode of a whole byte slot, and the eager decode it replaced) at each context, for
int8 (group 64) and int4 (group 32): GB/s of exact KV written, the figure the simulator's
`dequant` stage needs (it costs it as an elementwise kernel: bytes / (hbm_eff_bytes_per_s x
elementwise_efficiency) of the profile, printed beside it with `--hw`).
Only `--layers-distinct` layers hold distinct data (the others reuse them), to keep pinned
memory small; every layer still moves its own bytes. Median of `--steps` steps after one warm-up.
JSON (command, date, GPU, per-variant ms per step and speed-up over exact) goes to
benchmarks/results/lossy-speed-<date>.json (or --out); the table is printed last."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.timing import median_seconds
from kvpipe.executor.quant.quantize import Quantized, dequantize, quantize
from kvpipe.executor.sparse.chunks import RANGE_ALPHA, chunk_scores, even_bounds, pack_fine, summarise
from kvpipe.pipeline.lossy import HOT_FACTOR
from kvpipe.pipeline.units import parse_tokens

LAYERS, KV_HEADS, Q_HEADS, D = 32, 8, 32, 128
CHUNK, FINE, SINK_CHUNKS, RECENT_CHUNKS = 64, 8, 1, 4


def _triton_gather():
    """A GPU kernel copying whole rows of a pinned host tensor (zero-copy over PCIe) into device
    memory, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def kernel(src, idx, dst, W, BLOCK: tl.constexpr):
        r, b = tl.program_id(0), tl.program_id(1)
        row = tl.load(idx + r).to(tl.int64)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        m = offs < W
        tl.store(dst + r.to(tl.int64) * W + offs, tl.load(src + row * W + offs, mask=m), mask=m)

    def gather(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        W = src.shape[1]
        kernel[(idx.numel(), triton.cdiv(W, 4096))](src, idx, out, W, BLOCK=4096)
    return gather


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, kernel) -> None:
    """out[i] = src[idx[i]] for a 2-D src (pinned host) into out (device)."""
    if kernel is not None and out.is_cuda:
        kernel(src, idx, out)
    else:
        out.copy_(src[idx.cpu()])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, 32, 1, D]; k, v [1, 8, S, D] (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class Cache:
    """The KV of `distinct` layers in pinned host RAM, exact and quantised, plus GPU summaries."""

    def __init__(self, S: int, distinct: int, device: torch.device, variants: set[str]) -> None:
        pin = device.type == "cuda"
        g = torch.Generator(device=device).manual_seed(0)
        self.S, self.distinct = S, distinct
        self.exact, self.quant, self.summ, self.fine = [], {8: [], 4: []}, [], []
        for _ in range(distinct):
            kv = torch.randn(KV_HEADS, S, 2, D, generator=g, device=device, dtype=torch.bfloat16)  # [H, S, 2, D]
            self.exact.append(kv.cpu().pin_memory() if pin else kv.cpu())
            if variants & {"sparse", "sparse+int4", "sparse-refined"}:
                cb = even_bounds(S, CHUNK)
                self.summ.append(summarise(kv[:, :, 0], cb))                      # lo, hi [H, C, D]
            if "sparse-refined" in variants:   # packed 8-token summaries in host RAM: [H, F, 2, D] uint8
                fb = even_bounds(S, FINE)
                codes = pack_fine((cb, *self.summ[-1]), (fb, *summarise(kv[:, :, 0], fb)))
                host = torch.stack(codes, -2).cpu()
                self.fine.append(host.pin_memory() if pin else host)
            for bits, group in ((8, 64), (4, 32)):
                if not variants & {f"int{bits}", "sparse+int4" if bits == 4 else ""}:
                    continue
                qz = quantize(kv.view(KV_HEADS, S, 2 * D), bits, group, axis=1)  # codes [H, 2D, G, B]
                # token-group-major so that a chunk's codes are contiguous: [H, G, 2D, B]
                parts = (qz.codes.permute(0, 2, 1, 3), qz.scale.permute(0, 2, 1), qz.zero.permute(0, 2, 1))
                host = [p.contiguous().cpu() for p in parts]
                meta = Quantized(*(torch.empty(0),) * 3, qz.bits, qz.group, qz.axis, qz.shape, qz.length, qz.dtype)
                self.quant[bits].append(([p.pin_memory() for p in host] if pin else host, meta))


def _deq(codes, scale, zero, like: Quantized, tokens: int) -> torch.Tensor:
    """Dequantise token-group-major parts back to [1, H, tokens, 2, D] bf16."""
    q = Quantized(codes.permute(0, 2, 1, 3), scale.permute(0, 2, 1), zero.permute(0, 2, 1), like.bits,
                  like.group, 1, (KV_HEADS, 2 * D, tokens), tokens, like.dtype)
    return dequantize(q).reshape(1, KV_HEADS, tokens, 2, D)


def run_variant(name: str, cache: Cache, device: torch.device, steps: int, fraction: float, kernel,
                layers: int = LAYERS) -> list[float]:
    S, cuda = cache.S, device.type == "cuda"
    copy = torch.cuda.Stream(device) if cuda else None
    q = torch.randn(1, Q_HEADS, 1, D, device=device, dtype=torch.bfloat16)
    C = S // CHUNK
    n_sel = max(SINK_CHUNKS + RECENT_CHUNKS, math.ceil(fraction * S / CHUNK))
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        streamed = name in ("exact", "int8", "int4")
        bits = {"exact": None, "int8": 8, "int4": 4}.get(name)

        def fetch(d: int) -> list[torch.Tensor]:
            """Issue the copy of distinct layer d on the copy stream."""
            src = [cache.exact[d]] if bits is None else cache.quant[bits][d][0]
            with torch.cuda.stream(copy) if cuda else _null():
                return [s.to(device, non_blocking=True) for s in src]
        nxt = fetch(0) if streamed else None
        for layer in range(layers):
            d = layer % cache.distinct
            if streamed:
                cur = nxt
                if cuda:
                    torch.cuda.current_stream(device).wait_stream(copy)
                    for t in cur:
                        t.record_stream(torch.cuda.current_stream(device))
                if layer + 1 < layers:   # prefetch the next layer while this one is attended
                    nxt = fetch((layer + 1) % cache.distinct)
                kv = cur[0].unsqueeze(0) if bits is None else _deq(*cur, cache.quant[bits][d][1], S)
            else:
                lo, hi = cache.summ[d]
                qg = q.view(KV_HEADS, Q_HEADS // KV_HEADS, D)
                refine = (RANGE_ALPHA, True) if name == "sparse-refined" else ()  # its heuristic ranking
                score = chunk_scores(qg, lo, hi, *refine)                         # [H, C]
                score[:, :SINK_CHUNKS] = math.inf
                score[:, C - RECENT_CHUNKS:] = math.inf
                heads = torch.arange(KV_HEADS, device=device)[:, None]
                if name == "sparse-refined":
                    kv = _refined(cache, d, qg, lo, hi, score, n_sel, kernel, device)
                    out = attend(q, kv[:, :, :, 0], kv[:, :, :, 1])
                    continue
                sel = score.topk(n_sel, -1).indices.sort(-1).values                # [H, n_sel]
                rows = (sel + heads * C).flatten()
                if name == "sparse":
                    src = cache.exact[d].view(KV_HEADS * C, -1)                  # a row = one chunk of one head
                    out = torch.empty(rows.numel(), src.shape[1], device=device, dtype=src.dtype)
                    gather_rows(src, rows, out, kernel)
                    kv = out.view(1, KV_HEADS, n_sel * CHUNK, 2, D)
                else:
                    (codes, scale, zero), like = cache.quant[4][d]
                    per = CHUNK // like.group                                     # groups per chunk
                    grows = (rows[:, None] * per + torch.arange(per, device=device)).flatten()
                    parts = []
                    for p in (codes, scale, zero):
                        flat = p.view(KV_HEADS * p.shape[1], -1)
                        o = torch.empty(grows.numel(), flat.shape[1], device=device, dtype=p.dtype)
                        gather_rows(flat, grows, o, kernel)
                        parts.append(o.view(KV_HEADS, n_sel * per, *p.shape[2:]))
                    kv = _deq(*parts, like, n_sel * CHUNK)
            out = attend(q, kv[:, :, :, 0], kv[:, :, :, 1])
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if step:   # the first step warms up
            times.append(ms)
    return times


def _refined(cache: Cache, d: int, qg, lo, hi, score, n_sel: int, kernel, device) -> torch.Tensor:
    """LeoAM-style refinement: the 64-token chunks holding the best HOT_FACTOR x budget are split into
    8-token chunks whose packed summaries are gathered from host RAM, unpacked (min rounded down,
    max up), scored, and the best of them (budget in tokens) gathered: [1, H, tokens, 2, D]."""
    per, C = CHUNK // FINE, score.shape[-1]
    F = C * per
    heads = torch.arange(KV_HEADS, device=device)[:, None]
    n_hot = min(C, HOT_FACTOR * n_sel)
    hot = score.topk(n_hot, -1).indices                                   # [H, n_hot]
    fid = (hot[..., None] * per + torch.arange(per, device=device)).flatten(1)   # [H, n_hot*per] fine ids
    src = cache.fine[d].view(KV_HEADS * F, -1)                            # a row = one fine chunk's codes
    codes = torch.empty(fid.numel(), src.shape[1], device=device, dtype=torch.uint8)
    gather_rows(src, (fid + heads * F).flatten(), codes, kernel)
    codes = codes.view(KV_HEADS, -1, 2, D).float()
    parent = fid // per
    base = lo.float().gather(1, parent[..., None].expand(-1, -1, D))      # [H, n_hot*per, D]
    step = ((hi.float() - lo.float()) / 255).gather(1, parent[..., None].expand(-1, -1, D))
    slack = 2.0 ** -21 * (base.abs() + 255 * step)
    flo, fhi = base + codes[:, :, 0] * step - slack, base + codes[:, :, 1] * step + slack
    fs = chunk_scores(qg, flo, fhi, RANGE_ALPHA, share=True)              # [H, n_hot*per]
    forced = torch.isinf(score.gather(1, parent))                         # sink / recent chunks
    fs = fs.masked_fill(forced, math.inf)
    pick = fs.topk(n_sel * per, -1).indices
    rows = (fid.gather(1, pick).sort(-1).values + heads * F).flatten()
    kvsrc = cache.exact[d].view(KV_HEADS * F, -1)                         # a row = 8 tokens of one head
    out = torch.empty(rows.numel(), kvsrc.shape[1], device=device, dtype=kvsrc.dtype)
    gather_rows(kvsrc, rows, out, kernel)
    return out.view(1, KV_HEADS, n_sel * CHUNK, 2, D)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def check_gather(device: torch.device, kernel) -> str:
    """Does the zero-copy gather return the right rows? ('ok' or the error)."""
    if kernel is None or device.type != "cuda":
        return "no zero-copy kernel (Triton missing or CPU): rows gathered by the host"
    try:
        src = torch.arange(64 * 1000, dtype=torch.int32).view(64, 1000).pin_memory()
        idx = torch.tensor([5, 0, 63, 7], device=device)
        out = torch.empty(4, 1000, device=device, dtype=torch.int32)
        kernel(src, idx, out)
        return "ok" if torch.equal(out.cpu(), src[idx.cpu()]) else "WRONG ROWS"
    except Exception as e:   # reported, not hidden: the sparse rows then are not measured
        return f"failed: {type(e).__name__}: {e}"


def dequant_rate(device: torch.device, bits: int, group: int, tokens: int, fused: bool, reps: int = 5,
                 heads: int = KV_HEADS) -> dict:
    """Seconds (median of `reps` after a warm-up, CUDA events on CUDA) to dequantise one layer's
    `heads` x `tokens` KV from a byte slot into the exact slot as the executor does, and the rates:
    exact bytes written per second, and read + written bytes per second."""
    from kvpipe.executor.quant.blocks import BlockCodec, fused_decode
    from kvpipe.executor.quant.dequant import DECODE_VALUES
    from kvpipe.pipeline.lossy import DEFAULT_VGROUP
    codec = BlockCodec(bits, group, D, torch.bfloat16, DEFAULT_VGROUP.get({8: "int8", 4: "int4"}[bits]))
    nb = tokens // group
    g = torch.Generator(device=device).manual_seed(bits)
    kv = torch.randn(heads * nb, group, 2, D, generator=g, device=device, dtype=torch.bfloat16)
    qslot = codec.encode(kv).view(1, heads, nb * codec.record)
    del kv
    slot = torch.empty(1, heads, nb * group, 2, D, device=device, dtype=torch.bfloat16)

    def once() -> None:
        if fused:
            fused_decode()(codec, qslot, slot, 0, heads)
            return
        rec, out = qslot.view(1, heads, nb, codec.record), slot.view(1, heads, nb, group, 2, D)
        step = max(1, DECODE_VALUES // (heads * group * 2 * D))
        for c in range(0, nb, step):
            codec.decode(rec[:, :, c:c + step], out[:, :, c:c + step])

    t0 = time.perf_counter()
    once()                                               # warm-up (the compile, for the fused decode)
    warm_s = time.perf_counter() - t0
    sec = median_seconds(once, reps, device)
    out_b, in_b = slot.numel() * slot.element_size(), qslot.numel()
    return {"bits": bits, "group": group, "tokens": tokens, "heads": heads, "fused": fused, "s": sec,
            "first_call_s": warm_s, "out_bytes": out_b, "in_bytes": in_b,
            "out_bytes_per_s": out_b / sec, "traffic_bytes_per_s": (out_b + in_b) / sec}


def dequant_main(args, device: torch.device) -> int:
    """`--dequant`: the dequantise micro-benchmark (module docstring)."""
    hw = None
    if args.hw:
        from kvpipe.hw_profiles import load_profile
        hw = load_profile(args.hw)
    modes = [True, False] if args.fused == "both" else [args.fused == "on"]
    res = {"command": "python -m benchmarks.lossy_speed " + " ".join(args.argv),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "what": "dequantise of one layer's 8 KV heads, byte slot -> exact bf16 slot",
           "rows": []}
    if hw is not None:
        res["profile"] = {"name": hw.name, "modelled_bytes_per_s": hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency,
                          "how": "hbm_eff_bytes_per_s x elementwise_efficiency (read + written bytes)"}
    for ctx in args.context:
        for bits, group in ((8, 64), (4, 32)):
            for fused in modes:
                try:
                    row = dequant_rate(device, bits, group, parse_tokens(ctx), fused, args.steps)
                except Exception as e:   # reported, not hidden; the other rows still run
                    row = {"bits": bits, "group": group, "tokens": parse_tokens(ctx), "fused": fused,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                res["rows"].append(row)
    out = Path(args.out or f"benchmarks/results/dequant-rate-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"dequantise, one layer (8 KV heads x D {D}, bf16 out), {res['device']}")
    if hw is not None:
        print(f"profile {hw.name}: the simulator streams dequant's read + written bytes at "
              f"{res['profile']['modelled_bytes_per_s'] / 1e9:.0f} GB/s")
    print(f"{'tokens':>8}{'codec':>12}{'path':>7}{'ms':>9}{'out GB/s':>10}{'r+w GB/s':>10}{'1st call s':>11}")
    for r in res["rows"]:
        name = f"int{r['bits']} g{r['group']}"
        path = "fused" if r["fused"] else "eager"
        if "error" in r:
            print(f"{r['tokens']:>8}{name:>12}{path:>7}  not measured: {r['error']}")
            continue
        print(f"{r['tokens']:>8}{name:>12}{path:>7}{1e3 * r['s']:>9.3f}{r['out_bytes_per_s'] / 1e9:>10.1f}"
              f"{r['traffic_bytes_per_s'] / 1e9:>10.1f}{r['first_call_s']:>11.1f}")
    print(f"json: {out}")
    return 0 if all("error" not in r for r in res["rows"]) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", nargs="+", default=["128K", "512K"])
    ap.add_argument("--variants", nargs="+",
                    default=["exact", "int8", "int4", "sparse", "sparse-refined", "sparse+int4"])
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers-distinct", type=int, default=4)
    ap.add_argument("--layers", type=int, default=LAYERS, help="layers per step (32 for Llama-3-8B)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    ap.add_argument("--dequant", action="store_true", help="time the executor's dequantise alone (GB/s)")
    ap.add_argument("--fused", choices=["on", "off", "both"], default="both", help="--dequant: which decode")
    ap.add_argument("--hw", help="--dequant: a profile whose modelled dequant rate is printed beside")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    device = torch.device(args.device)
    if args.dequant:
        return dequant_main(args, device)
    kernel = _triton_gather() if device.type == "cuda" else None
    gather_status = check_gather(device, kernel)
    if gather_status != "ok" and device.type == "cuda":
        print(f"zero-copy gather: {gather_status}", file=sys.stderr)
    res = {"command": "python -m benchmarks.lossy_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "what": "KV path of one decode step (32 layers), not a whole model step",
           "zero_copy_gather": gather_status, "layers": args.layers, "results": {}}
    out = Path(args.out or f"benchmarks/results/lossy-speed-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for ctx in args.context:
        S = parse_tokens(ctx)
        cache = Cache(S, args.layers_distinct, device, set(args.variants))
        rows = {}
        for name in args.variants:
            if name.startswith("sparse") and device.type == "cuda" and gather_status != "ok":
                rows[name] = {"error": f"zero-copy gather {gather_status}"}
                continue
            try:
                ms = statistics.median(run_variant(name, cache, device, args.steps, args.fraction, kernel, args.layers))
                rows[name] = {"ms_per_step": ms}
            except Exception as e:   # one variant failing must not lose the others' figures
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        base = rows.get("exact", {}).get("ms_per_step")
        for r in rows.values():
            if base and "ms_per_step" in r:
                r["speedup_vs_exact"] = base / r["ms_per_step"]
        res["results"][ctx] = rows
        del cache
        out.write_text(json.dumps(res, indent=2) + "\n")   # saved after every context
    print(f"KV path of a decode step, Llama-3-8B shapes, {res['device']}; zero-copy gather: {gather_status}")
    print(f"{'context':>8}{'variant':>16}{'ms/step':>10}{'vs exact':>10}")
    for ctx, rows in res["results"].items():
        for name, r in rows.items():
            if "error" in r:
                print(f"{ctx:>8}{name:>16}  not measured: {r['error']}")
            else:
                print(f"{ctx:>8}{name:>16}{r['ms_per_step']:>10.1f}{r.get('speedup_vs_exact', float('nan')):>9.2f}x")
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
