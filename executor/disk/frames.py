"""The disk tier with a codec: each full block is encoded into a frame (kept raw when that is
not smaller) by `append` on the cpu lane and written to the block's slot by `flush` on the disk
lane; `read` fetches the stored frames (checksum over the stored bytes) and `decode`, on the cpu
lane, restores the raw bytes and the row's tail into the staging. A slot is a block long, so the
disk space is the raw size; the link carries the stored size."""
from __future__ import annotations

import errno
import time

import crc32c
import torch

from kvpipe.executor.disk.tier import ALIGN, DiskError, DiskFile, aligned_buffer


class FramedDiskFile(DiskFile):
    """A DiskFile whose blocks go through `codec` (elements of `elem` bytes)."""

    def __init__(self, kv_dir: str, rows: int, row_bytes: int, block_bytes: int, threads: int,
                 pin: bool, codec, elem: int, io: str | None = None) -> None:
        super().__init__(kv_dir, rows, row_bytes, block_bytes, threads, pin, io)   # no ring rows (windows.disk_rings)
        self.codec, self.elem = codec, elem
        self.stored = [[0] * self.blocks_per_row for _ in range(rows)]      # frame bytes; 0: raw
        self.pending: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(rows)]

    def _full_block(self, row: int, block: int, tail: memoryview) -> None:
        self._encode_block(row, block, tail)

    def _encode_block(self, row: int, block: int, tail: memoryview) -> None:
        """Frame of a full block, kept in an aligned buffer until `flush` writes it."""
        t0 = time.perf_counter()
        frame = self.codec.encode(tail, self.elem)
        self.stats.add(encode_s=time.perf_counter() - t0, codec_raw_bytes=self.block_bytes,
                       codec_stored_bytes=min(len(frame), self.block_bytes))
        n = len(frame)
        if n >= self.block_bytes:          # not smaller: stored raw
            n, frame = 0, tail
        buf = aligned_buffer(-(-(n or self.block_bytes) // ALIGN) * ALIGN, pin=False)
        view = memoryview(buf.numpy())
        view[:len(frame)] = frame
        t0 = time.perf_counter()
        self.crcs[row][block] = crc32c.crc32c(view[:n or self.block_bytes])
        self.stats.add(checksum_s=time.perf_counter() - t0, checksum_bytes=n or self.block_bytes)
        self.stored[row][block] = n
        self.pending[row].append((block, buf))

    def flush(self, rows: list[int]) -> int:
        """Write the frames `append` encoded for `rows`; returns the bytes written."""
        before = self.stats.write_bytes
        self._parallel([(self._flush_row, row) for row in rows])
        return self.stats.write_bytes - before

    def _flush_row(self, row: int) -> None:
        for block, buf in self.pending[row]:
            self._write_block(row, block, memoryview(buf.numpy()), checksum=False)
        self.pending[row] = []

    def read(self, items: list[tuple[int, memoryview]], frames: list[memoryview] | None = None) -> int:
        """Fetch the stored frames of each (row, dst)'s full blocks into `frames` (one per item,
        block k at k * block_bytes, ALIGN-aligned), verifying each; `decode` fills dst later.
        Returns the bytes read from the file."""
        if frames is None or len(frames) != len(items):
            raise ValueError("frames: one frame buffer per item is needed with a codec")
        before = self.stats.read_bytes
        self._parallel([(self._read_frame, row, k, frames[i]) for i, (row, dst) in enumerate(items)
                        for k in range(self._full_blocks(row, len(dst)))])
        return self.stats.read_bytes - before

    def _read_frame(self, row: int, k: int, frames: memoryview) -> None:
        B, n = self.block_bytes, self.stored[row][k] or self.block_bytes
        view = frames[k * B:k * B + -(-n // ALIGN) * ALIGN]
        t0 = time.perf_counter()
        done = self.io.pread(view, self._offset(row, k))
        t1 = time.perf_counter()
        if done != len(view):
            raise DiskError(errno.EIO, f"disk: short read of {self.path} at offset {self._offset(row, k)}")
        self._verify(row, k, view[:n])
        self.stats.add(read_bytes=len(view), read_s=t1 - t0, checksum_s=time.perf_counter() - t1,
                       checksum_bytes=n)

    def decode(self, items: list[tuple[int, memoryview]], frames: list[memoryview]) -> None:
        """Restore each (row, dst) from the frames `read` fetched, and the row's tail."""
        tasks = []
        for (row, dst), fr in zip(items, frames):
            full = self._full_blocks(row, len(dst))
            tasks += [(self._decode_block, row, k, fr, dst) for k in range(full)]
            if len(dst) % self.block_bytes:
                tasks.append((self._copy_tail, row, full, dst))
        self._parallel(tasks)

    def _decode_block(self, row: int, k: int, frames: memoryview, dst: memoryview) -> None:
        B, n = self.block_bytes, self.stored[row][k]
        out = dst[k * B:(k + 1) * B]
        if n:
            t0 = time.perf_counter()
            self.codec.decode(frames[k * B:k * B + n], out)
            self.stats.add(decode_s=time.perf_counter() - t0)
        else:
            out[:] = frames[k * B:(k + 1) * B]

