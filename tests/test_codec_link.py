"""benchmarks/codec_link.py's CPU parts on small data (the GPU run is the lead's)."""

import zstandard

import torch

from benchmarks.codec_link import BLOCK, cpu_codec, estimate, spread_sample


def test_cpu_codec_ratio_and_round_trip_match_an_independent_count():
    """Catches the benchmark reporting a ratio over the wrong byte counts (frames of some blocks
    lost, raw size miscounted): zstd-1's ratio is recomputed here with zstandard directly, and
    the zstd-planes rows must come back with a ratio and rates on 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    raw = (torch.randn(3 * BLOCK // 2 + 300, generator=g) * 0.05).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    row = cpu_codec("zstd-1", raw, threads=2)
    frames = [zstandard.ZstdCompressor(level=1).compress(raw[i:i + BLOCK]) for i in range(0, len(raw), BLOCK)]
    assert row["ratio"] == len(raw) / sum(len(f) for f in frames)
    planes = cpu_codec("zstd-planes", raw, threads=2)
    assert planes["ratio"] > 1.0 and planes["encode_bytes_per_s_2t"] > 0 and planes["decode_bytes_per_s_1t"] > 0


def test_sample_blocks_spread_over_the_whole_kv_and_the_h2d_estimate_is_the_slowest_lane():
    """Catches a sample taken from the start only (the first layer's keys: K/V statistics differ
    by layer and between K and V), and an estimate that is not the max of the lanes it names."""
    kv = torch.arange(8 * BLOCK, dtype=torch.int64).remainder(251).to(torch.uint8)
    kv[7 * BLOCK:] = 255                                  # the last block is recognisable
    s = spread_sample(kv, 3)
    assert len(s) == 3 * BLOCK and s[-BLOCK:] == bytes([255]) * BLOCK and s[:BLOCK] == kv[:BLOCK].numpy().tobytes()
    pred = {"decode_busy_s_per_step": {"gpu": 0.01, "h2d": 0.3, "d2h": 0.001, "disk": 0.0, "cpu": 0.0},
            "h2d_bytes_per_step": 16e9}
    assert estimate(pred, {"where": "gpu", "ratio": 1.5, "decode_bytes_per_s": 400e9}) == 0.3 / 1.5
    assert estimate(pred, {"where": "gpu", "ratio": 1.5, "decode_bytes_per_s": 40e9}) == 0.01 + 16e9 / 40e9
    assert estimate(pred, {"where": "cpu", "ratio": 1.5}) is None
