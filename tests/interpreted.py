"""(helper, not a test) Runs a test module's Triton kernels in Triton's interpreter: a subprocess,
since TRITON_INTERPRET must be set before Triton is imported. The script saves its outputs to
argv[1] (torch.save), reads the cases from argv[2] and imports the test module from argv[3]."""
from __future__ import annotations

import os
import subprocess
import sys

import torch


def run_interpreted(script: str, cases: list, out_dir, **env: str) -> list:
    """`script` run with the cases in Triton's interpreter (extra environment `env`) -> what it saved,
    one entry a case."""
    path = out_dir / "out.pt"
    r = subprocess.run([sys.executable, "-c", script, str(path), repr(cases), os.path.dirname(__file__)],
                       env={**os.environ, "TRITON_INTERPRET": "1", **env}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.load(path)
    assert len(got) == len(cases)
    return got
