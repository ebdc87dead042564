"""The disk tier and the disk codec on a GPU machine, Llama-3-8B shapes, random bf16
weights, kvpipe capped at a 24 GB GPU; every rate a ratio is taken against is measured in the
same invocation.

  python -m benchmarks.tiers disk [--kv-dir D] [--disk 64]  # O_DIRECT probe, link probe, then
        128K runs with disk units (raw and zstd-planes): decode vs the slowest lane's floor, the
        disk read rate reached, the codec's ratio on the run's own K/V
  python -m benchmarks.tiers 1m [--kv-dir D]                # probes, then START a detached 1M run
        (prefill + 8 decode steps); returns at once
  python -m benchmarks.tiers poll                           # the 1M run: still going, or its figures

Random weights give K/V whose statistics differ from a trained model's: every codec ratio here
is on random-weight K/V and says so. Results go to benchmarks/results/<machine>-<date>-tiers-disk.json
and, from poll, <machine>-<date>-tiers-1m.json (or --out); a short table is printed last."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GPU_BUDGET = "24GB"
UNIT_BYTES_PER_TOKEN = 512          # Llama-3-8B bf16: K and V of one KV head, 2 x 128 x 2 bytes
UNITS = 256                         # 32 layers x 8 KV heads
RESULTS = Path(__file__).resolve().parent / "results"
RANDOM_KV = "ratio on K/V of a random-weight model (a trained model's K/V has other statistics)"


def probe_disk(kv_dir: str, gib: float, threads: int = 8, request: int = 8 << 20) -> dict:
    """O_DIRECT rates of the disk under `kv_dir`: a pre-allocated file written and read back in
    `request`-byte requests by `threads` threads (no checksums: the device's rate)."""
    from kvpipe.executor.kv.pinned import HostArena
    n = int(gib * 2**30) // request
    path = os.path.join(kv_dir, f"kvpipe-probe-{os.getpid()}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * request)
        with HostArena(pin=False) as arena:
            bufs = [memoryview(arena.bytes(request).numpy()) for _ in range(threads)]
            for b in bufs:
                b[:] = os.urandom(request)

            def run(op) -> float:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda i: op(fd, [bufs[i % threads]], i * request), range(n)))
                return time.perf_counter() - t0

            write_s = run(os.pwritev)
            os.fsync(fd)
            read_s = run(os.preadv)
    finally:
        os.close(fd)
        os.unlink(path)
    return {"bytes": n * request, "threads": threads, "request_bytes": request,
            "write_bytes_per_s": n * request / write_s, "read_bytes_per_s": n * request / read_s}


def probe_link() -> dict:
    r = subprocess.run([sys.executable, "-m", "benchmarks.link"], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": r.stderr.strip()[-500:]}


def run_cmd(context: str, decode: int, kv_dir: str, *knobs: str) -> list[str]:
    return [sys.executable, "-m", "kvpipe", "run", "--model", "llama-3-8b", "--random-weights", "--context",
            context, "--decode-tokens", str(decode), "--gpu-mem", GPU_BUDGET, "--device", "cuda", "--hw", "h200",
            "--kv-dir", kv_dir, "--json", "--no-progress", *knobs]


def kvpipe(cmd: list[str], timeout: int = 590) -> dict:
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]} if r.returncode else json.loads(r.stdout)
    out["command"], out["wall_s"] = " ".join(cmd), time.time() - t0
    return out


def floors(run: dict, disk_rate: float, h2d_rate: float) -> dict:
    """Seconds per decode step each lane needs at its measured rate (mean over the steps)."""
    w, plan = run["workload"], run["plan"]
    mean_len = w["context"] + w["decode_tokens"] / 2
    offloaded = UNITS - plan["resident"]
    disk_bytes = plan["disk"] * mean_len * UNIT_BYTES_PER_TOKEN
    ratio = codec_ratio(run) or 1.0
    f = {"disk_s": disk_bytes / ratio / disk_rate, "h2d_s": offloaded * mean_len * UNIT_BYTES_PER_TOKEN / h2d_rate,
         "disk_bytes_per_step": disk_bytes}
    f["slowest_lane"] = "disk" if f["disk_s"] >= f["h2d_s"] else "h2d"
    f["floor_s"] = max(f["disk_s"], f["h2d_s"])
    return f


