"""The parallel load of a KV directory (executor/kv/saved.py `load`) on a store built directly, every
tier (GPU-resident, host, disk) and several checksummed blocks per unit: bit for bit the saved
store whatever the thread count, and a corrupt byte in any block named by file and offset."""
from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")

from kvpipe.executor.disk.tier import aligned_buffer   # noqa: E402
from kvpipe.executor.kv import loader, saved   # noqa: E402
from kvpipe.executor.kv.layout import DiskOptions, KVLayout   # noqa: E402
from kvpipe.executor.kv.store import KVStore   # noqa: E402

N = 300                       # tokens: 38400-byte units of fp32, head_dim 16
BLOCK = 8192                  # 5 checksummed blocks a unit, the last one partial
PIECE = 4096                  # read and checksummed in 2 parts a block (O_DIRECT where aligned)
# 3 layers x 4 KV heads: GPU-resident heads first, disk heads last, host between
LAYOUT = KVLayout(1, 4, 16, N + 8, (1, 0, 2), 2, 4, (1, 2, 0), 16)


def store(tmp_path, device: str = "cpu") -> KVStore:
    return KVStore(LAYOUT, torch.device(device), torch.float32, DiskOptions(str(tmp_path)))


def units(s: KVStore) -> dict:
    """Every unit's first N tokens as bytes, any tier."""
    out = {}
    for layer, h in saved._units(s):
        buf = aligned_buffer(saved._stride(s, N))
        saved._get(s, layer, h, N, N, buf)
        out[(layer, h)] = buf[:N * s.token_bytes].clone()
    return out


@pytest.fixture
def saved_dir(tmp_path, monkeypatch):
    """A KV directory of random units, and the units' bytes."""
    monkeypatch.setattr(saved, "BLOCK", BLOCK)
    monkeypatch.setattr(loader, "PIECE", PIECE)
    g = torch.Generator().manual_seed(3)
    with store(tmp_path) as a:
        for layer, h in saved._units(a):
            row = torch.randn(N * 2 * 16, generator=g).view(torch.uint8)
            if h >= LAYOUT.first_disk(layer):
                a.disk.append([(a._row(layer, 0, h), memoryview(row.numpy()))])
            else:
                r = LAYOUT.resident[layer]
                home = a.gpu[layer][0, h, :N] if h < r else a.host[layer][0, h - r, :N]
                home.reshape(-1).view(torch.uint8).copy_(row)
        man = saved.save(a, N, N, tmp_path / "kv", {})
        return tmp_path / "kv", man, units(a)


@pytest.mark.parametrize("threads", [1, 4])
def test_parallel_load_gives_the_saved_units_bit_for_bit(saved_dir, tmp_path, threads):
    """Fault caught: a block read into the wrong part of its home (each block at the unit's start,
    or each part of a block at the block's start), a block's crc32c not carried across its parts,
    a unit of one tier loaded into another's home, a staging buffer shared between threads (one
    thread's disk block appended with another's bytes), or the serial and parallel loads differing."""
    d, man, want = saved_dir
    assert len(man["units"][0]["crc32c"]) == 5
    with store(tmp_path) as b:
        assert saved.load(b, d, man, threads=threads) == N
        got = units(b)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.gpu
def test_cuda_load_through_pinned_stages_gives_the_saved_units(saved_dir, tmp_path):
    """Fault caught: a CUDA-resident unit's H2D copy from a pinned half that the next block's read
    overwrote before the copy ran (no event wait), or the stages freed before the copies ended."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    d, man, want = saved_dir
    with store(tmp_path, "cuda") as b:
        saved.load(b, d, man, threads=4)
        got = units(b)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("unit,block,byte", [(0, 0, 17), (1, 4, 17), (5, 2, 7000), (6, 3, 4000), (11, 1, 17)])
def test_a_corrupt_byte_in_any_block_of_a_parallel_load_is_named(saved_dir, tmp_path, unit, block, byte):
    """Fault caught: blocks after a unit's first not verified, the last partial block skipped, a
    disk or GPU-resident unit loaded unverified, a block's later parts not verified, or the error
    naming the unit's offset (or a part's) instead of the corrupt block's."""
    d, man, _ = saved_dir
    u = man["units"][unit]
    at = u["offset"] + block * BLOCK + byte
    path = d / man["data"]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))
    with store(tmp_path) as b, pytest.raises(ValueError) as e:
        saved.load(b, d, man, threads=4)
    assert f"checksum mismatch in {path} at offset {u['offset'] + block * BLOCK} " in str(e.value)


def test_a_load_leaves_the_saved_directory_unchanged(saved_dir, tmp_path):
    """Fault caught: a load that writes into the saved file (a writable descriptor or mapping the
    continuation's homes land in) or rewrites its manifest."""
    d, man, _ = saved_dir
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir()}
    with store(tmp_path) as b:
        saved.load(b, d, man, threads=4)
        b.host[0][0, 0, N:N + 4].fill_(1.0)     # the continuation's next tokens go into the homes
        b.host[0][0, 0, :4].fill_(2.0)
    assert before == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir()}


def test_a_manifest_listing_too_few_checksums_is_refused(saved_dir, tmp_path):
    """Fault caught: a unit whose manifest lists fewer checksums than its blocks loaded with the
    last blocks unread and unverified (the home's tail left as it was)."""
    d, man, _ = saved_dir
    man["units"][7]["crc32c"] = man["units"][7]["crc32c"][:-1]
    with store(tmp_path) as b, pytest.raises(ValueError, match="lists 4 checksums for the unit at offset"):
        saved.load(b, d, man, threads=4)
