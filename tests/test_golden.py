"""Behaviour held fixed across refactors: `kvpipe plan --json` on a set of commands prints the stored
JSON and exit code (tests/golden/plan_NN.*), and `kvpipe run --json` on the CPU gives the stored
`output_digest`. Catches any change of a planner choice, a prediction, a report field or the
bits a schedule computes. Regenerate a file only for an intended change, and say why in CHANGELOG.md."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_LLAMA

GOLDEN = Path(__file__).parent / "golden"
PLANS = GOLDEN.joinpath("commands.txt").read_text().splitlines()
RUNS = [line.split("\t") for line in GOLDEN.joinpath("runs.txt").read_text().splitlines()]


@pytest.mark.parametrize("n", range(1, len(PLANS) + 1))
def test_plan_json_is_unchanged(n, capsys):
    from kvpipe.cli import main
    rc = main(PLANS[n - 1].split())
    out, _ = capsys.readouterr()
    stem = GOLDEN / f"plan_{n:02d}"
    assert rc == int(stem.with_suffix(".rc").read_text())
    expected = stem.with_suffix(".json").read_text()
    assert (json.loads(out) if out else None) == (json.loads(expected) if expected else None)


@pytest.mark.parametrize("args,digest", RUNS, ids=[r[0] for r in RUNS])
def test_run_digest_is_unchanged(args, digest, tmp_path, capsys):
    from kvpipe.cli import main
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)   # a CPU GEMM's summation order follows its thread count: the digests' 2
    try:
        rc = main(["run", "--device", "cpu", "--no-progress", "--json", "--model", str(config),
                   "--random-weights", "--context", "200", "--decode-tokens", "8", "--seed", "3",
                   "--kv-dir", str(tmp_path), *args.split()])
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["output_digest"] == digest
