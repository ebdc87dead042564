"""executor/disk/tier.py's checksum law: a read of a row's prefix verifies every block it takes
from the file, so a corrupted byte anywhere in a multi-block read is an error that names the file
and the offset of the block holding it (not only when the byte sits in the read's first block)."""
import os
import random
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.disk.tier import ALIGN, DiskError, DiskFile, aligned_buffer


@settings(max_examples=15)
@given(rows=st.integers(1, 3), blocks=st.integers(2, 12), block_pages=st.sampled_from([1, 2]),
       tail=st.integers(0, ALIGN - 1), seed=st.integers(0, 2**31), data=st.data())
def test_a_corrupt_byte_anywhere_in_a_multi_block_read_is_found(rows, blocks, block_pages, tail, seed, data):
    """Fault caught: a read of several blocks that verifies the checksum of its first block only
    (or of any subset): one byte is flipped at a random place in a random full block of a random
    row, and reading every row must fail naming that block's offset in the file."""
    rng = random.Random(seed)
    B = block_pages * ALIGN
    row_bytes = blocks * B + tail
    with tempfile.TemporaryDirectory() as kv_dir, DiskFile(kv_dir, rows, row_bytes, B, threads=2, pin=False) as f:
        f.append([(r, memoryview(rng.randbytes(row_bytes))) for r in range(rows)])
        row, block = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, blocks - 1))
        at = (row * f.blocks_per_row + block) * B            # the block's offset, by the file's layout
        pos = at + data.draw(st.integers(0, B - 1))
        fd = os.open(f.path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, pos)[0]
            os.pwrite(fd, bytes([byte ^ data.draw(st.integers(1, 255))]), pos)
            os.fsync(fd)
        finally:
            os.close(fd)
        bufs = [aligned_buffer(row_bytes, pin=False) for _ in range(rows)]
        with pytest.raises(DiskError) as err:
            f.read([(r, memoryview(bufs[r].numpy())) for r in range(rows)])
        assert f"checksum mismatch in {f.path} at offset {at} " in str(err.value)


def test_an_untouched_multi_block_read_passes_every_check(tmp_path):
    """The other side of the law (a check that fires on good data would pass the test above):
    the same reads without corruption return the bytes written."""
    rng = random.Random(1)
    row_bytes = 7 * ALIGN + 100
    with DiskFile(str(tmp_path), 2, row_bytes, ALIGN, threads=2, pin=False) as f:
        want = [rng.randbytes(row_bytes) for _ in range(2)]
        f.append([(r, memoryview(w)) for r, w in enumerate(want)])
        bufs = [aligned_buffer(row_bytes, pin=False) for _ in range(2)]
        f.read([(r, memoryview(bufs[r].numpy())) for r in range(2)])
        assert [bytes(b.numpy()) for b in bufs] == want
