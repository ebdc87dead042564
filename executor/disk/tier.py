"""The disk tier: one pre-allocated file of fixed-size blocks per run, read and written with
O_DIRECT through page-aligned (pinned on CUDA) buffers by a thread pool, every block checksummed
(crc32c) and verified on every read.

A *row* is one sequence's K/V of one disk unit, `row_bytes` long at most, stored as blocks of
`block_bytes`. Rows only grow at their end: new bytes go into the row's in-memory tail block;
a full tail is written to its slot in the file. A read of a row's prefix takes the full blocks
from the file (verifying each one's crc) and the rest from the tail, so nothing is read that was
not written, and every offset and length the kernel sees is block-aligned. A *ring row* (a
window layer's unit, pipeline/disk_rows.py) has smaller blocks and few slots: logical block k of
its byte stream lies in slot k mod n, so the file keeps only the stream's last n blocks, and a
read of its end from a block boundary is at most two contiguous requests and the tail. (With a
codec the blocks are stored as frames: `executor.disk.frames`.)"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import crc32c
import torch

from kvpipe.pipeline.disk_rows import ring_block_bytes, ring_blocks
from kvpipe.pipeline.units import fmt_bytes

from kvpipe.executor.disk.io import PosixIO, lock, open_io
from kvpipe.executor.disk.stats import DiskStats
from kvpipe.executor.kv.pinned import ALIGN   # O_DIRECT alignment of addresses, offsets and lengths (safe for 512e and 4Kn disks)

IO_BYTES = 8 << 20      # one read request covers at most this many bytes (several blocks)
# The kernel's ways of saying the file cannot grow: the file system is full, the user's quota is
# spent, or the process's file-size limit (RLIMIT_FSIZE) is reached.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskError(OSError):
    """A disk-tier failure the user must see as one line (no space, a corrupt block); its text
    is the message alone (the errno stays in `.errno`)."""

    def __str__(self) -> str:
        return str(self.strerror)


def aligned_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose address is ALIGN-aligned (pinned by torch when `pin`:
    for small buffers only, torch rounds pinned sizes up to a power of two)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


def default_kv_dir() -> str:
    return tempfile.gettempdir()


def free_bytes(kv_dir: str) -> int:
    """Free bytes on the file system holding `kv_dir` (ValueError if it is not a directory)."""
    if not os.path.isdir(kv_dir):
        raise ValueError(f"kv-dir: {kv_dir!r} is not a directory")
    return shutil.disk_usage(kv_dir).free


class DiskFile:
    """Rows of blocks in one file under `kv_dir`; a context manager (creates on enter, removes on
    exit, whatever the exit). Thread-safe across rows; one row is used by one stage at a time."""

    def __init__(self, kv_dir: str, rows: int, row_bytes: int, block_bytes: int, threads: int,
                 pin: bool, io: str | None = None, rings: tuple[int, ...] = ()) -> None:
        """`io`: the I/O backend, auto/posix/kvikio (None: $KVPIPE_DISK_IO; see executor.disk.io);
        `rings`: per row, the bytes of the stream's end it must keep as a ring row (0: a row of
        every byte; (): none)."""
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise ValueError(f"block_bytes: must be a positive multiple of {ALIGN}, got {block_bytes}")
        if threads <= 0:
            raise ValueError(f"threads: must be positive, got {threads}")
        self.kv_dir, self.rows, self.row_bytes, self.block_bytes = kv_dir, rows, row_bytes, block_bytes
        self.threads, self.pin, self.io_kind = threads, pin, io
        self.io: PosixIO | None = None
        self.blocks_per_row = row_bytes // block_bytes        # full blocks; the partial one stays a tail
        if rings and len(rings) != rows:
            raise ValueError(f"rings: one entry per row expected ({rows}), got {len(rings)}")
        self.rings = tuple(rings) or (0,) * rows
        self.block = [ring_block_bytes(r, block_bytes) if r else block_bytes for r in self.rings]   # per row
        self.slots = [ring_blocks(r, b) if r else self.blocks_per_row for r, b in zip(self.rings, self.block)]
        self.base = [0, *accumulate(n * b for n, b in zip(self.slots, self.block))][:rows]   # a row's first slot
        self.tail_at = [0, *accumulate(self.block)][:rows]                                # its tail in `tails`
        self.path: str | None = None
        self.fd: int | None = None
        self.stats = DiskStats()

    @property
    def file_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.slots, self.block))

    def row_file_bytes(self, row: int) -> int:
        return self.slots[row] * self.block[row]

    # ---- lifetime ----------------------------------------------------------------------
    def open(self) -> "DiskFile":
        need, free = self.file_bytes, free_bytes(self.kv_dir)
        if need > free:
            raise DiskError(errno.ENOSPC, f"disk: the KV file needs {fmt_bytes(need)}, "
                                          f"{fmt_bytes(free)} free in {self.kv_dir}")
        self.path = os.path.join(self.kv_dir, f"kvpipe-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv")
        try:
            self._create()
            lock(self.fd)   # held while the run lives: a file without it was left by a dead run
            self.io = open_io(self.io_kind, self.path, self.fd, self.threads)
            self.stats.io = self.io.describe()
            self.tails = aligned_buffer(sum(self.block), pin=False)   # each row's tail block
            self.fill = [0] * self.rows                      # bytes written to each row so far
            self.top = [0] * self.rows                       # the most a ring row held since it was emptied
            self.crcs = [[0] * n for n in self.slots]        # per slot
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvpipe-disk")
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            try:
                self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.fd = os.open(self.path, flags, 0o600)
                self.stats.notes.append(f"O_DIRECT refused by the file system of {self.kv_dir}: "
                                        "reads and writes go through the page cache")
        except OSError as e:
            if e.errno in NO_SPACE:      # no inode left: the file system is full all the same
                raise DiskError(e.errno, f"disk: no space to create the KV file in {self.kv_dir} "
                                         f"({os.strerror(e.errno)})") from None
            raise
        try:
            os.posix_fallocate(self.fd, 0, max(self.file_bytes, 1))
        except OSError as e:
            if e.errno in NO_SPACE:
                raise DiskError(e.errno, f"disk: no space to pre-allocate {fmt_bytes(self.file_bytes)} "
                                         f"for {self.path} ({os.strerror(e.errno)}; "
                                         f"{fmt_bytes(free_bytes(self.kv_dir))} free now)") from None
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(self.fd, self.file_bytes)
            self.stats.notes.append(f"the file system of {self.kv_dir} cannot pre-allocate: the file is sparse")

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "DiskFile":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- I/O ---------------------------------------------------------------------------
    def _slot(self, row: int, block: int) -> int:
        """The slot of the row's logical block (a ring row's wraps)."""
        return block % self.slots[row] if self.rings[row] else block

    def _offset(self, row: int, block: int) -> int:
        return self.base[row] + self._slot(row, block) * self.block[row]

    def _tail(self, row: int) -> memoryview:
        at = self.tail_at[row]
        return memoryview(self.tails[at:at + self.block[row]].numpy())

    def append(self, items: list[tuple[int, memoryview]]) -> None:
        """Append bytes to rows: items (row, bytes); full tail blocks are checksummed and written.
        Rows run in parallel on the pool; raises DiskError on no space, naming the file."""
        self._parallel([(self._append_row, row, data) for row, data in items])

    def _append_row(self, row: int, data: memoryview) -> None:
        B, pos, n = self.block[row], 0, len(data)
        if self.fill[row] + n > self.row_bytes:
            raise ValueError(f"disk row {row}: {self.fill[row] + n} bytes exceed its {self.row_bytes}")
        if self.rings[row]:   # a ring row: blocks this append would overwrite again are not written
            keep = ((self.fill[row] + n) // B - self.slots[row]) * B
            pos = max(0, keep - self.fill[row])
            self.fill[row] += pos
            self.top[row] = max(self.top[row], self.fill[row] + n - pos)
        tail = self._tail(row)
        while pos < n:
            at = self.fill[row] % B
            take = min(B - at, n - pos)
            tail[at:at + take] = data[pos:pos + take]
            pos += take
            self.fill[row] += take
            if at + take == B:
                self._full_block(row, self.fill[row] // B - 1, tail)

    def _full_block(self, row: int, block: int, tail: memoryview) -> None:
        """A tail block just filled: checksum it and write it to its slot."""
        self._write_block(row, block, tail)

    def _write_block(self, row: int, block: int, buf: memoryview, checksum: bool = True) -> None:
        t0 = time.perf_counter()
        if checksum:
            self.crcs[row][self._slot(row, block)] = crc32c.crc32c(buf)
        t1 = time.perf_counter()
        try:
            done = self.io.pwrite(buf, self._offset(row, block))
        except OSError as e:
            if e.errno in NO_SPACE:      # a sparse file (no pre-allocation) on a disk that filled
                raise DiskError(e.errno, f"disk: no space left writing {self.path} at offset "
                                         f"{self._offset(row, block)} ({os.strerror(e.errno)})") from None
            raise
        if done != len(buf):
            raise DiskError(errno.EIO, f"disk: short write to {self.path} at offset {self._offset(row, block)}")
        self.stats.add(write_bytes=len(buf), write_s=time.perf_counter() - t1, checksum_s=t1 - t0,
                       checksum_bytes=len(buf) if checksum else 0)

    def truncate(self, row: int, nbytes: int) -> None:
        """Keep the row's first `nbytes`; a cut inside a written block brings it back to the tail."""
        if nbytes >= self.fill[row]:
            return
        B, k = self.block[row], nbytes // self.block[row]
        if nbytes == 0:
            self.top[row] = 0
        elif self.rings[row] and k < self.top[row] // B - self.slots[row]:
            raise ValueError(f"disk row {row}: its ring no longer holds byte {nbytes}")
        if nbytes % B and (k + 1) * B <= self.fill[row]:
            tail = self._tail(row)
            if self.io.pread(tail, self._offset(row, k)) != B:
                raise DiskError(errno.EIO, f"disk: short read of {self.path} at offset {self._offset(row, k)}")
            self._verify(row, k, tail)
        self.fill[row] = nbytes

    def read(self, items: list[tuple]) -> int:
        """Fill each (row, dst) with the row's first len(dst) bytes, which must be all it holds,
        or each (row, dst, first) with its bytes from `first` (a multiple of the row's block) to
        its end; dst must start ALIGN-aligned. Raises DiskError naming file and offset on a bad
        checksum. Returns the bytes read from the file."""
        before = self.stats.read_bytes
        tasks = []
        for row, dst, *first in items:
            first = first[0] if first else 0
            k0, full = self._span(row, first, len(dst))
            B = self.block[row]
            step = max(IO_BYTES // B, 1)
            b0 = k0
            while b0 < full:   # a request ends at IO_BYTES or where a ring row wraps
                wrap = b0 + self.slots[row] - b0 % self.slots[row] if self.rings[row] else full
                b1 = min(b0 + step, full, wrap)
                tasks.append((self._read_blocks, row, b0, b1, dst, k0))
                b0 = b1
            if (first + len(dst)) % B:
                tasks.append((self._copy_tail, row, full, dst, k0))
        self._parallel(tasks)
        return self.stats.read_bytes - before

    def _span(self, row: int, first: int, n: int) -> tuple[int, int]:
        """(first block, full blocks) of a read of the row from byte `first` to its end, `n` bytes."""
        B = self.block[row]
        if first + n != self.fill[row] or first % B:
            raise ValueError(f"disk row {row}: read of {n} bytes from {first}, it holds {self.fill[row]} "
                             f"(reads start on a {B}-byte block)")
        if self.rings[row] and first // B < self.top[row] // B - self.slots[row]:
            raise ValueError(f"disk row {row}: its ring no longer holds byte {first}")
        return first // B, self.fill[row] // B

    def _full_blocks(self, row: int, n: int) -> int:
        return self._span(row, 0, n)[1]

    def _verify(self, row: int, k: int, data: memoryview) -> None:
        if crc32c.crc32c(data) != self.crcs[row][self._slot(row, k)]:
            raise DiskError(errno.EIO, f"disk: checksum mismatch in {self.path} at offset "
                                       f"{self._offset(row, k)} (block of {self.block_bytes} bytes): "
                                       "the KV file is corrupt")

    def _read_blocks(self, row: int, b0: int, b1: int, dst: memoryview, k0: int = 0) -> None:
        B = self.block[row]
        view = dst[(b0 - k0) * B:(b1 - k0) * B]
        t0 = time.perf_counter()
        done = self.io.pread(view, self._offset(row, b0))
        t1 = time.perf_counter()
        if done != len(view):
            raise DiskError(errno.EIO, f"disk: short read of {self.path} at offset {self._offset(row, b0)}")
        for k in range(b0, b1):
            self._verify(row, k, view[(k - b0) * B:(k - b0 + 1) * B])
        self.stats.add(read_bytes=len(view), read_s=t1 - t0, checksum_s=time.perf_counter() - t1,
                       checksum_bytes=len(view))

    def _copy_tail(self, row: int, full: int, dst: memoryview, k0: int = 0) -> None:
        at = (full - k0) * self.block[row]
        dst[at:] = self._tail(row)[:len(dst) - at]

    def _parallel(self, tasks: list[tuple]) -> None:
        if not tasks:
            return
        futures = [self.pool.submit(fn, *args) for fn, *args in tasks]
        for f in futures:   # wait for all (a buffer must not be reused under a running request)
            f.exception()
        for f in futures:
            f.result()
