"""The fast ranking and selection of sparse decode (LOSSY, `--sparse F`): the Triton kernels of
executor/sparse/rank_triton.py against a float64 reference written here from the unpacked codes (on
CPU in Triton's interpreter, in a subprocess: TRITON_INTERPRET must be set before Triton is
imported, and must not leak into this process's compiled kernels), the sort-free selection of
executor/sparse_sketch.select against the top tokens the test ranks itself, and, on CUDA, the
kernels against the torch path."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.executor.sparse.homes import SCORE_ENV, score_path

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (units, query heads G, head_dim D, chunks C, chunk, bits, query scale, seed): D 64 and 128,
# bits 2/4/8, G 1 to 8 (3: not a power of two), token counts that end in a part tile (BLOCK_T =
# 64: 96, 160 tokens), and queries so small that every score is near 0 (a dead lane's 0 would
# then weigh as much as a live token in a head's sum of exp).
CASES = [(2, 4, 128, 3, 64, 2, 3.0, 0), (3, 3, 64, 5, 32, 4, 3.0, 1), (1, 8, 128, 3, 32, 8, 3.0, 2),
         (2, 1, 64, 2, 64, 2, 3.0, 3), (1, 4, 128, 5, 32, 2, 3.0, 4), (2, 2, 64, 3, 32, 2, 1e-3, 5)]

_SCRIPT = r"""
import sys, torch
from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.executor.sparse import rank_triton as sparse_triton
out = []
for U, G, D, C, chunk, bits, qscale, seed in eval(sys.argv[2]):
    g = torch.Generator().manual_seed(seed)
    S = C * chunk
    k = (torch.randn(U, S, D, generator=g) * (1 + 10 * torch.rand(D, generator=g))).bfloat16()  # outlier channels
    blocks = k.reshape(U, C, chunk, D)
    lo = torch.zeros(U, C + 2, D, dtype=torch.bfloat16)              # a bigger buffer, sliced as sparse_homes does
    hi = torch.zeros(U, C + 2, D, dtype=torch.bfloat16)
    lo[:, :C], hi[:, :C] = blocks.amin(2), blocks.amax(2)
    codes = sparse_sketch.encode(k, lo[:, :C], hi[:, :C], bits)
    q = (torch.randn(U, G, D, generator=g) * qscale).bfloat16()
    for kernel in sparse_triton.KERNELS:
        rank, s = sparse_triton.rank(q, lo[:, :C], hi[:, :C], codes, bits, with_scores=True, kernel=kernel)
        blocks = {how: sparse_triton.rank(q, lo[:, :C], hi[:, :C], codes, bits, kernel=kernel, blocks=16, how=how)
                  for how in ("sum", "max")}
        out.append(dict(q=q, lo=lo[:, :C].clone(), hi=hi[:, :C].clone(), codes=codes, bits=bits, rank=rank,
                        scores=s, kernel=kernel, blocks=blocks))
