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


def test_generate_takes_token_ids_as_a_list_or_a_tensor(tiny_config):
    """Fault caught: `kvpipe.generate(model, [1, 2, 3])` refused ("prompt: expected text, got
    list") where HF users pass input_ids; a list, a 1-D tensor and HF's [1, n] tensor must run as
    --prompt-format ids does, bad elements a ValueError naming `prompt`."""
    want = kvpipe.generate(tiny_config, " ".join(map(str, IDS)), prompt_format="ids", **RUN)
    for ids in (IDS, torch.tensor(IDS), torch.tensor([IDS])):
        got = kvpipe.generate(tiny_config, ids, **RUN)
        assert (got.tokens, got.output_digest, got.prompt_tokens) == (want.tokens, want.output_digest, 4)
    for bad, said in (([5, "6"], "'6'"), ([5, 6.0], "6.0"), ([5, True], "True"), ([], "no token ids"),
                      (torch.zeros(2, 3, dtype=torch.long), "1-D"), ([5, 999], "outside the vocabulary")):
        with pytest.raises(ValueError, match=f"^prompt: .*{said}"):
            kvpipe.generate(tiny_config, bad, **RUN)


@pytest.mark.parametrize("new, warned", [(4093, False), (4094, True)])
def test_the_trained_length_warning_counts_new_tokens(tiny_config, new, warned):
    """Fault caught: generate's warning said "4 prompt + 4093 decode tokens" for --max-new-tokens
    4094 (kvpipe run's decode steps, one fewer than the tokens asked for), or warned where every
    token fed to the model stays within the 4096 positions (the last one made is never fed)."""
    res = kvpipe.generate(tiny_config, IDS, **{**RUN, "max_new_tokens": new}, interrupt=lambda: True)
    said = [w for w in res.run.warnings if w.startswith("context:")]
    line = f"context: 4 prompt + up to {new} new tokens run past the model's max_position_embeddings (4096)"
    assert [w.startswith(line) for w in said] == ([True] if warned else []), said
