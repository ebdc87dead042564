"""A real lossless CPU block codec (zlib level 1) with nvCOMP's AnsBlocks interface (encode a
batch of equal blocks to padded rows and their sizes; decode at offsets into an output at
offsets), standing in for nvCOMP (which needs CUDA) so the compressed store and the codec
calibration's bookkeeping are tested on CPU. Shared by test_gpucodec.py and test_codec_cal.py."""
import zlib

import torch


class ZlibBlocks:
    def __init__(self, block):
        self.block, self.capacity = block, 2 * block + 64

    def encode(self, src):
        out, sizes = torch.zeros(src.shape[0], self.capacity, dtype=torch.uint8), []
        for i, row in enumerate(src):
            z = zlib.compress(row.numpy().tobytes(), 1)
            out[i, :len(z)] = torch.frombuffer(bytearray(z), dtype=torch.uint8)
            sizes.append(len(z))
        return out, sizes

    def decode(self, src, offsets, sizes, out, out_offsets):
        for at, n, to in zip(offsets, sizes, out_offsets, strict=True):
            raw = zlib.decompress(src[at:at + n].numpy().tobytes())
            assert len(raw) == self.block
            out[to:to + self.block] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
