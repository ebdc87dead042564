"""The GPU codec of the h2d link, `nvcomp-ans-planes` (lossless): the two bytes of every bf16/fp16
value are split into planes, the high plane (sign and exponent: few distinct values) is coded with
nvCOMP's ANS, the low plane (mantissa: near random) is kept raw (its ratio on random-weight K/V:
docs/PERFORMANCE.md).

`split_planes` / `interleave` are pure torch (they run and are tested on CPU). `AnsBlocks` drives
nvCOMP's batch API on ONE non-default torch stream, handed to the Codec and to every
`as_arrays`: a batch of equal-size blocks is carved out of
one contiguous torch buffer by an offset table (encode: into a torch-owned output, decode: into a
torch-owned output via `out=`), and every nvCOMP wrapper is held until an event recorded after
the call has passed (`_held`), so no wrapper dies while a queued kernel reads its memory. Encode
reads the compressed sizes back (a sync, once per filled block batch); decode reuses one
header-parsed config per batch size, so it syncs once per size, not per call."""
from __future__ import annotations

import sys
from collections import deque

import torch

from kvpipe.pipeline.codecs import REGISTRY, installed

ALIGN = 16   # nvCOMP's safe alignment of every entry's address ("if in doubt, use 16B")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) uint8 planes of a 2-byte tensor, each shaped like `x` (new, contiguous)."""
    if x.element_size() != 2:
        raise ValueError(f"dtype: byte planes need a 2-byte dtype (bf16/fp16), got {x.dtype}")
    assert sys.byteorder == "little", "the planes assume little-endian bytes (x86, ARM)"
    b = x.contiguous().view(torch.uint8).view(*x.shape, 2)       # [..., 2]: low byte first
    return b[..., 1].contiguous(), b[..., 0].contiguous()


def interleave(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes the value whose bytes are (`low`, `high`) into `out` in place (a 2-byte tensor or a
    view of one whose last dim is dense, shaped like the planes); returns `out`. The inverse of
    `split_planes`, bit for bit."""
    if out.element_size() != 2 or (out.dim() and out.stride(-1) != 1):
        raise ValueError(f"out: must be a 2-byte tensor with a dense last dim, got {out.dtype}")
    if high.shape != out.shape or low.shape != out.shape:
        raise ValueError(f"planes: shapes {tuple(high.shape)}, {tuple(low.shape)} differ from out {tuple(out.shape)}")
    b = out.view(torch.uint8).unflatten(-1, (out.shape[-1], 2))
    b[..., 0].copy_(low)
    b[..., 1].copy_(high)
    return out


def check_available(name: str, device: torch.device) -> None:
    """ValueError naming the field unless codec `name` can run on `device`."""
    if name != "nvcomp-ans-planes":
        raise ValueError(f"codec: h2d={name} has no GPU implementation in this executor")
    if device.type != "cuda":
        raise ValueError(f"codec: h2d={name} runs on a CUDA GPU (nvCOMP); this run is on {device}")
    if not installed(REGISTRY[name]):
        raise ValueError(f"codec: h2d={name} needs nvCOMP's Python package: pip install nvidia-nvcomp-cu13")


class AnsBlocks:
    """nvCOMP ANS over batches of `block` raw bytes each, on `stream` (the gpu lane's)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, block: int) -> None:
        from nvidia import nvcomp
        if block <= 0 or block % ALIGN:
            raise ValueError(f"block: must be a positive multiple of {ALIGN} bytes, got {block}")
        self.nv, self.stream, self.block, self.device = nvcomp, stream, block, device
        self.codec = nvcomp.Codec(algorithm="ANS", device_id=device.index, cuda_stream=stream.cuda_stream)
        need = max(self.codec.get_required_compression_alignment(), self.codec.get_required_decompression_alignment())
        if need > ALIGN:
            raise RuntimeError(f"nvCOMP ANS needs {need}-byte aligned buffers; the compressed logs align to {ALIGN}")
        # Encoded capacity per block: ANS never grows a block by more than its headers and chunk
        # table (64 KiB chunks); a block that does not shrink is stored raw by the caller.
        self.capacity = align(block + block // 2 + 65536)
        self.cconfigs: dict[int, object] = {}    # batch size -> CompressConfig
        self.dconfigs: dict[int, object] = {}    # batch size -> DecompressConfig
        self._held: deque = deque()

    def _hold(self, *objs) -> None:
        """Keep `objs` alive until the stream passes this point (then they are dropped)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self._held.append((ev, objs))

    def _carve(self, buf: torch.Tensor, offsets: list[int], sizes: list[int]):
        return self.nv.as_arrays(buf, offsets, sizes, cuda_stream=self.stream.cuda_stream)

    def _compress_config(self, n: int):
        """The CompressConfig of a batch of `n` blocks (built from sizes: no stream sync)."""
        if n not in self.cconfigs:
            self.cconfigs[n] = self.codec.compression_config(uncompressed_sizes=[self.block] * n)
        return self.cconfigs[n]

    def _decompress_config(self, n: int, srcs):
        """The DecompressConfig of a batch of `n` blocks: parsed from the headers of the first
        such batch (one stream sync per batch size), then reused, as nvCOMP allows for buffers of
        the same uncompressed per-element shape (every block here is `block` bytes)."""
        if n not in self.dconfigs:
            self.dconfigs[n] = self.codec.decompression_config(srcs)
        return self.dconfigs[n]

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """src [N, block] uint8 (contiguous, on the GPU) -> (out [N, capacity] uint8, the encoded
        size of each row). Reading the sizes back waits for the encode on the stream."""
        n, blk = src.shape[0], self.block
        if src.dtype != torch.uint8 or tuple(src.shape[1:]) != (blk,) or not src.is_contiguous():
            raise ValueError(f"src: expected contiguous uint8 [N, {blk}], got {src.dtype} {tuple(src.shape)}")
        out = torch.empty(n, self.capacity, dtype=torch.uint8, device=src.device)
        srcs = self._carve(src.view(-1), [i * blk for i in range(n)], [blk] * n)
        outs = self._carve(out.view(-1), [i * self.capacity for i in range(n)], [self.capacity] * n)
        enc = self.codec.encode(srcs, out=outs, compression_config=self._compress_config(n))
        sizes = [int(x) for x in enc.buffer_sizes]
        self._hold(srcs, outs, enc)
        return out, sizes

    def decode(self, src: torch.Tensor, offsets: list[int], sizes: list[int], out: torch.Tensor,
               out_offsets: list[int]) -> None:
        """Decode the encoded blocks at `offsets` (`sizes` bytes each) of the flat uint8 `src` into
        the flat uint8 `out` at `out_offsets` (`block` bytes each), queued on the stream."""
        n = len(offsets)
        if not n:
            return
        srcs = self._carve(src, offsets, sizes)
        outs = self._carve(out, out_offsets, [self.block] * n)
        res = self.codec.decode(srcs, out=outs, decompression_config=self._decompress_config(n, srcs))
        self._hold(srcs, outs, res)

    def close(self) -> None:
        self.stream.synchronize()
        self._held.clear()
