"""kvpipe against Hugging Face's baselines and the PCIe floor, everything measured in one
invocation: Llama-3-8B shapes with random bf16 weights, batch 1, kvpipe capped at a 24 GB GPU.

  python -m benchmarks.vs_hf 128k   # link floor, HF all-on-GPU and HF layer-wise offload, kvpipe
  python -m benchmarks.vs_hf 512k   # the longest context under 24 GB with host RAM alone
  python -m benchmarks.vs_hf all    # both, in one invocation

Each measurement runs in its own process (clean peak-memory counters). Results, with the command,
the date and the ratios to the floor / to HF measured in the same run, go to
benchmarks/results/<machine>-<date>-vs-hf-<stage>.json (or --out)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.result_file import result_file

GPU_BUDGET = "24GB"
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B bf16: 32 layers x 8 KV heads x 2 x 128 x 2 bytes
UNIT_BYTES_PER_TOKEN = KV_BYTES_PER_TOKEN // 256


def sh(args: list[str], timeout: int, **env_extra: str) -> dict:
    """Run one measurement process; its last stdout line (or whole stdout) is JSON."""
    t0 = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.time() - t0
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}",
                "command": " ".join(args), "wall_s": wall}
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    out["command"], out["wall_s"] = " ".join(args), wall
    return out


def kvpipe(context: str, decode: int, *knobs: str, timeout: int = 500, kernel: str = "auto") -> dict:
    """`kvpipe run` at Llama-3-8B shapes; kernel sets KVPIPE_ATTN (auto: cuDNN prefill, FA2 decode)."""
    out = sh([sys.executable, "-m", "kvpipe", "run", "--model", "llama-3-8b", "--random-weights",
              "--context", context, "--decode-tokens", str(decode), "--gpu-mem", GPU_BUDGET,
              "--device", "cuda", "--hw", "h200", "--json", "--no-progress", *knobs], timeout, KVPIPE_ATTN=kernel)
    out["command"] = f"KVPIPE_ATTN={kernel} {out['command']}"
    return out


def offloaded_bytes_per_step(run: dict) -> float:
    """Bytes a decode step fetches over PCIe: every offloaded unit's prefix (mean over the steps)."""
    units = 256 - run["plan"]["resident"]
    mean_len = run["workload"]["context"] + run["workload"]["decode_tokens"] / 2
    return units * mean_len * UNIT_BYTES_PER_TOKEN


def stage_128k(res: dict, save) -> None:
    res["link"] = sh([sys.executable, "-m", "benchmarks.link"], 120)
    h2d = res["link"].get("h2d_bytes_per_s")
    res["kvpipe_stream"] = kvpipe("128K", 8, "--group", "8", "--chunk", "4096", "--resident", "none")
    save()
    res["kvpipe_resident"] = kvpipe("128K", 16, "--group", "8", "--chunk", "4096", "--resident", "max")
    save()
    res["kvpipe_stream_fa2"] = kvpipe("128K", 2, "--group", "8", "--chunk", "4096", "--resident", "none",
                                      kernel="flash")   # the same prefill on FA2: what the kernel is worth
    save()
    res["hf_standard"] = sh([sys.executable, "-m", "benchmarks.hf_baseline", "--context", "131072"], 300)
    res["hf_offload"] = sh([sys.executable, "-m", "benchmarks.hf_baseline", "--context", "131072",
                            "--mode", "offload"], 300)
    save()
    rows = []
    for key in ("kvpipe_stream", "kvpipe_resident", "kvpipe_stream_fa2"):
        run = res[key]
        if "measured" not in run:
            continue
        m = run["measured"]
        floor = offloaded_bytes_per_step(run) / h2d if h2d else None
        hf_prefill = res["hf_standard"].get("prefill_s")
        run["ratios"] = {
            "decode_floor_s": floor,
            "decode_over_floor": m["decode_s_per_token"] / floor if floor else None,
            "prefill_over_hf_standard": m["prefill_s"] / hf_prefill if hf_prefill else None,
            "hf_offload_decode_over_floor": (res["hf_offload"].get("decode_s_per_token", 0) /
                                              (KV_BYTES_PER_TOKEN * 131072 / h2d)) if h2d else None,
        }
        rows.append((key, m, run["predicted"], run["ratios"]))
    print(f"\n{'run':18}{'prefill s':>11}{'(pred)':>9}{'decode s/tok':>14}{'(pred)':>9}{'floor':>8}"
          f"{'dec/floor':>10}{'pre/HF':>8}{'peak GB':>9}")
    for name in ("hf_standard", "hf_offload"):
        r = res[name]
        if "prefill_s" in r:
            print(f"{name:18}{r['prefill_s']:11.2f}{'':9}{r['decode_s_per_token']:14.3f}{'':9}{'':8}{'':10}{'':8}"
                  f"{r['peak_gpu_bytes'] / 1e9:9.1f}")
    for key, m, p, ra in rows:
        print(f"{key:18}{m['prefill_s']:11.2f}{p['prefill_s']:9.2f}{m['decode_s_per_token']:14.3f}"
              f"{p['decode_s_per_token']:9.3f}{ra['decode_floor_s']:8.3f}{ra['decode_over_floor']:10.2f}"
              f"{ra['prefill_over_hf_standard']:8.2f}{m['peak_bytes']['gpu'] / 1e9:9.1f}")


def stage_512k(res: dict, save) -> None:
    if "link" not in res:
        res["link"] = sh([sys.executable, "-m", "benchmarks.link"], 120)
    res["kvpipe_512k"] = kvpipe("512K", 4, "--group", "1", "--chunk", "8192", "--resident", "max", timeout=560)
    save()
    r = res["kvpipe_512k"]
    if "measured" in r:
        m, p = r["measured"], r["predicted"]
        print(f"\n512K: prefill {m['prefill_s']:.1f} s (pred {p['prefill_s']:.1f}), decode "
              f"{m['decode_s_per_token']:.3f} s/tok (pred {p['decode_s_per_token']:.3f}), peak GPU "
              f"{m['peak_bytes']['gpu'] / 1e9:.1f} GB, pinned host {m['peak_bytes']['host'] / 1e9:.1f} GB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=["128k", "512k", "all"])
    ap.add_argument("--out")
    args = ap.parse_args()
    res = {"command": "python -m benchmarks.vs_hf " + args.stage,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu_budget": GPU_BUDGET}
    out = Path(args.out or result_file(f"vs-hf-{args.stage}", "cuda"))
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(res, indent=2))   # after every measurement: a timeout keeps the rest
    stages = {"128k": [stage_128k], "512k": [stage_512k], "all": [stage_128k, stage_512k]}[args.stage]
    for stage in stages:
        stage(res, save)
    save()
    print(f"results: {out}")


if __name__ == "__main__":
    main()
