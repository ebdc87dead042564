"""One nvCOMP codec's round trip on the K/V, each in its own process (benchmarks/codec_link.py).

Why a process per codec: a fault inside a CUDA kernel (an illegal address) is sticky, it kills the
process's CUDA context, and every later call in that process fails ("nvCOMP error: Unable to get
context for stream 0" after a fault in ANS on the H200). A worker process per codec
keeps one codec's fault out of the others' rows. The parent (`run_isolated`) reads the worker's
stdout, one JSON object a line: `{"stage": ..., "bytes": n}` before each step, `{"row": {...}}`
at the end; a worker that dies without a row is reported with the stage it died in.

Inside a worker every buffer a queued kernel may touch is held by a name until the stream has
been synchronized: the input tensor and its nvCOMP view (`as_array`), the encoded Array, and the
decode target, which is a torch tensor (decode writes into it through `out=`), so no nvCOMP
Array goes out of scope while a kernel or a torch view still reads it. Everything runs on one
non-default torch stream, handed to the Codec and to `as_array`, so nvCOMP and torch order their
work on the same queue. The input is checked first (uint8, 1-D, contiguous, on CUDA, not empty).
Before the timed run on the whole buffer, exact round trips on its first 1 MiB and 64 MiB show
whether a fault depends on size.

  python -m benchmarks.nvcomp_isolated ALGO KV_FILE      # the worker; ALGO one of ALGOS
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ALGOS = ("ANS", "Bitcomp", "Cascaded", "GDeflate", "Zstd", "LZ4", "ANS-planes")
PROBE_BYTES = (1 << 20, 64 << 20)
REPO = Path(__file__).resolve().parent.parent


def check_input(t, name: str) -> None:
    """ValueError naming `name` unless `t` is a non-empty, contiguous, 1-D uint8 CUDA tensor."""
    import torch
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{name}: dtype {t.dtype}, expected torch.uint8 (bytes)")
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected 1-D and not empty")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous (nvCOMP reads one dense buffer)")
    if not t.is_cuda:
        raise ValueError(f"{name}: on {t.device}, expected a CUDA device")


def _timed(fn, stream, reps: int):
    """(median seconds, last result) of `fn` over `reps` runs after one warm-up, each run
    ended by a synchronize of `stream`; the result of a run is held until its sync."""
    res = fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = fn()
        stream.synchronize()
        times.append(time.perf_counter() - t0)
    return (statistics.median(times) if times else None), res


def round_trip(nvcomp, algo: str, kv, stream, reps: int, say=lambda **kw: None) -> dict:
    """Ratio, rates and bit-exactness of `algo` on `kv` (ANS-planes: ANS on the high byte of each
    bf16 pair, the low byte stored raw)."""
    import torch
    if algo not in ALGOS:
        raise ValueError(f"algo: unknown {algo!r} (known: {', '.join(ALGOS)})")
    check_input(kv, "kv")
    planes = algo == "ANS-planes"
    if planes and kv.numel() % 2:
        raise ValueError(f"kv: {kv.numel()} bytes, ANS-planes needs whole bf16 pairs")
    n = kv.numel()
    with torch.cuda.stream(stream):
        codec = nvcomp.Codec(algorithm=algo.split("-")[0], device_id=kv.device.index,
                             cuda_stream=stream.cuda_stream)
        pairs = kv.view(-1, 2)
        low = pairs[:, 0].contiguous() if planes else None     # held to the end
        src = pairs[:, 1].contiguous() if planes else kv
        stream.synchronize()
        src_arr = nvcomp.as_array(src, cuda_stream=stream.cuda_stream)
        say(stage="encode", bytes=n)
        enc_s, encoded = _timed(lambda: codec.encode(src_arr), stream, reps)
        stored = encoded.buffer_size + (low.numel() if planes else 0)
        back = torch.empty_like(src)   # torch-owned; an external `out` has a fixed size (never grown)
        say(stage="decode", bytes=n)
        dec_s, _ = _timed(lambda: codec.decode(encoded, out=back), stream, reps)
        say(stage="compare", bytes=n)
        full = torch.stack([low, back], 1).flatten() if planes else back
        exact = bool(torch.equal(full, kv))
        stream.synchronize()
    row = {"ratio": n / stored, "stored_bytes": stored, "exact": exact}
    if reps:
        row.update(encode_bytes_per_s=n / enc_s, decode_bytes_per_s=n / dec_s)
    return row


def worker(algo: str, kv_file: str, reps: int = 3) -> dict:
    """The row of one codec: probes on the first 1 MiB and 64 MiB, then the timed whole."""
    say = lambda **kw: print(json.dumps(kw), flush=True)
    say(stage="load", bytes=os.path.getsize(kv_file))
    import torch
    kv = torch.from_file(kv_file, shared=False, size=os.path.getsize(kv_file), dtype=torch.uint8)
    if not torch.cuda.is_available():
        return {"error": "CUDA is not available in the worker"}
    try:
        from nvidia import nvcomp
    except ImportError as e:
        return {"error": f"not installed ({e}): pip install nvidia-nvcomp-cu13"}
    kv = kv.cuda()
    stream = torch.cuda.Stream()
    row = {"nvcomp_version": nvcomp.__version__, "probes": []}
    for n in [p for p in PROBE_BYTES if p < kv.numel()]:
        say(stage="probe", bytes=n)
        probe = round_trip(nvcomp, algo, kv[:n], stream, 0)
        row["probes"].append({"bytes": n, "exact": probe["exact"], "ratio": probe["ratio"]})
    row.update(round_trip(nvcomp, algo, kv, stream, reps, say))
    return row


def parse_worker_output(stdout: str, returncode: int | None, stderr: str, timeout_s: float | None = None) -> dict:
    """The worker's row, or an error row naming how it ended (exit code, signal, time-out), the
    last stage it announced and the last line of its stderr."""
    last, row = None, None
    for line in stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "row" in obj:
            row = obj["row"]
        elif isinstance(obj, dict) and "stage" in obj:
            last = obj
    if row is not None and returncode == 0:
        if "error" in row and last is not None:   # a Python exception: where it was raised
            row = {**row, "error": f"{row['error']} (during {last['stage']} of {last['bytes']} bytes)"}
        return row
    if timeout_s is not None:
        how = f"timed out after {timeout_s:g} s"
    elif returncode is not None and returncode < 0:
        how = f"killed by {signal.Signals(-returncode).name}"
    else:
        how = f"exit {returncode}"
    where = f" during {last['stage']} of {last['bytes']} bytes" if last else " before its first stage"
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return {"error": f"worker {how}{where}" + (f": {tail[-1].strip()}" if tail else "")}


def run_isolated(algo: str, kv_file: str, timeout_s: float = 600.0) -> dict:
    """Runs `worker` in a fresh Python process; its row, or an error row if it died."""
    if algo not in ALGOS:
        raise ValueError(f"algo: unknown {algo!r} (known: {', '.join(ALGOS)})")
    cmd = [sys.executable, "-m", "benchmarks.nvcomp_isolated", algo, str(kv_file)]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return parse_worker_output(text(e.stdout), None, text(e.stderr), timeout_s)
    return parse_worker_output(p.stdout, p.returncode, p.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ALGOS:
        print(f"usage: python -m benchmarks.nvcomp_isolated ALGO KV_FILE (ALGO one of {', '.join(ALGOS)})",
              file=sys.stderr)
        return 2
    try:
        row = worker(*args)
    except Exception as e:   # reported as the row; the process (and its CUDA context) ends here
        row = {"error": f"{type(e).__name__}: {e}"[:400]}
    print(json.dumps({"row": row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
