"""Wall time of `kvpipe plan` (the planner search, the default) for every preset model at 1M and
4M tokens, plain and with --compare, each run as its own process pinned to two cores
(`taskset -c 0,1`), imports included. Target: at most 10 s each.

    python benchmarks/planner_speed.py [--cores 0,1] [--only llama-2-13b] [--out FILE.json]

Writes benchmarks/results/cpu-<date>-planner-speed.json (command, date, CPU model, load average, and
per case: wall, user and sys seconds, exit code) and prints a table last. User + sys is what the
run costs a single core; on a loaded machine the wall time also holds the waits for a core."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvpipe.pipeline.model import PRESETS

# Extra flags per model: the budgets under which a 4M context fits (without them the 13B and 70B
# models have no plan at 4M on the default rtx4090 profile, nor the 7B MHA models on its disk).
FLAGS = {
    "llama-3-70b": ["--hw", "h200", "--disk-mem", "4TiB"],
    "llama-2-13b": ["--hw", "a100-80g", "--disk-mem", "4TiB"],
}
# At 4M the 70B model's leanest plan needs 143 GiB of GPU with the allocator's room, more than the
# H200's 140.4 GiB: the case times the search on a hypothetical 192 GB GPU (a B200-class budget).
FLAGS_4M = {"llama-2-7b": ["--disk-mem", "2100GiB"], "longchat-7b-32k": ["--disk-mem", "2100GiB"],
            "llama-3-70b": ["--gpu-mem", "192GB"]}
CONTEXTS = ("1M", "4M")
TARGET_S = 10.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def case_args(model: str, context: str, compare: bool) -> list[str]:
    args = ["--model", model, "--context", context] + FLAGS.get(model, [])
    if context == "4M":
        args += FLAGS_4M.get(model, [])
    return args + (["--compare"] if compare else [])


def time_one(cmd: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"rc": proc.returncode, "wall_s": round(wall, 3),
            "user_s": round(after.ru_utime - before.ru_utime, 3),
            "sys_s": round(after.ru_stime - before.ru_stime, 3),
            "load_1min": round(os.getloadavg()[0], 2),
            "stderr_tail": proc.stderr.strip().splitlines()[-1:] if proc.returncode else []}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="0,1", help="CPU list for taskset (two cores by default)")
    ap.add_argument("--only", action="append", help="preset(s) to time (default: every preset)")
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/cpu-<date>-planner-speed.json)")
    a = ap.parse_args(argv)
    models = a.only or list(PRESETS)
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        print(f"planner_speed: error: --only: unknown preset {unknown[0]!r}", file=sys.stderr)
        return 2
    pin = ["taskset", "-c", a.cores] if shutil.which("taskset") else []
    if not pin:
        print("planner_speed: taskset not found: runs are not pinned", file=sys.stderr)
    start = dt.datetime.now(dt.timezone.utc)
    rows = []
    for model in models:
        for context in CONTEXTS:
            for compare in (False, True):
                cmd = pin + [sys.executable, "-m", "kvpipe", "plan"] + case_args(model, context, compare)
                r = time_one(cmd)
                rows.append({"model": model, "context": context, "compare": compare,
                             "command": " ".join(cmd[len(pin):]), **r})
                print(f"  {model} {context} {'--compare' if compare else 'plain'}: {r['wall_s']:.2f} s wall",
                      file=sys.stderr)
    out = Path(a.out) if a.out else Path(__file__).parent / "results" / f"cpu-{start:%Y-%m-%d}-planner-speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": " ".join([sys.executable] + sys.argv), "pinned": " ".join(pin), "date": start.isoformat(),
           "cpu": cpu_model(), "cpus_online": os.cpu_count(), "target_s": TARGET_S, "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# {doc['cpu']}, pinned: {doc['pinned'] or 'no'}, {start:%Y-%m-%d %H:%M} UTC; JSON: {out}")
    print(f"{'model':17} {'context':>7} {'mode':>9} {'wall s':>7} {'user+sys':>8} {'load':>5} {'rc':>3}")
    for r in rows:
        flag = "" if r["wall_s"] <= TARGET_S else "  > target"
        print(f"{r['model']:17} {r['context']:>7} {'compare' if r['compare'] else 'plain':>9} {r['wall_s']:7.2f} "
              f"{r['user_s'] + r['sys_s']:8.2f} {r['load_1min']:5.1f} {r['rc']:3d}{flag}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
