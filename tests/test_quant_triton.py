"""The Triton dequantise of executor/quant/dequant_triton.py (LOSSY `--lossy int4|int8`, the sparse window's
and a replayed step's decode): its slot rows equal the eager `BlockCodec.decode` bit for bit (on
CPU in Triton's interpreter, in a subprocess: TRITON_INTERPRET must be set before Triton is
imported, and must not leak into this process's compiled kernels; on CUDA compiled, against the
compiled `fused_decode` too), it writes no other row, and it honours a device-held block count
(also inside a captured CUDA graph); the reasons it cannot run; the store's choice of it."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from interpreted import run_interpreted

from kvpipe.executor.quant import dequant_triton as quant_triton
from kvpipe.executor.quant.blocks import BlockCodec, fused_decode

HAS_TRITON = importlib.util.find_spec("triton") is not None
SENTINEL = -3.0           # every slot value the decode must not write
B, H, J0, J1 = 2, 5, 1, 4  # sequences, slot head rows, the rows decoded (a slice not starting at 0)

# (bits, group, head_dim, V group, dtype, blocks nb, count or None): int4 and int8; groups 32 and
# 64; V groups of 64 and 128 channels at D 128 and 16, 32 or 64 at D 64 (1, 2 and 4 scales a
# token: a V group's scale picked by channel // gv); bf16 and fp16 slots; counts below, at 0 and
# past the blocks
CASES = [(4, 32, 128, 64, "bfloat16", 5, None), (4, 32, 128, 128, "bfloat16", 3, 2),
         (8, 64, 128, None, "float16", 3, None), (8, 32, 128, 128, "bfloat16", 4, 0),
         (4, 64, 64, 16, "float16", 3, 7), (8, 32, 64, 64, "bfloat16", 4, 3),
         (4, 32, 64, 32, "bfloat16", 4, None)]


def kv_values(n: int, g: int, D: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """K/V [n, g, 2, D] hard to quantise: heavy tails (a normal times e^(2 x normal)), outlier
    channels (x 30), a block whose K channels and V tokens are constant (scale 1, codes 0), and a
    block near the float16 metadata's limit (|x| up to 6e4: decoded fp16 values may round to inf,
    as the reference's do)."""
    x = torch.randn(n, g, 2, D, generator=gen) * torch.exp(2 * torch.randn(n, g, 2, D, generator=gen))
    x[..., torch.randperm(D, generator=gen)[:D // 16]] *= 30
    x = x.clamp(-6e4, 6e4)
    x[0] = torch.randn(1, 2, D, generator=gen).expand(g, 2, D)              # constant along tokens (K)
    x[0, :, 1] = torch.randn(g, 1, generator=gen).expand(g, D)               # constant along channels (V)
    if n > 1:
        x[1] = (torch.rand(g, 2, D, generator=gen) * 2 - 1) * 6e4
    return x.to(dtype)


def _inputs(case, seed: int, device="cpu"):
    """(codec, qslot, slot, count) for one case: the byte slot a [B, H, nb * record] view cut from
    a wider row, inside a buffer with more heads (the sequence stride is not H x the head stride);
    the exact slot likewise a view of more heads, longer than nb * group, all SENTINEL; `count` a
    one-element slice of an int64 row (as a replayed step's a[N:N + 1])."""
    bits, g, D, vg, dtype, nb, count = case
    dtype = getattr(torch, dtype)
    codec = BlockCodec(bits, g, D, dtype, vg)
    gen = torch.Generator().manual_seed(seed)
    recs = codec.encode(kv_values(B * H * (nb + 2), g, D, dtype, gen)).view(B, H, (nb + 2) * codec.record)
    wide = torch.zeros(B, H + 2, (nb + 2) * codec.record, dtype=torch.uint8)
    wide[:, 1:H + 1] = recs
    qslot = wide[:, 1:H + 1, :nb * codec.record].to(device)
    big = torch.full((B, H + 3, nb * g + 9, 2, D), SENTINEL, dtype=dtype)
    slot = big.to(device)[:, 2:H + 2]
    row = None if count is None else torch.tensor([9, 9, 9, 9, count, 9, 9, 9, 9, 9], device=device)[4:5]
    return codec, qslot, slot, row


_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_quant_triton import J0, J1, _inputs
from kvpipe.executor.quant import dequant_triton as quant_triton
out = []
for i, case in enumerate(eval(sys.argv[2])):
    codec, qslot, slot, count = _inputs(case, i)
    quant_triton.decode_window(codec, qslot, slot, J0, J1, count)
    out.append(slot.clone())
torch.save(out, sys.argv[1])
"""


def _check(case, codec, qslot, before, after) -> None:
    """The rows decoded equal BlockCodec.decode bit for bit (int16 views: -0, inf, NaN compared as
    bits); blocks at or past the count, tokens past nb * group and rows outside [J0, J1) keep
    their SENTINEL."""
    nb, count = case[5], case[6]
    g, D = codec.group, codec.D
    done = nb if count is None else min(count, nb)
    ref = torch.empty(B, J1 - J0, nb, g, 2, D, dtype=codec.dtype)
    codec.decode(qslot[:, J0:J1].reshape(B, J1 - J0, nb, codec.record), ref)
    got = after[:, J0:J1, :nb * g].reshape(ref.shape)
    assert torch.equal(got[:, :, :done].view(torch.int16), ref[:, :, :done].view(torch.int16)), case
    rest = after.clone()
    rest[:, J0:J1, :done * g] = SENTINEL
    assert torch.equal(rest.view(torch.int16), before.view(torch.int16)), case


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernel cannot be interpreted")
def test_the_triton_decode_equals_the_eager_decode_bit_for_bit_in_the_interpreter(tmp_path):
    # Faults caught: the int4 nibbles swapped (the even token or channel is the LOW nibble), K and
    # V swapped or K not transposed (K's codes are channel-major, the slot token-major), a V group's
    # scale or zero taken by token alone or by the wrong channel // gv (gv 16 to 128: 1 to 8
    # scales a token), K's scale taken per token instead of per channel, a field's offset in the
    # record off (the metadata sizes differ by group and gv), fp32 metadata assumed (float16 read),
    # a second rounding (through float16 before bf16) or bf16 truncated instead of rounded to
    # nearest even, the head slice's or the batch's strides ignored (views of wider buffers, rows
    # J0:J1 not from 0, B 2), records placed by nb * record instead of the window's row stride,
    # writes past nb * group or outside the rows, and the count ignored (blocks >= count written) or
    # misread (0, below, past nb).
    got = run_interpreted(_SCRIPT, CASES, tmp_path)
    for i, (case, after) in enumerate(zip(CASES, got)):
        codec, qslot, slot, _ = _inputs(case, i)
        _check(case, codec, qslot, slot, after)


def test_the_reasons_the_triton_decode_cannot_run(monkeypatch):
    # Faults caught: the CPU taken for a device the kernel runs on (outside the interpreter), fp32
    # models' float32 metadata accepted (not exact in float32, and read as float16 it would be
    # garbage), tile widths Triton cannot make (head_dim or group not a power of two) accepted; and
    # decode_window running CPU tensors outside the interpreter, or taking a wrong slot or count.
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ok = BlockCodec(4, 32, 128, torch.bfloat16, 64)
    assert "CUDA" in quant_triton.unavailable(ok, cpu)
    with pytest.raises(ValueError, match="interpreter"):
        codec, qslot, slot, _ = _inputs(CASES[0], 0)
        quant_triton.decode_window(codec, qslot, slot, J0, J1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "float32" in quant_triton.unavailable(BlockCodec(4, 32, 128, torch.float32), cpu)
    assert "head_dim" in quant_triton.unavailable(BlockCodec(4, 32, 96, torch.bfloat16), cpu)
    assert "group" in quant_triton.unavailable(BlockCodec(4, 24, 128, torch.bfloat16), cpu)
    if HAS_TRITON:
        assert quant_triton.unavailable(ok, cpu) is None
    codec, qslot, slot, _ = _inputs(CASES[0], 0)
    with pytest.raises(ValueError, match="slot"):
        quant_triton.decode_window(codec, qslot, slot[:, :, :codec.group], J0, J1)      # too few tokens
    with pytest.raises(ValueError, match="slot"):
        quant_triton.decode_window(codec, qslot, slot.float(), J0, J1)
    with pytest.raises(ValueError, match="count"):
        quant_triton.decode_window(codec, qslot, slot, J0, J1, torch.tensor([1], dtype=torch.int32))


def test_a_cpu_store_reports_its_window_decode_eager(tiny_model):
    # Fault caught: `paths` claiming a kernel (triton or compiled) for a store whose window calls
    # run eagerly (the CPU: not fused), or the Triton path chosen off CUDA.
    from test_dequant_paths import SPARSE_INT4, _store
    with _store(SPARSE_INT4, tiny_model) as store:
        assert store.q.sel_blocks and not store.q.triton_decode
        assert store.q.paths()["window_kernel"] == "eager"


@pytest.mark.gpu
def test_the_triton_decode_equals_eager_and_compiled_on_cuda():
    # Faults caught, on a GPU: the compiled kernel (not the interpreter) differing from the eager
    # decode or from the compiled fused_decode by a bit (the native round to bf16/fp16, the fma),
    # a layout or vectorisation fault of the compiled stores (a row written with another's values),
    # the count read on the host or ignored. Then a 128K-like window (8 heads x 820 records of
    # 4864 B) inside a captured CUDA graph: the count changed between replays is honoured (read on
    # the device; a host sync would fail the capture).
    dev = torch.device("cuda")
    for i, case in enumerate(CASES):
        codec, qslot, slot, count = _inputs(case, i, dev)
        if quant_triton.unavailable(codec, dev):
            pytest.skip(quant_triton.unavailable(codec, dev))
        before = slot.clone()
        quant_triton.decode_window(codec, qslot, slot, J0, J1, count)
        _check(case, codec, qslot.cpu(), before.cpu(), slot.cpu())
        if count is None:
            comp = before.clone()
            fused_decode()(codec, qslot, comp, J0, J1)
            assert torch.equal(comp.view(torch.int16), slot.view(torch.int16)), case
    codec = BlockCodec(4, 32, 128, torch.bfloat16, 64)
    nb, heads = 820, 8
    kv = kv_values(heads * nb, 32, 128, torch.bfloat16, torch.Generator().manual_seed(9)).to(dev)
    qslot = codec.encode(kv).view(1, heads, nb * codec.record)
    slot = torch.full((1, heads, nb * 32 + 16, 2, 128), SENTINEL, dtype=torch.bfloat16, device=dev)
    row = torch.zeros(10, dtype=torch.int64, device=dev)
    quant_triton.decode_window(codec, qslot, slot, 0, heads, row[4:5])          # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_triton.decode_window(codec, qslot, slot, 0, heads, row[4:5])
    ref = torch.empty(1, heads, nb, 32, 2, 128, dtype=torch.bfloat16, device=dev)
    codec.decode(qslot.view(1, heads, nb, codec.record), ref)
    for n in (300, 820):
        slot.fill_(SENTINEL)
        row[4] = n
        graph.replay()
        got = slot[:, :, :nb * 32].view(ref.shape)
        assert torch.equal(got[:, :, :n].view(torch.int16), ref[:, :, :n].view(torch.int16)), n
        assert bool((got[:, :, n:] == SENTINEL).all()) and bool((slot[:, :, nb * 32:] == SENTINEL).all()), n


@pytest.mark.gpu
def test_a_cuda_sparse_int4_store_decodes_its_window_by_the_triton_kernel(tiny_model):
    # Faults caught, on a GPU: the store keeping the compiled window where the Triton kernel runs
    # (bf16, D 64, group 16), `paths` not saying so, a window call not counted, and the kernel
    # compiled inside a timed dequant stage instead of in the store's open.
    from test_dequant_paths import SPARSE_INT4, _expected, _run
    from sparse_runs import CUDA_TINY
    model = tiny_model("llama", **CUDA_TINY)
    graph, paths = _run(model, SPARSE_INT4, decode=4, device="cuda")
    want = _expected(graph, SPARSE_INT4)
    assert paths["window_kernel"] == "triton"
    assert paths["window"] == want["window"] > 0 and paths["eager"] == 0
    assert paths["stage_compiles"] == paths["stage_compile_failures"] == 0


def test_compiled_variants_reads_the_kernels_module_it_imports(monkeypatch):
    # Fault caught: compiled_variants looking up the kernels module under another name than the one
    # decode_window imports (it then counts 0 forever and a compile inside a dequant stage goes unseen).
    name = f"{quant_triton.__package__}.dequant_kernels"
    assert importlib.util.find_spec(name) is not None

    class Kernel:
        device_caches = {0: ({"a": 1, "b": 2},)}
    monkeypatch.setitem(sys.modules, name, type(sys)("fake"))
    sys.modules[name].decode_records = Kernel()
    assert quant_triton.compiled_variants() == 2
