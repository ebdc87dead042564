"""`kvpipe calibrate`'s codec measurements, on the run's own kind of K/V (a prefill through
random-weight Llama-3-8B-shaped layers: random-weight K/V, whose statistics differ from a trained
model's), each as the executor runs the codec:

- the GPU codec of the h2d link (`nvcomp-ans-planes`, executor/codecs/h2d_store.py): nvCOMP ANS encode and
  decode of the high byte planes of batches of 16..512 blocks of H2D_BLOCK_TOKENS tokens (a fetch
  at 128K, group 8, decodes 256 in one call), fitted as `call_s + raw bytes / rate` in relative
  error; the byte-plane split before the encode and the set-aside + interleave after the decode
  (torch kernels, apart from nvCOMP) the same way; and whether a decode call starts only after a
  host -> device copy issued before it on another stream has ended (`decompress_waits_h2d`);
- the CPU codec of the disk link (`zstd-planes` at the level executor/codecs uses, in the disk
  tier's 1 MiB blocks, executor/disk/frames.py), one thread and the disk lane's thread count.

The timer and the block coder are passed in, so the bookkeeping runs on CPU in tests (a
perf_counter timer, a zlib coder); on the GPU the timer queues each call behind a sleep kernel
(CUDA events: device time, the host's issue hidden, as the lanes overlap it)."""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpipe.pipeline.calibration import Calibration, fit_alpha_beta_relative

from kvpipe.executor.codecs.nvcomp_ans_planes import interleave, split_planes

BATCHES = (16, 32, 64, 128, 256, 512)   # blocks per codec call
RANDOM_KV = "random-weight K/V: a trained model's K/V has other statistics"
LLAMA_LAYER = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                   attn_implementation="sdpa")


def prefill_kv(model, tokens: int, seed: int = 0) -> torch.Tensor:
    """K/V of a prefill of `tokens` seeded random ids through `model`, one row per (layer,
    sequence, KV head) unit as the executor stores it: [units, tokens, 2, D]."""
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = model.model(ids.to(dev), use_cache=True).past_key_values
    return torch.cat([torch.stack([layer.keys, layer.values], 3).flatten(0, 1) for layer in cache.layers])


def llama_kv(tokens: int, device, layers: int = 2) -> torch.Tensor:
    """`prefill_kv` of `layers` random-weight Llama-3-8B-shaped bf16 layers (the model is freed)."""
    from kvpipe.executor.layers.loader import random_model
    model = random_model({**LLAMA_LAYER, "num_hidden_layers": layers, "max_position_embeddings": 2 * tokens},
                         device, torch.bfloat16, 0)
    kv = prefill_kv(model, tokens)
    del model
    return kv


