"""The `score` stage of sparse decode (LOSSY, `--sparse F`) in isolation, per layer, and the
profile fit the simulator costs it by ([gpu] sparse_score_call_s / sparse_score_bytes_per_s): the
executor's Triton ranking (executor/sparse/rank_triton.py) and sort-free select, against the torch
path (executor/sparse/sketch.py: scores, group_share, select), on one layer's offloaded units
(default 8 units, GQA 4 query heads, D 128, 2-bit sketch, 20% of tokens), CUDA events, median of
--reps calls after a warm-up; the whole stage also replayed from a CUDA graph (device time), as
replayed steps run it (units a piece at a time, over tokens and over int4 blocks), and per score
kernel tiling. Columns: rank = the Triton ranking, select = the Triton selection (radix select;
JSON also has triton_select_topk_s, its threshold by torch.topk instead), t.sel = the torch
selection; beside them the simulator's score stage for the same shapes (LossySpec.score_cost,
pipeline/cost.stage_seconds on the --hw profile).

  python -m benchmarks.sparse_score                      # H200: 32K, 128K, 512K
  python -m benchmarks.sparse_score --contexts 4K --device cpu --reps 2   # CPU smoke (torch path only)

Agreement: per unit, the fraction of the Triton selection's tokens that the torch path also
selected (1.0: the same set; the ranking's float32 sums differ in order, so near-ties may flip).
JSON (command, date, device, rows, profile_fit) to benchmarks/results/<machine>-<date>-sparse-score.json
or --out; the table is printed last. Keys are random (heavy-tailed channels): timings do not
depend on their values."""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.result_file import result_file
from benchmarks.timing import median_seconds
from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.executor.sparse import rank_triton as sparse_triton
from kvpipe.pipeline.units import parse_tokens

LAYERS = 32          # Llama-3-8B: the implied decode-step cost is 32 score stages
TILINGS = (("token", 32, 4), ("token", 64, 4), ("token", 64, 8), ("token", 128, 8),   # (score kernel, tokens per
           ("chunk", 64, 2), ("chunk", 64, 4), ("chunk", 64, 8), ("chunk", 32, 2), ("chunk", 32, 4),   # program, warps)
           ("dot", 64, 2), ("dot", 64, 4), ("dot", 64, 8), ("dot", 32, 4))


def timed(fn, reps: int, dev: torch.device) -> float:
    """Median seconds of fn() over `reps` calls (CUDA events on CUDA, host clock on CPU), after 2 warm-ups."""
    for _ in range(2):
        fn()
    return median_seconds(fn, reps, dev)


def graph_timed(fn, reps: int, dev: torch.device) -> float | None:
    """Median device seconds of fn() replayed from a CUDA graph: the kernels' GPU time with no host
    issue in it (an event-timed call of the score's ~12 launches is host-bound at small contexts),
    which is the score stage's GPU duration in the simulator (its host issue is charged apart, per
    issued call). None off CUDA or where the capture fails."""
    if dev.type != "cuda":
        return None
    from kvpipe.executor.calibrate.timing import graph_median_s
    try:
        return graph_median_s(fn, reps)
    except RuntimeError:
        return None


def predicted_s(prefix: int, units: int, q_heads: int, head_dim: int, fraction: float, bits: int, hw_name: str) -> float:
    """The simulator's seconds for one layer's score stage on profile `hw_name`: the builder's
    cost inputs (LossySpec.score_cost over `units`) in a Stage, timed by pipeline/cost.stage_seconds."""
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.cost import stage_seconds
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.stage import Kind, Phase, Stage
    cost = LossySpec(sparse=fraction, sketch=bits).score_cost(prefix, q_heads, head_dim, 2, units)
    s = Stage(0, Kind.COMPUTE, "score", Phase.DECODE, 0, 0, None, (0, prefix), heads=tuple(range(units)), **cost)
    return stage_seconds(s, load_profile(hw_name), "bf16")


