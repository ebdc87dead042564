"""The disk tier's I/O backends (executor.disk.io): which one a run gets, and that the bytes a
backend writes are where the posix path reads them (kvikio on CUDA only: its I/O loads the CUDA
driver even for host buffers)."""

import os
import random

import pytest
import torch

from kvpipe.executor.disk.tier import ALIGN, DiskFile, aligned_buffer
from kvpipe.executor.disk.io import ENV, kvikio_usable, resolve


def test_auto_is_posix_without_cuda_or_kvikio_and_kvikio_on_demand_is_refused_by_name(monkeypatch):
    """Catches `auto` choosing kvikio where its I/O cannot run (no CUDA driver, or kvikio not
    installed: CI), and an unusable or misspelt backend accepted instead of refused naming the
    field (the argument, or the environment variable when it came from there)."""
    monkeypatch.delenv(ENV, raising=False)
    assert resolve(None) == ("kvikio" if kvikio_usable() else "posix")
    assert resolve("posix") == "posix"
    with pytest.raises(ValueError, match=r"^disk_io: expected one of auto, posix, kvikio, got 'fast'"):
        resolve("fast")
    monkeypatch.setenv(ENV, "Fast")
    with pytest.raises(ValueError, match=rf"^{ENV}: expected one of"):
        resolve(None)
    if not kvikio_usable():
        with pytest.raises(ValueError, match=r"^disk_io: kvikio needs"):
            resolve("kvikio")


def _roundtrip(tmp_path, io: str) -> tuple[list[bytes], list[bytes], str]:
    """Rows appended and read back through backend `io`, and each row's full blocks as the file
    holds them (read by plain os.pread, independent of the backend)."""
    rng = random.Random(3)
    rows, row_bytes = 3, 6 * ALIGN + 100
    want = [bytes(rng.randrange(256) for _ in range(row_bytes)) for _ in range(rows)]
    with DiskFile(str(tmp_path), rows, row_bytes, ALIGN, threads=4, pin=False, io=io) as f:
        for cut in (700, 3 * ALIGN, row_bytes):
            f.append([(r, memoryview(want[r])[f.fill[r]:cut]) for r in range(rows)])
        bufs = [aligned_buffer(row_bytes, pin=False) for _ in range(rows)]
        f.read([(r, memoryview(bufs[r].numpy())) for r in range(rows)])
        got = [bytes(b.numpy()) for b in bufs]
        fd = os.open(f.path, os.O_RDONLY)
        try:
            on_file = [os.pread(fd, f.blocks_per_row * ALIGN, f._offset(r, 0)) for r in range(rows)]
        finally:
            os.close(fd)
        desc = f.stats.io
    assert got == want
    assert on_file == [w[:6 * ALIGN] for w in want]
    return got, on_file, desc


def test_the_posix_backend_writes_blocks_where_they_belong(tmp_path):
    """Catches the backend indirection writing or reading at a wrong offset or length (every
    row's full blocks are checked in the file by plain os.pread, the tails through the read)."""
    _, _, desc = _roundtrip(tmp_path, "posix")
    assert desc.startswith("disk I/O: os.preadv/pwritev")
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
def test_kvikio_writes_and_reads_the_same_bytes_as_posix(tmp_path):
    """Catches kvikio's CuFile placing a block at another offset, reading short, or returning
    before its thread pool finished (the buffer checked too early), on host buffers in O_DIRECT."""
    pytest.importorskip("kvikio")
    got, on_file, desc = _roundtrip(tmp_path, "kvikio")
    assert desc.startswith("disk I/O: kvikio ") and "4 threads" in desc
    assert (got, on_file) == _roundtrip(tmp_path, "posix")[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["none", "zstd-planes"])
def test_disk_units_through_kvikio_give_the_same_bits_as_host_units(tiny_model, tmp_path, monkeypatch, codec):
    """Catches kvikio I/O changing a bit of the output in a real run on CUDA (bf16, pinned
    staging, deep prefetch): logits and tokens equal the plan with those units in host RAM."""
    pytest.importorskip("kvikio")
    from kvpipe.executor.layers.adapter import HFAdapter
    from kvpipe.executor.kv.layout import DiskOptions
    from kvpipe.executor.engine.runner import execute
    from kvpipe.pipeline.builder import build
    from kvpipe.pipeline.plan import Method, PhasePlan, Plan
    from kvpipe.pipeline.workload import Workload
    monkeypatch.setenv(ENV, "kvikio")
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3, dtype=torch.bfloat16, device="cuda")
    spec, w = HFAdapter(model).spec(), Workload(300, 6, 2)
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(11))
    cs = (("disk", codec),)
    plan = lambda disk: Plan(Method.HEADWISE, PhasePlan(2, 64, 3, cs), PhasePlan(1, 1, 3, cs), 2, disk)
    host = execute(build(spec, w, plan(0)), model, ids)
    on_disk = execute(build(spec, w, plan(8)), model, ids, disk=DiskOptions(str(tmp_path), ALIGN, 4))
    assert on_disk.disk["io"].startswith("disk I/O: kvikio ")
    assert torch.equal(on_disk.last_logits, host.last_logits) and torch.equal(on_disk.tokens, host.tokens)
    assert os.listdir(tmp_path) == []
