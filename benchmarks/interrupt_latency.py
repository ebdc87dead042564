"""Ctrl-C during a long answer: `kvpipe generate --json` as a user runs it (its own process),
signalled `--after` seconds into its answer. Per plan: the seconds from the signal to the
result on stdout and to the process's exit, the exit code, the tokens it printed, and whether they and their
`output_digest` equal an uninterrupted run of that many tokens (a second process, same plan).
Target: the result within about one decode step, the printed tokens those of the uninterrupted run.

    python -m benchmarks.interrupt_latency --gpu-mem 24GB --context 32K --plans "none:8,max:8"
    python -m benchmarks.interrupt_latency --model examples/tiny/config.json --context 64 --device cpu --plans none:1

Writes the JSON (benchmarks/results/<machine>-<date>-interrupt-latency.json) after every plan."""
from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time

from kvpipe.pipeline.units import parse_tokens

from .result_file import result_file

LARGE = 4096   # only the signal ends the interrupted answer; both runs plan for prompt + LARGE


def command(a, ids_file: str, resident: str, group: str, new: int) -> list[str]:
    """One generate; --max-context fixes the capacity, so the reference plans as the interrupted run."""
    return [sys.executable, "-m", "kvpipe", "generate", "--model", a.model, "--random-weights",
            "--device", a.device, "--prompt-format", "ids", "--prompt-file", ids_file, "--ignore-eos",
            "--max-new-tokens", str(new), "--max-context", str(parse_tokens(a.context) + LARGE),
            "--resident", resident, "--group", group, "--json",
            *(["--gpu-mem", a.gpu_mem] if a.gpu_mem else [])]


def interrupted(cmd: list[str], after_s: float) -> dict:
    """Starts `cmd`, waits for its 'prompt prefilled' line, signals it `after_s` later; times the
    result's first byte on stdout and the exit."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = b""
    while b"prompt prefilled" not in err:
        piece = os.read(p.stderr.fileno(), 65536)
        if not piece:
            raise RuntimeError("the run ended before its answer began:\n" + err.decode()[-2000:])
        err += piece
    time.sleep(after_s)
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    got, first = {p.stdout.fileno(): b"", p.stderr.fileno(): err}, None
    while len(got) > sum(1 for fd in got if fd < 0):
        for fd in select.select([fd for fd in got if fd >= 0], [], [], 300)[0]:
            piece = os.read(fd, 65536)
            if first is None and piece and fd == p.stdout.fileno():
                first = time.perf_counter() - t0
            if not piece:
                got[-1 - fd] = got.pop(fd)   # closed: kept under a negative key
            else:
                got[fd] += piece
    p.wait()
    out, err = got[-1 - p.stdout.fileno()].decode(), got[-1 - p.stderr.fileno()].decode()
    return {"result_s": first, "exit_s": time.perf_counter() - t0, "rc": p.returncode,
            "result": json.loads(out) if out.strip() else None, "stderr_tail": err.splitlines()[-4:]}


def whole(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout)


def row(a, ids_file: str, resident: str, group: str) -> dict:
    got = interrupted(command(a, ids_file, resident, group, LARGE), a.after)
    res = got.pop("result")
    n = len(res["tokens"]) if res else 0
    ref = whole(command(a, ids_file, resident, group, n)) if n else None
    step = (res or {}).get("timings", {}).get("decode_s_per_token")
    ttft = lambda r: r and r["timings"]["ttft_s"]   # room for LARGE tokens vs for n: what the room costs
    return {"resident": resident, "group": group, **got, "tokens": n,
            "ttft_s": ttft(res), "ttft_s_uninterrupted_n": ttft(ref), "decode": (res or {}).get("decode"),
            "finish_reason": res and res["finish_reason"], "decode_s_per_token": step,
            "result_in_steps": got["result_s"] / step if step and got["result_s"] else None,
            "equal_to_uninterrupted": bool(ref) and ref["tokens"] == res["tokens"]
            and ref["output_digest"] == res["output_digest"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--context", default="32K")
    ap.add_argument("--plans", default="none:8,max:8", help="RESIDENT:GROUP, comma-separated")
    ap.add_argument("--after", type=float, default=2.0, help="seconds into the answer before the signal")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n = parse_tokens(a.context)
    rng = random.Random(0)
    out = a.out or result_file("interrupt-latency", a.device)
    doc = {"command": " ".join(sys.argv), "context": n, "after_s": a.after, "rows": []}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(" ".join(str(rng.randrange(3, 250)) for _ in range(n)))
        f.flush()
        for plan in a.plans.split(","):
            resident, group = plan.split(":")
            doc["rows"].append(row(a, f.name, resident, group))
            r = doc["rows"][-1]
            print(f"{plan}: result {r['result_s'] or 0:.3f} s after the signal ({r['result_in_steps'] or 0:.1f} decode steps), "
                  f"exit {r['exit_s']:.3f} s, rc {r['rc']}, "
                  f"{r['tokens']} tokens, {r['finish_reason']}, equal to uninterrupted: {r['equal_to_uninterrupted']}, "
                  f"TTFT {r['ttft_s'] or 0:.3f} s (room {LARGE}) vs {r['ttft_s_uninterrupted_n'] or 0:.3f} s (room {r['tokens']})",
                  flush=True)
            with open(out, "w") as fo:
                json.dump(doc, fo, indent=1)


if __name__ == "__main__":
    main()
