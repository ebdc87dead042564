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


# --- nvCOMP codecs, one worker process each (benchmarks/nvcomp_isolated.py) ---

import json

import pytest

from benchmarks.codec_link import main
from benchmarks.nvcomp_isolated import ALGOS, check_input, parse_worker_output, run_isolated


@pytest.mark.parametrize("bad, field_text", [
    (torch.zeros(64, dtype=torch.bfloat16), "dtype"),                   # bf16 K/V handed over unviewed
    (torch.zeros(64, dtype=torch.uint8)[::2], "contiguous"),            # a strided plane view
    (torch.zeros(8, 8, dtype=torch.uint8), "shape"),                    # 2-D
    (torch.zeros(0, dtype=torch.uint8), "shape"),                       # empty
    (torch.zeros(64, dtype=torch.uint8), "CUDA"),                       # host memory
    (bytes(64), "torch.Tensor"),
])
def test_check_input_rejects_what_nvcomp_must_not_be_given(bad, field_text):
    """Catches a buffer that nvCOMP would read wrongly (a strided plane read as if dense, bf16
    elements where bytes are meant, host memory) reaching the codec instead of a ValueError that
    names the input."""
    with pytest.raises(ValueError, match=field_text) as e:
        check_input(bad, "kv")
    assert str(e.value).startswith("kv:")


def test_a_dead_worker_is_reported_with_its_stage_and_a_clean_row_passes_through():
    """Catches a worker's death (the CUDA fault that on the H200 took every later codec with it)
    being lost or read as a result: the error row must say how it ended and in which stage and
    size; a worker that ended cleanly gives back its row unchanged; an exception row says where."""
    stages = "\n".join(json.dumps(s) for s in ({"stage": "load", "bytes": 10}, {"stage": "decode", "bytes": 1 << 30}))
    dead = parse_worker_output(stages + "\nnot json\n", -6, "some\nCUDA error: an illegal memory access\n\n")
    assert dead == {"error": "worker killed by SIGABRT during decode of 1073741824 bytes: "
                             "CUDA error: an illegal memory access"}
    assert parse_worker_output("", 1, "")["error"] == "worker exit 1 before its first stage"
    assert parse_worker_output(stages, None, "", 2.5)["error"].startswith("worker timed out after 2.5 s during decode")
    row = {"ratio": 1.3, "exact": True}
    assert parse_worker_output(stages + "\n" + json.dumps({"row": row}), 0, "warning\n") == row
    raised = parse_worker_output(stages + "\n" + json.dumps({"row": {"error": "RuntimeError: x"}}), 0, "")
    assert raised == {"error": "RuntimeError: x (during decode of 1073741824 bytes)"}
    # a row printed by a process that then crashed is not taken as a result
    assert "error" in parse_worker_output(json.dumps({"row": row}), -11, "")


def test_a_killed_worker_does_not_stop_the_next_one(tmp_path):
    """Catches the isolation failing for real processes: a worker killed at its time limit must
    come back as an error row, and the next worker, on the same K/V file, must still run and
    report its own row (here, without CUDA or nvCOMP, the reason it could not measure)."""
    kv = tmp_path / "kv.u8"
    kv.write_bytes(bytes(range(256)) * 64)
    killed = run_isolated("ANS", str(kv), timeout_s=0.3)
    assert killed["error"].startswith("worker timed out after 0.3 s")
    nxt = run_isolated("Zstd", str(kv), timeout_s=300)
    assert "timed out" not in nxt.get("error", "")
    if not torch.cuda.is_available():
        assert nxt["error"] == "CUDA is not available in the worker (during load of 16384 bytes)"
    with pytest.raises(ValueError, match="algo"):
        run_isolated("ANS2", str(kv))


def test_unknown_gpu_codec_is_one_line_exit_2(capsys):
    """Catches a misspelt --gpu-codecs name running the 128K prefill first and then failing (or
    being skipped silently): it must stop at once with exit 2 and one stderr line naming the field."""
    assert main(["--gpu-codecs", "ANS,Snapy", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu-codecs" in err[0] and "Snapy" in err[0]


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ALGOS)
def test_every_nvcomp_codec_round_trips_a_bf16_buffer_exactly(tmp_path, algo):
    """On the GPU (with nvidia-nvcomp-cu13): catches a codec that changes a bit, or that still
    faults (the illegal address of 2026-11-30), on 8 MiB of gaussian bf16 bytes; the probes on the
    first 1 MiB and 64 MiB (here: 1 MiB only) must be exact too."""
    pytest.importorskip("nvidia.nvcomp")
    g = torch.Generator().manual_seed(1)
    raw = (torch.randn(4 << 20, generator=g) * 0.05).to(torch.bfloat16).view(torch.uint8)
    (tmp_path / "kv.u8").write_bytes(raw.numpy().tobytes())
    row = run_isolated(algo, str(tmp_path / "kv.u8"), timeout_s=300)
    assert "error" not in row, row
    assert row["exact"] and [p["exact"] for p in row["probes"]] == [True]
    assert row["stored_bytes"] > 0 and row["ratio"] == raw.numel() / row["stored_bytes"]