def kv_blocks(kv: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """The units' whole blocks of `block_tokens` tokens: [blocks, block_tokens, 2, D] (contiguous)."""
    n = kv.shape[1] // block_tokens
    if n == 0:
        raise ValueError(f"kv: {kv.shape[1]} tokens hold no block of {block_tokens}")
    return kv[:, :n * block_tokens].reshape(-1, block_tokens, *kv.shape[2:]).contiguous()


def fit(points: list[dict], key: str) -> tuple[float, float]:
    """(call_s, raw bytes per second) of `t = call_s + raw_bytes / rate` over the points' `key`
    seconds, least squares in relative error (pipeline.calibration.fit_alpha_beta_relative)."""
    return fit_alpha_beta_relative([p["raw_bytes"] for p in points], [p[key] for p in points])


def perf_timer(fn, reps: int = 3, warmups: int = 1) -> float:
    """Median host seconds of `fn` after `warmups` calls (CPU runs and tests)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def queued_timer(stream: torch.cuda.Stream, reps: int = 5, sleep_cycles: int = 100_000_000):
    """A timer of device seconds on `stream`: each call is queued behind a sleep kernel (longer
    than the host takes to issue it), between two CUDA events; median of `reps` after a warm-up."""
    def timer(fn) -> float:
        with torch.cuda.stream(stream):
            fn()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(sleep_cycles)
                a.record(stream)
                fn()
                b.record(stream)
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)
    return timer


def gpu_codec_points(blocks: torch.Tensor, coder, timer, batches=BATCHES,
                     keep: int = 256) -> tuple[list[dict], float, tuple]:
    """Per batch size n (blocks taken cyclically from `blocks` [N, bt, 2, D]), the seconds of
    the executor's codec pieces on it: `split` (byte planes), `encode` (high planes, sizes read
    back), `decode` (at the offsets an encode leaves), `interleave` (low plane set aside, both
    planes interleaved into the bf16 slot); every round trip checked bit for bit. Returns the
    points, the ratio raw / (coded high planes + raw low planes) of the N distinct blocks, and
    (blocks, its decode call, its interleave call) of the batch of `keep` blocks (or the largest
    below it)."""
    N, blk = blocks.shape[0], blocks[0].numel()        # blk: bytes of one block's plane
    dev = blocks.device
    points, kept = [], ()
    for n in batches:
        src = blocks[torch.arange(n, device=dev) % N].contiguous()            # [n, bt, 2, D]
        high, low = split_planes(src)
        high = high.view(n, blk)
        enc, sizes = coder.encode(high)
        offsets = [i * enc.shape[1] for i in range(n)]
        back = torch.empty_like(high)
        outs = [i * blk for i in range(n)]
        aside = torch.empty_like(low)
        slot = torch.empty_like(src)
        low_src = low.view(n, -1)                 # the low planes as fetched: the back half of the rows

        # this batch's buffers bound now: the kept pair is called after the loop has moved on
        # (late-bound names would decode a later batch's offsets against this one's sizes)
        def decode(enc=enc, offsets=offsets, sizes=sizes, back=back, outs=outs) -> None:
            coder.decode(enc.view(-1), offsets, sizes, back.view(-1), outs)

        def planes_back(n=n, low_src=low_src, aside=aside, back=back, src=src, slot=slot) -> None:
            aside.view(n, -1).copy_(low_src)
            interleave(back.view(src.shape), aside, slot)
        pt = {"blocks": n, "raw_bytes": src.numel() * src.element_size(),
              "split_s": timer(lambda: split_planes(src)), "encode_s": timer(lambda: coder.encode(high)),
              "decode_s": timer(decode), "interleave_s": timer(planes_back),
              "decode_host_s": perf_timer(decode)}           # host seconds to issue one decode call (JSON only)
        if not torch.equal(slot.view(torch.int16), src.view(torch.int16)):
            raise RuntimeError(f"calibrate: codec round trip of {n} blocks was not bit-exact")
        points.append(pt)
        if n <= keep:
            kept = (n, decode, planes_back)
    _, sizes = coder.encode(split_planes(blocks)[0].view(N, blk))
    stored = sum(min(s, blk) for s in sizes) + N * blk                         # coded high + raw low
    return points, 2 * N * blk / stored, kept


def set_gpu_codec(cal: Calibration, name: str, points: list[dict], ratio: float, block_tokens: int,
                  kv_what: str) -> None:
    """The [codec.<name>] fields from `gpu_codec_points`' points, each with its source."""
    sizes = [p["blocks"] for p in points]
    how = (f"batches of {sizes[0]}-{sizes[-1]} blocks of {block_tokens} tokens (the executor's block; a fetch "
           f"decodes its group's blocks in one call) of {kv_what} ({RANDOM_KV})")
    fits = {k: fit(points, k + "_s") for k in ("encode", "decode")}
    for k in ("split", "interleave"):    # secondary: a broken fit leaves the field out (HBM rate stands in)
        try:
            fits[k] = fit(points, k + "_s")
        except ValueError as e:
            cal.extra[f"codec.{name}.{k}_fit"] = f"not measured: {e}"
    lsq = "relative least-squares fit t = call_s + raw bytes / rate"
    cal.set(f"codec.{name}.compress_call_s", fits["encode"][0], f"nvCOMP ANS encode of the high planes, {how}; intercept of the {lsq}")
    cal.set(f"codec.{name}.compress_bytes_per_s", fits["encode"][1], f"slope of the same fit (encode, per raw K/V byte; {how})")
    cal.set(f"codec.{name}.decompress_call_s", fits["decode"][0], f"nvCOMP ANS decode of the high planes, {how}; intercept of the {lsq}")
    cal.set(f"codec.{name}.decompress_bytes_per_s", fits["decode"][1], f"slope of the same fit (decode, per raw K/V byte; {how})")
    if "split" in fits:
        cal.set(f"codec.{name}.split_bytes_per_s", fits["split"][1],
                f"the byte-plane split before the encode (torch), {how}; slope of the {lsq}")
    if "interleave" in fits:
        cal.set(f"codec.{name}.interleave_bytes_per_s", fits["interleave"][1],
                f"the low-plane set-aside and the interleave after the decode (torch), {how}; slope of the {lsq}")
    cal.set(f"codec.{name}.ratio", ratio, f"raw / (ANS high planes + raw low planes) of {kv_what} in blocks of {block_tokens} tokens ({RANDOM_KV})")
    cal.extra[f"codec.{name}.points"] = points
    cal.extra[f"codec.{name}.fits"] = {k: {"call_s": c, "bytes_per_s": r} for k, (c, r) in fits.items()}


