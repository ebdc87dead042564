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
import re
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch

from kvpipe.executor.disk.tier import ALIGN, aligned_buffer
from kvpipe.executor.kv.loader import Loading, _Reader, open_file
from kvpipe.executor.kv.store import KVStore

FORMAT = "kvpipe-kv"
VERSION = 1
MANIFEST = "manifest.json"
BLOCK = 4 << 20          # checksummed span of a unit's bytes
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
THREADS = max(2, min(16, _CORES))   # readers: one a core this process may run on, up to the link's need


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
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:   # a failed or interrupted write leaves no partial file behind
        tmp.unlink(missing_ok=True)
        raise


def _ours(name: str) -> bool:
    """A file a save writes (data, manifest, or their temporary names)."""
    return re.fullmatch(r"\.?(kv-[0-9a-f]{12}\.bin|manifest\.json)(\.tmp-\d+)?", name) is not None


def check_target(directory: str | os.PathLike, flag: str = "save-kv") -> dict | None:
    """Before any work: `directory` can take a save (a new or empty folder, or a KV directory,
    whose save it replaces). Returns the manifest it would replace, or None; ValueError naming
    `flag` for a file, a folder of other files (a save deletes stale data files there) or one
    that cannot be written."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ValueError(f"{flag}: {str(d)!r} is a file; give a folder (new, empty, or a saved KV directory)")
    top = next(p for p in (d, *d.parents) if p.exists())   # the folder the save creates its own in
    if not top.is_dir():
        raise ValueError(f"{flag}: {str(top)!r} is a file, so no folder can be made under it")
    if not os.access(top, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write in {str(top)!r} (permission denied)")
    try:   # a real folder made and removed: access() says yes to root, and /proc refuses any folder
        os.rmdir(tempfile.mkdtemp(prefix=".kvpipe-probe-", dir=top))
    except OSError as e:
        raise ValueError(f"{flag}: cannot make a folder in {str(top)!r} ({e.strerror})") from None
    if not d.exists():
        return None
    if (d / MANIFEST).is_file():
        try:
            return read_manifest(d, flag)
        except ValueError:
            raise ValueError(f"{flag}: {str(d / MANIFEST)!r} is not a readable {FORMAT} manifest; "
                             "give another folder, or remove that one") from None
    others = sorted(p.name for p in d.iterdir() if not _ours(p.name))
    if others:
        raise ValueError(f"{flag}: {str(d)!r} holds other files ({others[0]}{', ...' if len(others) > 1 else ''}) "
                         f"and no {MANIFEST}; give a new or empty folder, or a saved KV directory")
    return None


def replaced_note(previous: dict | None) -> str:
    """What a save replaced, for the line that reports it ('' for a new directory)."""
    return f"replacing its save of {previous.get('tokens_saved')} tokens" if previous else ""


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
    created = not d.exists()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"save-kv: cannot make {str(d)!r} ({e.strerror})") from None
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
    man = dict(meta, format=FORMAT, version=VERSION, data=name, tokens_saved=n, unit_bytes=nb,
               block_bytes=BLOCK, units=rows)
    try:
        _write_atomic(d / name, write)
        text = json.dumps(man).encode()
        _write_atomic(d / MANIFEST, lambda fd: os.write(fd, text))
    except BaseException as e:   # the previous save stays whole; a folder made for this one goes
        (d / name).unlink(missing_ok=True)
        if created and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
        if isinstance(e, OSError):   # a disk that fills, a folder removed under the save: one line
            raise ValueError(f"save-kv: cannot write in {str(d)!r} ({e.strerror})") from None
        raise
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
        if not Path(directory).is_dir():
            raise ValueError(f"{flag}: {str(directory)!r} does not exist (give a folder --save-kv wrote)") from None
        raise ValueError(f"{flag}: {str(directory)!r} holds no {MANIFEST} (not a saved KV directory)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read {path} ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
        raise ValueError(f"{flag}: {path} is not a {FORMAT} manifest of version {VERSION}")
    return man


def start(store: KVStore, directory: str | os.PathLike, man: dict, flag: str = "load-kv",
          threads: int = THREADS) -> Loading:
    """Start filling an empty store with the directory's units (each block verified) on
    `threads` threads; the caller `wait()`s (or runs a prefill behind it: executor/engine/live.py).
    Shape mismatches are refused here, before any thread starts."""
    refuse_rings(store.layout, flag)
    n, lo = man["tokens_saved"], store.layout
    nb = n * store.token_bytes
    if nb != man["unit_bytes"] or len(man["units"]) != lo.layers * lo.kv_heads:
        raise ValueError(f"{flag}: the saved units ({len(man['units'])} of {man['unit_bytes']} bytes) do not "
                         f"match this model's ({lo.layers * lo.kv_heads} of {nb} bytes)")
    block = man.get("block_bytes", BLOCK)
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"{flag}: the manifest's block_bytes {block!r} is not a positive integer")
    file = Path(directory) / man["data"]
    fds = open_file(file, flag)
    units = sorted(man["units"], key=lambda u: (u["layer"], u["head"]))   # layer by layer: a prefill can follow
    return Loading(_Reader(store, file, fds, n, block, flag), units, lo.layers, threads).start()


def load(store: KVStore, directory: str | os.PathLike, man: dict, flag: str = "load-kv",
         threads: int = THREADS) -> int:
    """Fill an empty store with the directory's units (each block verified) on `threads`
    threads, waiting for all; returns the tokens."""
    return start(store, directory, man, flag, threads).wait().tokens
