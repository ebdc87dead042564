"""Behaviour held fixed across refactors: `kvpipe plan --json` on a set of commands prints the stored
JSON and exit code (tests/golden/plan_NN.*), and `kvpipe run --json` on the CPU gives the stored
tokens and, on a CPU whose kernels the digests were recorded with, the stored `output_digest`
(tests/golden/runs.json). Catches any change of a planner choice, a prediction, a report field or
the bits a schedule computes. Regenerate a file only for an intended change, and say why in
CHANGELOG.md. A CPU GEMM's bits follow the instruction sets its library dispatches to, so digests
are kept per CPU (`cpu_key`); `python tests/test_golden.py --record` adds this CPU's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_LLAMA

GOLDEN = Path(__file__).parent / "golden"
PLANS = GOLDEN.joinpath("commands.txt").read_text().splitlines()
RUNS = json.loads(GOLDEN.joinpath("runs.json").read_text())
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_key() -> str:
    """The instruction sets a CPU GEMM library picks its kernels by, as one string."""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return "+".join(f for f in CPU_FLAGS if f in flags) or "none"


def golden_run(args: str, tmp_path) -> dict:
    """`kvpipe run --json` of the golden row `args` on the CPU, 2 threads (the digests')."""
    from kvpipe.cli import main
    config = Path(tmp_path) / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)   # a CPU GEMM's summation order follows its thread count: the digests' 2
    try:
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["run", "--device", "cpu", "--no-progress", "--json", "--model", str(config),
                       "--random-weights", "--context", "200", "--decode-tokens", "8", "--seed", "3",
                       "--kv-dir", str(tmp_path), *args.split()])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    return json.loads(buf.getvalue())


@pytest.mark.parametrize("n", range(1, len(PLANS) + 1))
def test_plan_json_is_unchanged(n, capsys):
    from kvpipe.cli import main
    rc = main(PLANS[n - 1].split())
    out, _ = capsys.readouterr()
    stem = GOLDEN / f"plan_{n:02d}"
    assert rc == int(stem.with_suffix(".rc").read_text())
    expected = stem.with_suffix(".json").read_text()
    assert (json.loads(out) if out else None) == (json.loads(expected) if expected else None)


@pytest.mark.parametrize("row", RUNS, ids=[r["args"] for r in RUNS])
def test_run_tokens_are_unchanged(row, tmp_path):
    """Fault caught: a schedule, placement or kernel change that moves a generated token."""
    assert golden_run(row["args"], tmp_path)["tokens"] == row["tokens"]


@pytest.mark.parametrize("row", RUNS, ids=[r["args"] for r in RUNS])
def test_run_digest_is_unchanged(row, tmp_path):
    """Fault caught: any change of the bits a schedule computes (final logits and ids), on a CPU
    whose digests are recorded; elsewhere skipped, naming the CPU (the tokens test still runs)."""
    key = cpu_key()
    if key not in row["digests"]:
        pytest.skip(f"no digest recorded for this CPU ({key}); `python tests/test_golden.py --record` adds it")
    assert golden_run(row["args"], tmp_path)["output_digest"] == row["digests"][key]


if __name__ == "__main__":   # record this CPU's digests (and check the tokens) into runs.json
    import sys
    import tempfile
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/test_golden.py --record")
    for row in RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            got = golden_run(row["args"], tmp)
        assert got["tokens"] == row["tokens"], (row["args"], got["tokens"])
        row["digests"][cpu_key()] = got["output_digest"]
    GOLDEN.joinpath("runs.json").write_text(json.dumps(RUNS, indent=1) + "\n")
    print(f"recorded {len(RUNS)} digests for {cpu_key()}")