torch.save(out, sys.argv[1])
"""


def _reference(q, lo, hi, codes, bits):
    """Float64 scores [U, G, S] of the rebuilt keys lo + (cell + 1/2) (hi - lo) / 2^bits, the cell
    unpacked here by shifts (channel per*i + j in bits j*bits of byte i), and their log group share
    [U, S]: logsumexp over heads of each head's log-softmax over the tokens."""
    U, S, nbytes = codes.shape
    per, L = 8 // bits, 1 << bits
    C, D = lo.shape[-2], lo.shape[-1]
    cells = torch.stack([(codes.long() >> (bits * j)) & (L - 1) for j in range(per)], -1).reshape(U, S, D)
    lod, hid = lo.double().repeat_interleave(S // C, 1), hi.double().repeat_interleave(S // C, 1)
    khat = lod + (cells.double() + 0.5) * (hid - lod) / L                    # [U, S, D]
    qd = q.double() / math.sqrt(D)
    s = qd @ khat.transpose(-1, -2)                                          # [U, G, S]
    share = torch.logsumexp(s - torch.logsumexp(s, -1, keepdim=True), -2)
    mag = qd.abs() @ khat.abs().transpose(-1, -2)                            # sum of |terms|: "token"
    # "chunk" sums q . (lo + step/2) and q step . cell: its terms, not k_hat's, bound its rounding
    step = (hid - lod) / L
    mag_chunk = qd.abs() @ ((lod + step / 2).abs() + cells.double() * step.abs()).transpose(-1, -2)
    return s, share, mag, mag_chunk


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be interpreted")
def test_triton_kernels_score_and_rank_as_the_float64_reference_in_the_interpreter(tmp_path):
    # Faults caught: codes unpacked from the wrong byte or bit (channel i of a byte at bits
    # i*bits), a token given its neighbour chunk's range (chunk index t // chunk), the cell's
    # centre missed (+1/2) or 1/sqrt(D) forgotten, a part tile's dead lanes leaking into a head's
    # max or sum of exp (tail tiles: 96 and 160 tokens), the tiles' (max, sum) combined wrongly
    # into the logsumexp, heads mixed up (G = 1, 3, 4, 8; "dot" pads them to 16 columns: a padded
    # column stored or a head's column swapped), strides of a sliced summary buffer ignored; in
    # the fused block rank (share with GB > 1), a block's tokens taken from the neighbour block, its
    # sum taken as a max (or the reverse), the logsumexp's max not added back. Tolerance: float32
    # rounding of a D-term sum (D * 2^-24 * sum |terms|, x 4; "dot" x 16: on the GPU its 3xTF32
    # products keep ~22 bits of each weight, not 24).
    path = tmp_path / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), repr(CASES)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got_all = torch.load(path)
    kernels = ("token", "chunk", "dot")
    assert [g["kernel"] for g in got_all] == list(kernels) * len(CASES)
    for case, got in zip([c for c in CASES for _ in kernels], got_all):
        s, share, mag, mag_chunk = _reference(got["q"], got["lo"], got["hi"], got["codes"], got["bits"])
        mag = mag if got["kernel"] == "token" else mag_chunk
        D = got["q"].shape[-1]
        tol = (16 if got["kernel"] == "dot" else 4) * D * 2.0 ** -24 * mag + 1e-30
        err = (got["scores"].double() - s).abs()
        assert bool((err <= tol).all()), case
        # the share is a difference of logs of sums of exp: its error is at most twice the scores'
        # worst error (as measured), plus the float32 rounding of log and exp near the values
        bound = 2 * err.amax() + 1e-5 * (1 + share.abs())
        assert bool(((got["rank"].double() - share).abs() <= bound).all()), case
        per = share.reshape(share.shape[0], -1, 16)                      # 16-token blocks, by hand
        for how, ref in (("sum", torch.logsumexp(per, -1)), ("max", per.amax(-1))):
            assert got["blocks"][how].shape == ref.shape, (case, how)
            assert bool(((got["blocks"][how].double() - ref).abs() <= bound.amax() + 1e-5 * (1 + ref.abs())).all()), (case, how)


