"""What a new user hit walking through the README and each command's --help on a CPU machine:
flags that refuse the README's own spelling, help texts that say one thing and do another.
Parser-level and tiny-model checks only (no checkpoint is loaded here)."""
from __future__ import annotations

import pytest

from kvpipe.cli import build_parser, main


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_context_takes_the_token_units_the_readme_writes(command):
    """Fault caught: `kvpipe chat --model DIR --max-context 16K` (the README's line) exiting 2 with
    "invalid int value: '16K'" because --max-context was type=int while --context takes 16K."""
    args = build_parser().parse_args([command, "--model", "m", "--max-context", "16K"])
    assert args.max_context == 16 * 1024
    assert build_parser().parse_args([command, "--model", "m", "--max-context", "300"]).max_context == 300


def test_a_bad_max_context_says_which_units_it_takes(capsys):
    """Fault caught: `--max-context 16x` answered "invalid int value", hiding that 16K is
    accepted, or a token-count error reaching the user as a traceback instead of one line."""
    rc = main(["chat", "--model", "m", "--max-context", "16x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvpipe: error: --max-context: "), err
    assert "128K" in err[0] and "Traceback" not in err[0], err
