"""kvpipe/textio.py: prompts in, streamed text out (no model: a byte-level fake tokenizer)."""
from __future__ import annotations

import io

import pytest

from kvpipe import textio

PIECES = [b"", b"Hel", b"lo", b" w\xc3", b"\xa9", b"rld", b" \xe2\x82", b"\xac", b"5", b" \xf0\x9f",
          b"\x98", b"\x80", b"!", b" STOP", b" after"]   # id 0 is special (no text)


class ByteTok:
    """Each id is a run of bytes; ids split UTF-8 characters the way byte-level BPE does."""

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(PIECES[i] for i in ids if not (skip_special_tokens and i == 0)).decode("utf-8", "replace")


def run(tokens, **kw):
    shown = []
    out = textio.Output(ByteTok(), kw.pop("max_new", 100), stream=shown.append, **kw)
    for i, t in enumerate(tokens):
        if out.take(i, t):
            break
    else:
        out.close()
    return out, shown


def test_streamed_pieces_are_the_whole_text_and_never_half_a_character():
    # Fault caught: a token ending inside a multi-byte character streamed as U+FFFD (or the
    # character lost), or streamed text that differs from the decode of all tokens at once.
    ids = list(range(1, 13))
    out, shown = run(ids)
    assert "".join(shown) == out.text == ByteTok().decode(ids) == "Hello wérld €5 😀!"
    assert not any("\ufffd" in p for p in shown)
    assert len(shown) >= 8          # streamed as it came, not once at the end
    assert out.finish_reason == "length" and out.tokens == ids


def test_eos_ends_with_stop_and_is_kept_in_tokens_not_text():
    # Fault caught: generation running past the end-of-sequence id, or its id missing from tokens
    # (HF keeps it) or printed in the text.
    out, shown = run([1, 2, 0, 3, 4], eos=frozenset({0}))
    assert out.tokens == [1, 2, 0] and out.finish_reason == "stop" and out.text == "Hello"


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    # Fault caught: a stop string split over tokens not found, its first characters streamed
    # before it was recognised, or the text after it kept.
    out, shown = run(list(range(1, 15)), stops=("P ", "€5 😀! ST"))
    assert out.finish_reason == "stop" and out.text == "Hello wérld "
    assert "".join(shown) == out.text
    assert out.tokens == list(range(1, 14))     # ends with the token that completed the stop


def test_max_new_tokens_counts_generated_tokens():
    # Fault caught: --max-new-tokens N giving N + 1 tokens (the prefill's token not counted).
    out, _ = run(list(range(1, 13)), max_new=3)
    assert out.tokens == [1, 2, 3] and out.finish_reason == "length"
    assert out.text == ByteTok().decode([1, 2, 3]) == "Hello w\ufffd"   # as HF decodes a cut character


def test_without_a_tokenizer_ids_are_streamed():
    # Fault caught: a model without a tokenizer (random weights) printing nothing.
    shown = []
    out = textio.Output(None, 3, stream=shown.append)
    assert [out.take(i, t) for i, t in enumerate([7, 8, 9])] == [False, False, True]
    assert "".join(shown) == "7 8 9 " and out.text is None


@pytest.mark.parametrize("kw, flag", [
    (dict(prompt="a", prompt_file="f"), "prompt"),
    (dict(prompt=None, prompt_file="/nonexistent/q.txt"), "prompt-file"),
    (dict(prompt="   "), "prompt"),
    (dict(prompt=None, prompt_file=None), "prompt"),
    (dict(prompt=5, prompt_file=None), "prompt"),
    (dict(prompt=None, stdin=io.StringIO("\n")), "stdin"),   # was "--prompt: ..." though --prompt was not given
])
def test_bad_prompts_name_the_flag(kw, flag):
    # Fault caught: a traceback, or an error that does not say which flag was wrong.
    kw.setdefault("prompt_file", None)
    with pytest.raises(ValueError, match=f"^{flag}: "):
        textio.read_prompt(**kw)


def test_prompt_from_stdin_and_ids_format():
    # Fault caught: standard input ignored; "1984 2001" read as ids without --prompt-format ids.
    assert textio.read_prompt(None, None, io.StringIO("1984 2001\n")) == "1984 2001\n"
    assert textio.parse_ids("1984 2001\n", 5000) == [1984, 2001]
    with pytest.raises(ValueError, match="^prompt: .*'hello'"):
        textio.parse_ids("12 hello", 5000)
    with pytest.raises(ValueError, match="^prompt: token id 5000 is outside"):
        textio.parse_ids("1 5000", 5000)