def codec_ratio(run: dict) -> float | None:
    d = run.get("disk") or {}
    return d["codec_raw_bytes"] / d["codec_stored_bytes"] if d.get("codec_stored_bytes") else None


def summarise(run: dict, probes: dict) -> dict:
    if "measured" not in run:
        return {"error": run.get("error")}
    f = floors(run, probes["disk"]["read_bytes_per_s"], probes["link"].get("h2d_bytes_per_s", 55e9))
    m = run["measured"]
    step = m["decode_s_per_token"]
    reached = f["disk_bytes_per_step"] / (codec_ratio(run) or 1.0) / step
    d = run.get("disk") or {}
    out = {"prefill_s": m["prefill_s"], "decode_s_per_token": step, "floor": f,
           "decode_vs_floor": step / f["floor_s"], "peak_bytes": m["peak_bytes"],
           "disk_read_rate_reached": reached,
           "disk_read_rate_vs_measured": reached / probes["disk"]["read_bytes_per_s"],
           "checksum_s": d.get("checksum_s"), "checksum_bytes": d.get("checksum_bytes"),
           "predicted_decode_s_per_token": run["predicted"]["decode_s_per_token"], "notes": d.get("notes")}
    if codec_ratio(run):
        out["codec"] = {"ratio": codec_ratio(run), "note": RANDOM_KV,
                        "encode_bytes_per_s_per_thread": d["codec_raw_bytes"] / d["encode_s"] if d["encode_s"] else None,
                        "decode_s_summed": d["decode_s"]}
    return out


def mode_disk(args, res: dict, save) -> list[str]:
    res["probes"] = {"disk": probe_disk(args.kv_dir, args.probe_gib), "link": probe_link()}
    save()
    base = ("--group", "8", "--chunk", "4096", "--resident", "none", "--disk", str(args.disk))
    for name, extra in (("disk_raw", ()), ("disk_zstd_planes", ("--codec", "disk=zstd-planes"))):
        res[name] = kvpipe(run_cmd("128K", 8, args.kv_dir, *base, *extra))
        res[name + "_summary"] = summarise(res[name], res["probes"])
        save()
    rows = [f"O_DIRECT under {args.kv_dir}: read {res['probes']['disk']['read_bytes_per_s'] / 1e9:.2f} GB/s, "
            f"write {res['probes']['disk']['write_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({res['probes']['disk']['threads']} threads x {res['probes']['disk']['request_bytes'] >> 20} MiB)",
            f"{'128K, ' + str(args.disk) + ' disk units':28}{'decode s/tok':>13}{'floor s':>9}{'x floor':>8}"
            f"{'disk GB/s':>10}{'x probe':>8}{'ratio':>7}"]
    for name in ("disk_raw", "disk_zstd_planes"):
        s = res[name + "_summary"]
        if "error" in s:
            rows.append(f"{name:28} error: {s['error']}")
            continue
        ratio = f"{s['codec']['ratio']:.3f}" if "codec" in s else "-"
        rows.append(f"{name:28}{s['decode_s_per_token']:>13.3f}{s['floor']['floor_s']:>9.3f}"
                    f"{s['decode_vs_floor']:>8.3f}{s['disk_read_rate_reached'] / 1e9:>10.2f}"
                    f"{s['disk_read_rate_vs_measured']:>8.2f}{ratio:>7}")
    rows.append(f"codec ratio: {RANDOM_KV}")
    return rows