_SELECT_SCRIPT = r"""
import sys, random, torch
from kvpipe.executor.sparse import rank_triton as sparse_triton
random.seed(0)
g = torch.Generator().manual_seed(0)
out = []
for i in range(int(sys.argv[2])):
    P = random.choice([1, 63, 64, 300, 1024, 1100, 2048, 2100, 5000])   # tiles of 1024: whole, part, one
    sealed = P // 64 * 64
    ties = i % 2 == 1
    rank = (torch.randint(-2, 3, (3, sealed), generator=g).float() if ties        # negative floats too
            else torch.randn(3, sealed, generator=g) * random.choice([1e-3, 1.0, 1e5]))
    budget, sink, recent = random.randint(1, P), random.randint(0, 100), random.randint(0, 300)
    out.append(dict(rank=rank, P=P, budget=budget, sink=sink, recent=recent,
                    got=sparse_triton.select(rank, P, budget, sink, recent, sel_tiles=2),   # several loop turns
                    topk=sparse_triton.select(rank, P, budget, sink, recent, radix=False)))
r = torch.randn(3, 5000, generator=g)
out.append({rm: sparse_triton.threshold(r, 0, 5000, rm) for rm in (1, 7, 100, 4999, 5000)} | {"r": r})
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be interpreted")
def test_triton_selection_takes_exactly_the_top_tokens_in_the_interpreter(tmp_path):
    # Faults caught in the radix select (threshold): a digit taken from the wrong end, the rank
    # sought not reduced by the tokens above the digit, negative floats mis-ordered (their bits
    # must be flipped), tokens outside the decided digits counted. In the two compaction kernels:
    # a tile's place in the output off by its own count, tied tokens taken from a later tile
    # before an earlier one (the lower index first across tiles), tile counts of another loop turn
    # of sel_write lost (2 tiles a turn here), the forced tokens of the unsealed tail or the sink
    # not written, a part tile's dead lanes counted, tokens written out of token order.
    path = tmp_path / "sel.pt"
    r = subprocess.run([sys.executable, "-c", _SELECT_SCRIPT, str(path), "12"],
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    *cases, thr = torch.load(path)
    for c in cases:
        P, budget = c["P"], c["budget"]
        for row in range(3):
            ref = _top_reference(c["rank"][row], P, lambda forced: max(0, min(P, max(budget, forced)) - forced),
                                 c["sink"], c["recent"])
            assert c["got"][row].tolist() == ref and c["topk"][row].tolist() == ref, (P, budget, c["sink"], c["recent"])
    for room in (1, 7, 100, 4999, 5000):   # the radix select's value: the room-th largest, sorted here
        assert thr[room].tolist() == [sorted(row, reverse=True)[room - 1] for row in thr["r"].tolist()]


def _top_reference(rank, prefix, room_of, sink, recent):
    """The tokens a step fetches, chosen here: the forced ones (sink, recent window, unsealed
    tail), then the unforced sealed tokens by decreasing rank, ties to the lower index."""
    sealed = rank.shape[-1]
    must = set(range(min(sink, prefix))) | set(range(max(0, prefix - recent), prefix)) | set(range(sealed, prefix))
    others = sorted((t for t in range(sealed) if t not in must), key=lambda t: (-float(rank[t]), t))
    return sorted(must | set(others[:room_of(len(must))]))


@given(P=st.integers(1, 900), frac=st.floats(0.01, 1.0), sink=st.integers(0, 40), recent=st.integers(0, 200),
       ties=st.booleans(), seed=st.integers(0, 10_000))
def test_sort_free_selection_takes_exactly_the_top_tokens_in_token_order(P, frac, sink, recent, ties, seed):
    # Faults caught: the threshold off by one (room - 1 or room + 1 unforced tokens), tokens equal
    # to the threshold over-taken or taken from the wrong end (the documented rule: the lower index
    # first, the set a stable sort takes), a forced token counted as a ranked one, indices written
    # out of token order or with a hole (the prefix-sum scatter), F = 1 not every token in order.
    g = torch.Generator().manual_seed(seed)
    sealed = P // 64 * 64
    rank = (torch.randint(0, 4, (3, sealed), generator=g).float() if ties
            else torch.randn(3, sealed, generator=g))                       # ties: many equal values
    budget = min(P, max(math.ceil(frac * P), 1))
    got = sparse_sketch.select(rank, P, budget, sink, recent)
    for row in range(3):
        ref = _top_reference(rank[row], P, lambda forced: max(0, min(P, max(budget, forced)) - forced), sink, recent)
        assert got[row].tolist() == ref
    if budget == P:
        assert got[0].tolist() == list(range(P)) and not sparse_sketch.ranks(P, sealed, budget, sink, recent)


def test_the_cpu_store_ranks_by_torch_and_refuses_a_forced_triton(monkeypatch):
    # Faults caught: the CPU path trying the Triton kernels (CPU CI has no Triton; compiled kernels
    # cannot take CPU tensors), and KVPIPE_SPARSE_SCORE=triton silently running the torch path.
    cpu = torch.device("cpu")
    monkeypatch.delenv(SCORE_ENV, raising=False)
    assert score_path(cpu, 128, 2)[0] == "torch"
    monkeypatch.setenv(SCORE_ENV, "triton")
    with pytest.raises(ValueError, match=SCORE_ENV):
        score_path(cpu, 128, 2)
    monkeypatch.setenv(SCORE_ENV, "fast")
    with pytest.raises(ValueError, match=SCORE_ENV):
        score_path(cpu, 128, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_ranking_matches_the_torch_path_on_cuda():
    # Faults caught: the compiled kernels (not the interpreter) differing from the torch path of
    # the same ranking beyond float32 rounding (e.g. a codegen or layout difference on the GPU),
    # the compiled selection kernels picking other tokens than sparse_sketch.select for the same
    # ranking, and a selection that then differs other than at near-ties of the threshold. 8 units x 32K
    # tokens, 2-bit codes, GQA 4, D 128, as one layer of Llama-3-8B shapes.
    from kvpipe.executor.sparse import rank_triton as sparse_triton
    dev = torch.device("cuda")
    if sparse_triton.unavailable(dev, 128, 2):
        pytest.skip(sparse_triton.unavailable(dev, 128, 2))
    g = torch.Generator(device=dev).manual_seed(0)
    U, G, D, chunk, S = 8, 4, 128, 64, 32768
    k = torch.randn(U, S, D, generator=g, device=dev).bfloat16()
    blocks = k.reshape(U, S // chunk, chunk, D)
    lo, hi = blocks.amin(2), blocks.amax(2)
    codes = sparse_sketch.encode(k, lo, hi, 2)
    q = torch.randn(U, G, D, generator=g, device=dev).bfloat16()
    fast, s_fast = sparse_triton.rank(q, lo, hi, codes, 2, with_scores=True)
    s_ref = sparse_sketch.scores(q, lo, hi, codes, 2)
    ref = sparse_sketch.group_share(s_ref)
    assert torch.allclose(s_fast, s_ref, rtol=1e-5, atol=1e-4)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=1e-4)
    P = S + 17
    a = sparse_triton.select(fast, P, S // 5, 64, 256)
    assert torch.equal(a, sparse_sketch.select(fast, P, S // 5, 64, 256))   # same rank: the same tokens
    b = sparse_sketch.select(ref, P, S // 5, 64, 256)
    room = b.shape[-1] - sparse_sketch.forced(P, S, 64, 256).numel()
    for u in range(U):
        differ = set(a[u].tolist()) ^ set(b[u].tolist())
        v = torch.topk(ref[u, 64:P - 256], room).values.min()            # the unforced tokens' room-th best
        assert all(abs(float(ref[u, t]) - float(v)) <= 1e-4 for t in differ)


def test_the_simulator_charges_the_sketch_codes_at_the_decode_attention_rate():
    # Faults caught: the score stage costed by the old torch path (float32 cells written and read:
    # ~8x the bytes), its codes charged at the roofline instead of the profile's decode-attention
    # table (rate and per-call term), the selection's small kernels dropped, or the per-unit
    # figures not scaled by the units. Reference: the profile's numbers, combined here by hand.
    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.cost import stage_seconds
    from kvpipe.pipeline.lossy import SELECT_BYTES_PER_TOKEN, SELECT_KERNELS, LossySpec
    from kvpipe.pipeline.stage import Kind, Phase, Stage
    from dataclasses import replace
    hw = replace(load_profile("h200-testbox"), sparse_score_call_s=None, sparse_score_bytes_per_s=None)
    P, units, G, D = 131072, 8, 4, 128
    cost = LossySpec(sparse=0.2).score_cost(P, G, D, 2, units)
    s = Stage(0, Kind.COMPUTE, "score", Phase.DECODE, 0, 0, None, (0, P), heads=tuple(range(units)), **cost)
    g8 = next(e for e in hw.decode_attention if e.group == 8)
    codes = units * P * D * 2 // 8
    other = units * (P // 64 * 2 * D * 2 + P * (8 * G + 4))
    stream = g8.call_s + codes / g8.bytes_per_s + other / hw.hbm_eff_bytes_per_s
    arith = units * P * D * (2 + 2 * G) / hw.flops_eff("fp32")
    small = max(SELECT_KERNELS * max(hw.small_kernel_s, hw.launch_overhead_s),
                units * P * SELECT_BYTES_PER_TOKEN / (hw.hbm_eff_bytes_per_s * hw.elementwise_efficiency))
    assert stage_seconds(s, hw, "bf16") == pytest.approx(max(stream, arith) + small, rel=1e-12)


def test_a_measured_score_table_costs_the_stage_whole():
    # Faults caught: the profile's measured score stage ([gpu] sparse_score_call_s and
    # sparse_score_bytes_per_s, benchmarks/sparse_score.py) ignored for the decode-attention
    # roofline (9x too fast on the H200), the selection's small kernels charged again on top of a
    # measurement that holds them, or the rate applied to other bytes than the packed codes; and a
    # profile giving one of the pair without the other accepted. Reference: by hand.
    from dataclasses import replace

    from kvpipe.hw_profiles import load_profile
    from kvpipe.pipeline.cost import stage_seconds
    from kvpipe.pipeline.hardware import HardwareFieldError
    from kvpipe.pipeline.lossy import LossySpec
    from kvpipe.pipeline.stage import Kind, Phase, Stage
    hw = replace(load_profile("h200-testbox"), sparse_score_call_s=3e-4, sparse_score_bytes_per_s=1e11)
    P, units, G, D = 131072, 8, 4, 128
    s = Stage(0, Kind.COMPUTE, "score", Phase.DECODE, 0, 0, None, (0, P), heads=tuple(range(units)),
              **LossySpec(sparse=0.2).score_cost(P, G, D, 2, units))
    assert stage_seconds(s, hw, "bf16") == pytest.approx(3e-4 + units * P * D * 2 / 8 / 1e11, rel=1e-12)
    with pytest.raises(HardwareFieldError, match="sparse_score"):
        replace(hw, sparse_score_bytes_per_s=None)


_PIECES_SCRIPT = r"""
import sys, torch
from kvpipe.executor.replay import sparse_step as lossy_replay
from kvpipe.executor.sparse import sketch as sparse_sketch
from kvpipe.executor.sparse import rank_triton as sparse_triton
from kvpipe.pipeline.lossy import LossySpec
g = torch.Generator().manual_seed(3)
out = []
for U, quant in ((5, None), (4, "int4")):          # 5 units: the last piece holds one
    prefix, chunk, D, bits = 1200, 64, 64, 2
    sealed = prefix // chunk * chunk
    k = (torch.randn(U, sealed, D, generator=g) * (1 + 10 * torch.rand(D, generator=g))).bfloat16()
    blocks = k.reshape(U, sealed // chunk, chunk, D)
    lo, hi = blocks.amin(2), blocks.amax(2)
    codes = sparse_sketch.encode(k, lo, hi, bits)
    q = torch.randn(U, 4, D, generator=g).bfloat16()
    spec = LossySpec(quant, sparse=0.2, sketch=bits, sink=32, recent=64)
    row = lossy_replay.step_args(spec, prefix)
    a = torch.tensor(row, dtype=torch.long)
    shapes = (row[lossy_replay.TOTAL], row[lossy_replay.H0], row[lossy_replay.H1], row[lossy_replay.N])
    gb = spec.group if spec.blocks else 1
    whole = sparse_triton.rank_select_static(q, lo, hi, codes, bits, a, *shapes, blocks=gb)
    pieces = sparse_triton.rank_select_static(q, lo, hi, codes, bits, a, *shapes, blocks=gb, piece=2)
    out.append(dict(whole=whole, pieces=pieces, n=row[lossy_replay.N]))
torch.save(out, sys.argv[1])
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton): the kernels cannot be interpreted")
def test_a_selection_by_pieces_equals_the_whole_selection_in_the_interpreter(tmp_path):
    # Faults caught in sparse_triton.rank_select_static's pieces (a replayed step's pipelined
    # selection): a piece's rows written into another piece's place, the last, shorter piece
    # dropped or read past its units (5 units in pieces of 2), the output not zeroed past a
    # step's kept tokens; over tokens and over int4 blocks.
    path = tmp_path / "pieces.pt"
    r = subprocess.run([sys.executable, "-c", _PIECES_SCRIPT, str(path)], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for c in torch.load(path):
        assert c["whole"].shape == c["pieces"].shape and torch.equal(c["whole"], c["pieces"])
        assert bool((c["pieces"][:, :c["n"]] > 0).any()) and bool((c["pieces"][:, c["n"]:] == 0).all())
