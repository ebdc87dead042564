"""Codec calibration (executor/calibrate/codecs.py) and how the model uses it: the per-call fit of a
GPU codec, profiles with and without the new [codec.*] fields, the cost of a GPU codec stage, the
simulated wait of a decode for the fetches issued before it (sim/codec_sync.py), and the CPU codec
of the disk link measured on K/V of a tiny random model. Expected values are computed by hand."""
import random

import pytest
import torch

from kvpipe.executor.calibrate import codecs as cp
from kvpipe.hw_profiles import ProfileError, load_profile
from kvpipe.pipeline.builder import build
from kvpipe.pipeline.calibration import Calibration, to_toml
from kvpipe.pipeline.cost import stage_seconds
from kvpipe.pipeline.hardware import CodecRates
from kvpipe.pipeline.model import PRESETS
from kvpipe.pipeline.plan import Method, PhasePlan, Plan
from kvpipe.pipeline.stage import Kind, Phase
from kvpipe.pipeline.workload import Workload
from kvpipe.sim.codec_sync import decompress_waits
from kvpipe.sim.engine import run
from zlib_blocks import ZlibBlocks

CODEC = "nvcomp-ans-planes"
LLAMA = PRESETS["llama-3-8b"]
BLOCK_RAW = 4096 * 2 * 128 * 2      # raw bytes of one executor block (4096 tokens, K and V, D=128, bf16)


def coded_plan(depth=2, group=8, chunk=16384):
    cs = (("h2d", CODEC),)
    return Plan(Method.HEADWISE, PhasePlan(group, chunk, depth, cs), PhasePlan(group, 1, depth, cs), 0)


def with_rates(hw, **kw):
    from dataclasses import replace
    old = hw.codec(CODEC)
    return replace(hw, codecs=tuple(replace(old, **kw) if c.name == CODEC else c for c in hw.codecs))


# ---- the per-call fit --------------------------------------------------------------------------
def test_fit_recovers_a_known_call_cost_and_rate():
    """Fault caught: call_s and rate swapped or the rate returned in seconds per byte, and a
    plain fit that lets the largest batch set the intercept (relative error is what keeps a
    0.4 ms call cost visible under 512-block batches). Timings: t = 0.4 ms + raw / 2 TB/s, with
    +-1% seeded noise."""
    rng = random.Random(0)
    points = [{"raw_bytes": n * BLOCK_RAW, "decode_s": (4e-4 + n * BLOCK_RAW / 2e12) * (1 + rng.uniform(-0.01, 0.01))}
              for n in cp.BATCHES]
    call_s, rate = cp.fit(points, "decode_s")
    assert call_s == pytest.approx(4e-4, rel=0.1) and rate == pytest.approx(2e12, rel=0.05)
    exact = [{"raw_bytes": p["raw_bytes"], "decode_s": 4e-4 + p["raw_bytes"] / 2e12} for p in points]
    assert cp.fit(exact, "decode_s") == pytest.approx((4e-4, 2e12), rel=1e-9)


# ---- profiles ----------------------------------------------------------------------------------
NEW_FIELDS = ("compress_call_s", "decompress_call_s", "split_bytes_per_s", "interleave_bytes_per_s",
              "decompress_waits_h2d")


def old_style_profile(tmp_path):
    """The bundled h200-testbox as written before the per-call fit: its [codec.*] tables without
    the calibrated fields (the bundled file now has them, from the fifth session's calibrate)."""
    text = (load_profile.__globals__["_HERE"] / "h200-testbox.toml").read_text()
    path = tmp_path / "old.toml"
    path.write_text("\n".join(line for line in text.splitlines() if not line.startswith(NEW_FIELDS)) + "\n")
    return path


def test_a_profile_without_the_new_codec_fields_loads_with_their_defaults(tmp_path):
    """Fault caught: profiles written before the per-call fit refused, or loaded with a made-up
    call cost, plane rate or wait."""
    rates = load_profile(str(old_style_profile(tmp_path))).codec(CODEC)
    assert (rates.compress_call_s, rates.decompress_call_s) == (0.0, 0.0)
    assert rates.split_bytes_per_s is None and rates.interleave_bytes_per_s is None
    assert rates.decompress_waits_h2d is False


