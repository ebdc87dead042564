"""A KV directory's load in flight (executor/kv/saved.py `start`): every unit read block by block
straight into its final home by a pool of reader threads, units issued in layer order, each
block's crc32c taken right after its read; `ready(layer)` blocks until one layer's units are home,
so a prefill can run behind the load layer by layer, and `wait()` joins it."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c
import torch

from kvpipe.executor.disk.tier import ALIGN, aligned_buffer
from kvpipe.executor.kv.pinned import release_cached_pinned
from kvpipe.executor.kv.store import KVStore

PIECE = 1 << 20   # bytes read then checksummed at a time: they stay in a core's L2 cache in between


@dataclass(frozen=True)
class LoadStats:
    """What one load did. `read_s`, `crc_s`: thread-seconds summed over the readers (divide by
    `threads` for the wall share); `seconds`: from the start to the last block verified and copied."""

    path: str            # "copy": blocks read into the homes, the caller waiting; "overlapped": a prefill ran behind it
    tokens: int
    bytes: int
    seconds: float
    read_s: float
    crc_s: float
    threads: int

    def to_json(self) -> dict:
        return dict(self.__dict__, rate_bytes_per_s=self.bytes / self.seconds if self.seconds > 0 else None)


def open_file(path: Path, flag: str) -> tuple[int, int | None]:
    """(a buffered descriptor, an O_DIRECT one or None where the file system refuses it: tmpfs,
    whose buffered read is one copy out of RAM anyway)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"{flag}: cannot open {path} ({e.strerror})") from None
    try:
        return fd, os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return fd, None


