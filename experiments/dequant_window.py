"""The executor's dequantise alone (executor/quant/store.py) at a run's real slot shape, on CUDA: the
compiled call over the whole byte slot (prefill, decode without --sparse), over the sparse window
of selected records (QuantHomes.decode_selected), and the eager passes, for int4 (group 32, V
groups of 64 channels) and int8 (group 64); with the pre-fix compiled call (the whole exact slot
an input of the compiled region: every call rewrote all of it) as a reference row, and K and V
written as two copies into their halves (the alternative to the one stacked copy).

  python -m experiments.dequant_window                    # Llama-3-8B at 128K, 4 decode tokens, F = 0.2
  python -m experiments.dequant_window --context 512K --out /tmp/dw.json

Shapes as `kvpipe run --model llama-3-8b --context 128K --decode-tokens 4 --group 8 --resident none`
has them: one byte slot of 8 KV heads x (capacity // group) records, the exact slot [1, 8, capacity,
2, 128] bf16; the window is min(blocks, LossySpec.max_fetched_blocks(capacity)) records. Per row:
`event_s`, the median of `--reps` calls each between two CUDA events (what a stage's span sees,
host issue included when it starves the GPU); `graph_s`, the median of as many replays of a CUDA
graph of the call (device time alone); `host_s`, the median host time to issue a call; the bytes
the call must move (records read + exact rows written) over graph_s, against the profile's HBM
rate (hbm_eff_bytes_per_s) and the simulator's rate for it (x elementwise_efficiency); the peak
memory a call allocates beyond its inputs; and whether its rows equal the eager decode bit for bit.
Needs CUDA: without it, one line and exit status 2. JSON (command, date, GPU, torch, rows) to --out
(default benchmarks/results/dequant-window-<date>.json)."""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

KV_HEADS, D = 8, 128
CODECS = (("int4", 4, 32, 64), ("int8", 8, 64, None))   # name, bits, group, V-group channels


def whole_slot_decode(codec, qslot: torch.Tensor, slot: torch.Tensor, j0: int, j1: int) -> None:
    """The pre-fix compiled region (executor/quant/store.py before the fix): slot_decode with the
    slicing and the two half copies (`halves_decode`) inside it, so the whole exact slot is an
    input it writes."""
    B, J, nb = qslot.shape[0], j1 - j0, qslot.shape[2] // codec.record
    rec = qslot[:, j0:j1].view(B, J, nb, codec.record)
    out = slot[:, j0:j1, :nb * codec.group].view(B, J, nb, codec.group, 2, codec.D)
    halves_decode(codec, rec, out)


def halves_decode(codec, rec: torch.Tensor, out: torch.Tensor) -> None:
    """records_decode with K and V written as two copies into out's halves (compiled: a
    select_scatter over the window, which reads its old rows) instead of one stacked copy."""
    from kvpipe.executor.quant.quantize import dequant_math
    kc, ks, kz, vc, vs, vz = codec.fields(rec)
    k = dequant_math(kc, ks, kz, codec.bits, torch.float32, out.dtype)
    out[..., 0, :].copy_(k.flatten(-2).transpose(-1, -2))
    v = dequant_math(vc, vs, vz, codec.bits, torch.float32, out.dtype)
    out[..., 1, :].copy_(v.flatten(-2))


