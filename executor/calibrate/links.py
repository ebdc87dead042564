"""`kvpipe calibrate`'s links: pinned H2D/D2H as alpha + bytes/beta (isolated copies, copies queued
back to back, both directions at once) and the O_DIRECT disk read/write rate and latency."""
from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvpipe.pipeline.calibration import Calibration, fit_alpha_beta, fit_alpha_beta_relative

from kvpipe.executor.calibrate.timing import MiB, cuda_median_s, graph_median_s


def copy_series(direction, n: int, size: int, reps: int = 5) -> tuple[float, float]:
    """Seconds per copy of `n` copies of `size` bytes queued back to back on one stream, as the
    executor issues a group's per-head fetches and a lane's consecutive stages: (queued eagerly
    behind a sleep kernel, so the host's issue rate cannot show; captured in a CUDA graph and
    replayed, as a replayed decode step runs its fetches)."""
    stream = torch.cuda.current_stream()
    queued = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)          # tens of ms of GPU cycles: longer than issuing n copies
        a.record(stream)
        for i in range(n):
            direction(size, i)
        b.record(stream)
        b.synchronize()
        queued.append(a.elapsed_time(b) / 1e3 / n)
    def copies() -> None:
        for i in range(n):
            direction(size, i)
    graphed = graph_median_s(copies, reps) / n
    return statistics.median(queued[1:]), graphed


SERIES_SIZES = (64 * 1024, 256 * 1024, MiB, 2 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)


def link_series(cal: Calibration, n: int = 32) -> None:
    """The link costs the lanes pay: pinned copies queued back to back on one stream (n per size,
    each from/to its own region), seconds per copy vs size, fitted as alpha + bytes/beta in
    relative error. These replace the isolated-copy fit of `links` (kept in the JSON record as
    link_isolated): a copy's latency alone (launch, completion) is not what the next copy queued
    behind it waits for. The same series captured in a CUDA graph (a replayed step's fetches) is
    fitted too and kept in the record (`{h2d,d2h}_graph_alpha_s`, `..._bytes_per_s`)."""
    top = max(SERIES_SIZES)
    host = torch.empty(n * top, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n * top, dtype=torch.uint8, device="cuda")
    cal.extra["link_isolated"] = {k: cal.values[k] for k in ("link.h2d_alpha_s", "link.h2d_bytes_per_s",
                                                             "link.d2h_alpha_s", "link.d2h_bytes_per_s")}
    for name, direction in (("h2d", lambda s, i: dev[i * s:(i + 1) * s].copy_(host[i * s:(i + 1) * s], non_blocking=True)),
                            ("d2h", lambda s, i: host[i * s:(i + 1) * s].copy_(dev[i * s:(i + 1) * s], non_blocking=True))):
        pts = [copy_series(direction, n, s) for s in SERIES_SIZES]
        alpha, beta = fit_alpha_beta_relative(SERIES_SIZES, [q for q, _ in pts])
        how = (f"{n} pinned {name.upper()} copies queued back to back on one stream behind a sleep kernel, sizes "
               f"{SERIES_SIZES[0] // 1024} KiB-{top // MiB} MiB, GPU seconds per copy")
        cal.set(f"link.{name}_alpha_s", alpha, how + ", intercept of the relative least-squares fit")
        cal.set(f"link.{name}_bytes_per_s", beta, "slope of the same fit (" + how + ")")
        g_alpha, g_beta = fit_alpha_beta_relative(SERIES_SIZES, [g for _, g in pts])
        cal.extra[f"{name}_graph_alpha_s"], cal.extra[f"{name}_graph_bytes_per_s"] = g_alpha, g_beta
        cal.extra[f"{name}_series_points"] = [{"bytes": s, "queued_s": q, "graph_s": g}
                                              for s, (q, g) in zip(SERIES_SIZES, pts)]


def links(cal: Calibration, quick: bool) -> None:
    sizes = [64 * 1024, MiB, 16 * MiB, 128 * MiB, 512 * MiB] + ([] if quick else [1024 * MiB])
    host = torch.empty(sizes[-1], dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(sizes[-1], dtype=torch.uint8, device="cuda")
    for name, direction in (("h2d", lambda n: dev[:n].copy_(host[:n], non_blocking=True)),
                            ("d2h", lambda n: host[:n].copy_(dev[:n], non_blocking=True))):
        secs = [cuda_median_s(lambda n=n: direction(n), 5) for n in sizes]
        alpha, beta = fit_alpha_beta(sizes, secs)
        cal.set(f"link.{name}_alpha_s", alpha, f"least squares of pinned {name.upper()} copies 64 KiB-{sizes[-1] // MiB} MiB")
        cal.set(f"link.{name}_bytes_per_s", beta, f"slope of the same fit (pinned {name.upper()})")
        cal.extra[f"{name}_points"] = list(zip(sizes, secs))
    n = 256 * MiB
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            dev[:n].copy_(host[:n], non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev[n:2 * n], non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)
    sec = cuda_median_s(both, 5)
    one = n / cal.values["link.h2d_bytes_per_s"]
    cal.set("link.pcie_duplex", bool(sec < 1.5 * one), f"256 MiB each way on two streams took {sec * 1e3:.1f} ms vs {one * 1e3:.1f} ms one way")
    cal.extra["duplex_total_bytes_per_s"] = 2 * n / sec


def disk(cal: Calibration, kv_dir: str, quick: bool, block: int = 16 * MiB, depth: int = 4) -> None:
    """O_DIRECT sequential write then read of one file in `kv_dir`, `depth` requests in flight."""
    total = (512 if quick else 2048) * MiB
    cal.set("disk.bytes", shutil.disk_usage(kv_dir).free, f"free bytes of {kv_dir} at calibration")
    path = os.path.join(kv_dir, f"kvpipe-calibrate-{os.getpid()}.bin")
    bufs = [mmap.mmap(-1, block) for _ in range(depth)]   # page-aligned, as O_DIRECT needs
    for b in bufs:
        b.write(os.urandom(block))
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        offsets = list(range(0, total, block))
        with ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: os.pwrite(fd, bufs[i % depth], offsets[i]), range(len(offsets))))
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(lambda i: os.preadv(fd, [bufs[i % depth]], offsets[i]), range(len(offsets))))
            read_s = time.perf_counter() - t0
        small = mmap.mmap(-1, 4096)
        lat = []
        for off in offsets[:: max(1, len(offsets) // 32)]:
            t0 = time.perf_counter()
            os.preadv(fd, [small], off + block // 2)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    direct = "O_DIRECT" if hasattr(os, "O_DIRECT") else "buffered (no O_DIRECT on this OS)"
    cal.set("disk.write_bytes_per_s", total / write_s, f"{direct} write of {total // MiB} MiB in {block // MiB} MiB blocks, {depth} in flight, fsync")
    cal.set("disk.read_bytes_per_s", total / read_s, f"{direct} read of the same file, {depth} in flight")
    cal.set("disk.alpha_s", statistics.median(lat), f"{direct} 4 KiB reads at {len(lat)} offsets, median")