def bench(prefix: int, args, dev: torch.device) -> dict:
    U, G, D, bits, chunk = args.units, args.q_heads, args.head_dim, args.bits, 64
    sealed = prefix // chunk * chunk
    g = torch.Generator(device=dev).manual_seed(0)
    k = (torch.randn(U, sealed, D, generator=g, device=dev)
         * (1 + 10 * torch.rand(D, generator=g, device=dev))).bfloat16()         # outlier channels
    blocks = k.view(U, sealed // chunk, chunk, D)
    lo, hi = blocks.amin(2), blocks.amax(2)
    codes = sparse_sketch.encode(k, lo, hi, bits)
    del k, blocks
    q = torch.randn(U, G, D, generator=g, device=dev).bfloat16()
    budget = math.ceil(args.fraction * prefix)
    sink, recent = 64, 256
    row = {"context": prefix, "units": U, "q_heads": G, "head_dim": D, "bits": bits, "fraction": args.fraction,
           "codes_bytes": codes.numel()}

    def torch_rank():
        return sparse_sketch.group_share(sparse_sketch.scores(q, lo, hi, codes, bits))
    share_torch = torch_rank()
    row["torch_rank_s"] = timed(torch_rank, args.reps, dev)
    row["torch_select_s"] = timed(lambda: sparse_sketch.select(share_torch, prefix, budget, sink, recent), args.reps, dev)
    row["torch_total_s"] = timed(lambda: sparse_sketch.select(torch_rank(), prefix, budget, sink, recent), args.reps, dev)
    ref = sparse_sketch.select(share_torch, prefix, budget, sink, recent)
    why = sparse_triton.unavailable(dev, D, bits)
    row["triton"] = why or "ok"
    if why is None:
        share_new = sparse_triton.rank(q, lo, hi, codes, bits)
        row["rank_max_abs_diff"] = float((share_new - share_torch).abs().max())
        row["new_rank_s"] = timed(lambda: sparse_triton.rank(q, lo, hi, codes, bits), args.reps, dev)
        row["rank_tilings_s"] = {f"{kern} {blk}x{w}": timed(lambda: sparse_triton.rank(q, lo, hi, codes, bits, block=blk,
                                                                                      warps=w, kernel=kern),
                                                            args.reps, dev) for kern, blk, w in TILINGS}
        row["rank_kernels_max_abs_diff"] = float((sparse_triton.rank(q, lo, hi, codes, bits, kernel="token")
                                                  - sparse_triton.rank(q, lo, hi, codes, bits, kernel="chunk")).abs().max())
        row["rank_dot_max_abs_diff"] = float((sparse_triton.rank(q, lo, hi, codes, bits, kernel="dot")
                                              - sparse_triton.rank(q, lo, hi, codes, bits, kernel="chunk")).abs().max())
        # as a pipelined replayed step runs the stage (executor/replay/device_step.py _score): the units a
        # piece at a time, each ranked and selected (select_static, counts in a device row), over
        # tokens (--sparse) and over int4's 32-token blocks (--sparse with --lossy int4)
        from kvpipe.pipeline.lossy import LossySpec
        for name, spec in (("unit_total_graph_s", LossySpec(sparse=args.fraction, sketch=bits)),
                           ("unit_blocks_graph_s", LossySpec("int4", sparse=args.fraction, sketch=bits))):
            row[name] = graph_timed(per_unit(q, lo, hi, codes, bits, spec, prefix), args.reps, dev)
        row["triton_select_s"] = timed(lambda: sparse_triton.select(share_new, prefix, budget, sink, recent),
                                       args.reps, dev)
        row["triton_select_topk_s"] = timed(lambda: sparse_triton.select(share_new, prefix, budget, sink, recent,
                                                                         radix=False), args.reps, dev)
        row["new_total_s"] = timed(lambda: sparse_triton.select(sparse_triton.rank(q, lo, hi, codes, bits), prefix,
                                                                budget, sink, recent), args.reps, dev)
        row["new_total_graph_s"] = graph_timed(lambda: sparse_triton.select(sparse_triton.rank(q, lo, hi, codes, bits),
                                                                            prefix, budget, sink, recent), args.reps, dev)
        new = sparse_triton.select(share_new, prefix, budget, sink, recent)
        row["triton_select_equal"] = bool(torch.equal(new, sparse_sketch.select(share_new, prefix, budget, sink, recent)))
        same = [len(set(a.tolist()) & set(b.tolist())) / a.numel() for a, b in zip(new, ref)]
        row["agreement_min"], row["agreement_mean"] = min(same), statistics.mean(same)
        row["indices_equal"] = bool(torch.equal(new, ref))
    row["step_ms"] = LAYERS * row.get("new_total_s", row["torch_total_s"]) * 1e3
    row["predicted_score_s"] = predicted_s(prefix, U, G, D, args.fraction, bits, args.hw)
    return row


def per_unit(q, lo, hi, codes, bits: int, spec, prefix: int):
    """A callable running the replayed score stage's work for `prefix` tokens under `spec`: per
    piece of PIPE_UNITS units, the ranking (whole blocks with quantisation, the fused block rank)
    and select_static with the step's counts in a device row (sparse_triton.rank_select_static,
    as SparseHomes.select_static calls it for a pipelined stage)."""
    from kvpipe.executor.replay import sparse_step as lossy_replay
    from kvpipe.executor.sparse.homes import BLOCK_RANK
    from kvpipe.pipeline.lossy import PIPE_UNITS
    row = lossy_replay.step_args(spec, prefix)
    a = torch.tensor(row, dtype=torch.long, device=q.device)
    g = spec.group if spec.blocks else 1
    shapes = (row[lossy_replay.TOTAL], row[lossy_replay.H0], row[lossy_replay.H1], row[lossy_replay.N])
    return lambda: sparse_triton.rank_select_static(q, lo, hi, codes, bits, a, *shapes, blocks=g, how=BLOCK_RANK,
                                                    piece=PIPE_UNITS)


def profile_fit(rows: list[dict]) -> dict | None:
    """The profile's [gpu] sparse_score_call_s / sparse_score_bytes_per_s: the new path's whole
    score stage (ranking + selection) against its packed code bytes, `call_s + bytes / rate` in
    relative least squares over the contexts measured (None: fewer than two, or no new path). Its
    device time replayed from a CUDA graph where every row has one (`timing` "graph"), else the
    event-timed calls (`timing` "events": host-bound where the kernels are short)."""
    from kvpipe.pipeline.calibration import fit_alpha_beta_relative
    rows = [r for r in rows if "new_total_s" in r]
    if rows and all(r.get("unit_total_graph_s") for r in rows):   # as replayed steps run it: per unit
        # t = pieces x call_s + bytes / rate (pipeline/cost.stage_seconds of a unit-pipelined score)
        from kvpipe.pipeline.lossy import PIPE_UNITS
        k = lambda r: -(-r["units"] // PIPE_UNITS)
        pts = [(r["codes_bytes"] / k(r), r["unit_total_graph_s"] / k(r)) for r in rows]
        timing = f"graph, {PIPE_UNITS} units at a time"
    else:
        key = "new_total_graph_s" if rows and all(r.get("new_total_graph_s") for r in rows) else "new_total_s"
        pts = [(r["codes_bytes"], r[key]) for r in rows]
        timing = "graph" if key == "new_total_graph_s" else "events"
    if len({b for b, _ in pts}) < 2:
        return None
    call, rate = fit_alpha_beta_relative([b for b, _ in pts], [t for _, t in pts])
    return {"sparse_score_call_s": call, "sparse_score_bytes_per_s": rate,
            "max_rel_err": max(abs(call + b / rate - t) / t for b, t in pts), "timing": timing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", default=["32K", "128K", "512K"])
    ap.add_argument("--units", type=int, default=8, help="offloaded (layer, KV head) units of one layer")
    ap.add_argument("--q-heads", type=int, default=4, help="query heads per KV head (GQA)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", type=int, default=2, choices=(2, 4, 8))
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--hw", default="h200-testbox", help="profile of the simulator's prediction")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    with torch.inference_mode():
        for c in args.contexts:
            P = parse_tokens(c)
            try:
                rows.append(bench(P, args, dev))
            except torch.OutOfMemoryError as e:
                rows.append({"context": P, "error": f"out of memory: {str(e).splitlines()[0][:200]}"})
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            print(f"sparse_score: {c}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    out = {"command": " ".join([sys.executable, "-m", "benchmarks.sparse_score", *(argv or sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "rows": rows,
           "profile_fit": profile_fit(rows)}
    path = Path(args.out) if args.out else result_file("sparse-score", dev.type)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    ms = lambda r, k: f"{1e3 * r[k]:.3f}" if k in r else "-"   # noqa: E731
    print(f"{'context':>8} {'torch ms/layer':>14} {'ms/layer':>9} {'rank':>7} {'select':>7} {'t.sel':>7} "
          f"{'pred ms':>8} {'ms/step':>8} {'agree':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8} FAILED: {r['error']}")
            continue
        new = "new_total_s" if "new_total_s" in r else "torch_total_s"
        print(f"{r['context']:>8} {ms(r, 'torch_total_s'):>14} {ms(r, new):>9} {ms(r, 'new_rank_s'):>7} "
              f"{ms(r, 'triton_select_s'):>7} {ms(r, 'torch_select_s'):>7} {ms(r, 'predicted_score_s'):>8} "
              f"{r['step_ms']:8.1f} {r.get('agreement_min', float('nan')):6.4f}")
    for r in rows:
        if r.get("unit_total_graph_s"):
            print(f"{r['context']:>8} unit-pipelined (as replayed steps), from a CUDA graph: tokens "
                  f"{1e3 * r['unit_total_graph_s']:.3f} ms, int4 blocks {1e3 * (r.get('unit_blocks_graph_s') or 0):.3f} ms")
        if r.get("new_total_graph_s"):
            print(f"{r['context']:>8} score stage replayed from a CUDA graph: {1e3 * r['new_total_graph_s']:.3f} ms "
                  f"(event-timed calls {1e3 * r['new_total_s']:.3f} ms)")
        if r.get("rank_tilings_s"):
            print(f"{r['context']:>8} rank ms by score kernel and tiling: "
                  + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in r["rank_tilings_s"].items()))
    if out["profile_fit"]:
        f = out["profile_fit"]
        print(f"profile [gpu]: sparse_score_call_s = {f['sparse_score_call_s']:.4g}, sparse_score_bytes_per_s = "
              f"{f['sparse_score_bytes_per_s']:.4g} (max relative error over the contexts {f['max_rel_err']:.1%}; "
              f"{'device time, CUDA-graph replays' if f['timing'] == 'graph' else 'event-timed calls'})")
    if any(r.get("triton", "ok") != "ok" for r in rows):
        print(f"triton not run: {next(r['triton'] for r in rows if r.get('triton', 'ok') != 'ok')} "
              "(ms/layer: the torch path)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
