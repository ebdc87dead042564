"""zstd on byte planes: the elements' bytes are regrouped by significance and the most
significant plane (sign and exponent bits of bf16/fp16/fp32, highly redundant in K/V) is
compressed with zstd level 1; the other planes (mantissa, near random) are stored as they are.
Lossless for any bit pattern (NaN payloads included): it only moves and entropy-codes bytes."""
from __future__ import annotations

import struct
import sys

import numpy as np
import zstandard

_HEADER = struct.Struct("<BBII")   # version, element bytes, elements, stored bytes of the high plane
_VERSION = 1


class Codec:
    name = "zstd-planes"
    lossless = True

    def __init__(self, level: int = 1) -> None:
        if sys.byteorder != "little":
            raise ValueError("codec: zstd-planes assumes a little-endian host")
        self.level = level

    def encode(self, raw: memoryview, elem: int) -> bytes:
        """Frame of `raw` (a whole number of `elem`-byte elements)."""
        a = np.frombuffer(raw, dtype=np.uint8)
        if elem <= 0 or len(a) % elem:
            raise ValueError(f"raw: {len(a)} bytes are not whole elements of {elem} bytes")
        n = len(a) // elem
        planes = a.reshape(n, elem).T                         # [elem, n]; row elem-1 = high byte
        high = np.ascontiguousarray(planes[elem - 1])
        packed = zstandard.ZstdCompressor(level=self.level).compress(high.data)
        if len(packed) >= n:                                  # incompressible: stored as is
            packed = high.tobytes()
        rest = np.ascontiguousarray(planes[:elem - 1]).tobytes()
        return _HEADER.pack(_VERSION, elem, n, len(packed)) + packed + rest

    def decode(self, frame: memoryview, out: memoryview) -> None:
        """Write the raw bytes of `frame` into `out` (exactly their length)."""
        version, elem, n, stored = _HEADER.unpack_from(frame)
        if version != _VERSION or len(out) != n * elem:
            raise ValueError(f"frame: version {version}, {n * elem} bytes for an output of {len(out)}")
        body = frame[_HEADER.size:]
        dst = np.frombuffer(out, dtype=np.uint8).reshape(n, elem)
        if stored == n:
            dst[:, elem - 1] = np.frombuffer(body[:n], dtype=np.uint8)
        else:
            high = zstandard.ZstdDecompressor().decompress(body[:stored], max_output_size=n)
            dst[:, elem - 1] = np.frombuffer(high, dtype=np.uint8)
        if elem > 1:
            dst[:, :elem - 1] = np.frombuffer(body[stored:stored + n * (elem - 1)],
                                              dtype=np.uint8).reshape(elem - 1, n).T