def mode_1m(args, res: dict, save) -> list[str]:
    res["probes"] = {"disk": probe_disk(args.kv_dir, args.probe_gib), "link": probe_link()}
    out, log = args.dir / "tiers-1m-run.json", args.dir / "tiers-1m-run.log"
    cmd = run_cmd("1M", 8, args.kv_dir, "--chunk", args.chunk, "--group", "1", "--resident", "max",
                  "--host-mem", args.host_mem, *sum((("--codec", c) for c in args.codec), ()))
    with open(out, "w") as fo, open(log, "w") as fl:
        # expandable segments: the first try (32K chunks, 20.2 of 22.4 GiB predicted) died of fragmentation
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        p = subprocess.Popen(cmd, stdout=fo, stderr=fl, start_new_session=True, env=env)   # detached: setsid
    res.update(pid=p.pid, command="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True " + " ".join(cmd), run_json=str(out), run_log=str(log),
               started=datetime.datetime.now(datetime.timezone.utc).isoformat())
    save()
    return [f"started pid {p.pid}: {' '.join(cmd)}", f"poll: python -m benchmarks.tiers poll   (log {log})"]


def mode_poll(args, res: dict, save) -> list[str]:
    started = json.loads((args.dir / "tiers-1m.json").read_text())
    out = Path(started["run_json"])
    alive = os.path.exists(f"/proc/{started['pid']}")
    text = out.read_text() if out.exists() else ""
    res.update(started=started, alive=alive)
    if alive or not text.strip():
        tail = Path(started["run_log"]).read_text()[-600:] if Path(started["run_log"]).exists() else ""
        res["log_tail"] = tail
        save()
        return [f"1M run pid {started['pid']}: {'running' if alive else 'ended without JSON'}", tail.strip()[-300:]]
    run = json.loads(text)
    res["run"], res["summary"] = run, summarise(run, started["probes"])
    save()
    s = res["summary"]
    if "error" in s:
        return [f"1M run failed: {s['error']}"]
    pk = s["peak_bytes"]
    return [f"1M exact run: prefill {s['prefill_s']:.0f} s, decode {s['decode_s_per_token']:.2f} s/token "
            f"({s['decode_vs_floor']:.2f}x the {s['floor']['slowest_lane']} floor {s['floor']['floor_s']:.2f} s)",
            f"peak gpu {pk['gpu'] / 2**30:.1f} GiB, host {pk['host'] / 2**30:.1f} GiB, disk {pk['disk'] / 2**30:.1f} GiB; "
            f"disk read {s['disk_read_rate_reached'] / 1e9:.2f} GB/s ({s['disk_read_rate_vs_measured']:.2f}x probe)"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["disk", "1m", "poll"])
    ap.add_argument("--kv-dir", default=tempfile.gettempdir())
    ap.add_argument("--disk", type=int, default=64, help="disk units of the 128K runs")
    ap.add_argument("--probe-gib", type=float, default=8.0, help="size of the O_DIRECT probe file")
    ap.add_argument("--host-mem", default="100GiB", help="1m: host budget (leave the OS ~16 GB)")
    ap.add_argument("--chunk", default="32K", help="1m: prefill chunk (32K: ~537 s predicted on h200, 16K: ~818 s)")
    ap.add_argument("--codec", action="append", default=[], help="1m: e.g. disk=zstd-planes")
    ap.add_argument("--out")
    ap.add_argument("--dir", type=Path, default=RESULTS, help="1m/poll: where the run's JSON and log go (outside the "
                    "checkout on the device, so a later call's copy of the tree cannot remove them)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    from benchmarks.result_file import result_file
    if args.out:
        path = Path(args.out)
    else:   # 1m writes the start record poll reads back; poll's file is the 1M result
        path = args.dir / "tiers-1m.json" if args.mode == "1m" else result_file(
            "tiers-disk" if args.mode == "disk" else "tiers-1m", "cuda")
    res: dict = {"mode": args.mode, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "command": " ".join(sys.argv)}
    save = lambda: path.write_text(json.dumps(res, indent=2))
    rows = {"disk": mode_disk, "1m": mode_1m, "poll": mode_poll}[args.mode](args, res, save)
    save()
    print(f"results: {path}")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
