"""The Triton decode attention of executor/layers/decode_triton.py (`attend_decode`'s CUDA kernels):
against a float64 softmax written here, in Triton's interpreter on CPU (in a subprocess:
TRITON_INTERPRET must be set before Triton is imported), with keys past `lens` poisoned with NaN;
the same bits for a head in buffers of other capacities; the reasons it cannot run; on CUDA the
same checks compiled, FA2's output within rounding, a captured replay equal to the eager call, and
a capture of a variant never compiled refused."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import run_interpreted

from kvpipe.executor.layers import decode_triton

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (KV heads G, query heads per KV head R, head dim D, capacity S, keys attended, dtype, split
# constants (SPLIT, BLOCK_N, BLOCK_S) or None for the module's): one split and a partial one,
# lens on a split boundary, lens 1, R 1 and 8, D 32 to 256, fp16, and small constants that make
# both kernels loop (several tiles a split, several combine iterations)
CASES = [(1, 4, 128, 600, 513, "bfloat16", None), (2, 4, 64, 1100, 1024, "float16", None),
         (3, 1, 32, 64, 1, "bfloat16", None), (2, 8, 256, 520, 520, "bfloat16", None),
         (2, 4, 64, 300, 233, "bfloat16", (32, 16, 4)), (1, 2, 128, 200, 200, "float16", (64, 16, 2))]


def _inputs(case, seed: int, device="cpu"):
    """(q, kv, lens, scale): q a head slice of a wider query tensor (head stride 2D), kv a head slice of a wider
    buffer whose rows from `lens` on hold NaN (never to be read), lens a slice of an int32 row."""
    G, R, D, S, n, dtype, _ = case
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    qw = (torch.randn(1, G * R + 3, 1, 2 * D, generator=gen) * 2).to(dtype)[..., :D]   # head stride 2D
    big = (torch.randn(1, G + 2, S, 2, D, generator=gen) * torch.tensor([2.0, 1.0])[:, None]).to(dtype)
    big[:, :, n:] = float("nan")
    row = torch.tensor([7, n, 7], dtype=torch.int32)
    return qw[:, 2:2 + G * R].to(device), big[:, 1:G + 1].to(device), row[1:2].to(device), D ** -0.5


def reference(q, kv, n: int, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T scale) v over keys [0, n), query head h on KV head h // R."""
    G, R = kv.shape[1], q.shape[1] // kv.shape[1]
    k = kv[0, :, :n, 0].double().repeat_interleave(R, 0)     # [Hq, n, D]
    v = kv[0, :, :n, 1].double().repeat_interleave(R, 0)
    w = torch.softmax(torch.einsum("hd,hnd->hn", q[0, :, 0].double(), k) * scale, -1)
    return torch.einsum("hn,hnd->hd", w, v).view(1, 1, -1, q.shape[-1])


def _close(got: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> bool:
    """Within the rounding of the probabilities and the output to the model dtype (2^-7 of the
    largest value, bf16's step; fp16 is finer)."""
    tol = 2.0 ** -7 * v.abs().max().item() + 1e-3
    return bool(torch.isfinite(got).all()) and (got.double() - ref).abs().max().item() <= tol


_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from test_decode_triton import _inputs
from kvpipe.executor.layers import decode_triton as dt
out = []
for i, case in enumerate(eval(sys.argv[2])):
    if case[-1] is not None:
        dt.SPLIT, dt.BLOCK_N, dt.BLOCK_S = case[-1]
    q, kv, lens, scale = _inputs(case, i)
    wide = torch.full((1, kv.shape[1], kv.shape[2] + 700, 2, kv.shape[-1]), float("nan"), dtype=kv.dtype)
    wide[:, :, :kv.shape[2]] = kv
    out.append((dt.attend(q, kv, lens, scale), dt.attend(q, wide, lens, scale)))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be interpreted")
def test_the_triton_decode_attention_equals_a_float64_softmax_in_the_interpreter(tmp_path):
    # Faults caught: keys at or past lens read (NaN there), a partial last split or a partial last
    # tile unmasked, splits past lens combined, the combine's weights not exp2(lse - max) (natural
    # log mixed with log2), a split's output left unnormalised, the query rows of another KV head
    # used (h // R), the head slice's strides ignored (q and kv are views of wider tensors), K and V
    # swapped, the scale dropped, the combine's or a split's loop stopping after one iteration
    # (small constants); and a head's bits depending on its buffer's capacity (the same keys in a
    # buffer 700 rows longer give other bits when splits follow the capacity).
    got = run_interpreted(_SCRIPT, CASES, tmp_path, KVPIPE_DECODE="auto")
    for i, (case, (a, b)) in enumerate(zip(CASES, got)):
        q, kv, lens, scale = _inputs(case, i)
        assert a.shape == (1, 1, q.shape[1], q.shape[-1]) and a.dtype == q.dtype, case
        assert _close(a, reference(q, kv, case[4], scale), kv[0, :, :case[4], 1]), case
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), case