def decode_waits_for_h2d(decode, control, stream: torch.cuda.Stream, idle_host_s: float,
                         copy_bytes: int = 512 << 20, reps: int = 3) -> dict:
    """Whether `decode` (queued on `stream`) starts only after a host -> device copy issued just
    before it on ANOTHER stream has ended, as the executor issues a group's decode while the next
    groups' fetches are in flight (the device holding its kernels, or the call blocking the host
    until the copy ends: either way the decode runs after the copy). The copy (~10 ms) far
    outlasts the decode alone; `control` (plain torch kernels) in the same place shows what
    overlap looks like. Returns the verdict with the times, ms from the copy's start: the decode
    waits when it ends after the copy does in every repeat, overlaps when before in every repeat,
    while the control ends before the copy in every repeat; else, or when the host needs half the
    copy's time to issue a decode at all (`idle_host_s`, no copy in flight), undecided (None)."""
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(copy_bytes, dtype=torch.uint8, device=stream.device)
    copier = torch.cuda.Stream(stream.device)
    rows = []
    for _ in range(reps):
        row = {}
        for label, fn in (("decode", decode), ("control", control)):
            torch.cuda.synchronize()
            c0, c1, d1 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            with torch.cuda.stream(copier):
                c0.record(copier)
                dst.copy_(host, non_blocking=True)
                c1.record(copier)
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                fn()
                row[f"{label}_host_ms"] = (time.perf_counter() - t0) * 1e3
                d1.record(stream)
            torch.cuda.synchronize()
            row[f"{label}_copy_end_ms"] = c0.elapsed_time(c1)
            row[f"{label}_end_ms"] = c0.elapsed_time(d1)
        rows.append(row)
    after = lambda label: [r[f"{label}_end_ms"] > r[f"{label}_copy_end_ms"] for r in rows]
    waits, control_overlaps, overlaps = all(after("decode")), not any(after("control")), not any(after("decode"))
    # a decode the host takes long to issue (no copy in flight) would end late without waiting
    quick_issue = all(idle_host_s * 1e3 < 0.5 * r["decode_copy_end_ms"] for r in rows)
    verdict = waits if control_overlaps and quick_issue and (waits or overlaps) else None
    return {"waits": verdict, "copy_bytes": copy_bytes, "idle_host_ms": idle_host_s * 1e3, "rows": rows}


def cpu_codec(cal: Calibration, kv: torch.Tensor, threads: int, block_bytes: int, kv_what: str,
              sample_bytes: int = 64 << 20, name: str = "zstd-planes") -> None:
    """The disk link's CPU codec as executor/disk/frames.py runs it: each `block_bytes` block of
    the K/V bytes (`kv`, the first `sample_bytes`) framed by executor/codecs' `name` codec
    (stored raw where the frame is not smaller), on 1 thread and on `threads` (the disk lane's
    pool); every block decoded back and compared. Writes [codec.<name>] (rates at `threads`,
    ratio) and host.cpu_codec_bytes_per_s (the slower direction at `threads`)."""
    from kvpipe.executor.codecs import load
    codec = load(name)
    elem = kv.element_size()
    raw = kv.detach().cpu().contiguous().view(torch.uint8).view(-1)[:sample_bytes]
    n = raw.numel() // block_bytes
    if n == 0:
        raise ValueError(f"kv: {raw.numel()} bytes hold no block of {block_bytes}")
    buf = raw[:n * block_bytes].numpy()
    blocks = [memoryview(buf[i * block_bytes:(i + 1) * block_bytes]) for i in range(n)]
    out = bytearray(n * block_bytes)
    outs = [memoryview(out)[i * block_bytes:(i + 1) * block_bytes] for i in range(n)]
    rates = {}
    frames: list[bytes] = []
    for t in sorted({1, threads}):
        with ThreadPoolExecutor(t) as pool:
            t0 = time.perf_counter()
            frames = list(pool.map(lambda b: codec.encode(b, elem), blocks))
            enc = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(lambda i: codec.decode(memoryview(frames[i]), outs[i]), range(n)))
            dec = time.perf_counter() - t0
        if bytes(out) != buf.tobytes():
            raise RuntimeError(f"calibrate: {name} round trip of the K/V was not bit-exact")
        rates[t] = (n * block_bytes / enc, n * block_bytes / dec)
    stored = sum(min(len(f), block_bytes) for f in frames)
    level = getattr(codec, "level", "?")
    how = (f"{name} (zstd level {level} on the high byte plane, executor/codecs) of {n} blocks of "
           f"{block_bytes >> 10} KiB of {kv_what} ({RANDOM_KV}), {threads} threads (the disk lane's pool)")
    enc_t, dec_t = rates[threads]
    cal.set(f"codec.{name}.compress_bytes_per_s", enc_t, f"encode, {how}, raw bytes per second")
    cal.set(f"codec.{name}.decompress_bytes_per_s", dec_t, f"decode, {how}, raw bytes per second")
    cal.set(f"codec.{name}.ratio", n * block_bytes / stored, f"raw / stored frames, {how}")
    one = rates[1]
    cal.set("host.cpu_codec_bytes_per_s", min(enc_t, dec_t),
            f"the slower of encode and decode, {how}; on 1 thread: encode {one[0] / 1e9:.3g} GB/s, "
            f"decode {one[1] / 1e9:.3g} GB/s")
    cal.extra[f"codec.{name}"] = {"threads": {str(t): {"encode_bytes_per_s": e, "decode_bytes_per_s": d}
                                              for t, (e, d) in rates.items()},
                                  "blocks": n, "block_bytes": block_bytes, "level": level}