def test_the_new_codec_fields_round_trip_through_the_toml_and_are_checked(tmp_path):
    """Fault caught: a calibrated [codec.*] field the loader does not know, a boolean read as a
    number, a negative call cost accepted."""
    base = (tmp_path / "base.toml")
    text = old_style_profile(tmp_path).read_text()
    cal = Calibration("x", "y", "z")
    vals = {"compress_call_s": 3e-4, "decompress_call_s": 2.5e-4, "split_bytes_per_s": 1.5e12,
            "interleave_bytes_per_s": 9e11, "decompress_waits_h2d": True}
    for k, v in vals.items():
        cal.set(f"codec.{CODEC}.{k}", v, "by hand")
    extra = "\n".join(line for line in to_toml(cal).splitlines() if "=" in line and not line.startswith(("name", "description")))
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"[codec.{CODEC}]")) + 1
    base.write_text("\n".join(lines[:at] + extra.splitlines() + lines[at:]) + "\n")
    rates = load_profile(str(base)).codec(CODEC)
    assert (rates.compress_call_s, rates.decompress_call_s, rates.split_bytes_per_s, rates.interleave_bytes_per_s,
            rates.decompress_waits_h2d) == (3e-4, 2.5e-4, 1.5e12, 9e11, True)
    bad = base.read_text().replace("decompress_waits_h2d = true", "decompress_waits_h2d = 1.0")
    base.write_text(bad)
    with pytest.raises(ProfileError, match="decompress_waits_h2d"):
        load_profile(str(base))
    base.write_text(bad.replace("decompress_waits_h2d = 1.0", "decompress_waits_h2d = true")
                    .replace("decompress_call_s = 0.00025", "decompress_call_s = -1.0"))
    with pytest.raises(ProfileError, match="decompress_call_s"):
        load_profile(str(base))


# ---- the cost of a GPU codec stage --------------------------------------------------------------
def test_gpu_codec_stages_cost_call_plus_bytes_over_rate():
    """Fault caught: the per-call cost dropped, charged on every decode step's compress (the
    executor encodes only when a block fills: once per 4096 steps), or the measured plane rate
    ignored in favour of the HBM rate."""
    hw = with_rates(load_profile("h200-testbox"), compress_call_s=1e-3, decompress_call_s=5e-4,
                    split_bytes_per_s=1e12, interleave_bytes_per_s=5e11, compress_bytes_per_s=1e11,
                    decompress_bytes_per_s=2e12)
    g = build(LLAMA, Workload(32768, 2, 1), coded_plan())
    dec = next(s for s in g.stages if s.kind is Kind.GPU_DECOMPRESS and s.phase is Phase.DECODE)
    want = 5e-4 + dec.bytes / 2e12 + dec.bytes / 5e11 + dec.ops * hw.launch_overhead_s
    assert stage_seconds(dec, hw, "bf16") == pytest.approx(want, rel=1e-12)
    pre = next(s for s in g.stages if s.kind is Kind.GPU_COMPRESS and s.phase is Phase.PREFILL)
    want = 1e-3 + pre.bytes / 1e11 + pre.bytes / 1e12 + pre.ops * hw.launch_overhead_s
    assert stage_seconds(pre, hw, "bf16") == pytest.approx(want, rel=1e-12)
    step = next(s for s in g.stages if s.kind is Kind.GPU_COMPRESS and s.phase is Phase.DECODE)
    want = 1e-3 / 4096 + step.bytes / 1e11 + step.bytes / 1e12 + step.ops * hw.launch_overhead_s
    assert stage_seconds(step, hw, "bf16") == pytest.approx(want, rel=1e-12)


