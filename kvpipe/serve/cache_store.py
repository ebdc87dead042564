"""Where the server's kept prefixes live: each entry is a KV directory (executor/kv/saved.py, the
`kvpipe generate --save-kv` format: data file, manifest, crc32c per block) in its tier's folder.
Host RAM is a folder on a RAM file system (/dev/shm where there is one), disk a folder under the
cache directory. Both folders are made on first use, named for this process, and removed whole by
`close()`; an entry's size is the bytes of its files."""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

RAM_FS = "/dev/shm"
MANIFEST_SLACK_BYTES = 64 << 10     # the manifest's fixed part (plan, hashes) and then some
ROOT_NAME = re.compile(r"kvpipe-cache-(?:host|disk)-(\d+)-\w+")   # a tier's folder: kvpipe-cache-TIER-PID-RANDOM


def ram_parent() -> str:
    """The folder the host-RAM tier lives under: a RAM file system if this machine has one."""
    return RAM_FS if os.path.isdir(RAM_FS) and os.access(RAM_FS, os.W_OK) else tempfile.gettempdir()


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def predicted_bytes(store, n: int) -> int:
    """The bytes of a KV directory of `n` tokens of `store` (executor/kv/store.KVStore): every
    unit's aligned row, and a manifest of n token ids and a checksum per block per unit."""
    from kvpipe.executor.disk.tier import ALIGN
    from kvpipe.executor.kv.saved import BLOCK
    lo = store.layout
    units, row = lo.layers * lo.kv_heads, n * store.token_bytes
    stride = -(-row // ALIGN) * ALIGN
    return units * stride + 8 * n + units * (96 + 12 * (-(-row // BLOCK))) + MANIFEST_SLACK_BYTES


def reclaim(parent: str) -> tuple[int, int]:
    """Remove the tier folders in `parent` left by servers that died without cleanup (SIGKILL):
    one whose process is gone. A pid reused by a live process keeps its folder (never a live
    server's). Returns (folders removed, their bytes)."""
    from kvpipe.executor.disk.io import left_behind
    removed = nbytes = 0
    for name in left_behind(parent, ROOT_NAME):
        path = Path(parent) / name
        nbytes += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed, nbytes


class DirStore:
    """The prefix cache's `Store` over KV directories; `parents[tier]` the folder each tier's own
    folder is made in."""

    def __init__(self, parents: dict[str, str]) -> None:
        self.parents = dict(parents)
        self.roots: dict[str, Path] = {}

    def root(self, tier: str) -> Path:
        if tier not in self.roots:
            os.makedirs(self.parents[tier], exist_ok=True)
            n, nbytes = reclaim(self.parents[tier])
            if n:
                print(f"kvpipe serve: removed {n} prefix-cache folder{'s' if n > 1 else ''} ({nbytes} bytes) left in "
                      f"{self.parents[tier]} by servers that ended without cleanup", file=sys.stderr, flush=True)
            self.roots[tier] = Path(tempfile.mkdtemp(prefix=f"kvpipe-cache-{tier}-{os.getpid()}-",
                                                     dir=self.parents[tier]))
        return self.roots[tier]

    def new(self, tier: str) -> Path:
        return Path(tempfile.mkdtemp(prefix="entry-", dir=self.root(tier)))

    def nbytes(self, handle: Path) -> int:
        return sum(f.stat().st_size for f in handle.iterdir())

    def move(self, handle: Path, tier: str) -> Path:
        dst = self.new(tier)
        for f in handle.iterdir():
            shutil.move(str(f), dst / f.name)
        handle.rmdir()
        return dst

    def drop(self, handle: Path) -> None:
        shutil.rmtree(handle, ignore_errors=True)

    def close(self) -> None:
        for root in self.roots.values():
            shutil.rmtree(root, ignore_errors=True)
        self.roots.clear()
