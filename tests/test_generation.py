"""kvpipe/generation.py as a library call: quiet on stderr (the CLI prints the progress lines),
and token ids taken as HF users pass input_ids (a list of ints or a 1-D tensor). Tiny random Llama."""
from __future__ import annotations

import pytest

import kvpipe
from kvpipe.cli import main

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("single_thread")
IDS = [5, 6, 7, 8]
RUN = dict(random_weights=True, device="cpu", max_new_tokens=3, ignore_eos=True)


def test_generate_from_python_prints_nothing_the_cli_prints_its_lines(tiny_config, capfd):
    """Fault caught: `kvpipe.generate()` printing "kvpipe: executing up to N new tokens ..." (a
    library call should be quiet, as HF's generate is), or the CLI losing that line."""
    res = kvpipe.generate(tiny_config, " ".join(map(str, IDS)), prompt_format="ids", **RUN)
    out, err = capfd.readouterr()
    assert len(res.tokens) == 3 and out == "" and "kvpipe" not in err, err
    assert main(["generate", "--model", tiny_config, "--random-weights", "--device", "cpu", "--prompt-format", "ids",
                 "--prompt", "5 6 7 8", "--max-new-tokens", "3", "--ignore-eos"]) == 0
    assert "kvpipe: executing up to 3 new tokens on cpu" in capfd.readouterr().err
