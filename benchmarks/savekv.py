"""A second question over a saved document: first-question TTFT (the document's prefill, then
--save-kv) against the second question's (--load-kv: the KV load plus the question's prefill
only), the KV load rate against the disk's O_DIRECT read rate probed on the same file in the same
run, and a chat's second turn in one session (no load: the KV stayed where the plan put it).
Targets: (load + second TTFT) <= 5% of the first TTFT at 128K; load >= 80% of the link's rate.

    python -m benchmarks.savekv --gpu-mem 24GB --contexts 32K,128K --kv-dir /dev/shm   # KV dir in host RAM
    python -m benchmarks.savekv --gpu-mem 24GB --contexts 32K,128K --kv-dir /path/on/nvme
    python -m benchmarks.savekv --model tests-like/config.json --contexts 1K --device cpu   # CPU smoke
    python -m benchmarks.savekv --store-only --contexts 64K --kv-dir /dev/shm --device cpu   # the load alone

--store-only times executor/kv/saved.load alone on a store of random K/V (--shape layers,heads,
head_dim; --split GPU,disk heads per layer, the rest host): serial (one thread) and parallel, each
checked bit for bit against the saved store, against the file's read rate with as many threads
(into reused buffers). "parallel_warm": the homes' pages faulted in before the load, as CUDA's
registered host homes are when the store opens (CPU homes fault on the load's first write).

Prints and writes one JSON object (benchmarks/results/<machine>-<date>-savekv.json)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvpipe.conversation import Conversation
from kvpipe.executor.disk.tier import aligned_buffer
from kvpipe.executor.kv import saved
from kvpipe.executor.kv.layout import DiskOptions, KVLayout
from kvpipe.executor.kv.store import KVStore
from kvpipe.pipeline.model import load_model
from kvpipe.pipeline.units import parse_tokens

from .generate_json import generate_json
from .result_file import result_file


def read_rate(path: Path, threads: int = 8, request: int = 8 << 20, into: torch.Tensor | None = None) -> float:
    """Bytes per second reading `path` with O_DIRECT (the link's floor): into reused, cache-hot
    aligned buffers, or with `into` (a touched uint8 tensor of the file's size) each byte to its
    own place in DRAM, as a load into the homes writes it."""
    size = path.stat().st_size
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:      # tmpfs (/dev/shm: the host-RAM case) refuses O_DIRECT
        fd = os.open(path, os.O_RDONLY)
    bufs = [aligned_buffer(request) for _ in range(threads)] if into is None else None
    whole = memoryview(into.numpy()) if into is not None else None

    def part(i: int) -> None:
        view = memoryview(bufs[i % threads].numpy()) if whole is None else None
        for at in range(i * request, size, threads * request):
            n = min(request, size - at) // 4096 * 4096 or 4096
            os.preadv(fd, [view[:n] if whole is None else whole[at:at + n]], at)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))
    os.close(fd)
    return size / (time.perf_counter() - t0)


def read_rates(path: Path, threads: int) -> tuple[float, float]:
    """(cache-hot, into DRAM) read rates of `path` (`read_rate`); the DRAM target touched first."""
    into = aligned_buffer(-(-path.stat().st_size // 4096) * 4096)
    into.zero_()
    return read_rate(path, threads), read_rate(path, threads, into=into)


def generate(args, tokens: list[int], *flags: str) -> dict:
    """`kvpipe generate --json` on `tokens` with this run's device, GPU cap and KV folder."""
    for flag, v in (("--device", args.device), ("--gpu-mem", args.gpu_mem), ("--kv-dir", args.kv_dir)):
        flags += (flag, v) if v else ()
    return generate_json(args.model, tokens, args.new, *flags)


def row(args, context: int) -> dict:
    g = torch.Generator().manual_seed(context)
    vocab = load_model(args.model).vocab
    doc = torch.randint(0, vocab, (context,), generator=g).tolist()
    q = torch.randint(0, vocab, (args.question,), generator=g).tolist()
    kv = Path(tempfile.mkdtemp(prefix="kvpipe-savekv-", dir=args.kv_dir))
    first = generate(args, doc, "--save-kv", str(kv))
    second = generate(args, q, "--load-kv", str(kv))
    man = json.loads((kv / "manifest.json").read_text())
    link, link_dram = read_rates(kv / man["data"], 8)
    t, t1 = second["timings"], first["timings"]
    with Conversation(args.model, max_context=context + 2 * args.new + args.question, max_new_tokens=args.new,
                      random_weights=True, device=args.device, gpu_mem=args.gpu_mem, kv_dir=args.kv_dir) as c:
        c.load(kv)            # the same directory loaded with nothing behind it: the load alone
        alone = dict(c.live.loaded.to_json(), **c.load_figures)
        c.reset()
        one = c.append(doc, max_new_tokens=args.new, ignore_eos=True)
        two = c.append(c.tokens + one.tokens[-1:] + q, max_new_tokens=args.new, ignore_eos=True)
    for f in kv.iterdir():
        f.unlink()
    kv.rmdir()
    ld = t["kv_load"]
    return {"context": context, "question_tokens": args.question, "plan": first["plan"],
            "kv_units": first.get("kv_units"), "first_ttft_s": t1["ttft_s"],
            "second_ttft_s": t["ttft_s"], "second_prefill_tokens": t["prefill_tokens"],
            "kv_load_path": ld["path"], "kv_load_s": t["kv_load_s"], "kv_load_held_s": t["kv_load_held_s"],
            "kv_bytes": t["kv_load_bytes"], "kv_load_rate": t["kv_load_bytes"] / t["kv_load_s"],
            "kv_load_read_s_per_thread": ld["read_s"] / ld["threads"],
            "kv_load_crc_s_per_thread": ld["crc_s"] / ld["threads"], "kv_load_threads": ld["threads"],
            "kv_fingerprint_s": ld["fingerprint_s"], "link_read_rate": link,
            "load_vs_link": t["kv_load_bytes"] / t["kv_load_s"] / link, "link_read_rate_into_dram": link_dram,
            "load_vs_link_into_dram": t["kv_load_bytes"] / t["kv_load_s"] / link_dram,
            "load_alone": alone, "load_alone_vs_link": alone["rate_bytes_per_s"] / link,
            "second_vs_first": (t["ttft_s"] + t["kv_load_held_s"]) / t1["ttft_s"],
            "chat_turn1_ttft_s": one.timings["ttft_s"], "chat_turn2_ttft_s": two.timings["ttft_s"],
            "chat_turn2_prefill_tokens": two.timings["prefill_tokens"],
            "chat_turn2_vs_turn1": two.timings["ttft_s"] / one.timings["ttft_s"],
            "decode_s_per_token": t1["decode_s_per_token"]}


def _units_equal(a: KVStore, b: KVStore, n: int) -> bool:
    """Every unit's first n tokens the same bytes in both stores (any tier)."""
    x, y = (aligned_buffer(saved._stride(a, n)) for _ in range(2))
    for layer, h in saved._units(a):
        saved._get(a, layer, h, n, n, x)
        saved._get(b, layer, h, n, n, y)
        if not torch.equal(x, y):
            return False
    return True


def fill_random(a: KVStore, n: int, seed: int) -> None:
    """Random bytes into every unit's first n tokens, any tier."""
    g, lo = torch.Generator().manual_seed(seed), a.layout
    row = torch.empty(n * a.token_bytes, dtype=torch.uint8)
    for layer, h in saved._units(a):
        row.view(torch.int16).random_(generator=g)
        if h >= lo.first_disk(layer):
            a.disk.append([(a._row(layer, 0, h), memoryview(row.numpy()))])
        else:
            r = lo.resident[layer]
            home = a.gpu[layer][0, h, :n] if h < r else a.host[layer][0, h - r, :n]
            home.reshape(-1).view(torch.uint8).copy_(row)


def store_row(args, n: int) -> dict:
    """saved.load alone: serial and parallel load rates of a random store against the read rate."""
    L, H, D = (int(v) for v in args.shape.split(","))
    gpu, disk = (int(v) for v in args.split.split(","))
    lo = KVLayout(1, H, D, n + 64, (gpu,) * L, 2, H, (disk,) * L, 16)
    dev, opts = args.device or ("cuda" if torch.cuda.is_available() else "cpu"), DiskOptions(args.kv_dir)
    kv = Path(tempfile.mkdtemp(prefix="kvpipe-loadkv-", dir=args.kv_dir))
    out = {"tokens": n, "shape": args.shape, "split": args.split, "device": dev}
    with KVStore(lo, dev, torch.bfloat16, opts) as a:
        fill_random(a, n, n)
        man = saved.save(a, n, n, kv, {})
        size = man["unit_bytes"] * len(man["units"])
        out.update(kv_bytes=size, threads=args.threads)
        for name, threads, warm in (("serial", 1, False), ("parallel", args.threads, False),
                                    ("parallel_warm", args.threads, True)):
            with KVStore(lo, dev, torch.bfloat16, opts) as b:
                for t in (b.gpu + b.host) if warm else ():   # pages faulted in first, as registering does
                    if t is not None:
                        t.zero_()
                t0 = time.perf_counter()
                st = saved.start(b, kv, man, threads=threads).wait()
                dt = time.perf_counter() - t0
                out[f"{name}_load_s"], out[f"{name}_rate"] = dt, size / dt
                out[f"{name}_read_s_per_thread"], out[f"{name}_crc_s_per_thread"] = st.read_s / threads, st.crc_s / threads
                out[f"{name}_equal"] = _units_equal(a, b, n)
    out["read_rate"], out["read_rate_into_dram"] = read_rates(kv / man["data"], args.threads)
    out["parallel_vs_read"] = out["parallel_rate"] / out["read_rate"]
    out["parallel_warm_vs_read"] = out["parallel_warm_rate"] / out["read_rate"]
    for f in kv.iterdir():
        f.unlink()
    kv.rmdir()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b", help="preset or config.json (random weights)")
    ap.add_argument("--contexts", default="32K,128K")
    ap.add_argument("--question", type=int, default=64, help="tokens of the second question")
    ap.add_argument("--new", type=int, default=8, help="tokens generated per question")
    ap.add_argument("--gpu-mem", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-dir", default=None, help="where the KV directory and the disk tier go")
    ap.add_argument("--out", default=None)
    ap.add_argument("--store-only", action="store_true", help="time saved.load alone on random K/V")
    ap.add_argument("--shape", default="8,8,128", help="--store-only: layers,kv_heads,head_dim")
    ap.add_argument("--split", default="2,2", help="--store-only: GPU,disk heads per layer (the rest host)")
    ap.add_argument("--threads", type=int, default=saved.THREADS, help="--store-only: parallel readers")
    args = ap.parse_args()
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = Path(args.out) if args.out else result_file("savekv-load" if args.store_only else "savekv", dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "savekv", "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
           "model": args.model, "gpu_mem": args.gpu_mem, "rows": [],
           "targets": {"second_vs_first": 0.05, "load_vs_link": 0.80}}
    for c in args.contexts.split(","):
        out["rows"].append((store_row if args.store_only else row)(args, parse_tokens(c, "contexts")))
        path.write_text(json.dumps(out, indent=2))     # after every row: a cut run keeps what it measured
        print(json.dumps(out["rows"][-1], indent=2), flush=True)


if __name__ == "__main__":
    main()
