"""Can a saved KV directory's host units be used where they lie instead of copied? The floor of
each way of getting a file in host RAM (tmpfs, /dev/shm) ready for H2D streaming, on one file of
--gib GiB:

  copy         read into a touched pinned buffer, 8 MiB requests over --threads threads (the
               loader's copy, no checksum)
  copy+crc     the same with crc32c per PIECE bytes right after each read (the loader's path)
  map+register the file mapped shared (torch.from_file) and pinned with cudaHostRegister: no copy
  crc in place crc32c over the mapping, --threads threads (what a load would still verify)
  h2d          the H2D rate from the registered mapping beside that from cudaHostAlloc memory

  python -m experiments.host_map --gib 12 --out FILE.json     # on the GPU machine

Prints a table last; JSON to --out."""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

REQUEST = 8 << 20
PIECE = 1 << 20


def _parts(size: int, threads: int, request: int):
    return [range(i * request, size, threads * request) for i in range(threads)]


def copy_rate(path: str, into: torch.Tensor, threads: int, piece: int | None) -> float:
    """Bytes/s reading `path` into `into` (each byte to its own place); with `piece`, crc32c of
    every `piece` bytes right after its read."""
    size, fd, whole = os.path.getsize(path), os.open(path, os.O_RDONLY), memoryview(into.numpy())

    def part(offsets) -> None:
        for at in offsets:
            n = min(REQUEST, size - at)
            if piece is None:
                os.preadv(fd, [whole[at:at + n]], at)
                continue
            for a in range(at, at + n, piece):
                v = whole[a:min(a + piece, at + n)]
                os.preadv(fd, [v], a)
                crc32c.crc32c(v)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, _parts(size, threads, REQUEST)))
    os.close(fd)
    return size / (time.perf_counter() - t0)


def crc_rate(view: torch.Tensor, threads: int) -> float:
    whole, size = memoryview(view.numpy()), view.numel()

    def part(offsets) -> None:
        for at in offsets:
            crc32c.crc32c(whole[at:at + REQUEST])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, _parts(size, threads, REQUEST)))
    return size / (time.perf_counter() - t0)


def h2d_rate(src: torch.Tensor, gpu: torch.Tensor, reps: int = 3) -> float:
    n = gpu.numel()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in range(reps):
        gpu.copy_(src[r * n % max(1, src.numel() - n):][:n], non_blocking=True)
    torch.cuda.synchronize()
    return reps * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=12.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 8)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out")
    a = ap.parse_args()
    size = int(a.gib * (1 << 30)) // REQUEST * REQUEST
    path = os.path.join(a.dir, f"host-map-{os.getpid()}.bin")
    res: dict = {"bytes": size, "threads": a.threads, "dir": a.dir, "device": torch.cuda.get_device_name()}
    try:
        chunk = torch.randint(0, 256, (REQUEST,), dtype=torch.uint8).numpy().tobytes()
        with open(path, "wb") as f:
            for _ in range(size // REQUEST):
                f.write(chunk)
        into = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        into.zero_()
        res["copy_bytes_per_s"] = copy_rate(path, into, a.threads, None)
        res["copy_crc_bytes_per_s"] = copy_rate(path, into, a.threads, PIECE)
        res["copy_crc4m_bytes_per_s"] = copy_rate(path, into, a.threads, 4 * PIECE)
        mapped = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        rt = torch.cuda.cudart()
        t0 = time.perf_counter()
        err = rt.cudaHostRegister(mapped.data_ptr(), size, 0)
        res["register_s"] = time.perf_counter() - t0
        res["register_error"] = int(err) if not isinstance(err, int) else err
        res["register_bytes_per_s"] = size / res["register_s"]
        res["crc_in_place_bytes_per_s"] = crc_rate(mapped, a.threads)
        gpu = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        res["h2d_registered_bytes_per_s"] = h2d_rate(mapped, gpu)
        res["h2d_pinned_bytes_per_s"] = h2d_rate(into, gpu)
        rt.cudaHostUnregister(mapped.data_ptr())
    finally:
        if os.path.exists(path):
            os.remove(path)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    g = lambda k: f"{res[k] / 1e9:7.1f} GB/s" if k in res else "      -"   # noqa: E731
    print(f"{res['bytes'] / 1e9:.1f} GB in {a.dir}, {a.threads} threads")
    for k in ("copy_bytes_per_s", "copy_crc_bytes_per_s", "copy_crc4m_bytes_per_s", "register_bytes_per_s",
              "crc_in_place_bytes_per_s", "h2d_registered_bytes_per_s", "h2d_pinned_bytes_per_s"):
        print(f"  {k[:-12]:18}{g(k)}")
    print(f"  register_s        {res.get('register_s', 0):7.2f} s (error {res.get('register_error')})")


if __name__ == "__main__":
    main()