# ---- the decode's wait for in-flight fetches (simulator) ---------------------------------------
@pytest.mark.parametrize("depth", [2, 3])
def test_a_waiting_decode_holds_the_fetch_lane_as_the_executor_does(depth):
    """Fault caught: a decode that waits for in-flight H2D copies (decompress_waits_h2d) simulated
    as if it overlapped them. The executor issues the fetches of the next depth-1 groups before a
    group's decode, so that decode starts after the last of them ends, and the fetch after them
    (into the decode's slot) after the decode and its attention: between those two fetches the
    h2d lane idles at least the decode plus the attention. Without the wait it does not."""
    hw = with_rates(load_profile("h200-testbox"), decompress_waits_h2d=False)
    work, plan = Workload(65536, 3, 1), coded_plan(depth)
    g = build(LLAMA, work, plan)
    waits = decompress_waits(g, with_rates(hw, decompress_waits_h2d=True))
    st = g.stages
    assert decompress_waits(g, hw) == {}
    fetches = [s for s in st if s.tag == "kv_fetch" and s.phase is Phase.DECODE and s.step == 1]
    decodes = [s for s in st if s.kind is Kind.GPU_DECOMPRESS and s.phase is Phase.DECODE and s.step == 1]
    for i, d in enumerate(decodes[:-depth]):       # by hand: the fetch depth-1 groups ahead (one group a layer)
        assert waits[d.id] == fetches[i + depth - 1].id
    for label, profile in (("waits", with_rates(hw, decompress_waits_h2d=True)), ("overlaps", hw)):
        trace, _ = run(g, profile)
        span = {sp.stage: sp for sp in trace.spans}
        attn = {s.layer: s for s in st if s.tag == "attn" and s.phase is Phase.DECODE and s.step == 1}
        gaps = []
        for i, d in enumerate(decodes[:-depth]):
            nxt, prev = fetches[i + depth], fetches[i + depth - 1]
            busy = (span[d.id].end_s - span[d.id].start_s) + (span[attn[d.layer].id].end_s - span[attn[d.layer].id].start_s)
            gaps.append(span[nxt.id].start_s - span[prev.id].end_s - busy)
        if label == "waits":
            assert min(gaps) >= -1e-12
        else:
            assert max(gaps) < 0


def test_the_waiting_decode_slows_the_simulated_codec_step():
    """Fault caught: the wait computed but not honoured by the simulation (the one-pass schedule
    ignores forward waits; the event simulation must run)."""
    from kvpipe.sim.simulate import simulate
    hw = with_rates(load_profile("h200-testbox"), decompress_waits_h2d=False)
    work, plan = Workload(65536, 4, 1), coded_plan()
    free = simulate(LLAMA, work, plan, hw).report.timing.decode_s_per_token
    held = simulate(LLAMA, work, plan, with_rates(hw, decompress_waits_h2d=True)).report.timing.decode_s_per_token
    assert held > free * 1.02


# ---- the measurements (CPU) ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_kv():
    """K/V [units, 2048, 2, 16] bf16 of a prefill through a tiny random-weight Llama (CPU)."""
    from kvpipe.executor.layers.loader import random_model
    cfg = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
               tie_word_embeddings=False, attn_implementation="sdpa")
    return cp.prefill_kv(random_model(cfg, "cpu", torch.bfloat16, 0), 2048)


def test_prefill_kv_is_the_units_k_and_v_in_the_executors_layout(tiny_kv):
    """Fault caught: K and V mixed up, or units cut across layers / heads (the blocks would then
    not be the executor's blocks)."""
    assert tiny_kv.shape == (2 * 2, 2048, 2, 16) and tiny_kv.dtype == torch.bfloat16
    assert not torch.equal(tiny_kv[:, :, 0], tiny_kv[:, :, 1])


def test_cpu_codec_measured_on_the_kv_of_a_tiny_random_model(tiny_kv):
    """Fault caught: the disk link's CPU codec rate left at the base profile's figure (issue 9:
    calibrate measures it), a rate that is not positive, a source that does not say which codec
    and level ran on what K/V, a round trip that is not checked."""
    cal = Calibration("t", "d", "s")
    cp.cpu_codec(cal, tiny_kv, threads=2, block_bytes=64 << 10, kv_what="tiny K/V", sample_bytes=1 << 20)
    v, n = cal.values, cal.notes
    assert v["host.cpu_codec_bytes_per_s"] > 0 and v["codec.zstd-planes.compress_bytes_per_s"] > 0
    assert v["host.cpu_codec_bytes_per_s"] == min(v["codec.zstd-planes.compress_bytes_per_s"],
                                                  v["codec.zstd-planes.decompress_bytes_per_s"])
    assert v["codec.zstd-planes.ratio"] > 1.0            # the exponent plane of K/V compresses
    for key in ("host.cpu_codec_bytes_per_s", "codec.zstd-planes.ratio"):
        assert "zstd level 1" in n[key] and "random-weight K/V" in n[key] and "2 threads" in n[key]
        assert n[key].startswith("measured")
    assert set(cal.extra["codec.zstd-planes"]["threads"]) == {"1", "2"}


