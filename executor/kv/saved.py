"""A KV directory: the K/V of a conversation's first `n` tokens, every (layer, KV head) unit of
every tier (GPU-resident units too), written out so a later run continues from it.

    DIR/manifest.json       what `manifest(...)` returns, plus "data" and "units" (below)
    DIR/kv-<id>.bin         unit u's n tokens x [K; V] x head_dim in the model's dtype, at an
                            ALIGN-aligned offset (O_DIRECT-friendly); each BLOCK bytes of it
                            has its crc32c in the manifest

Each save writes a new data file, then the manifest, each to a temporary name first, fsynced and
renamed, then removes the data files the manifest no longer names: a crash leaves the previous
save whole, or no manifest at all, never a half one. `load` verifies every block and names the
file and byte offset of a corrupt one."""
from __future__ import annotations

import json
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch

from kvpipe.executor.disk.tier import ALIGN, aligned_buffer
from kvpipe.executor.kv.pinned import release_cached_pinned
from kvpipe.executor.kv.store import KVStore

FORMAT = "kvpipe-kv"
VERSION = 1
MANIFEST = "manifest.json"
BLOCK = 4 << 20          # checksummed span of a unit's bytes
THREADS = max(2, min(16, os.cpu_count() or 2))   # readers: one a core, up to the link's need


def _units(store: KVStore) -> list[tuple[int, int]]:
    lo = store.layout
    return [(layer, h) for layer in range(lo.layers) for h in range(lo.kv_heads)]


def _stride(store: KVStore, n: int) -> int:
    return -(-n * store.token_bytes // ALIGN) * ALIGN


def _tensor(buf: torch.Tensor, store: KVStore, n: int) -> torch.Tensor:
    return buf[:n * store.token_bytes].view(store.dtype).view(n, 2, store.layout.head_dim)


def _get(store: KVStore, layer: int, h: int, n: int, length: int, buf: torch.Tensor) -> None:
    """Unit (layer, h)'s first n tokens into `buf` (the row holds `length`)."""
    lo = store.layout
    if h >= lo.first_disk(layer):
        row = aligned_buffer(_stride(store, length))
        store.disk.read([(store._row(layer, 0, h), memoryview(row[:length * store.token_bytes].numpy()))])
        buf[:n * store.token_bytes].copy_(row[:n * store.token_bytes])
        return
    n_res = lo.resident[layer]
    src = store.gpu[layer][0, h, :n] if h < n_res else store.host[layer][0, h - n_res, :n]
    _tensor(buf, store, n).copy_(src)


def _crcs(view: memoryview) -> list[int]:
    return [crc32c.crc32c(view[i:i + BLOCK]) for i in range(0, len(view), BLOCK)]


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def refuse_rings(layout, flag: str) -> None:
    """ValueError naming `flag` where a window layer keeps a ring (executor/kv/ring.py): a KV
    directory holds every unit's first n tokens, which a ring no longer has."""
    if layout.rings:
        raise ValueError(f"{flag}: this model's sliding-window layers keep only their last "
                         f"{max(layout.rings)} tokens (a ring); their KV cannot be saved or loaded")


def save(store: KVStore, n: int, length: int, directory: str | os.PathLike, meta: dict) -> dict:
    """Write the first `n` tokens of every unit (the store holds `length`) and a manifest of
    `meta` plus the data file's units and checksums; returns the manifest."""
    refuse_rings(store.layout, "save-kv")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    units, stride, nb = _units(store), _stride(store, n), n * store.token_bytes
    if store.cuda:
        torch.cuda.synchronize(store.device)
    name = f"kv-{uuid.uuid4().hex[:12]}.bin"
    rows: list[dict] = [{}] * len(units)

    def write(fd: int) -> None:
        def one(i: int) -> None:
            buf = aligned_buffer(stride)
            buf[nb:].zero_()
            _get(store, *units[i], n, length, buf)
            view = memoryview(buf.numpy())
            os.pwrite(fd, view, i * stride)
            rows[i] = {"layer": units[i][0], "head": units[i][1], "offset": i * stride, "crc32c": _crcs(view[:nb])}
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, range(len(units))))
    _write_atomic(d / name, write)
    man = dict(meta, format=FORMAT, version=VERSION, data=name, tokens_saved=n, unit_bytes=nb,
               block_bytes=BLOCK, units=rows)
    text = json.dumps(man).encode()
    _write_atomic(d / MANIFEST, lambda fd: os.write(fd, text))
    for old in d.glob("kv-*.bin"):
        if old.name != name:
            old.unlink()
    return man