def eager_decode(codec, qslot: torch.Tensor, slot: torch.Tensor, heads: int) -> None:
    """QuantHomes._decode's eager passes (BlockCodec.decode in passes of DECODE_VALUES)."""
    from kvpipe.executor.quant.dequant import DECODE_VALUES
    nb, g = qslot.shape[2] // codec.record, codec.group
    rec = qslot.view(1, heads, nb, codec.record)
    out = slot[:, :, :nb * g].view(1, heads, nb, g, 2, codec.D)
    step = max(1, DECODE_VALUES // (heads * g * 2 * codec.D))
    for c in range(0, nb, step):
        codec.decode(rec[:, :, c:c + step], out[:, :, c:c + step])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_s(fn, reps: int, device: torch.device) -> float:
    """Median host seconds to issue one call (the GPU drained after each)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        _sync(device)
    return statistics.median(times)


def _extra_peak(fn, device: torch.device) -> int | None:
    """Bytes a call allocates beyond what was allocated before it (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(name: str, fn, slot: torch.Tensor, ref: torch.Tensor, tokens: int, moved: int, reps: int,
            rates: dict) -> dict:
    """One row: `fn` decodes the first `tokens` slot tokens of every head; `ref` is eager's.
    (On a CPU, for a smoke test of this code only: host clock, no graph, no peak.)"""
    from benchmarks.timing import median_seconds
    dev = slot.device
    row = {"path": name, "tokens": tokens, "moved_bytes": moved}
    try:
        t0 = time.perf_counter()
        fn()                                          # the compile, for the compiled paths
        _sync(dev)
        row["first_call_s"] = time.perf_counter() - t0
        for _ in range(2):
            fn()
        slot[:, :, :tokens].fill_(float("nan"))
        fn()
        _sync(dev)
        row["bit_equal_eager"] = bool(torch.equal(slot[:, :, :tokens].view(torch.int16), ref.view(torch.int16)))
        row["extra_peak_bytes"] = _extra_peak(fn, dev)
        for _ in range(2):
            fn()
        row["event_s"] = median_seconds(fn, reps, dev)
        row["host_s"] = _host_s(fn, min(reps, 50), dev)
    except Exception as e:   # reported, not hidden; the other rows still run
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row
    if dev.type == "cuda":
        from kvpipe.executor.calibrate.timing import graph_median_s
        try:
            row["graph_s"] = graph_median_s(fn, reps)
        except Exception as e:   # e.g. a capture the compiled call does not allow: event_s stands
            row["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    sec = row.get("graph_s", row["event_s"])
    row["moved_bytes_per_s"] = moved / sec
    row["of_hbm"] = row["moved_bytes_per_s"] / rates["hbm_bytes_per_s"]
    row["of_modelled"] = row["moved_bytes_per_s"] / rates["modelled_bytes_per_s"]
    return row


def codec_rows(bits: int, group: int, vgroup: int | None, capacity: int, fraction: float, reps: int,
               rates: dict, dev: torch.device) -> tuple[dict, list[dict]]:
    """The rows of one codec (module docstring), and its shapes."""
    from kvpipe.executor.quant.blocks import BlockCodec, fused_decode, slot_decode
    from kvpipe.pipeline.lossy import LossySpec
    quant = {4: "int4", 8: "int8"}[bits]
    spec = LossySpec(quant, group=group, vgroup=vgroup, sparse=fraction)
    codec = BlockCodec(bits, group, D, torch.bfloat16, spec.vgroup)
    blocks = capacity // group
    window = min(blocks, spec.max_fetched_blocks(capacity))
    gen = torch.Generator(device=dev).manual_seed(bits)
    qslot = torch.empty(1, KV_HEADS, blocks * codec.record, dtype=torch.uint8, device=dev)
    for h in range(KV_HEADS):   # per head: the encode's float32 temporaries stay small
        kv = torch.randn(blocks, group, 2, D, generator=gen, device=dev).to(torch.bfloat16)
        qslot[0, h] = codec.encode(kv).view(-1)
    del kv
    slot = torch.zeros(1, KV_HEADS, capacity, 2, D, dtype=torch.bfloat16, device=dev)
    win = qslot[:, :, :window * codec.record]
    refs = {}
    for nb, q in ((blocks, qslot), (window, win)):
        eager_decode(codec, q, slot, KV_HEADS)
        refs[nb] = slot[:, :, :nb * group].clone()
    exact_token = 2 * D * 2
    moved = lambda nb: KV_HEADS * nb * (codec.record + group * exact_token)   # noqa: E731
    old = torch.compile(whole_slot_decode, dynamic=False)
    halves = torch.compile(halves_decode, dynamic=False)
    cases = [("compiled full", lambda: fused_decode()(codec, qslot, slot, 0, KV_HEADS), blocks),
             ("compiled window", lambda: fused_decode()(codec, win, slot, 0, KV_HEADS), window),
             ("eager full", lambda: eager_decode(codec, qslot, slot, KV_HEADS), blocks),
             ("eager window", lambda: eager_decode(codec, win, slot, KV_HEADS), window),
             ("pre-fix compiled full", lambda: old(codec, qslot, slot, 0, KV_HEADS), blocks),
             ("pre-fix compiled window", lambda: old(codec, win, slot, 0, KV_HEADS), window),
             ("compiled window, K/V as two copies",
              lambda: slot_decode(codec, win, slot, 0, KV_HEADS, decode=halves), window)]
    rows = []
    for name, fn, nb in cases:
        row = measure(name, fn, slot, refs[nb], nb * group, moved(nb), reps, rates)
        rows.append({"codec": quant, "bits": bits, "group": group, "vgroup": spec.vgroup, "blocks": nb, **row})
    head = {"codec": quant, "record_bytes": codec.record, "blocks": blocks, "window_blocks": window,
            "slot_bytes": slot.numel() * slot.element_size(), "byte_slot_bytes": qslot.numel()}
    del qslot, slot, win, refs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return head, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="128K")
    ap.add_argument("--decode-tokens", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.2, help="--sparse F (the window's size)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hw", default="h200-testbox", help="profile whose HBM rate the rows are held against")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dequant_window: needs a CUDA device (none here); nothing measured", file=sys.stderr)
        return 2
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.units import parse_tokens
    hw = load_profile(args.hw)
    rates = {"hbm_bytes_per_s": hw.hbm_eff_bytes_per_s,
             "modelled_bytes_per_s": hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency}
    capacity = parse_tokens(args.context) + args.decode_tokens
    res = {"command": "python -m experiments.dequant_window " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "capacity": capacity,
           "fraction": args.fraction, "profile": {"name": hw.name, **rates},
           "what": "one layer's dequantise, 8 KV heads x D 128, byte slot -> exact bf16 slot [1, 8, capacity, 2, 128]",
           "codecs": [], "rows": []}
    for _, bits, group, vgroup in CODECS:
        head, rows = codec_rows(bits, group, vgroup, capacity, args.fraction, args.reps, rates,
                                torch.device("cuda"))
        res["codecs"].append(head)
        res["rows"] += rows
    out = Path(args.out or f"benchmarks/results/dequant-window-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"dequantise, one layer, {res['device']}, capacity {capacity} tokens; profile {hw.name}: HBM "
          f"{rates['hbm_bytes_per_s'] / 1e9:.0f} GB/s, modelled {rates['modelled_bytes_per_s'] / 1e9:.0f} GB/s")
    for h in res["codecs"]:
        print(f"  {h['codec']}: {h['blocks']} blocks of {h['record_bytes']} B, window {h['window_blocks']}, "
              f"exact slot {h['slot_bytes'] / 1e6:.0f} MB")
    print(f"{'codec':>6} {'path':<36}{'blocks':>7}{'event ms':>10}{'graph ms':>10}{'host ms':>9}"
          f"{'moved MB':>10}{'GB/s':>8}{'of HBM':>8}{'peak+ MB':>10}{'bits':>6}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['codec']:>6} {r['path']:<36}{r['blocks']:>7}  not measured: {r['error']}")
            continue
        graph = f"{1e3 * r['graph_s']:10.3f}" if "graph_s" in r else f"{'-':>10}"
        print(f"{r['codec']:>6} {r['path']:<36}{r['blocks']:>7}{1e3 * r['event_s']:10.3f}{graph}"
              f"{1e3 * r['host_s']:9.3f}{r['moved_bytes'] / 1e6:10.1f}{r['moved_bytes_per_s'] / 1e9:8.0f}"
              f"{r['of_hbm']:8.2f}{(r['extra_peak_bytes'] or 0) / 1e6:10.1f}{'ok' if r['bit_equal_eager'] else 'DIFF':>6}")
    print(f"json: {out}")
    return 0 if all("error" not in r for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