def test_the_reasons_the_triton_decode_attention_cannot_run(monkeypatch):
    # Faults caught: the CPU taken for a device the kernels run on (outside the interpreter), fp32
    # accepted (tiles are bf16/fp16), a head dim Triton cannot tile (96) or more query heads a KV
    # head than a tile's rows accepted, and KVPIPE_DECODE=flash ignored or a bad value accepted.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("KVPIPE_DECODE", raising=False)
    kv = lambda G, D, dt=torch.bfloat16: torch.zeros(1, G, 8, 2, D, dtype=dt)   # noqa: E731
    q = lambda H, D, dt=torch.bfloat16: torch.zeros(1, H, 1, D, dtype=dt)      # noqa: E731
    assert "CUDA" in decode_triton.unavailable(q(8, 128), kv(2, 128))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode_triton.unavailable(q(8, 128), kv(2, 128)) is None
    assert "float32" in decode_triton.unavailable(q(8, 128, torch.float32), kv(2, 128, torch.float32))
    assert "96" in decode_triton.unavailable(q(8, 96), kv(2, 96))
    assert "32 query heads" in decode_triton.unavailable(q(32, 128), kv(1, 128))
    monkeypatch.setenv("KVPIPE_DECODE", "flash")
    assert "flash" in decode_triton.unavailable(q(8, 128), kv(2, 128))
    monkeypatch.setenv("KVPIPE_DECODE", "fast")
    with pytest.raises(ValueError, match="KVPIPE_DECODE"):
        decode_triton.unavailable(q(8, 128), kv(2, 128))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_the_compiled_triton_decode_attention_on_cuda(monkeypatch):
    # Faults caught: as the interpreter test, compiled (the interpreter runs no tile layout, no
    # pipelining); its output away from FA2's varlen call by more than rounding, or no closer to
    # float64 than FA2's (P rounded once to bf16 in the P.V product); a captured replay
    # giving other bits than the eager call (or not following lens moved on the device); and a
    # capture of a variant not compiled before it let through (it would compile inside the capture).
    from kvpipe.executor.layers.attention import attend_decode
    for i, case in enumerate(CASES[:4] + [(8, 4, 128, 40000, 32769, "bfloat16", None)]):
        q, kv, lens, scale = _inputs(case, i, "cuda")
        cu_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, kv.shape[2]], dtype=torch.int32, device="cuda")
        got = decode_triton.attend(q, kv, lens, scale)
        assert _close(got.cpu(), reference(q.cpu(), kv.cpu(), case[4], scale), kv[0, :, :case[4], 1].cpu()), case
        monkeypatch.setenv("KVPIPE_DECODE", "flash")
        flash = attend_decode(q, torch.nan_to_num(kv), lens, cu_q, cu_k, scale)   # FA2 reads whole tiles: NaN * 0
        monkeypatch.delenv("KVPIPE_DECODE")
        assert _close(got.cpu(), flash.double().cpu(), kv[0, :, :case[4], 1].cpu()), case
        wide = torch.full((1, kv.shape[1], kv.shape[2] + 700, 2, kv.shape[-1]), float("nan"), dtype=kv.dtype, device="cuda")
        wide[:, :, :kv.shape[2]] = kv
        assert torch.equal(got.view(torch.int16), decode_triton.attend(q, wide, lens, scale).view(torch.int16)), case
    errs = []
    for i in range(6):   # nearer the float64 softmax rounded to bf16 than FA2 (P kept to ~16 bits, not 8)
        q2, kv2, lens2, sc = _inputs((2, 4, 128, 4000, 2000 + 333 * i, "bfloat16", None), 100 + i, "cuda")
        kv2 = torch.nan_to_num(kv2)
        ref = reference(q2.cpu(), kv2.cpu(), int(lens2), sc).to(torch.bfloat16).double()
        mine = (decode_triton.attend(q2, kv2, lens2, sc).cpu().double() - ref).norm().item()
        monkeypatch.setenv("KVPIPE_DECODE", "flash")
        cu_k2 = torch.tensor([0, kv2.shape[2]], dtype=torch.int32, device="cuda")
        theirs = (attend_decode(q2, kv2, lens2, cu_q, cu_k2, sc).cpu().double() - ref).norm().item()
        monkeypatch.delenv("KVPIPE_DECODE")
        errs.append((mine, theirs))
    print("decode attention error vs float64 (triton, FA2):", errs)
    assert sum(a for a, _ in errs) < sum(b for _, b in errs), errs
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = decode_triton.attend(q, kv, lens, scale)
    g.replay()
    assert torch.equal(out.view(torch.int16), got.view(torch.int16))
    lens.fill_(20000)
    g.replay()
    assert torch.equal(out.view(torch.int16), decode_triton.attend(q, kv, lens, scale).view(torch.int16))
    q7 = torch.zeros(1, 7, 1, 64, dtype=torch.bfloat16, device="cuda")   # 7 query heads a KV head: never compiled
    kv7 = torch.zeros(1, 1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="not compiled"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            decode_triton.attend(q7, kv7, lens, 0.125)