def _pread(fds: tuple[int, int | None], view: memoryview, ptr: int, at: int) -> int:
    """Read len(view) bytes at file offset `at` into `view` (CPU memory at address `ptr`): its
    ALIGN-aligned body with O_DIRECT where the address allows, the rest buffered; returns the
    bytes read. Memoryviews, not tensors: this runs per piece, holding the GIL."""
    done, n = 0, len(view)
    if fds[1] is not None and ptr % ALIGN == 0 and at % ALIGN == 0 and n >= ALIGN:
        try:
            done = os.preadv(fds[1], [view[:n // ALIGN * ALIGN]], at)
        except OSError:   # a file system that opens O_DIRECT but refuses the request: buffered
            done = 0
    while done < n:
        got = os.preadv(fds[0], [view[done:]], at + done)
        if got <= 0:
            break
        done += got
    return done


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _Reader:
    """One load's per-unit work: a CPU or host home read into in place; a CUDA unit through a
    per-thread pinned double buffer and an async H2D copy on the thread's stream; a disk unit
    through a per-thread staging block appended to its row. crc32c releases the GIL."""

    def __init__(self, store: KVStore, path: Path, fds, n: int, block: int, flag: str) -> None:
        self.store, self.path, self.fds, self.n, self.block, self.flag = store, path, fds, n, block, flag
        self.nb, self.local, self.failed = n * store.token_bytes, threading.local(), threading.Event()
        self.lock, self.read_s, self.crc_s = threading.Lock(), 0.0, 0.0

    def _home(self, layer: int, h: int) -> torch.Tensor | None:
        """The unit's home as flat bytes when a read can land in it (CPU memory), else None."""
        lo, s = self.store.layout, self.store
        if h >= lo.first_disk(layer):
            return None
        n_res = lo.resident[layer]
        if h < n_res:
            return None if s.cuda else _flat(s.gpu[layer][0, h, :self.n])
        return _flat(s.host[layer][0, h - n_res, :self.n])

    def _stage(self, name: str, nbytes: int, pin: bool) -> torch.Tensor:
        buf = getattr(self.local, name, None)
        if buf is None:
            buf = aligned_buffer(nbytes, pin=pin)
            setattr(self.local, name, buf)
        return buf

    def _block(self, dst: torch.Tensor, at: int, crc: int) -> None:
        """One checksummed block, read and checksummed in PIECE-sized parts (each still in the
        core's cache when its crc32c runs, the crc carried from part to part)."""
        value, read_s, crc_s = 0, 0.0, 0.0
        view, ptr = memoryview(dst.numpy()), dst.data_ptr()
        for a in range(0, len(view), PIECE):
            part = view[a:a + PIECE]
            t0 = time.perf_counter()
            got = _pread(self.fds, part, ptr + a, at + a)
            t1 = time.perf_counter()
            if got != len(part):
                raise ValueError(f"{self.flag}: {self.path} is truncated: short read at offset {at + a}")
            value = crc32c.crc32c(part, value)
            read_s, crc_s = read_s + t1 - t0, crc_s + time.perf_counter() - t1
        with self.lock:
            self.read_s, self.crc_s = self.read_s + read_s, self.crc_s + crc_s
        if value != crc:
            raise ValueError(f"{self.flag}: checksum mismatch in {self.path} at offset {at} "
                             f"(block of {dst.numel()} bytes): the saved KV is corrupt")

    def unit(self, u: dict):
        """Load unit `u`; returns the CUDA event its last H2D copy ends with (None off the GPU)."""
        s, layer, h, nb, B = self.store, u["layer"], u["head"], self.nb, self.block
        if len(u["crc32c"]) != -(-nb // B):   # fewer would leave bytes unread and unverified
            raise ValueError(f"{self.flag}: the manifest lists {len(u['crc32c'])} checksums for the unit at offset "
                             f"{u['offset']} of {self.path}, its {nb} bytes need {-(-nb // B)}")
        spans = [(k * B, min((k + 1) * B, nb), crc) for k, crc in enumerate(u["crc32c"])]
        home = self._home(layer, h)
        if home is not None:
            for a, b, crc in spans:
                self._block(home[a:b], u["offset"] + a, crc)
        elif h >= s.layout.first_disk(layer):
            stage = self._stage("row", B, False)
            for a, b, crc in spans:   # a row grows at its end: block by block is one append
                self._block(stage[:b - a], u["offset"] + a, crc)
                s.disk.append([(s._row(layer, 0, h), memoryview(stage[:b - a].numpy()))])
        else:
            return self._to_gpu(_flat(s.gpu[layer][0, h, :self.n]), u["offset"], spans)
        return None

    def _to_gpu(self, dst: torch.Tensor, offset: int, spans) -> torch.cuda.Event:
        """A GPU-resident unit: blocks into two pinned halves in turn, each copied H2D while the
        next block is read (a half is reused once its copy's event has passed)."""
        B = self.block
        stage = self._stage("pinned", 2 * B, True)
        if getattr(self.local, "stream", None) is None:
            self.local.stream = torch.cuda.Stream(self.store.device)
            self.local.events = [None, None]
        ev = self.local.events
        with torch.cuda.stream(self.local.stream):
            for i, (a, b, crc) in enumerate(spans):
                if ev[i % 2] is not None:
                    ev[i % 2].synchronize()
                half = stage[(i % 2) * B:(i % 2) * B + b - a]
                self._block(half, offset + a, crc)
                dst[a:b].copy_(half, non_blocking=True)
                ev[i % 2] = torch.cuda.Event()
                ev[i % 2].record()
        return ev[(len(spans) - 1) % 2]   # the unit's last copy: stream order puts the others before it


class Loading:
    """A load in flight on `threads` reader threads (started by `start()`); units are issued in the
    order given (saved.start: layer by layer). `ready(layer)` blocks until every unit of the layer is home
    (raising the load's error, if any) and returns the CUDA events their copies end with; `wait()`
    joins every reader, closes the file and returns the LoadStats (or raises the first error)."""

    def __init__(self, reader: _Reader, units: list[dict], layers: int, threads: int) -> None:
        self.reader, self.units, self.threads = reader, units, max(1, threads)
        self.path = "copy"   # "overlapped" once a prefill runs behind it (its user sets it)
        self.left = [0] * layers
        for u in units:
            self.left[u["layer"]] += 1
        self.events: list[list] = [[] for _ in range(layers)]
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.t0 = self.t1 = 0.0
        self.stats: LoadStats | None = None

    def start(self) -> "Loading":
        self.t0 = time.perf_counter()
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvpipe-load")
        for u in self.units:
            self.pool.submit(self._one, u)
        return self

    def _one(self, u: dict) -> None:
        if self.reader.failed.is_set():
            return                      # an earlier unit failed: the others stop at their next one
        try:
            ev = self.reader.unit(u)
        except BaseException as e:
            self.reader.failed.set()
            with self.cond:
                self.error = self.error or e
                self.cond.notify_all()
            return
        with self.cond:
            self.left[u["layer"]] -= 1
            if ev is not None:
                self.events[u["layer"]].append(ev)
            self.t1 = time.perf_counter()
            self.cond.notify_all()

    def ready(self, layer: int) -> list:
        with self.cond:
            while self.left[layer] and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise self.error
            return list(self.events[layer])

    def cancel(self) -> None:
        """Stop the readers at their next unit; an unfinished load then fails (`wait` raises)."""
        with self.cond:
            if self.error is None and any(self.left):
                self.error = ValueError(f"{self.reader.flag}: the load was stopped before it ended")
            self.reader.failed.set()
            self.cond.notify_all()

    def wait(self) -> LoadStats:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            try:
                pool.shutdown(wait=True)
            finally:
                for fd in self.reader.fds:
                    if fd is not None:
                        os.close(fd)
                if self.reader.store.cuda:
                    torch.cuda.synchronize(self.reader.store.device)   # every H2D copy done before the stages go
                    release_cached_pinned()   # the readers' pinned stages back to the system, not torch's cache
            r, end = self.reader, time.perf_counter() if self.path == "copy" else self.t1   # overlapped: joined later
            self.stats = LoadStats(self.path, r.n, r.nb * len(self.units), end - self.t0, r.read_s, r.crc_s,
                                   self.threads)
        if self.error is not None:
            raise self.error
        return self.stats