def read_manifest(directory: str | os.PathLike, flag: str = "load-kv") -> dict:
    """The manifest of a KV directory; ValueError naming `flag` when it is not one."""
    path = Path(directory) / MANIFEST
    try:
        man = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag}: {str(directory)!r} holds no {MANIFEST} (not a saved KV directory)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        raise ValueError(f"{flag}: {path} is not a {FORMAT} manifest of version {VERSION}")
    return man


def _open(path: Path, flag: str) -> tuple[int, int | None]:
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


def _pread(fds: tuple[int, int | None], dst: torch.Tensor, at: int) -> int:
    """Read len(dst) bytes at file offset `at` into the uint8 CPU tensor `dst`: its ALIGN-aligned
    body with O_DIRECT where the address allows, the rest buffered; returns the bytes read."""
    view, done, n = memoryview(dst.numpy()), 0, dst.numel()
    if fds[1] is not None and dst.data_ptr() % ALIGN == 0 and at % ALIGN == 0 and n >= ALIGN:
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


class _Loader:
    """One load's work: each unit read block by block straight into its final home (a CPU or host
    home; a CUDA unit through a per-thread pinned double buffer and an async H2D copy on the
    thread's stream; a disk unit through a per-thread staging block), each block's crc32c taken
    right after its read, while it is in cache, on the same thread (crc32c releases the GIL)."""

    def __init__(self, store: KVStore, path: Path, fds, n: int, block: int, flag: str) -> None:
        self.store, self.path, self.fds, self.n, self.block, self.flag = store, path, fds, n, block, flag
        self.nb, self.local, self.failed = n * store.token_bytes, threading.local(), threading.Event()

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
        if _pread(self.fds, dst, at) != dst.numel():
            raise ValueError(f"{self.flag}: {self.path} is truncated: short read at offset {at}")
        if crc32c.crc32c(memoryview(dst.numpy())) != crc:
            raise ValueError(f"{self.flag}: checksum mismatch in {self.path} at offset {at} "
                             f"(block of {dst.numel()} bytes): the saved KV is corrupt")

    def unit(self, u: dict) -> None:
        if self.failed.is_set():
            return
        try:
            self._unit(u)
        except BaseException:
            self.failed.set()     # the other threads stop at their next unit
            raise

    def _unit(self, u: dict) -> None:
        s, layer, h, nb = self.store, u["layer"], u["head"], self.nb
        home = self._home(layer, h)
        B = self.block
        if len(u["crc32c"]) != -(-nb // B):   # fewer would leave bytes unread and unverified
            raise ValueError(f"{self.flag}: the manifest lists {len(u['crc32c'])} checksums for the unit at offset "
                             f"{u['offset']} of {self.path}, its {nb} bytes need {-(-nb // B)}")
        spans = [(k * B, min((k + 1) * B, nb), crc) for k, crc in enumerate(u["crc32c"])]
        if home is not None:
            for a, b, crc in spans:
                self._block(home[a:b], u["offset"] + a, crc)
        elif h >= s.layout.first_disk(layer):
            stage = self._stage("row", B, False)
            for a, b, crc in spans:   # a row grows at its end: block by block is one append
                self._block(stage[:b - a], u["offset"] + a, crc)
                s.disk.append([(s._row(layer, 0, h), memoryview(stage[:b - a].numpy()))])
        else:
            self._to_gpu(_flat(s.gpu[layer][0, h, :self.n]), u["offset"], spans)

    def _to_gpu(self, dst: torch.Tensor, offset: int, spans) -> None:
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


def load(store: KVStore, directory: str | os.PathLike, man: dict, flag: str = "load-kv",
         threads: int = THREADS) -> int:
    """Fill an empty store with the directory's units (each block verified) on `threads`
    threads; returns the tokens."""
    refuse_rings(store.layout, flag)
    n, lo = man["tokens_saved"], store.layout
    nb = n * store.token_bytes
    if nb != man["unit_bytes"] or len(man["units"]) != lo.layers * lo.kv_heads:
        raise ValueError(f"{flag}: the saved units ({len(man['units'])} of {man['unit_bytes']} bytes) do not "
                         f"match this model's ({lo.layers * lo.kv_heads} of {nb} bytes)")
    path = Path(directory) / man["data"]
    fds = _open(path, flag)
    try:
        block = man.get("block_bytes", BLOCK)
        if not isinstance(block, int) or block <= 0:
            raise ValueError(f"{flag}: the manifest's block_bytes {block!r} is not a positive integer")
        job = _Loader(store, path, fds, n, block, flag)
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(job.unit, man["units"]))
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
        if store.cuda:
            torch.cuda.synchronize(store.device)   # every H2D copy done before the stages go
            release_cached_pinned()   # the readers' pinned stages back to the system, not torch's cache
    return n
