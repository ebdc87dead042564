"""benchmarks/lossy_speed.py runs end to end (CPU, tiny context), and on a GPU its zero-copy gather
returns the right rows (the sparse timings are meaningless otherwise)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

# benchmarks/ is not an installed package: load the script by path (works from any directory)
_spec = importlib.util.spec_from_file_location(
    "lossy_speed", Path(__file__).resolve().parents[1] / "benchmarks" / "lossy_speed.py")
lossy_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lossy_speed)


def test_every_variant_runs_and_is_reported(tmp_path):
    # Fault caught: a variant that crashes (shapes of the quantised or gathered layouts) or is
    # silently left out of the JSON the lead reads.
    out = tmp_path / "speed.json"
    assert lossy_speed.main(["--context", "512", "--device", "cpu", "--steps", "1", "--layers-distinct", "1",
                             "--layers", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["512"]
    assert set(rows) == {"exact", "int8", "int4", "sparse", "sparse-refined", "sparse+int4"}
    assert all(r["ms_per_step"] > 0 for r in rows.values()) and rows["exact"]["speedup_vs_exact"] == 1


def test_gather_rows_on_the_host_path():
    # Fault caught: rows gathered in the wrong order (the selection would attend other chunks).
    src = torch.arange(40).view(10, 4)
    idx = torch.tensor([3, 0, 9])
    out = torch.empty(3, 4, dtype=src.dtype)
    lossy_speed.gather_rows(src, idx, out, None)
    assert torch.equal(out, src[[3, 0, 9]])


@pytest.mark.gpu
def test_zero_copy_gather_reads_pinned_host_rows():
    # Fault caught: the Triton kernel unable to read pinned host memory, or reading wrong rows.
    assert lossy_speed.check_gather(torch.device("cuda"), lossy_speed._triton_gather()) == "ok"


def test_dequant_rate_benchmark_reports_each_codec(tmp_path):
    # Fault caught: the dequantise micro-benchmark crashing on the executor's slot layout, or
    # reporting a rate that is not bytes written / seconds measured.
    out = tmp_path / "dq.json"
    assert lossy_speed.main(["--dequant", "--context", "1K", "--device", "cpu", "--fused", "off", "--steps", "1",
                             "--hw", "h200-testbox", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["bits"], r["group"]) for r in res["rows"]] == [(8, 64), (4, 32)]
    for r in res["rows"]:
        assert r["out_bytes"] == 8 * 1024 * 2 * 128 * 2 and r["out_bytes_per_s"] == r["out_bytes"] / r["s"]
    assert res["profile"]["modelled_bytes_per_s"] > 0


@pytest.mark.gpu
def test_fused_dequant_is_faster_than_eager_on_cuda():
    # Fault caught: the compiled decode falling back to eager (a graph break, a recompile limit) or
    # running no faster than the eager ops it replaced (the int4 miss of 2026-11-30).
    fused = lossy_speed.dequant_rate(torch.device("cuda"), 4, 32, 32768, True)
    eager = lossy_speed.dequant_rate(torch.device("cuda"), 4, 32, 32768, False)
    assert fused["s"] < eager["s"] / 2
