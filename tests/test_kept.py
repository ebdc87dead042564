"""kvpipe/kept.py: `generate --load-kv` refusing a saved KV that cannot continue before the model
is converted or loaded. Tiny random Llama; a `.gguf` that must not be read stands for a real one."""
from __future__ import annotations

import pytest

import kvpipe
from kvpipe import checkpoint
from kvpipe.cli import main

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_dtype_the_save_was_not_made_in_is_refused_before_the_gguf_converts(tiny_config, tmp_path,
                                                                              monkeypatch, capsys):
    """Fault caught: `generate --model X.gguf --dtype bf16 --load-kv DIR` (DIR saved in fp32)
    converting the .gguf for bf16 (seconds, and a cache folder) before refusing the dtype."""
    kv = tmp_path / "kv"
    kvpipe.generate(tiny_config, [5, 6, 7, 8], random_weights=True, device="cpu", max_new_tokens=1, save_kv=kv)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def converted(*a, **k):
        raise AssertionError("converted before the dtype was checked")
    monkeypatch.setattr(checkpoint, "convert_gguf", converted)
    rc = main(["generate", "--model", str(gguf), "--dtype", "bf16", "--load-kv", str(kv), "--prompt", "next"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "kvpipe: error: --load-kv: saved in fp32, this model runs in bf16 (--dtype)\n", err
    with pytest.raises(ValueError, match="^load-kv: saved in fp32, this model runs in bf16"):
        kvpipe.generate(str(gguf), "next", load_kv=kv, dtype="bf16")
    with pytest.raises(ValueError, match="^load-kv: saved in fp32, this model runs in fp16"):
        kvpipe.generate(tiny_config, "5 6", prompt_format="ids", random_weights=True, load_kv=kv, dtype="fp16")
