"""Codecs: round trips are bit-exact for every bit pattern (NaN payloads, infinities, denormals,
-0), the registry and `kvpipe codecs` agree with the implementations, compress/decompress are
stages of the graph that the simulator costs, it picks a codec only where it pays, and a run
with a codec on the disk link gives the same bits as the same plan in host RAM."""

import copy
import os
import struct
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpipe.executor.layers.adapter import HFAdapter
from kvpipe.executor.codecs import IMPLEMENTATIONS, load
from kvpipe.executor.disk.tier import DiskError
from kvpipe.executor.kv.layout import DiskOptions
from kvpipe.executor.engine.runner import execute
from kvpipe.hw_profiles import load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.codecs import REGISTRY
from kvpipe.pipeline.cost import stage_seconds
from kvpipe.pipeline.hardware import CodecRates
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Kind, Lane
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.codec_choice import choose_codec

pytestmark = pytest.mark.usefixtures("single_thread")

# Special bit patterns per element width: +-0, +-inf, quiet/signalling NaNs with payloads,
# smallest/largest denormals, +-max finite.
SPECIAL = {
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFF81, 0x7F81, 0x0001, 0x807F, 0x7F7F,   # bf16
        0x7C00, 0xFC00, 0x7E01, 0x7C01, 0x03FF, 0x8001, 0x7BFF],                         # fp16
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0xFFFFFFFF,
        0x00000001, 0x807FFFFF, 0x7F7FFFFF],
}


@st.composite
def element_bytes(draw):
    elem = draw(st.sampled_from([2, 4]))
    n = draw(st.integers(0, 3000))
    value = st.one_of(st.sampled_from(SPECIAL[elem]), st.integers(0, 2 ** (8 * elem) - 1),
                      st.integers(0x3F00, 0x3FFF) if elem == 2 else st.integers(0x3F000000, 0x3FFFFFFF))
    vals = draw(st.lists(value, min_size=n, max_size=n))
    return elem, struct.pack(f"<{n}{'H' if elem == 2 else 'I'}", *vals)


