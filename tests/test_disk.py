"""The disk tier: a real file written and read with O_DIRECT through aligned buffers, every block
checksummed; runs with disk units give the same bits as with host units; the file is gone
after a run however it ends; a corrupt block is an error naming the file and the offset."""

import fcntl
import os
import random
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.disk.tier import ALIGN, DiskError, DiskFile, aligned_buffer
from kvpipe.executor.kv.layout import DiskOptions
from kvpipe.executor.engine.runner import execute
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Kind, Lane
from kvpipe.pipeline.workload import Workload

pytestmark = pytest.mark.usefixtures("single_thread")


def headwise(group, chunk, resident, disk, depth=2):
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth), PhasePlan(group, 1, depth), resident, disk)


# ---- the file ------------------------------------------------------------------------------
def test_rows_read_back_what_was_appended_through_o_direct(tmp_path):
    """Catches lost or shifted bytes at block and tail boundaries (appends of odd sizes cross
    them), a read that sees another row's blocks, and a file opened without O_DIRECT on a file
    system that supports it (ext4/xfs: the page cache would make the rates dishonest)."""
    rng = random.Random(0)
    rows, row_bytes = 3, 5 * ALIGN + 300
    want = [bytearray() for _ in range(rows)]
    with DiskFile(str(tmp_path), rows, row_bytes, ALIGN, threads=3, pin=False) as f:
        assert os.path.getsize(f.path) == rows * 5 * ALIGN        # full blocks only, pre-allocated
        if not f.stats.notes:                                    # O_DIRECT accepted
            assert fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        for size in (1, 511, 4096, 3000, 7000, 5000, 800):
            items = []
            for r in range(rows):
                if len(want[r]) + size > row_bytes:
                    continue
                data = bytes(rng.randrange(256) for _ in range(size))
                want[r] += data
                items.append((r, memoryview(data)))
            f.append(items)
            bufs = [aligned_buffer(len(w) + ALIGN, pin=False) for w in want]
            f.read([(r, memoryview(bufs[r][:len(want[r])].numpy())) for r in range(rows)])
            for r in range(rows):
                assert bytes(bufs[r][:len(want[r])].numpy()) == bytes(want[r]), (r, size)
        assert f.stats.write_bytes == sum(len(w) // ALIGN for w in want) * ALIGN
        path = f.path
    assert not os.path.exists(path)


def test_a_file_larger_than_the_free_space_is_refused_before_it_exists(tmp_path):
    """Catches allocation before the free-space check (a half-made file left behind)."""
    free = __import__("shutil").disk_usage(tmp_path).free
    f = DiskFile(str(tmp_path), 2, free, ALIGN, threads=1, pin=False)
    with pytest.raises(DiskError, match=r"needs .* free in"):
        f.open()
    assert os.listdir(tmp_path) == []


# ---- runs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=2)


def run(model, plan, ids, kv_dir, decode=4, block=ALIGN, **kw):
    g = build(HFAdapter(model).spec(), Workload(ids.shape[1], decode, ids.shape[0]), plan)
    return execute(g, model, ids, disk=DiskOptions(str(kv_dir), block, threads=2), **kw)


@pytest.mark.parametrize("group,resident,disk,batch", [(1, 0, 8, 1), (2, 1, 3, 2), (4, 2, 5, 1)])
def test_disk_units_give_the_same_bits_as_host_units(model, tmp_path, group, resident, disk, batch):
    """Catches any byte of K/V changed, lost or misplaced on its way through the disk (staging
    rows, tails, the group row of a mixed group): logits and tokens must equal bit for bit the
    same plan with those units in host RAM."""
    ids = torch.randint(0, 128, (batch, 150), generator=torch.Generator().manual_seed(group))
    host = run(model, headwise(group, 40, resident, 0), ids, tmp_path)
    on_disk = run(model, headwise(group, 40, resident, disk), ids, tmp_path)
    assert torch.equal(on_disk.last_logits, host.last_logits)
    assert torch.equal(on_disk.tokens, host.tokens)
    g = on_disk.trace.graph
    assert {s.lane for s in g.stages} >= {Lane.DISK}
    reads = [s for s in g.stages if s.kind is Kind.DISK_READ]
    assert sum(on_disk.moved_bytes[s.id] for s in reads) == sum(s.bytes for s in reads)
    assert on_disk.disk["read_bytes"] > 0 and on_disk.disk["checksum_bytes"] > 0
    assert on_disk.disk_bytes > 0 and os.listdir(tmp_path) == []


@settings(max_examples=10)
@given(group=st.sampled_from([1, 2, 4]), resident=st.integers(0, 4), disk=st.integers(1, 4),
       chunk=st.integers(17, 70), context=st.integers(71, 140), batch=st.integers(1, 2),
       block=st.sampled_from([ALIGN, 2 * ALIGN]), codec=st.sampled_from(["none", "zstd-planes"]))
def test_any_disk_placement_keeps_every_bit(model, group, resident, disk, chunk, context, batch, block, codec):
    """Catches boundary cases of the disk path (a row ending exactly on a block, a prefix shorter
    than one block, mixed groups, several sequences, raw-stored frames): for random plans the
    logits equal, bit for bit, the same plan with the disk units in host RAM."""
    ids = torch.randint(0, 128, (batch, context), generator=torch.Generator().manual_seed(context))
    cs = (("disk", codec),)
    plan = lambda d: Plan(Method.HEADWISE, PhasePlan(group, chunk, 2, cs), PhasePlan(group, 1, 2, cs), resident, d)
    with tempfile.TemporaryDirectory() as kv_dir:
        host = run(model, plan(0), ids, kv_dir, decode=3, block=block)
        on_disk = run(model, plan(disk), ids, kv_dir, decode=3, block=block)
        assert os.listdir(kv_dir) == []
    assert torch.equal(on_disk.last_logits, host.last_logits) and torch.equal(on_disk.tokens, host.tokens)


def test_a_flipped_byte_in_the_file_is_an_error_naming_file_and_offset(model, tmp_path):
    """Catches a read that does not verify its blocks (a silently wrong answer): a byte of the
    KV file is flipped mid-run, the next read of that block must fail with the file and offset."""
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    seen = {}

    def flip(s):
        if s.kind is Kind.DISK_READ and s.phase.value == "prefill" and s.step == 3 and not seen:
            (name,) = os.listdir(tmp_path)
            seen["path"] = os.path.join(tmp_path, name)
            fd = os.open(seen["path"], os.O_RDWR)
            try:
                b = os.pread(fd, 1, 100)
                os.pwrite(fd, bytes([b[0] ^ 0x10]), 100)     # inside block 0 of row 0
            finally:
                os.close(fd)

    with pytest.raises(DiskError) as err:
        run(model, headwise(1, 40, 0, 8), ids, tmp_path, stage_hook=flip)
    assert f"checksum mismatch in {seen['path']} at offset 0 " in str(err.value)
    assert os.listdir(tmp_path) == []                        # removed on the failure too


def test_the_file_is_removed_when_a_stage_fails(model, tmp_path):
    """Catches a file left behind when the run dies mid-way on an error."""
    ids = torch.zeros(1, 120, dtype=torch.long)

    def boom(s):
        if s.kind is Kind.DISK_WRITE and s.step == 1:
            assert len(os.listdir(tmp_path)) == 1
            raise RuntimeError("stage failed")

    with pytest.raises(RuntimeError, match="stage failed"):
        run(model, headwise(2, 40, 0, 4), ids, tmp_path, stage_hook=boom)
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["none", "zstd-planes"])
def test_disk_units_give_the_same_bits_as_host_units_on_cuda(tiny_model, tmp_path, codec):
    """Catches, on CUDA in bf16, a disk read racing the h2d copy of its staging (pinned, async),
    a kv_write before its d2h store has landed, or a codec changing a bit: same logits and
    tokens as the plan with those units in pinned host RAM, with deep prefetch."""
    model = tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=3, dtype=torch.bfloat16,
                       device="cuda")
    spec = HFAdapter(model).spec()
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(7))
    w = Workload(300, 8, 2)
    cs = (("disk", codec),)
    plan = lambda disk: Plan(Method.HEADWISE, PhasePlan(2, 64, 3, cs), PhasePlan(1, 1, 3, cs), 2, disk)
    host = execute(build(spec, w, plan(0)), model, ids)
    for disk in (4, 10):
        on_disk = execute(build(spec, w, plan(disk)), model, ids, disk=DiskOptions(str(tmp_path), ALIGN, 4))
        assert torch.equal(on_disk.last_logits, host.last_logits), disk
        assert torch.equal(on_disk.tokens, host.tokens), disk
        assert on_disk.disk["read_bytes"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
def test_registered_host_buffers_are_pinned_and_copy_back_exactly():
    """Catches host tiers left pageable (non_blocking copies would serialise with compute) and
    a registration that is not undone (the next registration of the pages would fail)."""
    from kvpipe.executor.kv.pinned import HostArena
    from gpu_checks import is_registered
    for _ in range(2):
        with HostArena(pin=True) as arena:
            t = arena.empty((3, 1000, 2, 64), torch.bfloat16)
            assert is_registered(t) and t.data_ptr() % ALIGN == 0
            t.copy_(torch.randn(t.shape).to(torch.bfloat16))
            back = torch.empty_like(t)
            dev = t.to("cuda", non_blocking=True)
            back.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, t)