def test_gpu_codec_step_bookkeeping_on_cpu(tiny_kv):
    """Fault caught, in the GPU step's bookkeeping: batches cut wrong (a round trip that is not
    exact raises), the ratio counting the low planes coded, a field written without a source or
    the call cost missing from the profile."""
    blocks = cp.kv_blocks(tiny_kv, 512)                         # [16, 512, 2, 16]
    coder = ZlibBlocks(blocks[0].numel())
    points, ratio, (kept, decode, planes) = cp.gpu_codec_points(blocks, coder, lambda fn: cp.perf_timer(fn, 1),
                                                                batches=(2, 16, 64), keep=16)
    assert [p["blocks"] for p in points] == [2, 16, 64] and kept == 16
    # Fault caught: the kept decode / interleave pair bound to the loop's LAST batch's buffers
    # (late-bound closure names; on the H200 the wait probe then decoded 512 offsets against
    # 128 sizes and the profile lost its codec table): called after the loop, the 16-block pair
    # must still give back exactly its own blocks.
    calls = []
    coder.decode = lambda src, offsets, sizes, out, outs: calls.append((len(offsets), len(sizes), len(outs)))
    decode()
    planes()
    assert calls == [(16, 16, 16)], calls
    assert points[1]["raw_bytes"] == 16 * 512 * 2 * 16 * 2
    high = torch.stack([b.view(torch.uint8).view(-1, 2)[:, 1] for b in blocks])     # by hand: byte 1 of each bf16
    import zlib
    stored = sum(min(len(zlib.compress(h.numpy().tobytes(), 1)), h.numel()) for h in high) + high.numel()
    assert ratio == pytest.approx(2 * high.numel() / stored, rel=1e-12)
    cal = Calibration("t", "d", "s")
    synthetic = [{**p, **{k: 1e-4 + p["raw_bytes"] / 1e9 for k in ("encode_s", "decode_s", "split_s", "interleave_s")}}
                 for p in points]
    cp.set_gpu_codec(cal, CODEC, synthetic, ratio, 512, "tiny K/V")
    for f in ("compress_call_s", "decompress_call_s"):
        assert cal.values[f"codec.{CODEC}.{f}"] == pytest.approx(1e-4, rel=1e-6)
    assert cal.values[f"codec.{CODEC}.interleave_bytes_per_s"] == pytest.approx(1e9, rel=1e-6)
    assert all("random-weight K/V" in cal.notes[k] for k in cal.values)


@pytest.mark.gpu
def test_gpu_codec_step_on_the_gpu():
    """Fault caught (GPU, nVCOMP): the codec step failing where `kvpipe calibrate` runs it, a fit
    with no call cost or rate, the wait probe undecided or missing."""
    pytest.importorskip("nvidia.nvcomp")
    from kvpipe.executor.calibrate import codecs
    cal = Calibration("t", "d", "s")
    codecs(cal, quick=True, tokens=8192)
    v = cal.values
    assert v[f"codec.{CODEC}.decompress_bytes_per_s"] > 0 and v[f"codec.{CODEC}.decompress_call_s"] >= 0
    assert v[f"codec.{CODEC}.ratio"] > 1.2 and v["host.cpu_codec_bytes_per_s"] > 0
    assert isinstance(v.get(f"codec.{CODEC}.decompress_waits_h2d"), bool), cal.extra.get(f"codec.{CODEC}.waits_probe")


def test_the_host_waits_for_a_filling_encode_in_both_engines():
    """Fault caught: the executor's read-back of the encoded sizes (one host sync per batch of
    filled blocks) simulated as if the host ran ahead: the stage issued after a prefill chunk's
    gpu_compress must not be issued before that compress ends. The one-pass schedule and the
    event simulation must agree on it."""
    from kvpipe.sim.engine import run_events
    from kvpipe.sim.onepass import schedule
    hw = with_rates(load_profile("h200-testbox"), decompress_waits_h2d=False)   # no forward waits: one pass applies
    g = build(LLAMA, Workload(49152, 1, 1), coded_plan())
    events, _ = run_events(g, hw)
    one, _, _ = schedule(g, hw)
    assert [(s.start_s, s.end_s) for s in events.spans] == [(s.start_s, s.end_s) for s in one.spans]
    span = {sp.stage: sp for sp in one.spans}
    syncs = [s for s in g.stages if s.kind is Kind.GPU_COMPRESS and s.phase is Phase.PREFILL]
    assert syncs
    for s in syncs:
        nxt = g.stages[s.id + 1]     # issued after it: it cannot start before the compress ended
        assert span[nxt.id].start_s >= span[s.id].end_s