@given(element_bytes())
def test_zstd_planes_round_trips_every_bit_pattern(case):
    """Catches a lossy or misordered plane split (NaN payloads, -0 and denormals included)."""
    elem, raw = case
    codec = load("zstd-planes")
    frame = codec.encode(memoryview(raw), elem)
    out = bytearray(len(raw))
    codec.decode(memoryview(frame), memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zstd_planes_round_trips_tensors_and_compresses_kv_like_data(dtype):
    """Catches a codec that round-trips only by storing raw (it must shrink the redundant
    exponent byte of normally distributed values), or that breaks on a real tensor's bytes."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
    raw = memoryview(x.view(torch.uint8).numpy())
    codec = load("zstd-planes")
    frame = codec.encode(raw, x.element_size())
    out = torch.empty_like(x)
    codec.decode(memoryview(frame), memoryview(out.view(torch.uint8).numpy()))
    assert torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    assert len(raw) / len(frame) > 1.1


def test_registry_lines_and_implementations_agree(capsys):
    """Catches a listed codec that cannot run, and a `kvpipe codecs` line per codec missing its
    lossless/lossy mark or where it runs."""
    from kvpipe.cli import main
    assert main(["codecs"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == list(REGISTRY)
    for ln, info in zip(lines, REGISTRY.values()):
        assert ("lossless" if info.lossless else "LOSSY") in ln and f"runs on {info.lane}" in ln
        if info.lane == "cpu":
            assert info.name in IMPLEMENTATIONS
        if info.lane == "gpu":   # the GPU codec of h2d (executor/codecs/nvcomp_ans_planes.py) refuses only what it cannot run
            from kvpipe.executor.codecs.nvcomp_ans_planes import check_available
            with pytest.raises(ValueError, match="CUDA GPU"):
                check_available(info.name, torch.device("cpu"))
    assert main(["plan", "--codec", "h2d=zstd-planes"]) == 2      # it serves the disk link only


# ---- graph, cost, choice ---------------------------------------------------------------------
LLAMA = PRESETS["llama-3-8b"]


def disk_plan(codec, disk=64, chunk=4096, group=1):
    cs = (("disk", codec),)
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, 2, cs), PhasePlan(group, 1, 2, cs), 0, disk)


def test_codec_stages_sit_between_the_copies_and_the_disk():
    """Catches a codec stage that is missing, on the wrong lane, or not on the data path (a
    write that does not wait for its compression, a fetch that does not wait for decompression)."""
    g = build(LLAMA, Workload(8192, 2), disk_plan("zstd-planes", 40))
    st_ = g.stages
    writes = [s for s in st_ if s.kind is Kind.DISK_WRITE]
    reads = [s for s in st_ if s.kind is Kind.DISK_READ]
    assert writes and reads
    for w in writes:
        (c,) = w.deps
        assert st_[c].kind is Kind.COMPRESS and st_[c].lane is Lane.CPU and st_[c].bytes == w.bytes
    for s in st_:
        if s.kind is Kind.DECOMPRESS:
            assert s.lane is Lane.CPU and st_[s.deps[0]].kind is Kind.DISK_READ
    decomp = {s.id for s in st_ if s.kind is Kind.DECOMPRESS}
    fetches = [s for s in st_ if s.kind is Kind.H2D and s.layer in {r.layer for r in reads}
               and s.heads[-1] == LLAMA.kv_heads - 1 and s.tokens[1] > 0 and s.layer < 8]
    assert fetches and all(set(f.deps) & decomp for f in fetches)


def test_disk_stages_cost_stored_bytes_and_codec_stages_their_rate():
    """Catches a cost model that ignores the ratio on the disk link or the codec's own time."""
    hw = load_profile("h200")
    rates = CodecRates("zstd-planes", 2e9, 4e9, 2.0)
    hw = replace(hw, codecs=(rates,))
    g = build(LLAMA, Workload(8192, 1), disk_plan("zstd-planes", 40))
    for s in g.stages:
        t = stage_seconds(s, hw, "bf16")
        if s.kind is Kind.DISK_READ:
            assert t == pytest.approx(s.ops * hw.disk_alpha_s + s.bytes / 2.0 / hw.disk_read_bytes_per_s)
        if s.kind is Kind.DECOMPRESS:
            assert t == pytest.approx(s.bytes / 4e9)
        if s.kind is Kind.COMPRESS:
            assert t == pytest.approx(s.bytes / 2e9)


@pytest.mark.parametrize("decompress,pays", [(50e9, True), (0.2e9, False)])
def test_the_simulator_picks_the_codec_only_where_it_pays(decompress, pays):
    """Catches a rule that picks a codec by its ratio alone: at the same ratio 1.5, a fast
    decompressor beats the raw disk read, a slow one (slower than the disk) must not be picked."""
    hw = replace(load_profile("h200"), codecs=(CodecRates("zstd-planes", 50e9, decompress, 1.5),))
    w = Workload(16384, 12)
    plan, choice = choose_codec(LLAMA, w, disk_plan("none", 48), hw, "disk")
    totals = dict(choice.total_s)
    assert choice.chosen == ("zstd-planes" if pays else "none")
    assert plan.decode.codec("disk") == choice.chosen
    assert (totals["zstd-planes"] < totals["none"]) is pays


# ---- runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_codec_on_the_disk_link_keeps_every_bit(tiny_model, tmp_path, dtype):
    """Catches any byte changed by compression on the way to disk and back (frames, raw-stored
    blocks, tails): same logits and tokens, bit for bit, as the plan with those units in host RAM;
    and a flipped byte of a stored frame is an error naming the file."""
    model = copy.deepcopy(tiny_model("llama", kv_heads=4, q_heads=8, head_dim=16, layers=2)).to(dtype)
    spec = HFAdapter(model).spec()
    batch = 2 if dtype is torch.float32 else 1      # bf16 matmuls are slow on CPUs without bf16 units
    ids = torch.randint(0, 128, (batch, 160), generator=torch.Generator().manual_seed(1))
    w = Workload(160, 4, batch)
    opts = DiskOptions(str(tmp_path), 4096, threads=2)
    host = execute(build(spec, w, disk_plan("none", 0, 48, 2).with_(resident=1)), model, ids)
    coded = execute(build(spec, w, disk_plan("zstd-planes", 5, 48, 2).with_(resident=1)), model, ids, disk=opts)
    assert torch.equal(coded.last_logits, host.last_logits) and torch.equal(coded.tokens, host.tokens)
    g = coded.trace.graph
    assert any(s.kind is Kind.COMPRESS for s in g.stages) and coded.disk["write_bytes"] > 0

    def flip(s):
        if s.kind is Kind.DISK_READ and s.step == 2 and s.phase.value == "decode":
            (name,) = os.listdir(tmp_path)
            with open(tmp_path / name, "r+b") as f:
                f.seek(20)
                b = f.read(1)
                f.seek(20)
                f.write(bytes([b[0] ^ 1]))

    with pytest.raises(DiskError, match=f"checksum mismatch in {tmp_path}/kvpipe-.* at offset 0 "):
        execute(build(spec, w, disk_plan("zstd-planes", 5, 48, 2).with_(resident=1)), model, ids, disk=opts,
                stage_hook=flip)
    assert os.listdir(tmp_path) == []
